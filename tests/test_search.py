"""The searchers of `autotune search`: the parametric rule, refinement, Optuna (resumable storage) and the
portfolio, against brute force on small workloads; and the `autotune search` command."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from agents.base import RELEASES, Problem, SearchContext, SearchResult, baseline_names, better, get_searcher
from agents.refine import refine
from agents.rule import LOOKAHEADS, RuleParams, ranked_moves, rule_actions
from runtime.policy import PolicyOptions, load_policy
from runtime.vocab import KEEP, RECOMPUTE, SWAP
from runtime.workload import peak_report
from tests.synthetic import chain_workload, fixed_profile, framed_chain_workload
from tests.test_cli import run

N, S, TAU = 8, 1000, 1e-3


def chain_problem(fraction: float, n: int = N) -> Problem:
    """An n-layer chain on a slow link: a copy takes 5 ops' time, so swapping is worth it only where it hides."""
    w = chain_workload(n, S, TAU)
    hw = fixed_profile(h2d_bytes_per_s=S / (5 * TAU), d2h_bytes_per_s=S / (5 * TAU))
    peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
    return Problem(w, hw, int(peak * fraction))


def optimum_at(problem: Problem, options: PolicyOptions) -> float:
    """The fastest feasible samples/s over every keep/swap/recompute policy under ``options``; 0 when nothing
    fits."""
    best = 0.0
    for combo in itertools.product((KEEP, SWAP, RECOMPUTE), repeat=problem.n):
        r = problem.simulator.run(np.array(combo, dtype=np.int8), budget_bytes=problem.budget_bytes, options=options)
        if r.feasible:
            best = max(best, r.samples_per_s)
    return best


def brute_force(problem: Problem) -> float:
    """The fastest feasible samples/s over every keep/swap/recompute policy and, where it swaps, every
    prefetch look-ahead and release point the searchers choose from (agents.rule.LOOKAHEADS,
    agents.base.RELEASES): the optimum of the space they search. 0 when nothing fits."""
    best = 0.0
    for combo in itertools.product((KEEP, SWAP, RECOMPUTE), repeat=problem.n):
        vec = np.array(combo, dtype=np.int8)
        options = [(x, y) for x in LOOKAHEADS for y in RELEASES] if SWAP in combo else [(2, 4)]
        for lookahead, release in options:
            opts = PolicyOptions(prefetch_lookahead=lookahead, release_after=release)
            r = problem.simulator.run(vec, budget_bytes=problem.budget_bytes, options=opts)
            if r.feasible:
                best = max(best, r.samples_per_s)
    return best


@functools.cache
def chain_optimum(fraction: float, n: int) -> float:
    """brute_force on ``chain_problem(fraction, n)``, once per process (13 s for six layers)."""
    return brute_force(chain_problem(fraction, n=n))


def test_rule_applies_the_shortest_fitting_prefix() -> None:
    p = chain_problem(0.7)
    params = RuleParams()
    actions, options, result = rule_actions(p, params)
    assert result.feasible
    order, moves, _ = ranked_moves(p, params)
    applied = int(np.sum(actions != KEEP))
    shorter = p.keep_all()
    shorter[order[: applied - 1]] = moves[: applied - 1]
    assert not p.evaluate(shorter, options).feasible  # one move fewer does not fit


def test_rule_cannot_fit_every_budget_but_reports_its_lowest_peak() -> None:
    """Recomputing consecutive chain layers regenerates them together (Rule 7), so the default rule stalls
    at 70% of the peak; it then returns the policy with the lowest peak it reached."""
    p = chain_problem(0.6)
    _, _, result = rule_actions(p, RuleParams())
    assert not result.feasible and result.peak_bytes == 7 * S


def test_rule_from_a_fitting_start_only_gives_back_throughput() -> None:
    p = chain_problem(0.6)
    start = np.array([RECOMPUTE, RECOMPUTE, KEEP, RECOMPUTE, RECOMPUTE, KEEP, RECOMPUTE, KEEP], dtype=np.int8)
    assert p.evaluate(start).feasible  # 6 of 10 kS, at 16 + 5 op times
    actions, _, relaxed = rule_actions(p, RuleParams(), start=start)
    assert relaxed.feasible and relaxed.samples_per_s > p.evaluate(start).samples_per_s
    assert set(np.flatnonzero(actions != KEEP)) < set(np.flatnonzero(start != KEEP))  # only gave back


def test_refine_is_never_worse_and_still_fits() -> None:
    p = chain_problem(0.6)
    start = np.array([RECOMPUTE, RECOMPUTE, KEEP, RECOMPUTE, RECOMPUTE, KEEP, RECOMPUTE, KEEP], dtype=np.int8)
    before = p.evaluate(start)
    actions, options, after = refine(p, start, p.options)
    assert after.feasible and after.samples_per_s >= before.samples_per_s
    assert p.evaluate(actions, options) == after


def test_refine_tries_the_options_before_the_costly_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """agents/refine.py: the look-ahead and release point are cheap moves, tried before any exchange (options
    change what single moves gain: on BERT-base at 60%, DTR's policy gained 9.9% from single moves once its
    look-ahead had changed). From four swaps released at the next pack point on the 8-chain at 60%, the first
    exchange already sees the options the look-ahead search picks for the policy the single moves left."""
    from agents import refine as refine_module

    p = chain_problem(0.6)
    start = np.array([KEEP, KEEP, SWAP, SWAP, SWAP, SWAP, KEEP, KEEP], dtype=np.int8)
    opts = PolicyOptions(prefetch_lookahead=0, release_after=1)
    assert p.evaluate(start, opts).feasible
    seen: list[tuple[PolicyOptions, PolicyOptions]] = []  # (options given, the fastest for that policy)
    exchange = refine_module._exchange

    def recording(problem, actions, options, result, late, width=40):  # type: ignore[no-untyped-def]
        seen.append((options, refine_module.fastest_lookahead(problem, actions, options, result)[0]))
        return exchange(problem, actions, options, result, late, width)

    monkeypatch.setattr(refine_module, "_exchange", recording)
    refine(p, start, opts)
    assert seen and seen[0][1] == seen[0][0]
    assert seen[0][0] != opts  # (so the test can tell: the options the search started from were not the best)


@pytest.mark.parametrize("fraction", [0.6, 0.5])
def test_portfolio_reaches_the_brute_force_optimum_where_no_baseline_fits(fraction: float) -> None:
    """On a 6-layer chain at 60% and 50% of its peak no baseline fits; the portfolio repairs one and
    refines it to the optimum of brute force over every policy, look-ahead and release point (25.6
    samples/s: recompute c_0, swap c_1-c_3 on demand, released two pack points on)."""
    p = chain_problem(fraction, n=6)
    optimum = chain_optimum(fraction, 6)
    seeds = tuple(get_searcher(name).search(p) for name in [*baseline_names(), "ppo-onepass"])
    got = get_searcher("portfolio").search(p, SearchContext(trials=60, time_limit_s=60, seeds=seeds))
    assert not any(r.feasible for r in seeds)  # the seeds alone miss it
    assert optimum > 0 and got.feasible and got.result.samples_per_s == pytest.approx(optimum, rel=1e-9)


_PROFILES = {
    "slow link": {"h2d_bytes_per_s": S / (5 * TAU), "d2h_bytes_per_s": S / (5 * TAU)},  # a copy: 5 ops' time
    "fast link": {"h2d_bytes_per_s": S / (0.5 * TAU), "d2h_bytes_per_s": S / (0.5 * TAU)},
    "one clock": {"h2d_bytes_per_s": S / (0.5 * TAU), "d2h_bytes_per_s": S / (0.5 * TAU), "is_gpu": False},
    "host costs": {"h2d_bytes_per_s": S / (2 * TAU), "d2h_bytes_per_s": S / (2 * TAU), "pack_s": TAU / 4,
                   "unpack_s": TAU / 4, "frame_s": TAU / 4, "swap_s": TAU / 4, "record_op_s": TAU / 4,
                   "replay_op_s": TAU / 2, "region_s": TAU / 2},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "profile", "fraction"),
    [
        ("chain", "slow link", 0.7),
        ("chain", "fast link", 0.5),
        ("chain", "one clock", 0.7),
        ("chain", "host costs", 0.5),
        ("framed", "slow link", 0.6),
        ("framed", "host costs", 0.8),  # the optimum swaps with its bytes let go at the next pack point
    ],
)
def test_portfolio_within_one_percent_of_brute_force(workload: str, profile: str, fraction: float) -> None:
    """Six-layer chains, plain and framed in blocks of two layers (regions), on a slow and a fast link,
    one clock (the CPU) and with the runtime's host costs: the portfolio's answer is within 1% of brute
    force over every policy, look-ahead and release point (six- and seven-layer chains and the framed one on
    these four profiles at 80%, 70%, 60% and 50%: the optimum in all 42 of the 48 cells where a policy fits,
    README "Search")."""
    w = chain_workload(6, S, TAU) if workload == "chain" else framed_chain_workload(6, S, TAU, block=2)
    hw = fixed_profile(**_PROFILES[profile])  # type: ignore[arg-type]
    budget = int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * fraction)
    optimum = brute_force(Problem(w, hw, budget))
    got = get_searcher("portfolio").search(Problem(w, hw, budget), SearchContext(trials=20, time_limit_s=20))
    assert optimum > 0 and got.feasible and got.result.samples_per_s >= 0.99 * optimum


def test_restarts_refine_the_other_seeds_where_the_fastest_seeds_optimum_is_local(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ Restarts ]: on the framed 8-chain (blocks of 3) with host costs, at 80% of its peak, the fastest
    seed is delta's and refining it stops at 1 / 17 ms = 58.8 samples/s; refining DTR's reaches 1 / 16 ms =
    62.5, the optimum of every policy at its options (brute force over the 3^8 policies). Each probe runs to
    its end here (on a loaded machine a 0.25-s probe got less far and another seed won the same optimum);
    the probes cut off are the next test's."""
    from agents import portfolio
    from agents.optuna_search import _Best
    from agents.portfolio import _restarts

    monkeypatch.setattr(portfolio, "PROBE_S", 60.0)

    w = framed_chain_workload(N, S, TAU, 3)
    hw = fixed_profile(**_PROFILES["host costs"])
    p = Problem(w, hw, int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.8))
    seeds = tuple(get_searcher(name).search(p) for name in baseline_names())
    fastest = max((r for r in seeds if r.feasible), key=lambda r: r.result.samples_per_s)
    start = (fastest.policy.to_vector(w), fastest.policy.options)
    best = _Best()
    best.offer(*refine(p, *start))
    assert fastest.searcher == "delta" and best.result is not None
    assert best.result.samples_per_s == pytest.approx(1 / (17 * TAU))
    won = _restarts(p, SearchContext(), best, seeds, start, until=float("inf"), watch=None)
    assert won == "dtr" and best.result.samples_per_s == pytest.approx(1 / (16 * TAU))
    assert best.options is not None
    assert best.result.samples_per_s == pytest.approx(optimum_at(p, best.options), rel=1e-9)


@pytest.mark.parametrize("ample", [False, True])
def test_restarts_go_on_from_the_most_promising_probe_not_the_fastest_seed(
    ample: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Restarts ]: each other seed is first refined for ``PROBE_S``, then the best probe goes on. On a
    clock that only refinement advances: the fastest other seed's refinement takes 2 s and ends at 10
    samples/s; a slower seed's probe shows 10.5 and its refinement ends at 12 after 2 s. With time for the
    probes and one refinement's rest, the restarts answer 12 (refining the fastest seed first reached 10.5:
    the slower seed's refinement cut off). With time for everything, the fastest seed's probe (9.0, more
    than ``1 - PROBE_NEAR`` behind the best) does not go on."""
    import types

    from agents import portfolio
    from agents.optuna_search import _Best

    w = framed_chain_workload(N, S, TAU, 3)
    hw = fixed_profile(**_PROFILES["host costs"])
    p = Problem(w, hw, int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * 0.8))
    distinct: dict[bytes, SearchResult] = {}  # one seed per policy, the fastest first
    for r in sorted((get_searcher(name).search(p) for name in baseline_names()), key=lambda r: -r.result.samples_per_s):
        if r.feasible:
            distinct.setdefault(r.policy.to_vector(w).tobytes(), r)
    seeds = list(distinct.values())
    assert len(seeds) >= 3, "three distinct fitting seeds"
    first, fast, slow = seeds[0], seeds[1], seeds[-1]
    now = [0.0]
    # seed -> (samples/s when cut off, at the end), and the seconds its refinement has left
    plan = {fast.searcher: (9.0, 10.0), slow.searcher: (10.5, 12.0)}
    left = {fast.searcher: 2.0, slow.searcher: 2.0}
    by_vector = {r.policy.to_vector(w).tobytes(): r.searcher for r in seeds}  # a refined policy is its seed's

    def fake_refine(problem: Problem, actions: np.ndarray, options: object, *, deadline: float, **_: object):  # type: ignore[no-untyped-def]
        name = by_vector[actions.tobytes()]
        cut, end = plan.get(name, (1.0, 1.0))
        spent = min(left.get(name, 0.0), deadline - now[0])
        now[0] += spent
        left[name] = left.get(name, 0.0) - spent
        value = end if left[name] <= 0 else cut
        return actions.copy(), options, dataclasses.replace(first.result, samples_per_s=value, feasible=True)

    monkeypatch.setattr(portfolio, "refine", fake_refine)
    monkeypatch.setattr(portfolio, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    best = _Best()
    best.offer(first.policy.to_vector(w), first.policy.options, dataclasses.replace(first.result, samples_per_s=5.0))
    until = 2 * portfolio.PROBE_S + (2.0 - portfolio.PROBE_S) + 0.1  # two probes, then one refinement's rest
    if ample:
        until = 100.0
    start = (first.policy.to_vector(w), first.policy.options)
    won = portfolio._restarts(p, SearchContext(), best, tuple(seeds), start, until=until, watch=None)
    assert best.result is not None and best.result.samples_per_s == 12.0 and won == slow.searcher
    if ample:
        assert left[fast.searcher] == pytest.approx(2.0 - portfolio.PROBE_S)  # probed, not gone on with


def test_portfolio_reaches_the_eight_layer_chains_optimum() -> None:
    """At half the 8-layer chain's peak, six changes from where single moves and pairs stall: the window
    moves (agents/refine.py) enumerate every policy at once and find the optimum of every policy at the
    answer's options (40.0 samples/s; brute force over every look-ahead and release point too: 124 s)."""
    p = chain_problem(0.5)
    got = get_searcher("portfolio").search(p, SearchContext(trials=20, time_limit_s=20))
    best = optimum_at(p, got.policy.options)
    assert got.feasible and got.result.samples_per_s == pytest.approx(best, rel=1e-9)
    assert best == pytest.approx(40.0)


def test_optuna_interrupted_before_its_first_trial_answers_its_best_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C before the first trial's policy (`autotune sweep`'s Optuna phase, where the enqueued seed trials
    are already stored) once ended in an internal error (an assertion): the best seed is the answer."""
    from agents import optuna_search

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    p = chain_problem(0.7)
    seeds = tuple(get_searcher(name).search(p) for name in baseline_names())
    monkeypatch.setattr(optuna_search, "rule_actions", interrupted)
    ctx = SearchContext(trials=8, seeds=seeds)
    got = get_searcher("optuna-tpe").search(p, ctx)
    top = max((r for r in seeds if r.feasible), key=lambda r: r.result.samples_per_s)
    assert ctx.interrupted and got.feasible and got.result.samples_per_s == top.result.samples_per_s
    alone = get_searcher("optuna-tpe").search(p, SearchContext(trials=8))  # no seeds: keep-all, said so
    assert (alone.policy.to_vector(p.workload) == 0).all()


def test_optuna_interrupted_while_it_enqueues_its_seeds_answers_its_best_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while the study stores its first trials (the seeds, enqueued: `autotune sweep`'s test saw it
    land there once the storage held two trials) escaped the search and ended the whole cell unreached
    ("interrupted after 0 of 2 cells"); it is the search's to take: its best seed is the answer."""
    import optuna

    calls = []

    def enqueue(self: object, *_a: object, **_k: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    p = chain_problem(0.7)
    seeds = tuple(get_searcher(name).search(p) for name in baseline_names())
    monkeypatch.setattr(optuna.study.Study, "enqueue_trial", enqueue)
    ctx = SearchContext(trials=8, seeds=seeds)
    got = get_searcher("optuna-tpe").search(p, ctx)
    top = max((r for r in seeds if r.feasible), key=lambda r: r.result.samples_per_s)
    assert ctx.interrupted and len(calls) == 2 and got.feasible
    assert got.result.samples_per_s == top.result.samples_per_s


def test_optuna_enqueues_no_more_warm_starts_than_its_trials(tmp_path: Path) -> None:
    """A study of 2 trials (`autotune sweep --trials 2`) enqueued all its warm starts (the seeds and three of
    keep's neighbours): the ones beyond its trials stayed WAITING in the storage for good, shown so in the
    dashboard."""
    import optuna

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    p = chain_problem(0.7)
    seeds = tuple(get_searcher(name).search(p) for name in baseline_names())
    get_searcher("optuna-tpe").search(p, SearchContext(trials=2, storage=url, seeds=seeds))
    (name,) = optuna.get_all_study_names(url)
    states = [t.state for t in optuna.load_study(study_name=name, storage=url).trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2


def test_optuna_study_resumes_from_storage(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    import optuna

    first = get_searcher("optuna-tpe").search(chain_problem(0.5), SearchContext(trials=8, storage=url))
    (name,) = optuna.get_all_study_names(url)
    again = get_searcher("optuna-tpe").search(chain_problem(0.5), SearchContext(trials=8, storage=url))
    assert len(optuna.load_study(study_name=name, storage=url).trials) == 8  # --trials is the study's total
    assert again.result.samples_per_s == first.result.samples_per_s  # re-derived from the stored trials
    more = get_searcher("optuna-tpe").search(chain_problem(0.5), SearchContext(trials=16, storage=url))
    assert len(optuna.load_study(study_name=name, storage=url).trials) == 16
    assert not better(first.result, more.result)  # the first run's trials still count


def test_a_resumed_study_keeps_its_starts_when_the_seeds_that_fit_change(tmp_path: Path) -> None:
    """The Optuna study's ``start`` choices are the seeds that fit, and those can change between runs of one
    study (a resume once ended in an internal error, "CategoricalDistribution does not support dynamic value
    space", from `autotune search` on the calibrated ``cpu`` profile): a resumed run draws from the starts its
    study began with, with seeds or without."""
    import optuna

    url = f"sqlite:///{tmp_path / 's.db'}"
    p = chain_problem(0.7)
    seeds = tuple(r for r in (get_searcher(name).search(p) for name in baseline_names()) if r.feasible)
    assert len(seeds) >= 2
    get_searcher("optuna-tpe").search(p, SearchContext(trials=12, storage=url, seeds=seeds))
    (name,) = optuna.get_all_study_names(url)
    got = get_searcher("optuna-tpe").search(p, SearchContext(trials=24, storage=url, seeds=seeds[:1]))
    got2 = get_searcher("optuna-tpe").search(p, SearchContext(trials=36, storage=url))
    trials = optuna.load_study(study_name=name, storage=url).trials
    assert len(trials) == 36 and {len(t.distributions["start"].choices) for t in trials} == {1 + len(seeds)}
    assert got.feasible and got2.feasible


def test_optuna_records_the_budget_as_a_constraint(tmp_path: Path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'c.db'}"
    get_searcher("optuna-tpe").search(chain_problem(0.7), SearchContext(trials=12, storage=url))
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 12 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert any(t.user_attrs["constraint"][0] > 0 for t in trials)  # over budget: completed, not failed
    assert study.best_trial.user_attrs["constraint"][0] <= 0  # best_trial is a feasible one


# -- the command -----------------------------------------------------------------------------------------------
SEARCH = ["search", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--timeout", "20"]
SEARCH += ["--reserve", "8MiB"]
# In tensor bytes: at this size no policy below the no-policy peak runs on the caching allocator's model (the
# default, --budget-kind reserved, NOTE [ Reserved budget ]; tests/test_main_flow.py tests it).
SEARCH += ["--budget-kind", "allocated"]


def test_portfolio_stops_early_once_converged_with_the_optimum() -> None:
    """Bounded by time alone (trials 0: what `autotune search` runs), the portfolio stops once its best has
    not improved for half its time (agents.portfolio._Watch): on the 6-layer chain at 60% it has the brute
    force optimum within a second, so it stops after STALE_MIN_S, long before its 60 s. With a set number
    of trials it runs them all (reproducible) and does not claim to have converged."""
    p = chain_problem(0.6, n=6)
    ctx = SearchContext(trials=0, time_limit_s=60)
    got = get_searcher("portfolio").search(p, ctx)
    assert got.result.samples_per_s == pytest.approx(chain_optimum(0.6, 6), rel=1e-9)
    assert ctx.state.converged_s is not None and ctx.state.converged_s < 30 and got.wall_s < 30
    counted = SearchContext(trials=10, time_limit_s=60)
    get_searcher("portfolio").search(chain_problem(0.6, n=6), counted)
    assert counted.state.converged_s is None


def test_search_json_and_policy_roundtrip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out, db = tmp_path / "r18.policy.json", tmp_path / "s.db"
    args = [*SEARCH, "--budget", "200MB", "--trials", "12", "--out", str(out), "--storage", f"sqlite:///{db}"]
    code, stdout, err = run(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(stdout)
    keys = ["samples_per_s", "peak_bytes", "feasible", "budget_bytes", "gpu", "best_heuristic"]
    keys += ["best_heuristic_samples_per_s", "milp_samples_per_s", "no_policy_samples_per_s", "policy_path"]
    for key in keys:
        assert key in got, key
    assert got["budget_bytes"] == 200_000_000 and got["planned_budget_bytes"] == 200_000_000 - 8 * 2**20
    assert got["feasible"] and got["peak_bytes"] <= got["planned_budget_bytes"]
    assert got["milp_samples_per_s"] is None and got["policy_path"] == str(out)
    assert got["converged"] is False  # a set number of trials runs to the end
    assert got["samples_per_s"] >= got["best_heuristic_samples_per_s"]
    assert got["best_heuristic"] in baseline_names()
    again = json.loads(run(capsys, "simulate", "--policy", str(out), "--json")[1])
    assert again["peak_bytes"] == got["peak_bytes"] and again["iter_s"] == got["iter_s"]
    assert "planning for a100-40gb" in err and "reserve" in err
    assert json.loads(out.read_text())["budget_bytes"] == 200_000_000  # train caps the device at the budget
    # One count of the run's work: the file's trials were the searcher's own share (a QA run read 48,381 in the
    # file beside 48,983 evaluations and 29,416 simulations in the JSON).
    assert json.loads(out.read_text())["provenance"]["trials"] == got["evaluations"] > got["simulations"] > 0


def test_search_stops_early_once_converged_and_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`autotune search` as users type it (no --trials): bounded by --timeout, done before it once converged."""
    out = tmp_path / "p.json"
    args = ["search", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--budget", "200MB"]
    args += ["--budget-kind", "allocated"]  # as SEARCH
    code, stdout, err = run(capsys, *args, "--reserve", "8MiB", "--timeout", "120", "--out", str(out))
    assert code == 0, err
    assert "converged, stopped before the time limit" in stdout and out.exists()
    assert json.loads(out.read_text())["provenance"]["wall_s"] < 60


def test_search_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = [
        *SEARCH,
        "--budget",
        "200MB",
        "--trials",
        "6",
        "--out",
        str(out),
        "--storage",
        f"sqlite:///{tmp_path / 'x.db'}",
    ]
    code, stdout, _ = run(capsys, *args)
    assert code == 0 and "best baseline" in stdout and "no policy" in stdout and "saved activations" in stdout
    assert out.exists()


def test_impossible_budget_is_reported_at_once_with_a_budget_that_works(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *SEARCH, "--budget", "10MB")
    assert code == 2 and "no policy can meet it" in err and "autotune can meet" in err
    code, _, err = run(capsys, *SEARCH, "--budget", "10MB", "--reserve", "0")  # the last --reserve wins
    assert code == 2 and "no policy can meet it" in err and "reserve" not in err.split("error:")[1]


def test_ctrl_c_keeps_the_best_policy_and_says_how_to_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agents.optuna_search as opt

    calls = {"n": 0}
    real = opt.rule_actions

    def interrupted_later(*a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(opt, "rule_actions", interrupted_later)
    out = tmp_path / "p.json"
    code, _, err = run(
        capsys, *SEARCH, "--budget", "200MB", "--out", str(out), "--storage", f"sqlite:///{tmp_path / 'i.db'}"
    )
    assert code == 130 and "resume with --storage" in err
    kept = load_policy(out)  # a whole policy, that fits what the search planned for
    assert kept.predicted is not None and kept.predicted.peak_bytes <= 200_000_000 - 8 * 2**20


def test_ctrl_c_of_a_searcher_without_a_study_names_none_to_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--searcher refine`` (as ppo, ppo-onepass and the baselines) keeps no Optuna study: Ctrl-C said "resume
    with --storage ... --study ..." all the same, naming a study the storage did not hold (a QA run)."""
    import optuna

    from envs.problem import Problem

    calls = {"n": 0}
    real = Problem.evaluate

    def interrupted_later(self, *a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 400:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Problem, "evaluate", interrupted_later)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    args = [*SEARCH, "--budget", "200MB", "--searcher", "refine", "--out", str(tmp_path / "p.json"), "--storage", url]
    code, _, err = run(capsys, *args)
    assert code == 130 and calls["n"] >= 400 and "interrupted" in err
    assert "resume with" not in err and optuna.get_all_study_names(url) == []


@pytest.mark.parametrize("kind", ["allocated", "reserved"])
def test_a_budget_below_the_default_reserve_names_a_budget_that_works(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    """The first error names the budget to use (the reserve included), and that budget is then accepted:
    one error, not a chain of them (a 1KB budget used to suggest --reserve 0, which failed next). In reserved
    bytes (NOTE [ Reserved budget ] step 5) too: what a frugal policy reserves there, where the tensors' floor
    alone failed again (no policy of three searches ran on the caching allocator's model)."""
    args = ["search", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--budget-kind", kind]
    for budget in ("1KB", "100MB"):
        code, _, err = run(capsys, *args, "--budget", budget)
        assert code == 2 and "128.00 MiB reserve for workspaces (--reserve) included" in err, err
        assert err.count("error:") == 1 and "--reserve 0" not in err
    suggested = err.split("autotune can meet ")[1].split(" (")[0]  # e.g. "313.10 MiB"
    store = f"sqlite:///{tmp_path / 's.db'}"
    code, stdout, err = run(capsys, *args, "--budget", suggested.replace(" ", ""), "--timeout", "5", "--trials", "3",
                            "--out", str(tmp_path / "p.json"), "--storage", store, "--json")  # fmt: skip
    assert code == 0 and json.loads(stdout)["feasible"], err


def test_a_trial_orphaned_while_sampling_is_failed_and_retried(tmp_path: Path) -> None:
    """A worker killed inside ``study.ask()`` leaves a RUNNING trial with no heartbeat, which Optuna never
    fails by itself; the next worker adopts it (a first heartbeat), fails it once stale and runs its retry
    (NOTE [ Distributed search ])."""
    import warnings
    from collections import Counter

    import optuna

    from agents.optuna_search import retried_trial_number, storage_for, study_name

    url = f"sqlite:///{tmp_path / 'o.db'}"
    problem = chain_problem(0.7)
    name = study_name(problem, "optuna-tpe")
    study = optuna.create_study(storage=storage_for(url, 1), study_name=name, direction="maximize")
    with warnings.catch_warnings():  # "heartbeat ... supposed to be used with Study.optimize": indeed
        warnings.simplefilter("ignore", UserWarning)
        orphan = study.ask()  # RUNNING, never beats: its worker "died" while sampling
    got = get_searcher("optuna-tpe").search(problem, SearchContext(trials=6, storage=url, heartbeat_s=1))
    study = optuna.load_study(study_name=name, storage=url)
    states = Counter(t.state.name for t in study.trials)
    assert states["RUNNING"] == 0 and states["WAITING"] == 0 and states["COMPLETE"] >= 6, states
    assert study.trials[orphan.number].state == optuna.trial.TrialState.FAIL
    assert orphan.number in {retried_trial_number(t) for t in study.trials}
    assert got.feasible


def test_optuna_answers_no_worse_than_a_seed_whose_lookahead_it_cannot_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delta's policy for MobileNet-v2 b16 on a100-40gb at 349,782,272 bytes prefetches 7 ahead; the seed's
    trial takes the rule's nearest look-ahead, 8, and runs over the budget, so one trial of Optuna answered
    nothing that fits (a QA sweep: optuna 578.1 beside delta 647.7). The seed is the answer's floor. (With
    cuBLAS's default workspaces in the trace, as `autotune search` plans.)"""
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="mobilenet_v2", batch_size=16, target=hw))
    delta = get_searcher("delta").search(Problem(w, hw, 349_782_272))
    assert delta.feasible and delta.policy.options.prefetch_lookahead == 7
    found = get_searcher("optuna-tpe").search(Problem(w, hw, 349_782_272), SearchContext(trials=1, seeds=(delta,)))
    assert found.feasible and found.result.samples_per_s >= delta.result.samples_per_s


def test_a_searcher_that_loses_to_a_baseline_answers_with_its_policy_and_says_whose(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`search --searcher optuna-tpe` whose own best is slower than a baseline's answers with the baseline's
    policy; `searcher` (the table's and --json's) named the baseline there, where the portfolio's names itself
    and says "won by" whom: now both do the latter."""
    import io

    from rich.console import Console

    from agents import optuna_search
    from autotune.search import best_heuristic, run_search

    def slowest_seed(self: object, problem: Problem, ctx: SearchContext) -> SearchResult:
        slowest = min((r for r in ctx.seeds if r.feasible), key=lambda r: r.result.samples_per_s)
        return dataclasses.replace(slowest, searcher="optuna-tpe", note="")

    monkeypatch.setattr(optuna_search.OptunaSearcher, "search", slowest_seed)
    outcome = run_search(chain_problem(0.7), SearchContext(trials=2, time_limit_s=10), "optuna-tpe",
                         out=tmp_path / "p.json", milp=False, milp_time_s=1.0, err=Console(file=io.StringIO()),
                         quiet=True)  # fmt: skip
    top, found = best_heuristic(outcome), outcome.found
    assert top is not None and top.result.samples_per_s > min(
        r.result.samples_per_s for r in outcome.baselines if r.feasible
    )  # the seeds differ: the searcher's answer lost
    assert found.searcher == "optuna-tpe" and found.note == f"won by {top.searcher}"
    assert found.result.samples_per_s == top.result.samples_per_s
    assert found.policy.provenance.searcher == top.searcher  # the file says who made the policy


def test_an_answer_that_does_not_fit_is_not_said_to_have_won(tmp_path: Path) -> None:
    """Where nothing fits (an interrupted search, a budget no searcher reached), the table's "found" row and
    --json's note said "won by delta" beside "fits: no": it says the answer does not fit, and whose came
    nearest."""
    import io

    from rich.console import Console

    from autotune.search import dumps, render, run_search

    outcome = run_search(chain_problem(0.05), SearchContext(trials=2, time_limit_s=5), "portfolio",
                         out=tmp_path / "p.json", milp=False, milp_time_s=1.0, err=Console(file=io.StringIO()),
                         quiet=True)  # fmt: skip
    assert not outcome.found.feasible
    assert outcome.found.note.startswith("does not fit the budget; nearest: ")
    assert json.loads(dumps(outcome))["note"] == outcome.found.note
    table = Console(file=io.StringIO(), width=200)
    render(table, outcome)
    shown = table.file.getvalue()  # type: ignore[attr-defined]
    assert "won by" not in shown and "found (portfolio, does not fit the budget; nearest: " in shown


@pytest.mark.parametrize("kind", ["allocated", "reserved"])
def test_a_budget_that_holds_the_model_as_it_is_says_no_policy_is_needed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    """resnet18 b2 (a 187 MiB peak) within 30 GB: the answer keeps everything, and the table said it was
    "won by capuchin". Keeping everything is the fastest policy there is, so the search (6.8 s to converge on it in
    a QA run) is not run: the baselines' evaluations only. With --budget-kind reserved too, where keeping
    everything runs on the caching allocator's model (before, its pool of finalists made the search run)."""
    code, out, err = run(capsys, "search", "--model", "resnet18", "--batch-size", "2", "--gpu", "a100-40gb",
                         "--budget", "30GB", "--budget-kind", kind, "--out", str(tmp_path / "p.json"), "--storage",
                         f"sqlite:///{tmp_path / 's.db'}", "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["note"] == "keeping everything fits the budget: no policy needed" and got["slowdown"] == 0
    assert got["searcher"] == "portfolio" and got["evaluations"] < 100, got["evaluations"]


def test_keeping_everything_that_fits_only_as_applied_does_not_say_no_policy_is_needed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A tied embedding (tests.fixtures_models:make_tied, on the CPU): plain training peaks at 2.70 MiB, the end
    of backward holding the tied weight's two gradients and their sum; keeping every tensor peaks at 2.21 MiB,
    since the runtime sums them in place (R14). Within 2.5 MiB the answer keeps everything, which fits only with
    the policy applied: the table said "no policy needed" beside a "no policy" row that does not fit (a QA run on
    GPT-2, 1.68 GiB against 1.53 within 1.6 GiB)."""
    code, out, err = run(capsys, "search", "--model", "tests.fixtures_models:make_tied", "--gpu", "cpu", "--budget",
                         "2.5MiB", "--timeout", "5", "--out", str(tmp_path / "p.json"), "--storage",
                         f"sqlite:///{tmp_path / 's.db'}", "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["feasible"] and got["no_policy_peak_bytes"] > got["planned_budget_bytes"] >= got["peak_bytes"]
    assert sum(v for k, v in got["bytes_by_action"].items() if k != "kept") == 0
    assert got["evaluations"] < 100, got["evaluations"]  # keeping everything is the fastest: no search
    assert got["note"] == "keeping everything fits only as applied: R14 sums the shared gradients in place"
    assert got["bytes_by_action"]["kept"] > 0 == sum(v for k, v in got["bytes_by_action"].items() if k != "kept")
