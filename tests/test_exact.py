"""The exact yardstick (agents/solvers/exact.py): its bounds never above the simulator, its optimum equal to
brute force where brute force runs, and the portfolio against it where brute force does not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agents.base import Problem, SearchContext, get_searcher
from agents.solvers.exact import Bounds, solve_exact
from runtime.hardware import get_profile
from runtime.policy import PolicyOptions
from runtime.synthetic import synthetic_workload
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload, peak_report
from tests.synthetic import chain_workload, diamond_workload, fixed_profile, framed_chain_workload
from tests.test_search import _PROFILES, TAU, S, brute_force, chain_optimum, chain_problem

_WORKLOADS = {
    "chain": lambda: chain_workload(7, S, TAU),
    "framed": lambda: framed_chain_workload(6, S, TAU, block=2),
    "diamond": lambda: diamond_workload(S, TAU),
}


_CASES = [f"{w}/{p}" for w in _WORKLOADS for p in _PROFILES] + [
    f"synthetic/{p}" for p in ("a100-40gb", "v100-16gb", "cpu")
]


def _case(name: str) -> tuple[Workload, object]:
    """The workload and profile of a case, built when the test runs (the ``cpu`` profile is calibrated on this
    machine, seconds that collection should not spend in every worker)."""
    workload, profile = name.split("/")
    if workload == "synthetic":
        return synthetic_workload(), get_profile(profile)
    return _WORKLOADS[workload](), fixed_profile(**_PROFILES[profile])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", _CASES)
def test_bounds_never_above_the_simulator(name: str) -> None:
    """B1 and B2 (NOTE [ Exact yardstick ]) on 300 random policies and options per workload and profile: the
    peak bound at most the simulated peak, the time bound at most the simulated iteration; both exact for
    keeping everything where nothing else is left (the peak as traced; compute alone, the host never
    behind)."""
    w, hw = _case(name)
    p = Problem(w, hw, 1 << 60, allow_compress=True)  # type: ignore[arg-type]
    b, sim = Bounds(p), p.simulator
    rng = np.random.default_rng(0)
    for _ in range(300):
        vec = np.where(rng.uniform(size=sim.k) < rng.uniform(), rng.integers(0, 4, sim.k), KEEP).astype(np.int8)
        opts = PolicyOptions(
            prefetch_lookahead=int(rng.choice([0, 1, 2, 8])), release_after=int(rng.choice([1, 2, 4, 16])), lossy=True
        )
        r = sim.run(vec, options=opts)
        assert b.peak_bound(np.flatnonzero(vec == KEEP)) <= r.peak_bytes
        t = b.time_bound(np.flatnonzero(vec == SWAP), np.flatnonzero(vec == RECOMPUTE), np.flatnonzero(vec == COMPRESS))
        assert t <= r.iter_s * (1 + 1e-12)
    keep = sim.run(p.keep_all())
    assert b.peak_bound(range(sim.k)) == keep.peak_bytes
    if name.startswith(("chain/slow", "chain/fast", "chain/one")):
        assert b.time_bound([], [], []) == pytest.approx(keep.iter_s, rel=1e-12)


def test_bounds_by_hand_on_the_chain() -> None:
    """The 7-layer chain on the slow link (14 ops of TAU; a copy takes 5; c_i made and saved by op i, read by
    backward op 13 - i). Recomputing c_1 and c_2 adds their producers: 16 TAU. Swapping c_0: 1 TAU to its
    save, 5 + 5 of copies, 1 from its use on: 12, below the 14 of compute. Swapping c_3: 4 + 10 + 4 (ops 10
    to 13) = 18 TAU; with c_0 too, the copy streams' totals (out: 1 + 10; back: from 6, 10, then op 13: 17)
    stay below 18. Memory: keeping all gives the traced peak (9 S at op 7: x, the loss gradient and the
    seven layers); with none kept each c_i holds [i, i + 1] and its use: 4 S at op 8 (x, two gradients and
    c_5, read there)."""
    p = chain_problem(1.0, n=7)
    b = Bounds(p)
    assert b.time_bound([], [1, 2], []) == pytest.approx(16 * TAU)
    assert b.time_bound([0], [], []) == pytest.approx(14 * TAU)
    assert b.time_bound([3], [], []) == pytest.approx(18 * TAU)
    assert b.time_bound([0, 3], [], []) == pytest.approx(18 * TAU)
    keep_peak = peak_report(p.workload, p.hardware.alloc_granularity_bytes).peak_bytes
    assert b.peak_bound(range(7)) == keep_peak == 9 * S
    assert b.peak_bound([]) == 4 * S


@pytest.mark.parametrize(
    ("workload", "profile", "fraction"),
    [
        ("chain", "slow link", 0.7),
        ("chain", "one clock", 0.7),
        ("framed", "host costs", 0.8),
        ("chain", "fast link", 0.5),
    ],
)
def test_exact_equals_brute_force(workload: str, profile: str, fraction: float) -> None:
    """Six-layer chains, plain and framed (regions), on four profiles: the branch and bound proves the same
    optimum as brute force over every policy, look-ahead and release point."""
    w = chain_workload(6, S, TAU) if workload == "chain" else framed_chain_workload(6, S, TAU, block=2)
    hw = fixed_profile(**_PROFILES[profile])  # type: ignore[arg-type]
    budget = int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * fraction)
    got = solve_exact(Problem(w, hw, budget))
    optimum = brute_force(Problem(w, hw, budget))
    assert got.optimal and got.gap == 0.0 and got.bound_s == got.result.iter_s  # type: ignore[union-attr]
    assert optimum > 0 and got.samples_per_s == pytest.approx(optimum, rel=1e-12)
    assert got.result == Problem(w, hw, budget).simulator.run(got.actions, budget_bytes=budget, options=got.options)  # type: ignore[arg-type]


def test_exact_at_half_the_six_chain_and_below_its_floor() -> None:
    p = chain_problem(0.5, n=6)
    got = solve_exact(p)
    assert got.optimal and got.samples_per_s == pytest.approx(chain_optimum(0.5, 6), rel=1e-12)
    none = solve_exact(chain_problem(0.2, n=6))  # below what any policy holds: proven, nothing simulated
    assert none.optimal and none.actions is None and math.isinf(none.bound_s) and none.evaluations == 0
    # On one clock at 60% brute force finds nothing (a swap frees nothing there): proven too, by simulating.
    w, hw = chain_workload(6, S, TAU), fixed_profile(**_PROFILES["one clock"])  # type: ignore[arg-type]
    p = Problem(w, hw, int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.6))
    none = solve_exact(p)
    assert brute_force(p) == 0.0 and none.optimal and none.actions is None and none.evaluations > 0


def test_exact_on_the_eight_chain_and_the_portfolio_against_it() -> None:
    """The 8-layer chain at half its peak: 40.0 samples/s, as brute force over every policy, look-ahead and
    release point found in 124 s (tests/test_search.py); the portfolio reaches it."""
    p = chain_problem(0.5)
    got = solve_exact(p)
    assert got.optimal and got.samples_per_s == pytest.approx(40.0, rel=1e-9)
    answer = get_searcher("portfolio").search(chain_problem(0.5), SearchContext(trials=20, time_limit_s=20))
    assert answer.result.samples_per_s >= 0.99 * got.samples_per_s


@pytest.mark.slow
def test_portfolio_reaches_the_ten_chains_optimum() -> None:
    """Ten layers at 70% (3^10 policies times 35 options: past brute force): the proven optimum, 43.5
    samples/s, and the portfolio within 1% of it (it reaches it at 50% too: 38.5)."""
    fraction = 0.7
    p = chain_problem(fraction, n=10)
    got = solve_exact(p, time_limit_s=300)
    assert got.optimal
    answer = get_searcher("portfolio").search(chain_problem(fraction, n=10), SearchContext(trials=20, time_limit_s=20))
    assert answer.feasible and answer.result.samples_per_s >= 0.99 * got.samples_per_s


def test_a_time_limit_gives_a_proven_bound_and_its_gap() -> None:
    """Stopped at once, the answer is the incumbent and the bound the root's (compute alone): the gap is
    what is left to prove, and the bound is above every policy brute force finds."""
    p = chain_problem(0.5, n=6)
    start = np.array([RECOMPUTE, SWAP, SWAP, SWAP, KEEP, KEEP], dtype=np.int8)
    opts = PolicyOptions(prefetch_lookahead=0, release_after=2)  # the optimum (tests/test_search.py)
    assert p.simulator.run(start, budget_bytes=p.budget_bytes, options=opts).feasible
    got = solve_exact(p, incumbent=(start, opts), stop=lambda: True)
    assert not got.optimal and got.evaluations == 1
    assert got.bound_s == pytest.approx(12 * TAU)  # every op once
    assert got.bound_samples_per_s >= chain_optimum(0.5, 6) >= got.samples_per_s
    assert got.gap == pytest.approx(1 - got.bound_s / got.result.iter_s)  # type: ignore[union-attr]


def test_units_decide_together() -> None:
    """Units of two layers: the optimum over those policies is brute force's over the same, and no better than
    per layer."""
    p = chain_problem(0.7, n=6)
    units = [[0, 1], [2, 3], [4, 5]]
    got = solve_exact(p, units=units)
    best = 0.0
    for a in range(27):
        per_unit = [(a // 9) % 3, (a // 3) % 3, a % 3]
        vec = np.repeat(np.array(per_unit, dtype=np.int8), 2)
        for opts in [PolicyOptions(prefetch_lookahead=la, release_after=r) for la in (0, 1, 2, 4, 8, 16, 32)
                     for r in (1, 2, 4, 8, 16)] if SWAP in per_unit else [p.options]:  # fmt: skip
            r = p.simulator.run(vec, budget_bytes=p.budget_bytes, options=opts)
            best = max(best, r.samples_per_s if r.feasible else 0.0)
    assert got.optimal and got.samples_per_s == pytest.approx(best, rel=1e-12)
    assert got.samples_per_s <= solve_exact(p).samples_per_s


@pytest.mark.parametrize(("profile", "optimum"), [("host costs", 62.5), ("slow link", 1000 / 17)])
def test_the_portfolios_exact_phase_finds_what_refinement_misses(
    profile: str, optimum: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 8-layer chain framed in blocks of two at 80% of its peak: the optimum swaps one layer and keeps
    another that refinement recomputes (two changes at once, each alone worse or over budget). Refining the
    fastest seed alone (no restarts), without its exact phase and its perturbations (which reach it too, from
    random starts) the portfolio stops below 0.99 of it; with the exact phase, it answers the optimum (proven
    here)."""
    from agents import portfolio

    w = framed_chain_workload(8, S, TAU, block=2)
    hw = fixed_profile(**_PROFILES[profile])  # type: ignore[arg-type]
    budget = int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.8)
    proven = solve_exact(Problem(w, hw, budget))
    assert proven.optimal and proven.samples_per_s == pytest.approx(optimum, rel=1e-9)
    ctx = SearchContext(trials=20, time_limit_s=20)
    monkeypatch.setattr(portfolio, "RESTART_SHARE", 0.0)
    got = get_searcher("portfolio").search(Problem(w, hw, budget), ctx)
    assert got.result.samples_per_s == pytest.approx(optimum, rel=1e-9) and "exact" in got.note
    monkeypatch.setattr(portfolio, "EXACT_SHARE", (0.0, 0.0))
    monkeypatch.setattr(portfolio, "PERTURB_ROUNDS", 0)
    without = get_searcher("portfolio").search(Problem(w, hw, budget), ctx)
    assert without.result.samples_per_s < 0.99 * optimum
