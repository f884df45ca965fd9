"""Per-tensor refinement of a policy: first-improvement local search on the simulator.

Moves, tried on the non-keep candidates from the largest down: back to keep (it frees nothing, so it only
stays if the policy still fits), or to the other of swap / recompute. Then exchanges: one costly decision
given back, one cheap one taken (see :func:`_exchange`); when those find nothing, pairs of changes
among the largest candidates (:func:`_pairs`). A move is accepted when the policy still fits the
budget and runs faster. Then the prefetch look-ahead is tried at each of agents.rule.LOOKAHEADS, and the
release point of swapped bytes at each of agents.base.RELEASES. Passes
repeat until one changes nothing or the deadline passes. Every accepted step
is a simulated improvement, so the result is never worse than the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from agents.base import RELEASES, Problem, Proposal, Searcher, register
from agents.rule import LOOKAHEADS, RuleParams, ranked_moves
from envs.simulator import KEEP, RECOMPUTE, SWAP, SimResult
from runtime.policy import PolicyOptions


def refine(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    *,
    deadline: float | None = None,
    max_passes: int = 8,
) -> tuple[np.ndarray, PolicyOptions, SimResult]:
    """Improve a policy; one over budget is first repaired (:func:`_repair`) and returned as it is if that
    fails. ``deadline`` is a ``time.perf_counter()`` value."""
    best = np.asarray(actions, dtype=np.int8).copy()
    best_result = problem.evaluate(best, options)
    if not best_result.feasible:
        best, options, best_result = _repair(problem, best, options, best_result, deadline)
        if not best_result.feasible:
            return best, options, best_result
    nbytes = np.array([c.nbytes for c in problem.workload.candidates], dtype=np.int64)

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    for _ in range(max_passes):
        improved = False
        for ci in np.argsort(-nbytes, kind="stable"):
            if late():
                return best, options, best_result
            current = int(best[ci])
            if current == KEEP:
                continue
            for move in (KEEP, RECOMPUTE if current == SWAP else SWAP):
                best[ci] = move
                r = problem.evaluate(best, options)
                if r.feasible and r.samples_per_s > best_result.samples_per_s:
                    best_result, current, improved = r, move, True
                    break
                best[ci] = current
        if not late():
            best, best_result, swapped = _exchange(problem, best, options, best_result, late)
            improved = improved or swapped
        if not improved and not late():
            best, best_result, paired = _pairs(problem, best, options, best_result, late)
            improved = improved or paired
        if not late():
            options, faster = fastest_lookahead(problem, best, options, best_result, late)
            improved = improved or faster is not best_result
            best_result = faster
        if not improved:
            break
    return best, options, best_result


def fastest_lookahead(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    late: Callable[[], bool] | None = None,
) -> tuple[PolicyOptions, SimResult]:
    """The prefetch look-ahead (of agents.rule's ``LOOKAHEADS``), then the release point (``RELEASES``),
    under which ``actions`` fit and run fastest, starting from ``options`` and their ``result`` (returned as
    they are when none is faster); stops when ``late()``."""
    trials = [("prefetch_lookahead", x) for x in LOOKAHEADS]
    if np.any(actions == SWAP):
        trials += [("release_after", x) for x in RELEASES]
    for name, value in trials:
        if late is not None and late():
            break
        trial = replace(options, **{name: value})  # type: ignore[arg-type]
        r = problem.evaluate(actions, trial)
        if r.feasible and r.samples_per_s > result.samples_per_s:
            options, result = trial, r
    return options, result


def _repair(
    problem: Problem, actions: np.ndarray, options: PolicyOptions, result: SimResult, deadline: float | None
) -> tuple[np.ndarray, PolicyOptions, SimResult]:
    """Descent on the peak for a policy over budget: single moves (any candidate to any action, or another
    prefetch look-ahead) accepted when they lower the peak, until it fits or no move helps."""
    best, best_result = actions.copy(), result
    while not best_result.feasible:
        improved = False
        for ci in range(problem.n):
            for move in (KEEP, SWAP, RECOMPUTE):
                if deadline is not None and time.perf_counter() > deadline:
                    return best, options, best_result
                if best[ci] == move:
                    continue
                trial = best.copy()
                trial[ci] = move
                r = problem.evaluate(trial, options)
                if r.peak_bytes < best_result.peak_bytes:
                    best, best_result, improved = trial, r, True
        for name, value in [("prefetch_lookahead", x) for x in LOOKAHEADS] + [("release_after", x) for x in RELEASES]:
            other = replace(options, **{name: value})  # type: ignore[arg-type]
            r = problem.evaluate(best, other)
            if r.peak_bytes < best_result.peak_bytes:
                options, best_result, improved = other, r, True
        if not improved:
            break
    return best, options, best_result


def _exchange(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    late: Callable[[], bool],
    width: int = 40,
) -> tuple[np.ndarray, SimResult, bool]:
    """Exchange moves: give one costly decision back (to keep) and take a cheap one instead (a kept candidate
    gets the rule's cheaper action), accepted when the policy still fits and runs faster. The costly side
    is the ``width`` non-keep candidates whose keeping alone saves the most time (measured); the cheap side
    the ``1.5 * width`` kept candidates the rule ranks cheapest per byte."""
    best, best_result, improved = actions.copy(), result, False
    gains = []
    for c in np.flatnonzero(best != KEEP).tolist():
        trial = best.copy()
        trial[c] = KEEP
        gains.append((best_result.iter_s - problem.evaluate(trial, options).iter_s, int(c)))
    costly = [c for gain, c in sorted(gains, reverse=True)[:width] if gain > 0]
    order, moves, _ = ranked_moves(problem, RuleParams(lookahead=options.prefetch_lookahead))
    cheap = [(int(d), int(a)) for d, a in zip(order, moves, strict=True) if best[d] == KEEP][: int(width * 1.5)]
    for ci in costly:
        for di, action in cheap:
            if late():
                return best, best_result, improved
            if best[di] != KEEP or best[ci] == KEEP:
                continue
            trial = best.copy()
            trial[ci], trial[di] = KEEP, action
            r = problem.evaluate(trial, options)
            if r.feasible and r.samples_per_s > best_result.samples_per_s:
                best, best_result, improved = trial, r, True
                break
    return best, best_result, improved


def _pairs(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    late: Callable[[], bool],
    width: int = 24,
) -> tuple[np.ndarray, SimResult, bool]:
    """Two candidates changed at once, each to any other action, over the ``width`` largest candidates: the
    moves single changes cannot make (a swap traded for a recompute elsewhere). First improvement."""
    nbytes = np.array([c.nbytes for c in problem.workload.candidates], dtype=np.int64)
    top = np.argsort(-nbytes, kind="stable")[:width].tolist()
    best, best_result = actions.copy(), result
    for i, ci in enumerate(top):
        for di in top[i + 1 :]:
            for a in (KEEP, SWAP, RECOMPUTE):
                for b in (KEEP, SWAP, RECOMPUTE):
                    if late():
                        return best, best_result, False
                    if a == best[ci] or b == best[di]:
                        continue
                    trial = best.copy()
                    trial[ci], trial[di] = a, b
                    r = problem.evaluate(trial, options)
                    if r.feasible and r.samples_per_s > best_result.samples_per_s:
                        return trial, r, True
    return best, best_result, False


@register
class Refine(Searcher):
    name = "refine"
    composite = True
    summary = "per-tensor local search from the best heuristic's policy (DTR, Capuchin, checkpoint-sqrt)"

    def _search(self, problem: Problem) -> Proposal:
        from agents.base import get_searcher

        start, start_options, start_result = problem.keep_all(), problem.options, None
        for name in ("capuchin", "dtr", "checkpoint-sqrt"):
            r = get_searcher(name).search(problem)
            if r.feasible and (start_result is None or r.result.samples_per_s > start_result.samples_per_s):
                start, start_options, start_result = r.policy.to_vector(problem.workload), r.policy.options, r.result
        deadline = None if problem.time_limit_s is None else time.perf_counter() + problem.time_limit_s
        actions, options, _ = refine(problem, start, start_options, deadline=deadline)
        return Proposal(actions, options=options)
