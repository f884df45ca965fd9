"""DTR (Kirisame et al., ICLR 2021): under a cap, the replay evicts, one at a time, the evictable tensor
with the smallest h_DTR = (c(t) + c(e*(t))) / (m(t) * staleness(t)), computed here independently."""

from __future__ import annotations

import math

import pytest

from agents.base import Problem, Status, get_searcher
from agents.heuristics.dtr import dtr_replay
from runtime.vocab import KEEP, RECOMPUTE
from tests.synthetic import chain_workload, fixed_profile

S = 1000  # bytes per tensor
TAU = 1e-3  # seconds per op
N = 8


def _expected_h(i: int, op: int, evicted: set[int]) -> float:
    """h_DTR of c_i before op ``op`` of the chain, by hand: each c_i costs one op to recompute from c_{i-1}
    and was last read by layer i + 1, which ended at (i + 2) * TAU; its evicted neighbourhood is the run of
    evicted tensors just before it (ancestors) and just after it (descendants)."""
    cost = 1
    j = i - 1
    while j in evicted:
        cost, j = cost + 1, j - 1
    j = i + 1
    while j in evicted:
        cost, j = cost + 1, j + 1
    staleness_s = (op - (i + 2)) * TAU
    return cost * TAU / (S * staleness_s) if staleness_s > 0 else math.inf  # read by the previous op


def test_eviction_order_follows_h_dtr() -> None:
    """The no-policy chain holds x, c_0..c_{n-1} (and g_0) at the end of forward: 9 * S before op 7 and
    10 * S at op 8. A cap of 8 * S forces exactly two evictions."""
    w = chain_workload(N, S, TAU)
    p = Problem(w, fixed_profile(), budget_bytes=N * S)
    log = dtr_replay(p.simulator, p.budget_bytes)
    assert [(e.op, e.candidate) for e in log] == [(7, 0), (8, 2)]
    # Before op 7, c_0..c_5 are evictable (dropped by the program, not yet needed): c_0 is the stalest.
    pool_7 = {i: _expected_h(i, 7, set()) for i in range(6)}
    assert log[0].candidate == min(pool_7, key=pool_7.__getitem__)
    assert log[0].h == pytest.approx(pool_7[0])
    # Before op 8, c_1..c_6: c_1 is now the stalest but its neighbourhood holds the evicted c_0 (cost 2),
    # so c_2 (h = 1 / (4 S)) goes before c_1 (h = 2 / (5 S)): the e* term decides, not staleness alone.
    pool_8 = {i: _expected_h(i, 8, {0}) for i in range(1, 7)}
    assert log[1].candidate == min(pool_8, key=pool_8.__getitem__) == 2
    assert log[1].h == pytest.approx(pool_8[2]) and pool_8[2] < pool_8[1]

    r = get_searcher("dtr").search(p)
    expected = [RECOMPUTE if i in (0, 2) else KEEP for i in range(N)]
    assert r.status == Status.FEASIBLE and r.policy.to_vector(w).tolist() == expected
    assert r.result.peak_bytes == N * S and r.result.recompute_s == pytest.approx(2 * TAU)


def test_no_eviction_under_a_loose_cap() -> None:
    p = Problem(chain_workload(N, S, TAU), fixed_profile(), budget_bytes=(N + 2) * S)
    assert dtr_replay(p.simulator, p.budget_bytes) == []
