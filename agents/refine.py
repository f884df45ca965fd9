"""Per-tensor refinement of a policy: first-improvement local search on the simulator.

Cheap moves first: on the non-keep candidates from the largest down, back to keep (it frees nothing, so it
only stays if the policy still fits) or to the other of swap / recompute; then the prefetch look-ahead at each
of agents.rule.LOOKAHEADS, the release point of swapped bytes at each of agents.base.RELEASES and the regions
run the other way (one node each or checkpointed, ``PolicyOptions.region_nodes``). These repeat
while they find something (at most ``CHEAP_PASSES`` times in a row), before the costly moves: exchanges, one
costly decision given back and one cheap one taken (see :func:`_exchange`); when those find nothing, pairs of
changes among the largest candidates (:func:`_pairs`), then every assignment of a window of consecutive
candidates at once (:func:`_windows`; on a problem of a few candidates one window holds them all, and the
search is exhaustive). After costly moves that found something the cheap ones run again. A move is accepted
when the policy still fits the budget and runs faster. Refinement ends when a pass changes nothing, after
``max_passes`` passes of costly moves, or at the deadline. Every accepted step is a simulated improvement, so
the result is never worse than the start.

Cheap moves before costly ones since options change what single moves gain: on BERT-base 8 x 512 at 60% of
its peak (a100-40gb), DTR's policy gains 0.7% from single moves, nothing from 0.56 s of exchanges, 1% from
the look-ahead 2 -> 4 and release 4 -> 8, then 9.9% from single moves again (42.17 -> 47.14 samples/s):
with the look-ahead before the exchanges that is 0.1 s from the start instead of 0.7 s.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from agents.base import RELEASES, Problem, Proposal, SearchContext, Searcher, register
from agents.rule import LOOKAHEADS, RuleParams, ranked_moves
from envs.simulator import SimResult
from runtime.policy import PolicyOptions
from runtime.vocab import KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload

CHEAP_PASSES = 16  # passes of cheap moves in a row at most before the costly ones run


def refine(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    *,
    deadline: float | None = None,
    max_passes: int = 8,
    windows: bool = True,
) -> tuple[np.ndarray, PolicyOptions, SimResult]:
    """Improve a policy; one over budget is first repaired (:func:`_repair`) and returned as it is if that
    fails. ``deadline`` is a ``time.perf_counter()`` value; ``windows=False`` leaves out the window moves
    (the costliest: a search that refines many starts runs them on its first)."""
    best = np.asarray(actions, dtype=np.int8).copy()
    best_result = problem.evaluate(best, options)
    if not best_result.feasible:
        best, options, best_result = _repair(problem, best, options, best_result, deadline)
        if not best_result.feasible:
            return best, options, best_result
    nbytes = np.array([c.nbytes for c in problem.workload.candidates], dtype=np.int64)

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    passes = cheap = 0
    while passes < max_passes:
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
            options, faster = fastest_lookahead(problem, best, options, best_result, late)
            improved = improved or faster is not best_result
            best_result = faster
        if late():
            break
        if improved and cheap < CHEAP_PASSES:  # the cheap moves again, before the costly ones
            cheap += 1
            continue
        passes, cheap = passes + 1, 0
        best, best_result, costly = _exchange(problem, best, options, best_result, late)
        if not costly and not late():
            best, best_result, costly = _pairs(problem, best, options, best_result, late)
        if windows and not costly and not late():
            best, options, best_result, costly = _windows(problem, best, options, best_result, late)
        if not (improved or costly):
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
    then the regions' mechanism (``region_nodes``), under which ``actions`` fit and run fastest, starting from
    ``options`` and their ``result`` (returned as
    they are when none is faster); stops when ``late()``."""
    trials: list[tuple[str, object]] = [("prefetch_lookahead", x) for x in LOOKAHEADS]
    if np.any(actions == SWAP):
        trials += [("release_after", x) for x in RELEASES]
    if np.any(actions == RECOMPUTE):
        trials.append(("region_nodes", not options.region_nodes))
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
                if r.shortfall_bytes < best_result.shortfall_bytes:
                    best, best_result, improved = trial, r, True
        moves: list[tuple[str, object]] = [("prefetch_lookahead", x) for x in LOOKAHEADS]
        moves += [("release_after", x) for x in RELEASES] + [("region_nodes", not options.region_nodes)]
        for name, value in moves:
            other = replace(options, **{name: value})  # type: ignore[arg-type]
            r = problem.evaluate(best, other)
            if r.shortfall_bytes < best_result.shortfall_bytes:
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


WINDOW_EVALS = 8_000  # simulations one pass of window moves may take (an 8-candidate problem's every policy)
MIN_WINDOW = 4  # narrower windows add little to pairs


def window_width(n: int, budget: int = WINDOW_EVALS) -> int:
    """The widest window w (at most n) whose every assignment, over every window, fits ``budget``
    simulations: (n - w + 1) 3^w. 0 when it is under ``MIN_WINDOW``."""
    for w in range(n, MIN_WINDOW - 1, -1):
        if (n - w + 1) * 3**w <= budget:
            return w
    return 0


def _windows(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    late: Callable[[], bool],
) -> tuple[np.ndarray, PolicyOptions, SimResult, bool]:
    """Every keep / swap / recompute assignment of w candidates whose producers run one after another,
    the others as they are; the fastest that fits replaces the policy when it beats it, then the next
    window (best improvement per window). These are the moves several changes wide that single moves and
    pairs cannot make: on an 8-layer chain at half its peak, the optimum is six changes away from where they
    stall. An assignment that would be faster but swaps over the budget is tried again with swapped bytes
    let go at the next pack point (``release_after`` 1), then also copied back on demand (look-ahead 0): the
    leanest release and prefetch. w (:func:`window_width`) keeps a pass within ``WINDOW_EVALS`` simulations;
    when w covers every candidate the one window enumerates every policy."""
    w = window_width(problem.n)
    if w == 0:
        return actions, options, result, False
    order = np.argsort([c.producer for c in problem.workload.candidates], kind="stable")
    best, best_options, best_result, improved = actions.copy(), options, result, False
    for start in range(problem.n - w + 1):
        window = order[start : start + w]
        current = best[window].copy()
        found: tuple[np.ndarray, PolicyOptions, SimResult] | None = None
        lean = [replace(best_options, release_after=1), replace(best_options, release_after=1, prefetch_lookahead=0)]
        lean = [o for i, o in enumerate(lean) if o != best_options and o not in lean[:i]]
        trial = best.copy()
        for combo in itertools.product((KEEP, SWAP, RECOMPUTE), repeat=w):
            if late():
                break
            trial[window] = combo
            if np.array_equal(trial[window], current):
                continue
            incumbent = (found[2] if found else best_result).samples_per_s
            r, o = problem.evaluate(trial, best_options), best_options
            if not r.feasible and r.samples_per_s > incumbent and SWAP in combo:
                for o in lean:
                    r = problem.evaluate(trial, o)
                    if r.feasible:
                        break
            if r.feasible and r.samples_per_s > incumbent:
                found = (trial.copy(), o, r)
        if found is not None:
            best, best_options, best_result = found
            improved = True
        if late():
            break
    return best, best_options, best_result, improved


@register
class Refine(Searcher):
    """Where the problem has rivals (the same model traced with other partitions: NOTE [ Choosing a partition ]
    C5 in autotune/partitions.py), the partition is a move too: refinement starts on the partition whose best
    heuristic is fastest (half the time), then carries its policy to each other partition (a candidate of the
    same key keeps its action, the others start from that partition's best heuristic) and refines it there; the
    fastest wins."""

    name = "refine"
    composite = True
    chooses_partition = True
    summary = "per-tensor local search from the best heuristic's policy (DTR, Capuchin, checkpoint-sqrt)"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        from agents.base import better

        members = problem.members
        started = time.perf_counter()
        starts = [_best_heuristic(m, ctx) for m in members]
        order = sorted(range(len(members)), key=lambda i: _rank(starts[i][2]))
        first = order[0]

        def deadline(share: float) -> float | None:
            if ctx.time_limit_s is None:
                return None
            now = time.perf_counter()
            return now + share * max(0.0, ctx.time_limit_s - (now - started))

        actions, options, result = refine(
            members[first], *starts[first][:2], deadline=deadline(0.5 if len(members) > 1 else 1.0)
        )
        chosen = first
        for n, j in enumerate(order[1:]):
            carried = carry(members[chosen].workload, actions, members[j].workload, starts[j][0])
            a, o, r = refine(members[j], carried, options, deadline=deadline(1.0 / (len(order) - 1 - n)))
            if better(r, result):
                chosen, actions, options, result = j, a, o, r
        return Proposal(actions, options=options, rival=chosen - 1)


def _best_heuristic(problem: Problem, ctx: SearchContext) -> tuple[np.ndarray, PolicyOptions, SimResult | None]:
    """The fastest fitting policy of DTR, Capuchin and checkpoint-sqrt (keep-all and no result where none fits)."""
    from agents.base import get_searcher

    start, start_options, start_result = problem.keep_all(), problem.options, None
    for name in ("capuchin", "dtr", "checkpoint-sqrt"):
        r = get_searcher(name).search(problem, ctx)
        if r.feasible and (start_result is None or r.result.samples_per_s > start_result.samples_per_s):
            start, start_options, start_result = r.policy.to_vector(problem.workload), r.policy.options, r.result
    return start, start_options, start_result


def _rank(result: SimResult | None) -> float:
    """Sort key of a start: the fastest fitting first, then those without one."""
    return -result.samples_per_s if result is not None else float("inf")


def carry(src: Workload, actions: np.ndarray, dst: Workload, default: np.ndarray) -> np.ndarray:
    """``actions`` (over ``src``'s candidates) on ``dst``, the same model traced with another partition: each
    candidate of a key ``src`` has takes its action, the others ``default``'s (over ``dst``'s candidates)."""
    by_key = {c.key: int(a) for c, a in zip(src.candidates, actions, strict=True)}
    out = np.asarray(default, dtype=np.int8).copy()
    for i, c in enumerate(dst.candidates):
        if c.key in by_key:
            out[i] = by_key[c.key]
    return out
