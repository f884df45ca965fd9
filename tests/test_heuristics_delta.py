"""DELTA (Tang et al., 2022): the filter releases large, long-idle tensors first (bytes x idle seconds); the
director swaps a tensor whose copy hides under prefetching and recomputes one whose copy cannot hide
when its recomputation is cheaper."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agents.base import Problem, Status, get_searcher
from agents.heuristics.delta import direct, filter_priority, release_until_fits
from runtime.hardware import HardwareProfile
from runtime.policy import PolicyOptions
from runtime.vocab import RECOMPUTE, SWAP
from tests.synthetic import chain_workload, fixed_profile

S = 1000  # bytes per tensor
TAU = 1e-3  # seconds per op


def gpu_profile(bytes_per_s: float) -> HardwareProfile:
    """The fixed-time profile with copy engines (Rule 1): copies overlap compute, as on a GPU."""
    return dataclasses.replace(fixed_profile(bytes_per_s, bytes_per_s), is_gpu=True)


def test_filter_releases_by_bytes_times_idle_time() -> None:
    """A 4-layer chain with c_0, c_1, c_2 of 1000, 2000 and 2500 bytes. Their idle windows (end of the
    layer that saved them to their backward) are 6, 4 and 2 op times, so bytes x idle = 6000, 8000 and
    5000: DELTA's order is c_1, c_0, c_2, where "largest first" would say c_2, c_1 and "longest idle
    first" c_0, c_1."""
    w = chain_workload(4, S, TAU)
    for ci, size in ((0, S), (1, 2 * S), (2, 5 * S // 2)):
        w.candidates[ci].nbytes = w.tensors[w.candidates[ci].tensor].nbytes = size
    # A slow link (10 ms a copy) leaves the director only recompute; 6000 bytes takes two releases.
    p = Problem(w, gpu_profile(1e5), budget_bytes=6 * S)
    assert filter_priority(p)[:3] == pytest.approx([6 * S * TAU, 8 * S * TAU, 5 * S * TAU])
    actions, result, released = release_until_fits(p, PolicyOptions(prefetch_lookahead=2))
    assert released == [1, 0]
    assert result.feasible and actions.tolist() == [RECOMPUTE, RECOMPUTE, 0, 0]


def test_director_swaps_what_hides_and_recomputes_what_does_not() -> None:
    """An 8-layer chain, copies of 2.5 op times each way. c_0 idles 14 op times: its round trip (5) hides
    with a look-ahead of 8. c_6 idles 2: at least 3 op times would show, against 1 to recompute it."""
    p = Problem(chain_workload(8, S, TAU), gpu_profile(S / (2.5 * TAU)), budget_bytes=9 * S)
    options = PolicyOptions(prefetch_lookahead=8)
    keep = p.keep_all()
    now = p.evaluate(keep, options)
    action, swapped, exposed_s, recompute_s = direct(p, keep, now, 0, options)
    assert action == SWAP and exposed_s == 0.0 and swapped is not None and swapped.stall_s == 0.0
    action, swapped, exposed_s, recompute_s = direct(p, keep, now, 6, options)
    assert action == RECOMPUTE and swapped is None
    assert recompute_s == pytest.approx(TAU) and exposed_s >= 3 * TAU - 1e-12


def test_search_swaps_with_prefetch_and_stops_at_the_budget() -> None:
    """With the same link, one release fits 9 * S: c_0 (the filter's first), swapped, with a look-ahead
    that hides it (no stall) and no recomputation."""
    p = Problem(chain_workload(8, S, TAU), gpu_profile(S / (2.5 * TAU)), budget_bytes=9 * S)
    r = get_searcher("delta").search(p)
    assert r.status == Status.FEASIBLE
    assert np.flatnonzero(r.policy.to_vector(p.workload)).tolist() == [0]
    assert r.policy.to_vector(p.workload)[0] == SWAP
    assert r.result.stall_s == 0.0 and r.result.recompute_s == 0.0
