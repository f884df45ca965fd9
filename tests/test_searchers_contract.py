"""The contract of agents/base.py, run over every registered searcher."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from agents.base import Problem, SearchContext, SearchResult, Status, get_searcher, list_searchers
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.trace import capture
from runtime.vocab import COMPRESS
from runtime.workload import peak_report
from tests.test_trace import tiny_cnn_build

_W = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
_HW = get_profile("v100-16gb")
_PEAK = peak_report(_W, _HW.alloc_granularity_bytes).peak_bytes
_FLOOR = peak_report(_W, _HW.alloc_granularity_bytes).persistent_bytes  # nothing can go below this


def problem(fraction: float) -> Problem:
    return Problem(_W, _HW, budget_bytes=int(_PEAK * fraction))


def context(seed: int = 0) -> SearchContext:
    return SearchContext(time_limit_s=20, seed=seed)


_RUNS: dict[tuple[str, float, int], tuple[Problem, SearchResult]] = {}


def searched(name: str, fraction: float, seed: int = 0) -> tuple[Problem, SearchResult]:
    """One search per (searcher, budget, seed), shared by the rules below (per test worker)."""
    key = (name, fraction, seed)
    if key not in _RUNS:
        p = problem(fraction)
        _RUNS[key] = (p, get_searcher(name).search(p, context(seed)))
    return _RUNS[key]


@pytest.mark.parametrize("name", list_searchers())
def test_rule_1_an_impossible_budget_is_reported_not_raised(name: str) -> None:
    """A budget under the persistent state cannot be met: the status says so and the result is over it."""
    p, r = searched(name, _FLOOR / _PEAK * 0.5)
    assert r.status in (Status.INFEASIBLE, Status.TIMEOUT) and not r.feasible
    assert r.result.peak_bytes > p.budget_bytes and r.evaluations >= 1


@pytest.mark.parametrize("name", ["ppo", "ppo-onepass", "ppo-pretrained", "portfolio", "capuchin"])
def test_rule_1_a_budget_of_nothing_is_reported_not_raised(name: str) -> None:
    """The RL agents (and the portfolio, which runs the agent's one pass) raised ValueError from their
    environment for a budget of 0 bytes through the Python API (a QA run); the heuristics answered INFEASIBLE."""
    r = get_searcher(name).search(Problem(_W, _HW, budget_bytes=0), SearchContext(time_limit_s=2, trials=2))
    assert r.status == Status.INFEASIBLE and not r.feasible


@pytest.mark.parametrize("name", list_searchers())
@pytest.mark.parametrize("fraction", [1.0, 0.7])
def test_rule_2_the_status_and_the_figures_are_the_policys(name: str, fraction: float) -> None:
    p, r = searched(name, fraction)
    again = p.evaluate(r.policy.to_vector(_W), r.policy.options)
    assert again == r.result  # the policy, simulated again, gives the reported figures
    if r.status in (Status.FEASIBLE, Status.OPTIMAL):
        assert r.result.feasible and r.result.peak_bytes <= p.budget_bytes
    if r.status == Status.INFEASIBLE:
        assert not r.result.feasible
    if fraction == 1.0:  # keep-all fits: every searcher answers with a policy that fits
        assert r.feasible and r.status != Status.INFEASIBLE
    assert r.policy.predicted is not None and r.policy.predicted.peak_bytes == r.result.peak_bytes


@pytest.mark.parametrize("name", list_searchers())
def test_rule_3_optimal_only_from_exact_solvers(name: str) -> None:
    statuses = {searched(name, f)[1].status for f in (1.0, 0.7)}
    if not get_searcher(name).exact:
        assert Status.OPTIMAL not in statuses


@pytest.mark.parametrize("name", list_searchers())
def test_rule_4_no_compression_unless_allowed(name: str) -> None:
    for f in (1.0, 0.7):
        assert not np.any(searched(name, f)[1].policy.to_vector(_W) == COMPRESS)


@pytest.mark.parametrize("name", ["ppo-onepass", "portfolio"])
def test_rule_4_compression_allowed_on_the_problem_is_allowed_in_the_answer(name: str) -> None:
    """A problem made with ``allow_compress`` (as the gym environment's default one is) lets the searchers
    compress: the RL agent proposed compressed tensors, and the answer's policy, made without ``lossy``, was
    refused when made, after the whole search (the portfolio, which the agent seeds, too)."""
    p = Problem(_W, _HW, budget_bytes=int(_PEAK * 0.9), allow_compress=True)
    assert p.options.lossy
    r = get_searcher(name).search(p, SearchContext(time_limit_s=2, seed=0, trials=3))
    assert r.status == Status.FEASIBLE and r.policy.options.lossy
    if name == "ppo-onepass":
        assert (r.policy.to_vector(_W) == COMPRESS).any()  # what was refused before


def test_the_python_api_says_a_wrong_argument_in_one_line(tmp_path: Any) -> None:
    """A QA run through the API: a profile's name, a budget as text, a seed numpy refuses, a dict for the
    context and a model's name for the workload failed deep inside (AttributeError, TypeError in a comparison,
    numpy's seeding twelve frames down). A profile's name now works; the rest are one-line errors."""
    from envs.simulator import Simulator
    from runtime.policy import load_policy

    by_name = Problem(_W, "v100-16gb", budget_bytes=_PEAK)  # type: ignore[arg-type]
    assert by_name.hardware == _HW and Simulator(_W, "v100-16gb").run(by_name.keep_all()).peak_bytes == _PEAK
    with pytest.raises(TypeError, match=r"budget_bytes='6GB': expected a whole number of bytes"):
        Problem(_W, _HW, budget_bytes="6GB")  # type: ignore[arg-type]
    for seed in (-1, 2**32, 1.5):
        with pytest.raises(ValueError, match=r"seed=.*expected a whole number from 0 to 2\*\*32 - 1"):
            SearchContext(seed=seed)  # type: ignore[arg-type]
    assert SearchContext(seed=np.int64(3)).seed == 3
    with pytest.raises(TypeError, match=r"takes an agents.base.Problem and a SearchContext"):
        get_searcher("capuchin").search(problem(0.7), {"time_limit_s": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_policy\(path, workload=None\) takes"):
        load_policy(tmp_path / "p.json", "resnet18")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_policy\(path, workload=None\) takes"):
        load_policy(5)  # type: ignore[arg-type]


def test_an_action_code_outside_the_vocabulary_is_refused() -> None:
    """``Problem.evaluate`` scored a code outside 0..3 (7, -1, or 257 wrapped to a swap by int8) as a drop with no
    legal meaning, below every legal policy's peak, and kept it as the best seen; ``Policy.from_vector`` refuses
    the same vectors."""
    p = problem(0.7)
    for bad in ([7] * p.n, [-1] * p.n, [257] * p.n, [2.9] * p.n, [0] * (p.n + 1)):
        with pytest.raises(ValueError, match="action"):
            p.evaluate(bad)
    assert p.evaluations == 5 and p.evaluate([0] * p.n).peak_bytes == _PEAK
    assert p.evaluate(np.full(p.n, 2.0)) == p.evaluate(np.full(p.n, 2))  # an exact solver's whole floats


def test_rule_4_no_swap_on_a_profile_without_copy_engines() -> None:
    """Simulator Rule 4: on the CPU a swapped tensor's copy is the same memory, so a swap never lowers the peak
    and adds a copy; swap-based heuristics answered swaps there all the same (and where a tensor's own op saves
    it, the runtime copies it while that op's inputs are live: measured above the plan). No searcher is offered
    swap on such a profile: a swap is planned and answered as keep."""
    from runtime.vocab import SWAP

    cpu = get_profile("cpu")
    peak = peak_report(_W, cpu.alloc_granularity_bytes).peak_bytes
    assert Problem(_W, _HW, budget_bytes=_PEAK).allow_swap
    for name in ("vdnn", "zhang-swap"):
        swapped = get_searcher(name).search(Problem(_W, _HW, budget_bytes=int(_PEAK * 0.8)), context())
        assert (swapped.policy.to_vector(_W) == SWAP).any(), name  # they swap on a GPU's profile
        p = Problem(_W, cpu, budget_bytes=int(peak * 0.8))
        r = get_searcher(name).search(p, context())
        assert not (r.policy.to_vector(_W) == SWAP).any(), name
        assert r.result == p.evaluate(r.policy.to_vector(_W), r.policy.options)
    assert not p.allow_swap


@pytest.mark.parametrize("name", list_searchers())
def test_rule_5_deterministic_under_one_seed(name: str) -> None:
    a = searched(name, 0.7, seed=3)[1]
    b = get_searcher(name).search(problem(0.7), context(seed=3))
    assert np.array_equal(a.policy.to_vector(_W), b.policy.to_vector(_W)) and a.policy.options == b.policy.options


@pytest.mark.parametrize("name", list_searchers(exact=False))
def test_rule_6_heuristics_stop_once_the_budget_holds(name: str) -> None:
    """With a budget above the no-policy peak, a budget-aware heuristic changes nothing."""
    p = problem(1.05)
    r = get_searcher(name).search(p)
    keep_all = p.evaluate(np.zeros(len(_W.candidates), dtype=np.int8), p.options)
    assert r.feasible and r.result.samples_per_s == pytest.approx(keep_all.samples_per_s)
    assert keep_all.iter_s == pytest.approx(keep_all.compute_s + _HW.host.op_s)  # the first op waits for its issue


def test_unknown_searcher_did_you_mean() -> None:
    with pytest.raises(AutotuneError, match="did you mean"):
        get_searcher("capuchn")


def test_ctrl_c_inside_a_query_prints_no_sqlalchemy_cleanup_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A Ctrl-C that lands inside one of Optuna's queries makes SQLAlchemy's cursor cleanup fail, which it
    logs with a traceback ("Error closing cursor"): inside ``noting_sigint`` after a Ctrl-C that is not
    logged, and the logger is as it was afterwards."""
    pool = logging.getLogger("sqlalchemy.pool.impl.QueuePool")
    ctx = SearchContext()
    with ctx.noting_sigint():
        pool.error("before")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode; the sleep is interrupted
        pool.error("Error closing cursor")
    pool.error("after")
    assert ctx.state.sigint_pending
    assert [r.getMessage() for r in caplog.records] == ["before", "after"]


def test_an_error_optuna_raises_after_a_ctrl_c_is_the_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands in one of Optuna's storage queries can come out of ``study.optimize`` as an error
    whose chain does not hold the KeyboardInterrupt (Optuna 5: AssertionError "Should not reach."). With the
    Ctrl-C noted and not yet taken, the search takes it as the interrupt and answers; without, it is raised."""
    import optuna

    w = capture(tiny_cnn_build(), name="cnn", batch_size=2)
    hw = get_profile("a100-40gb")
    budget = int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.8)

    def optimize(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("Should not reach.")

    monkeypatch.setattr(optuna.study.Study, "optimize", optimize)
    ctx = SearchContext(time_limit_s=5, trials=3)
    ctx.state.sigint_pending = True
    result = get_searcher("optuna-tpe").search(Problem(w, hw, budget), ctx)
    assert ctx.interrupted and result.policy is not None
    with pytest.raises(AssertionError, match="Should not reach"):
        get_searcher("optuna-tpe").search(Problem(w, hw, budget), SearchContext(time_limit_s=5, trials=3))
