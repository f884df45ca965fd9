"""The default searcher: baselines, then Optuna warm-started with them, then per-tensor refinement.

1. Every heuristic baseline runs (about a second on ResNet-101); their results become the warm-start seeds
   (``Problem.seeds``), unless the caller already ran them and passed them in. The pretrained agent's one
   pass (agents/pretrained.py, under a second on ResNet-101) joins them.
2. Optuna over the parametric rule (agents/optuna_search.py) for most of the remaining time (or
   ``Problem.trials`` trials): NSGA-II from keep-all alone, then TPE whose starts are the seeds (one trial
   per feasible seed enqueued first). Study names: the problem's, suffixed ``.explore`` and
   ``.seeded``.
3. Per-tensor refinement (agents/refine.py) of the best policy found so far (repairing the seeds in turn
   while nothing fits), then iterated local search: random perturbations of the best, each refined.

The best feasible result of all three wins, so the portfolio is never below its seeds. Without a time limit
it runs ``DEFAULT_TIME_S``. The per-problem RL searcher (``ppo``) has not earned a place here.
"""

from __future__ import annotations

import time
import warnings
from typing import ClassVar

import numpy as np

from agents.base import Problem, Proposal, Searcher, SearchResult, baseline_names, get_searcher, register
from agents.optuna_search import OptunaNSGA2, OptunaSearcher, OptunaTPE, _Best, remaining, study_name
from agents.refine import refine
from envs.simulator import KEEP, RECOMPUTE, SWAP
from runtime.errors import AutotuneError

DEFAULT_TIME_S = 45.0
#: The pretrained agent's one pass joins the seeds (measured in experiments/bench_quality.py --agent: the
#: portfolio with it, in the same time, was faster in more held-out cells than it was slower).
AGENT_SEED = True
OPTUNA_SHARE = 0.75  # of the time left after the baselines; the rest goes to refinement


@register
class Portfolio(Searcher):
    name = "portfolio"
    composite = True
    summary = "baselines, then Optuna TPE warm-started with them, then per-tensor refinement; the best wins"
    study_key: ClassVar[str] = OptunaTPE.name  # study names: the problem's for this key, suffixed per phase

    def _initial_seeds(self, problem: Problem) -> None:
        """The warm-start seeds: every heuristic baseline, unless the caller passed seeds; then the pretrained
        agent's one pass (agents/pretrained.py), under a second, unless a seed came from it already."""
        if not problem.seeds:
            for name in baseline_names():
                if problem.interrupted:
                    break
                problem.seeds.append(get_searcher(name).search(problem))
                if problem.progress is not None:
                    problem.progress(f"baseline {name}", None)
        if AGENT_SEED and not problem.interrupted and all(r.searcher != "ppo-onepass" for r in problem.seeds):
            try:
                problem.seeds.append(get_searcher("ppo-onepass").search(problem))
            except AutotuneError as e:  # a broken agent file must not cost the search its answer
                warnings.warn(f"the pretrained agent's seed is left out: {e}", stacklevel=2)
            if problem.progress is not None:
                problem.progress("ppo-onepass", None)

    def _phases(self, problem: Problem) -> list[tuple[float, list[SearchResult], str, OptunaSearcher]]:
        """(share of the Optuna time left, seeds, study-name suffix, searcher) per Optuna phase."""
        return [(0.5, [], ".explore", OptunaNSGA2()), (1.0, problem.seeds, ".seeded", OptunaTPE())]

    def _search(self, problem: Problem) -> Proposal:
        started = time.perf_counter()
        limit = DEFAULT_TIME_S if problem.time_limit_s is None else problem.time_limit_s
        deadline = started + limit
        self._initial_seeds(problem)
        best = _Best()
        winner = ""
        for r in problem.seeds:
            if best.offer(r.policy.to_vector(problem.workload), r.policy.options, r.result):
                winner = r.searcher
        # Optuna twice: NSGA-II from keep-all alone (TPE, given the seeds as starts, settles on the best seed
        # and stops exploring; NSGA-II alone beat TPE alone in most cells of experiments/bench_quality.py),
        # then TPE from the seeds. Two studies, since their ``start`` choices differ.
        name = problem.study_name or study_name(problem, self.study_key)
        seeds = problem.seeds
        for share, phase_seeds, suffix, searcher in self._phases(problem):
            if problem.interrupted:
                break
            budget_s = (remaining(deadline) or 0.0) * OPTUNA_SHARE * share
            trials = None if problem.trials is None else (problem.trials + 1) // 2
            before = best.result
            problem.seeds, problem.study_name = phase_seeds, name + suffix
            try:
                searcher.optimize(problem, best, time_limit_s=budget_s, trials=trials)
            finally:
                problem.seeds, problem.study_name = seeds, name
            if best.result is not before:
                winner = searcher.name
        if not problem.interrupted and best.actions is not None and best.options is not None:
            before = best.result
            # Refine the best; while nothing fits, repair from every seed in turn, lowest peak first.
            starts = [(best.actions, best.options)]
            if best.result is not None and not best.result.feasible:
                ranked = sorted(problem.seeds, key=lambda r: r.result.peak_bytes)
                starts += [(r.policy.to_vector(problem.workload), r.policy.options) for r in ranked]
            try:
                for actions, options in starts:
                    actions, options, result = refine(problem, actions, options, deadline=deadline)
                    best.offer(actions, options, result)
                    if result.feasible or remaining(deadline) == 0:
                        break
            except KeyboardInterrupt:
                problem.interrupted = True
            if best.result is not before:
                winner += " + refine"
        if not problem.interrupted and best.actions is not None and best.options is not None:
            before = best.result
            try:
                _iterated(problem, best, deadline)
            except KeyboardInterrupt:
                problem.interrupted = True
            if best.result is not before:
                winner += " + perturbation"
        assert best.actions is not None
        return Proposal(best.actions, options=best.options, note=f"won by {winner}" if winner else "")


PERTURB_ROUNDS = 30


def _iterated(problem: Problem, best: _Best, deadline: float) -> None:
    """Iterated local search: perturb the best policy (a quarter of its decisions, at least two, set to
    random actions), repair and refine it, keep it if better; ``PERTURB_ROUNDS`` rounds or until the
    deadline. Local optima of refinement can be several changes away from better policies."""
    rng = np.random.default_rng(problem.seed)
    moves = np.array([KEEP, SWAP, RECOMPUTE], dtype=np.int8)
    for _ in range(PERTURB_ROUNDS):
        if remaining(deadline) == 0 or best.actions is None or best.options is None:
            return
        trial = best.actions.copy()
        picked = rng.choice(problem.n, size=min(problem.n, max(2, problem.n // 4)), replace=False)
        trial[picked] = rng.choice(moves, size=len(picked))
        actions, options, result = refine(problem, trial, best.options, deadline=deadline, windows=False)
        best.offer(actions, options, result)
