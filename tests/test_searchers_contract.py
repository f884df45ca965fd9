"""The contract of agents/base.py, run over every registered searcher."""

from __future__ import annotations

import numpy as np
import pytest

from agents.base import Problem, Status, get_searcher, list_searchers
from envs.simulator import COMPRESS
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.trace import capture
from runtime.workload import peak_report
from tests.test_trace import tiny_cnn_build

_W = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
_HW = get_profile("v100-16gb")
_PEAK = peak_report(_W, _HW.alloc_granularity_bytes).peak_bytes
_FLOOR = peak_report(_W, _HW.alloc_granularity_bytes).persistent_bytes  # nothing can go below this


def problem(fraction: float, **kw) -> Problem:  # type: ignore[no-untyped-def]
    return Problem(_W, _HW, budget_bytes=int(_PEAK * fraction), time_limit_s=20, **kw)


@pytest.mark.parametrize("name", list_searchers())
def test_contract(name: str) -> None:
    searcher = get_searcher(name)
    for fraction in (1.0, 0.7):
        p = problem(fraction)
        r = searcher.search(p)
        again = p.evaluate(r.policy.to_vector(_W), r.policy.options)
        assert again == r.result  # the policy, simulated again, gives the reported figures
        assert r.status in Status and r.wall_s >= 0 and r.evaluations >= 1
        if r.feasible:
            assert r.result.peak_bytes <= p.budget_bytes
        if r.status == Status.OPTIMAL:
            assert searcher.exact
        assert not np.any(r.policy.to_vector(_W) == COMPRESS)  # compression was not allowed
    # A budget under the persistent state cannot be met: reported, not raised.
    impossible = searcher.search(problem(_FLOOR / _PEAK * 0.5))
    assert impossible.status in (Status.INFEASIBLE, Status.TIMEOUT)
    # Deterministic under one seed.
    a, b = searcher.search(problem(0.7, seed=3)), searcher.search(problem(0.7, seed=3))
    assert np.array_equal(a.policy.to_vector(_W), b.policy.to_vector(_W))


@pytest.mark.parametrize("name", list_searchers(exact=False))
def test_heuristics_stop_once_the_budget_holds(name: str) -> None:
    """With a budget above the no-policy peak, a budget-aware heuristic changes nothing."""
    p = problem(1.05)
    r = get_searcher(name).search(p)
    keep_all = p.evaluate(np.zeros(len(_W.candidates), dtype=np.int8), p.options)
    assert r.feasible and r.result.samples_per_s == pytest.approx(keep_all.samples_per_s)
    assert keep_all.iter_s == pytest.approx(keep_all.compute_s + _HW.host.op_s)  # the first op waits for its issue


def test_unknown_searcher_did_you_mean() -> None:
    with pytest.raises(AutotuneError, match="did you mean"):
        get_searcher("capuchn")
