"""Exact solvers against references: brute force over every policy, and the simulator itself.

checkpoint-dp: both dynamic programmes against brute force over all 2^n checkpoint sets of the same memory
model, and that model against the simulator on chains. milp: its optimum against brute force over all
3^n (4^n with compression) policies scored by the simulator, on small chains where each candidate is its
own unit (where the model is exact: NOTE [ MILP model ] in agents/solvers/milp/model.py).
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from agents.base import Problem, SearchContext, SearchResult, Status, get_searcher
from agents.solvers.checkpoint_dp import (
    ChainModel,
    chain_actions,
    chain_of,
    chain_peak_bytes,
    min_peak_checkpoints_cubic,
    min_peak_checkpoints_linear,
    min_recompute_checkpoints,
)
from agents.solvers.milp.data import MilpData, decision_units
from agents.solvers.milp.model import build_milp
from envs.simulator import SimResult
from runtime.hardware import HardwareProfile
from runtime.policy import PolicyOptions
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload
from tests.synthetic import chain_workload, fixed_profile


# -- checkpoint-dp: the pure dynamic programmes ---------------------------------------------------------------
def random_chain(rng: random.Random, n: int) -> ChainModel:
    sizes = [rng.choice([0, 1, 5, 10, 40, 100]) for _ in range(n)]
    fwd = [rng.randint(0, 30) for _ in range(n)]
    return ChainModel.of(sizes, fwd, [f + rng.randint(0, 30) for f in fwd])


def subsets(n: int) -> list[list[int]]:
    return [[i for i in range(n) if mask >> i & 1] for mask in range(1 << n)]


def test_dp_forms_agree_with_brute_force() -> None:
    rng = random.Random(0)
    for n in [1, 2, 3, *(rng.randint(4, 12) for _ in range(40))]:
        model = random_chain(rng, n)
        least = min(chain_peak_bytes(model, ks) for ks in subsets(n))
        cubic, cubic_set = min_peak_checkpoints_cubic(model)
        linear, linear_set = min_peak_checkpoints_linear(model)
        assert cubic == linear == least, (model, cubic, linear, least)
        assert chain_peak_bytes(model, cubic_set) == chain_peak_bytes(model, linear_set) == least


def test_dp_hand_computed_chain() -> None:
    """8 equal layers of 10 B, nothing else: checkpoints {3, 6} leave segments 0-2, 4-5 and 7, whose
    backward peaks are 0 + 30, 10 + 20 and 20 + 10 (the checkpoints below plus the segment): 30, three
    layers' worth, against 80 for keeping everything. Segments shrink as the checkpoints below grow."""
    model = ChainModel.of([10] * 8)
    assert chain_peak_bytes(model, {3, 6}) == 30 and chain_peak_bytes(model, range(8)) == 80
    assert min_peak_checkpoints_linear(model)[0] == min_peak_checkpoints_cubic(model)[0] == 30


def test_min_recompute_under_a_bound_matches_brute_force() -> None:
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 10)
        model = random_chain(rng, n)
        seconds = [rng.choice([0.1, 0.2, 0.5, 1.0]) for _ in range(n)]
        least = min_peak_checkpoints_linear(model)[0]
        assert min_recompute_checkpoints(model, seconds, least - 1) is None
        bound = least + rng.randint(0, 60)
        fitting = [ks for ks in subsets(n) if chain_peak_bytes(model, ks) <= bound]
        best = min(sum(seconds) - sum(seconds[i] for i in ks) for ks in fitting)
        found = min_recompute_checkpoints(model, seconds, bound)
        assert found is not None and found[0] == pytest.approx(best)
        assert chain_peak_bytes(model, found[1]) <= bound
        assert found[0] == pytest.approx(sum(seconds) - sum(seconds[i] for i in found[1]))


def test_chain_model_rejects_forward_bytes_above_backward() -> None:
    with pytest.raises(ValueError, match="fwd_other_bytes"):
        ChainModel.of([1, 2], [5, 0], [4, 0])


# -- checkpoint-dp: the model is the simulator on a chain -----------------------------------------------------
def vary(w: Workload, rng: random.Random, candidate_sizes: list[int], other_sizes: list[int]) -> Workload:
    """Random sizes for chain_workload's activations and for its other tensors (input, gradients)."""
    saved = {c.tensor for c in w.candidates}
    for t in w.tensors:
        t.nbytes = rng.choice(candidate_sizes if t.id in saved else other_sizes)
    for c in w.candidates:
        c.nbytes = w.tensors[c.tensor].nbytes
    return w


@pytest.mark.parametrize("sizes", ["equal", "random"])
def test_chain_model_is_the_simulator_for_every_checkpoint_set(sizes: str) -> None:
    rng = random.Random(2)
    w = chain_workload(7, 100, 1e-3)
    if sizes == "random":
        vary(w, rng, [10, 50, 100, 300], [1, 20, 200])
    p = Problem(w, fixed_profile(), budget_bytes=10**9)
    chain = chain_of(p)
    assert chain.exact and len(chain.units) == 7
    for ks in subsets(7):
        assert p.evaluate(chain_actions(p, chain, ks)).peak_bytes == chain_peak_bytes(chain.model, ks), ks


def test_checkpoint_dp_statuses_on_a_chain() -> None:
    w = chain_workload(8, 100, 1e-3)
    hw = fixed_profile()
    probe = Problem(w, hw, budget_bytes=10**9)
    chain = chain_of(probe)
    least, _ = min_peak_checkpoints_linear(chain.model)
    keep_peak = probe.evaluate(probe.keep_all()).peak_bytes
    dp = get_searcher("checkpoint-dp")
    # At the least peak: that set, proved optimal, and the model's peak is the simulator's.
    tight = dp.search(Problem(w, hw, budget_bytes=least))
    assert tight.status == Status.OPTIMAL and tight.gap == 0.0
    assert tight.result.peak_bytes == least < keep_peak
    # Below it: nothing fits, and the note says it was proved.
    below = dp.search(Problem(w, hw, budget_bytes=least - 1))
    assert below.status == Status.INFEASIBLE and "proved" in below.note and below.result.peak_bytes == least
    # With room: the fastest fitting set (keep all when it fits), recomputing nothing.
    roomy = dp.search(Problem(w, hw, budget_bytes=keep_peak))
    assert roomy.feasible and roomy.result.recompute_s == 0.0


# -- milp: brute force over every policy on small chains -------------------------------------------------------
def chain_instance(rng: random.Random, n: int, compress: bool) -> tuple[Workload, HardwareProfile, PolicyOptions]:
    """A chain with random layer sizes, op times, link rates, prefetch look-ahead and release point (Rule 4:
    one or two pack points on, in forward where the compute stream may wait for the copy, or four, mostly
    at the first backward use of a tensor that is not kept). Gradients are small, so the activations
    decide; float32 tensors when compressing (so bfloat16 halves them)."""
    w = vary(chain_workload(n, 100, 1e-3), rng, [48, 96, 200, 400], [4, 8, 20])
    for t in w.tensors:
        t.dtype = "float32" if compress else t.dtype
    for op in w.ops:
        op.time_s = rng.choice([1e-4, 2e-4, 5e-4, 1e-3])
    hw = fixed_profile(h2d_bytes_per_s=rng.choice([1e5, 3e5, 1e6, 3e6]), d2h_bytes_per_s=rng.choice([1e5, 1e6, 3e6]))
    release = rng.choice([1, 2, 4])
    return w, hw, PolicyOptions(prefetch_lookahead=rng.choice([0, 1, 2]), lossy=compress, release_after=release)


def brute_force(p: Problem) -> tuple[SimResult, tuple[int, ...]] | None:
    """The fastest policy within the budget over every action vector, by the simulator."""
    codes = (KEEP, SWAP, RECOMPUTE, COMPRESS) if p.allow_compress else (KEEP, SWAP, RECOMPUTE)
    best: tuple[SimResult, tuple[int, ...]] | None = None
    for acts in itertools.product(codes, repeat=p.n):
        r = p.evaluate(np.array(acts, dtype=np.int8))
        if r.feasible and (best is None or r.iter_s < best[0].iter_s):
            best = (r, acts)
    return best


def check_against_brute_force(
    seed: int, count: int, max_n: int, compress: bool, notes: list[str] | None = None
) -> list[tuple[int, ...]]:
    """MILP optimum == brute-force optimum on ``count`` random chains; returns the optimal policies (and
    appends the MILP's notes to ``notes``)."""
    rng = random.Random(seed)
    optima: list[tuple[int, ...]] = []
    milp = get_searcher("milp")
    while len(optima) < count:
        w, hw, opts = chain_instance(rng, rng.randint(3, max_n), compress)
        keep_peak = Problem(w, hw, budget_bytes=0, options=opts).evaluate(np.zeros(len(w.candidates))).peak_bytes
        budget = int(keep_peak * rng.choice([0.6, 0.7, 0.8, 0.9]))
        p = Problem(w, hw, budget_bytes=budget, options=opts, allow_compress=compress)
        best = brute_force(p)
        r = milp.search(p, SearchContext(time_limit_s=30))
        if notes is not None:
            notes.append(r.note)
        if best is None:
            assert r.status == Status.INFEASIBLE
            continue
        assert r.status == Status.OPTIMAL, r.note
        # HiGHS stops within a relative gap of 1e-6.
        assert r.result.iter_s == pytest.approx(best[0].iter_s, rel=2e-6, abs=1e-12), (best[1], r.note)
        assert r.result.peak_bytes <= budget
        optima.append(best[1])
    return optima


def test_milp_matches_brute_force_keep_swap_recompute() -> None:
    optima = check_against_brute_force(seed=0, count=18, max_n=5, compress=False)
    # The instances exercise every action and Rule 7's interplay: a swapped layer under a recomputed one
    # (fetched when the recompute needs it, not at its own prefetch) and a chain of recomputes.
    assert any(SWAP in o for o in optima) and any(RECOMPUTE in o for o in optima)
    assert any(o[i] == SWAP and o[i + 1] == RECOMPUTE for o in optima for i in range(len(o) - 1))
    assert any(o[i] == o[i + 1] == RECOMPUTE for o in optima for i in range(len(o) - 1))


def test_milp_matches_brute_force_with_compression() -> None:
    optima = check_against_brute_force(seed=11, count=6, max_n=4, compress=True)
    assert any(COMPRESS in o for o in optima)


def hard_chain() -> Problem:
    rng = random.Random(0)
    w = chain_workload(40, 100, 1e-3)
    for op in w.ops:
        op.time_s = rng.choice([1e-4, 2e-4, 5e-4, 1e-3])
    hw = fixed_profile(3e5, 3e5)
    keep_peak = Problem(w, hw, budget_bytes=0).evaluate(np.zeros(40)).peak_bytes
    return Problem(w, hw, budget_bytes=keep_peak // 2)


def test_milp_timeout_returns_an_incumbent(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS stopped by its time limit before it could prove anything (the limit set to 0 s, whatever the
    machine's speed): the answer is TIMEOUT with the best incumbent, which fits and was simulated."""
    import highspy

    real = highspy.Highs.setOptionValue

    def no_time(self: highspy.Highs, name: str, value: object) -> object:
        return real(self, name, 0.0 if name == "time_limit" else value)

    monkeypatch.setattr(highspy.Highs, "setOptionValue", no_time)
    p = hard_chain()
    r = get_searcher("milp").search(p, SearchContext(time_limit_s=0.01))
    assert r.status == Status.TIMEOUT
    assert r.result.peak_bytes <= p.budget_bytes
    assert r.result.samples_per_s < p.workload.batch_size / p.simulator.compute_s  # it had to pay
    assert not np.array_equal(r.policy.to_vector(p.workload), p.keep_all())


def test_milp_infeasible_returns_least_peak() -> None:
    """Below the gradients and input alone nothing fits: INFEASIBLE, with a policy no worse than keep-all."""
    w = chain_workload(5, 100, 1e-3)
    p = Problem(w, fixed_profile(), budget_bytes=150)
    r = get_searcher("milp").search(p, SearchContext(time_limit_s=10))
    assert r.status == Status.INFEASIBLE
    assert r.result.peak_bytes < p.evaluate(p.keep_all()).peak_bytes


def test_milp_rows_and_columns_are_named() -> None:
    w, hw, opts = chain_instance(random.Random(3), 5, compress=True)
    p = Problem(w, hw, budget_bytes=1000, options=opts, allow_compress=True)
    built = build_milp(MilpData(p, decision_units(p), (KEEP, SWAP, RECOMPUTE, COMPRESS), 1.0), 1000)
    for names in (built.milp.col_names, built.milp.row_names):
        assert all(names) and len(set(names)) == len(names)
    kinds = {name.split("[")[0] for name in built.milp.row_names}
    assert {"one_action", "memory", "stall", "h2d_issue", "d2h_issue", "pull_lb", "late_release"} <= kinds
    if opts.release_after < 4:
        assert "release" in kinds


# -- real models --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resnet50_milp_fits_and_beats_checkpoint_dp() -> None:
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile
    from runtime.workload import peak_report

    w, _ = trace_model(TraceRequest(model="resnet50", batch_size=64))
    hw = get_profile("a100-40gb")
    budget = int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.7)
    results: dict[str, SearchResult] = {}
    for name in ("checkpoint-dp", "milp"):
        results[name] = get_searcher(name).search(Problem(w, hw, budget_bytes=budget), SearchContext(time_limit_s=60))
        assert results[name].result.peak_bytes <= budget, results[name].note
    assert results["milp"].status in (Status.OPTIMAL, Status.TIMEOUT, Status.FEASIBLE)
    assert results["milp"].result.samples_per_s > results["checkpoint-dp"].result.samples_per_s


def test_ctrl_c_stops_the_milp_solve_at_once() -> None:
    """HiGHS solves in one C++ call, during which Python runs no signal handler: Ctrl-C waited for the whole
    solve (36 s of a 40 s time limit on resnet101's MILP). The solve runs in a thread of its own; an interrupt
    starts HiGHS's MIP interrupt callback, which stops it at its next check, and the KeyboardInterrupt goes on
    with nothing left running. A stand-in for HiGHS checks every 10 ms and would run for 30 s."""
    import _thread
    import threading
    import time
    from types import SimpleNamespace

    from agents.solvers.milp.highs import _run_interruptible

    kind = "kCallbackMipInterrupt"
    hs = SimpleNamespace(cb=SimpleNamespace(HighsCallbackType=SimpleNamespace(__members__={kind: kind})))

    class Solver:  # highspy's names
        def __init__(self) -> None:
            self.callback = None
            self.active: set[object] = set()
            self.checks = 0
            self.steps = 3000  # 30 s of checks

        def setCallback(self, fn, data):  # type: ignore[no-untyped-def]
            self.callback = fn

        def startCallback(self, k):  # type: ignore[no-untyped-def]
            self.active.add(k)

        @staticmethod
        def resetThreadScheduler(blocking: bool) -> None:
            pass

        def run(self) -> None:
            for _ in range(self.steps):
                self.checks += 1
                if kind in self.active and self.callback is not None:
                    data_in = SimpleNamespace(user_interrupt=False)
                    self.callback(kind, "", None, data_in, None)
                    if data_in.user_interrupt:
                        return
                time.sleep(0.01)

    h = Solver()
    threading.Timer(0.2, _thread.interrupt_main).start()  # Ctrl-C, as the signal handler raises it
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        _run_interruptible(hs, h)
    assert time.perf_counter() - start < 1.0 and h.checks < 100
    assert [t.name for t in threading.enumerate() if t.name == "highs"] == [] and h.callback is None
    h.active.clear()
    before, h.steps = h.checks, 50
    _run_interruptible(hs, h)  # uninterrupted: runs to its end (0.5 s) with the callback never started
    assert h.checks == before + 50
