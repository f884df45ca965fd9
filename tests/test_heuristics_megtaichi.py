"""MegTaiChi (shared/seeds/002; agents/heuristics/megtaichi.py): under a cap, the replay evicts the evictable
tensor whose next access in the iteration's pattern is furthest ahead (Belady), then recomputes it."""

from __future__ import annotations

import pytest

from agents.base import Problem, Status, get_searcher
from agents.heuristics.dtr import dtr_replay
from runtime.vocab import KEEP, RECOMPUTE
from tests.synthetic import chain_workload, fixed_profile
from tests.test_heuristics_dtr import TAU, N, S


def test_evicts_the_furthest_next_access_where_dtr_weighs_staleness() -> None:
    """The 8-layer chain under 8 * S, as in DTR's test: two evictions, before ops 7 and 8. Backward reads c_i
    first at op 15 - i, so before op 7 the furthest next access among c_0..c_5 is c_0's (op 15), and before
    op 8, c_0 gone, c_1's (op 14); DTR takes c_2 there instead (its evicted neighbourhood makes c_1 dear).
    Both recompute two ops: c_1's replay regenerates c_0 on the way, which then serves c_0's own use."""
    w = chain_workload(N, S, TAU)
    p = Problem(w, fixed_profile(), budget_bytes=N * S)
    sim = p.simulator
    assert [int(sim.first_use[i]) for i in range(N)] == [15 - i for i in range(N)]
    r = get_searcher("megtaichi").search(p)
    assert r.status == Status.FEASIBLE
    assert r.policy.to_vector(w).tolist() == [RECOMPUTE, RECOMPUTE] + [KEEP] * (N - 2)
    assert r.result.peak_bytes == N * S and r.result.recompute_s == pytest.approx(2 * TAU)
    dtr = get_searcher("dtr").search(p).policy.to_vector(w).tolist()
    assert dtr != r.policy.to_vector(w).tolist()  # another rule, another choice, at the same cost here
    assert [(e.op, e.candidate) for e in dtr_replay(sim, N * S)] == [(7, 0), (8, 2)]


def test_no_eviction_under_a_loose_cap() -> None:
    p = Problem(chain_workload(N, S, TAU), fixed_profile(), budget_bytes=(N + 2) * S)
    r = get_searcher("megtaichi").search(p)
    assert r.policy.to_vector(p.workload).tolist() == [KEEP] * N and r.note.startswith("0 evictions")
