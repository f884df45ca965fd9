"""The default searcher: baselines, refinement, then Optuna warm-started with them, then more refinement.

1. Every heuristic baseline runs (about a second on ResNet-101); their results become the warm-start seeds
   (``SearchContext.seeds``), unless the caller already ran them and passed them in. The pretrained agent's one
   pass (agents/pretrained.py, under a second on ResNet-101) joins them.
2. Per-tensor refinement (agents/refine.py) of the best seed (repairing the seeds in turn while nothing
   fits): early, since it finds most of what a long search adds to the seeds, in seconds.
2a. Restarts: refinement of every other fitting seed, each for ``PROBE_S`` first, then on from the most
   promising probes (within ``PROBE_NEAR`` of the best), until the search converges or ``RESTART_SHARE`` of
   the time is spent. Refinement ends in its start's local optimum, and the best seed's is often not the best
   one (NOTE [ Restarts ]).
2b. The exact yardstick (agents/solvers/exact.py) with the best so far as its incumbent: over every policy
   where there are at most ``EXACT_SMALL`` candidates, over ``EXACT_UNITS`` blocks decided together
   otherwise, for ``EXACT_SHARE`` of the time; what it finds better is refined per tensor (a restart from
   the exact solution of a coarsened problem). Refinement's moves stall where the better policy is several
   changes away at once (swap one tensor *and* keep another: the framed 8-chain at 70-80%).
3. Optuna over the parametric rule (agents/optuna_search.py) for most of the remaining time (or
   ``SearchContext.trials`` trials): NSGA-II from keep-all alone, then TPE whose starts are the seeds (one trial
   per feasible seed enqueued first). Study names: the context's (or the problem's), suffixed ``.explore`` and
   ``.seeded``. What Optuna finds better is refined in turn.
4. Iterated local search: random perturbations of the best, each refined; the early stop's stale time counts
   again from its start (NOTE [ Restarts ]).

The best feasible result of all wins, so the portfolio is never below its seeds. Without a time limit it
runs ``DEFAULT_TIME_S``; within a time limit it stops early once converged (``EARLY_STOP``), setting
``RunState.converged_s``. The per-problem RL searcher (``ppo``) has not earned a place here.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, ClassVar

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, SearchResult, baseline_names, get_searcher, register
from agents.optuna_search import OptunaNSGA2, OptunaSearcher, OptunaTPE, _Best, remaining, study_name
from agents.refine import refine
from agents.solvers.exact import solve_exact
from agents.solvers.milp.data import decision_units
from envs.simulator import SimResult
from runtime.errors import AutotuneError
from runtime.policy import PolicyOptions
from runtime.vocab import KEEP, RECOMPUTE, SWAP

DEFAULT_TIME_S = 45.0
#: The pretrained agent's one pass joins the seeds (measured in experiments/bench_quality.py --agent: the
#: portfolio with it, in the same time, was faster in more held-out cells than it was slower).
AGENT_SEED = True
#: Stop before the time limit once converged (``_Watch``). Only where the search is bounded by time
#: (``SearchContext.trials`` 0): a set number of trials is run to the end.
EARLY_STOP = True
IMPROVEMENT = 1e-3  # relative: smaller gains are taken but do not keep the search going
STALE_MIN_S = 3.0
RESTART_SHARE = 0.7  # of the time limit, from the start, at most for the restarts (step 2a)
PROBE_S = 0.25  # each restart's first refinement, before the most promising go on (step 2a)
PROBE_NEAR = 0.97  # ... those whose probe got within this share of the best policy's speed (step 2a)
OPTUNA_SHARE = 0.75  # of the time left after the baselines and the first refinement; the rest: refinement, perturbation
EXACT_SMALL = 16  # candidates at most for the exact phase to decide each one (step 2b)
EXACT_UNITS = 10  # blocks decided together by the exact phase on larger problems
EXACT_SHARE = (0.5, 0.08)  # of the time limit for the exact phase: small problems, larger ones
Seeds = tuple[SearchResult, ...]


@register
class Portfolio(Searcher):
    name = "portfolio"
    composite = True
    summary = "baselines, then Optuna TPE warm-started with them, then per-tensor refinement; the best wins"
    study_key: ClassVar[str] = OptunaTPE.name  # study names: the problem's for this key, suffixed per phase

    def _initial_seeds(self, problem: Problem, ctx: SearchContext) -> Seeds:
        """The warm-start seeds: every heuristic baseline, unless the caller passed seeds; then the pretrained
        agent's one pass (agents/pretrained.py), under a second, unless a seed came from it already."""
        seeds = list(ctx.seeds)
        if not seeds:
            for name in baseline_names():
                if ctx.interrupted:
                    break
                seeds.append(get_searcher(name).search(problem, ctx))
                ctx.report(f"baseline {name}")
        if AGENT_SEED and not ctx.interrupted and all(r.searcher != "ppo-onepass" for r in seeds):
            try:
                seeds.append(get_searcher("ppo-onepass").search(problem, ctx))
            except AutotuneError as e:  # a broken agent file must not cost the search its answer
                warnings.warn(f"the pretrained agent's seed is left out: {e}", stacklevel=2)
            ctx.report("ppo-onepass")
        return tuple(seeds)

    def study_names(self, name: str) -> list[str]:
        return [name + suffix for _, _, suffix, _ in self._phases(())]

    def _phases(self, seeds: Seeds) -> list[tuple[float, Seeds, str, OptunaSearcher]]:
        """(share of the Optuna time left, seeds, study-name suffix, searcher) per Optuna phase."""
        return [(0.5, (), ".explore", OptunaNSGA2()), (1.0, seeds, ".seeded", OptunaTPE())]

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        started = time.perf_counter()
        limit = DEFAULT_TIME_S if ctx.time_limit_s is None else ctx.time_limit_s
        deadline = started + limit
        seeds = self._initial_seeds(problem, ctx)
        best = _Best()
        watch = _Watch(best, started) if EARLY_STOP and ctx.trials == 0 else None
        winner = ""
        for r in seeds:
            if best.offer(r.policy.to_vector(problem.workload), r.policy.options, r.result):
                winner = r.searcher
        if _seen(problem, best):
            winner = "a policy the baselines simulated"
        # Refinement first: past the seeds, most of what a long search finds is refinement's, and it finds it
        # in seconds (experiments/bench_anytime.py: on ResNet-101 and GPT-2 the last 0.1-0.5% came from the
        # refinement after 45 s of Optuna, within a few seconds of its start).
        first = None if best.actions is None or best.options is None else (best.actions.copy(), best.options)
        if self._refined(problem, ctx, best, deadline, repair=seeds):
            winner += " + refine"
        if first is not None:
            until = min(deadline, started + limit * RESTART_SHARE)
            restarted = _restarts(problem, ctx, best, seeds, first, until, watch)
            if restarted:
                winner = f"{restarted} + refine"
        if self._exact(problem, ctx, best, deadline, limit):
            winner = "exact"
            if self._refined(problem, ctx, best, deadline):
                winner += " + refine"
        # Optuna twice: NSGA-II from keep-all alone (TPE, given the seeds as starts, settles on the best seed
        # and stops exploring; NSGA-II alone beat TPE alone in most cells of experiments/bench_quality.py),
        # then TPE from the seeds. Two studies, since their ``start`` choices differ.
        name = ctx.study_name or study_name(problem, self.study_key)
        optuna_found = False
        if watch is not None:  # the stale time counts from here (NOTE [ Restarts ])
            watch.rearm()
        phases = self._phases(seeds)
        for share, phase_seeds, suffix, searcher in phases:
            if ctx.interrupted or remaining(deadline) == 0 or (watch is not None and watch.converged()):
                break
            phase = ctx.derive(
                seeds=phase_seeds,
                study_name=name + suffix,
                time_limit_s=(remaining(deadline) or 0.0) * OPTUNA_SHARE * share,
                # --trials in all, shared by the phases (ppo-pretrained's one phase ran half of them)
                trials=None if ctx.trials is None else -(-ctx.trials // len(phases)),
            )
            before = best.result
            searcher.optimize(problem, phase, best, stop=watch)
            if best.result is not before:
                winner, optuna_found = searcher.name, True
        if optuna_found and self._refined(problem, ctx, best, deadline):
            winner += " + refine"
        if not ctx.interrupted and best.actions is not None and best.options is not None:
            before = best.result
            if watch is not None:  # perturbation gets its own stale time (NOTE [ Restarts ])
                watch.rearm()
            try:
                _iterated(problem, ctx, best, deadline, watch)
            except KeyboardInterrupt:
                ctx.interrupt()
            if best.result is not before:
                winner += " + perturbation"
        if _seen(problem, best):
            winner += " + a policy simulated on the way"
        if watch is not None and not ctx.interrupted and remaining(deadline):
            ctx.state.converged_s = time.perf_counter() - started
        assert best.actions is not None
        return Proposal(best.actions, options=best.options, note=f"won by {winner}" if winner else "")

    @staticmethod
    def _refined(problem: Problem, ctx: SearchContext, best: _Best, deadline: float, repair: Seeds = ()) -> bool:
        """Refine the best policy (agents/refine.py); while nothing fits, repair from every seed of ``repair``
        in turn, lowest peak first. True when that made the best better."""
        if ctx.interrupted or best.actions is None or best.options is None or remaining(deadline) == 0:
            return False
        before = best.result
        starts = [(best.actions, best.options)]
        if best.result is not None and not best.result.feasible:
            ranked = sorted(repair, key=lambda r: r.result.peak_bytes)
            starts += [(r.policy.to_vector(problem.workload), r.policy.options) for r in ranked]
        try:
            for actions, options in starts:
                actions, options, result = refine(problem, actions, options, deadline=deadline)
                best.offer(actions, options, result)
                ctx.report("refine", best.result)
                if result.feasible or remaining(deadline) == 0:
                    break
        except KeyboardInterrupt:
            ctx.interrupt()
        return best.result is not before

    @staticmethod
    def _exact(problem: Problem, ctx: SearchContext, best: _Best, deadline: float, limit: float) -> bool:
        """Step 2b: True when the exact phase found a better policy."""
        left = remaining(deadline) or 0.0
        if ctx.interrupted or left == 0 or best.result is None or not best.result.feasible:
            return False
        small = problem.n <= EXACT_SMALL
        units = None if small else decision_units(problem, EXACT_UNITS)
        before = best.result
        ctx.report("exact", best.result)
        try:
            assert best.actions is not None and best.options is not None
            found = solve_exact(
                problem,
                units,
                time_limit_s=min(left, limit * EXACT_SHARE[0 if small else 1]),
                incumbent=(best.actions, best.options),
                stop=lambda: ctx.interrupted,
            )
        except KeyboardInterrupt:
            ctx.interrupt()
            return False
        if found.actions is not None and found.options is not None and found.result is not None:
            best.offer(found.actions, found.options, found.result)
        return best.result is not before


# NOTE [ Restarts ]
# Refining only the fastest seed lost to refining another one in 3 of the transformer cells of
# experiments/bench_quality.py on each GPU's kernels (8 s each; 6 of 26 cells of docs/results.md's restarts
# table gained from restarts): GPT-2 8 x 1024 on
# a100-40gb at 45%, delta's seed (17.37 samples/s, the fastest) refines to 17.59, Capuchin's (16.32) to 17.91;
# at 60% the agent's one pass (18.10) to 18.31, Capuchin's (17.87) to 18.47; ResNet-101 b64 at 60%, Capuchin's
# (952.8, the fastest) gains nothing, the one pass's (951.2) reaches 959.6. Each refinement took 1-5 s there.
# So after the first, every other fitting seed is refined (one policy once), until the search converges
# (``_Watch``: restarts that keep finding nothing stop it) or ``RESTART_SHARE`` of the time is spent; what
# follows (the exact phase, Optuna, perturbation) starts from the best of them. The seed's own speed says
# little about where its refinement ends (GPT-2 at 45%: the one pass's 16.44 ends at 16.47, Capuchin's 16.32
# at 17.91, DTR's 15.60 at 17.50, vdnn's 9.14 at 17.13), so each is first refined for ``PROBE_S`` (fastest seed
# first), and those cut off go on in the order of where their probes got (Capuchin's 17.43 first there): a
# 10-second search reaches Capuchin's 17.91 at 7 s, where refining the seeds fastest first to their ends ran
# out of time after the one pass's and answered 17.59. ``RESTART_SHARE`` 0.7 leaves that time; at 16 s (the
# quality grid's 26 cells of the restarts table) the answers were the same in 25 cells and 0.13% lower in one
# (GPT-2 v100-16gb 60%). The watch counts its stale time, and the time it is half of, from Optuna's start: its
# first look was there before restarts, and restarts and an exact phase that found nothing must not cut Optuna
# short; nor should their seconds make Optuna run twice as long before the search may stop (stopped as
# converged after the restarts, ResNet-101 b64 on a100-40gb at 30% answered 834.3 samples/s at 7.9 s, where
# Optuna and perturbation had reached 843.3 by 16 s; ResNet-18 b4 at 200 MB ran no Optuna trial at all).
# Only probes within ``PROBE_NEAR`` of the best go on: since refinement tries its cheap moves (options
# included) first, a probe is most of the way to where its refinement ends (BERT-base 8 x 512 on a100-40gb at
# 60%: DTR's probe 47.18 samples/s, its end 47.19; Capuchin's 47.04 and 47.14), and going on from probes far
# behind took the time perturbation makes gains in: ResNet-50 b64 at 30%, probes at 637-1,126 samples/s
# against the best 1,340.0 went on for 3.5 s of a 10-s search and won nothing; without them perturbation
# reached 1,358.8 (the 60-s answer) at 7.7 s. Perturbation gets stale time of its own, as Optuna does: its
# rounds (a quarter of the decisions at random, then refined: 0.5-2.5 s each on ResNet-50) are where the 60-s
# runs found their last 0.3-1.4% (ResNet-50 at 30-80%, GPT-2 8 x 1024 at 45%), and a 10-s search stopped as
# converged once Optuna had found nothing for 3 s, before the first round ended (ResNet-50 at 60%: 1,529.2 at
# 7.8 s; with the rearm, 1,540.2 at 9.7 s).


def _restarts(
    problem: Problem,
    ctx: SearchContext,
    best: _Best,
    seeds: Seeds,
    first: tuple[np.ndarray, PolicyOptions],
    until: float,
    watch: _Watch | None,
) -> str:
    """Step 2a (NOTE [ Restarts ]): refine the fitting seeds other than ``first`` (already refined), each
    for ``PROBE_S`` first (fastest seed first), then on from where the probes cut off, the fastest probe
    first, until ``until`` or until ``watch`` says the search has converged. Returns the name of the seed
    whose refinement made the best better last, or ""."""
    done = {(first[0].tobytes(), repr(first[1]))}
    won = ""
    cut_off: list[tuple[SimResult, np.ndarray, PolicyOptions, str]] = []  # probes stopped by their time

    def stop() -> bool:
        return ctx.interrupted or time.perf_counter() >= until or (watch is not None and watch.converged())

    def refined(actions: np.ndarray, options: PolicyOptions, name: str, cut: float) -> bool:
        """Refine until ``cut``, offer the result; False after a Ctrl-C."""
        nonlocal won
        try:
            actions, options, result = refine(problem, actions, options, deadline=cut)
        except KeyboardInterrupt:
            ctx.interrupt()
            return False
        if best.offer(actions, options, result):
            won = name
        ctx.report("refine", best.result)
        if cut < until and result.feasible and time.perf_counter() >= cut:  # a probe cut off before its optimum
            cut_off.append((result, actions, options, name))
        return True

    for r in sorted((r for r in seeds if r.feasible), key=lambda r: -r.result.samples_per_s):
        if stop():
            break
        actions = r.policy.to_vector(problem.workload)
        key = (actions.tobytes(), repr(r.policy.options))
        if key in done:
            continue
        done.add(key)
        if not refined(actions, r.policy.options, r.searcher, min(until, time.perf_counter() + PROBE_S)):
            return won
    for probe, actions, options, name in sorted(cut_off, key=lambda p: -p[0].samples_per_s):
        if best.result is not None and probe.samples_per_s < PROBE_NEAR * best.result.samples_per_s:
            break  # the rest are further behind
        if stop() or not refined(actions, options, name, until):
            break
    return won


def _seen(problem: Problem, best: _Best) -> bool:
    """Offer the fastest fitting policy any evaluation of the problem saw (``Problem.best_seen``): a
    baseline's trial it did not keep (Capuchin's swap that fits, where its cost per byte chose a recompute
    and it ended over budget: ResNet-50 at 30% on a100-40gb, 1,300.9 samples/s), a rule's prefix."""
    return problem.best_seen is not None and best.offer(*problem.best_seen)


class _Watch:
    """The early stop (``EARLY_STOP``): converged once the best policy fits and has not improved by more than
    ``IMPROVEMENT`` for half the search's time so far (from Optuna's start: :meth:`rearm`), and for at least
    ``STALE_MIN_S``. So a search whose last real gain came at t stops at about 2t (experiments/bench_anytime.py:
    on ResNet-101 and GPT-2 the gains after the refinement of the seeds were under 1%, most under 0.5%, spread
    over the rest of a minute). Also an Optuna callback that stops the study then."""

    def __init__(self, best: _Best, started: float) -> None:
        self.best = best
        self.started = started
        self.value = 0.0
        self.last = started

    def converged(self) -> bool:
        r = self.best.result
        now = time.perf_counter()
        if r is None or not r.feasible:
            self.value, self.last = 0.0, now
            return False
        if r.samples_per_s > self.value * (1 + IMPROVEMENT):
            self.value, self.last = r.samples_per_s, now
        return now - self.last >= max(STALE_MIN_S, (now - self.started) / 2)

    def rearm(self) -> None:
        """Count the stale time, and the search's time it is measured against, from now (NOTE [ Restarts ])."""
        self.last = self.started = time.perf_counter()

    def __call__(self, study: Any, _trial: Any) -> None:
        if self.converged():
            study.stop()


PERTURB_ROUNDS = 30


def _iterated(problem: Problem, ctx: SearchContext, best: _Best, deadline: float, watch: _Watch | None = None) -> None:
    """Iterated local search: perturb the best policy (a quarter of its decisions, at least two, set to
    random actions), repair and refine it, keep it if better; ``PERTURB_ROUNDS`` rounds, or until the
    deadline, or until ``watch`` says the search has converged. Local optima of refinement can be several
    changes away from better policies."""
    rng = np.random.default_rng(ctx.seed)
    moves = np.array([KEEP, SWAP, RECOMPUTE], dtype=np.int8)
    for _ in range(PERTURB_ROUNDS):
        if remaining(deadline) == 0 or best.actions is None or best.options is None:
            return
        if watch is not None and watch.converged():
            return
        trial = best.actions.copy()
        picked = rng.choice(problem.n, size=min(problem.n, max(2, problem.n // 4)), replace=False)
        trial[picked] = rng.choice(moves, size=len(picked))
        actions, options, result = refine(problem, trial, best.options, deadline=deadline, windows=False)
        best.offer(actions, options, result)
        ctx.report("perturbation", best.result)
