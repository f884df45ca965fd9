"""Swapping from variables' lifetimes and read/write order (Zhang et al. 2019).

Zhang, Yeung, Shu, He and Wang, "Efficient Memory Management for GPU-based Deep Learning Systems",
arXiv:1903.06631, 2019 (implemented in Apache SINGA, ``src/core/device/swap_gpu.cc``). Training repeats
the same iteration, so one iteration's trace gives every variable's read/write order; a variable idle
between two accesses can live in host memory meanwhile. The paper proposes several strategies that
decide *which* variables to swap and *when*; we implement each and keep the best:

**Which** (SINGA ``SwapGPU::Plan`` and ``SelectBlock``). The swappable variables are those whose accesses
straddle the memory peak (last access before it, next access after it). They are ranked by a priority
score and taken one by one until the peak is within the limit:

- ``DOA`` (duration of absence): the idle interval between the two accesses; longest first.
- ``AOA`` (area of absence): the slack ``DOA - swap-out - swap-in`` times the size when the transfers fit
  in the interval (divided by the size when they do not); largest first.
- ``WDOA`` (weighted DOA): the sum, over the ops of the idle interval, of how far the memory load exceeds
  the limit: an absence that covers the overloaded stretch counts more.
- ``majority``: majority voting, the sum of a variable's ranks under the three scores; smallest first.

**When** (SINGA ``SwapGPU::Scheduling``), two modes:

- ``no-overhead``: swap out as soon as the variable is final, swap in just early enough to arrive
  before its next access; only variables whose round trip fits in their idle interval are eligible,
  so the iteration takes no longer ("reduces the memory cost by up to 34.2% without communication
  overhead", the abstract), and the limit may not be met.
- ``stick-to-limit``: keep under the limit whatever it costs: every straddling variable is eligible, then
  the others, and the transfers that do not hide stall the computation.

Adaptations to our setting:
- Variables are saved activations (``workload.candidates``); the idle interval is the simulator's
  (``CandidateFeatures.idle_s``: from the end of the op after which the runtime may copy the tensor out,
  Rule 4, to the start of its first backward use, Rule 6), and transfer times are the simulator's.
- The straddling test uses the no-policy peak op; a candidate straddles it when it could be off the
  device there (dropped by the program before it, first needed in backward after it).
- SINGA's slack subtracts the swap-out time twice (``SwapOutTime`` for both directions); we subtract the
  swap-out and the swap-in time, which is what the paper describes.
- SINGA times each swap-in individually; our runtime issues copies a fixed number of unpack points ahead
  (Rule 5, ``prefetch_lookahead``), so each strategy is simulated at several look-aheads.
- The strategy (score x mode x look-ahead) with the best throughput within the budget wins; the lowest
  peak when none fits. Each strategy stops selecting as soon as the budget holds (by bisection over the
  ranking: see :func:`agents.heuristics._selection.shortest_fitting_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, register
from agents.heuristics._selection import Plan, best_plan, shortest_fitting_prefix
from runtime.vocab import SWAP
from runtime.workload import memory_timeline

PRIORITIES = ("DOA", "AOA", "WDOA", "majority")
MODES = ("no-overhead", "stick-to-limit")
LOOKAHEADS = (1, 2, 3, 4, 6, 8)  # unpack points ahead that a swap-in may be issued


def priority_scores(problem: Problem) -> dict[str, np.ndarray]:
    """Per candidate, each score (higher = swap first): DOA and slack in seconds, AOA, WDOA, and the
    negated majority-voting rank sum."""
    feats, sim = problem.simulator.features, problem.simulator
    doa_s = feats.idle_s
    slack_s = doa_s - feats.swap_out_s - feats.swap_in_s
    nbytes = np.maximum(1, feats.nbytes).astype(np.float64)
    aoa = np.where(slack_s >= 0, slack_s * nbytes, slack_s / nbytes)
    # WDOA: the load's excess over the limit, summed over the ops the variable is absent from.
    excess = memory_timeline(problem.workload, problem.hardware.alloc_granularity_bytes) - problem.budget_bytes
    prefix = np.concatenate([[0.0], np.cumsum(excess, dtype=np.float64)])
    last = np.minimum(sim.first_use, sim.n_ops)
    wdoa = prefix[last] - prefix[np.minimum(sim.save_op + 1, last)]
    scores = {"DOA": doa_s, "AOA": aoa, "WDOA": wdoa, "slack_s": slack_s}
    votes = np.zeros(feats.k)
    for name in ("DOA", "AOA", "WDOA"):
        votes[_descending(scores[name])] += np.arange(feats.k)  # a variable's rank under this score
    scores["majority"] = -votes
    return scores


def _descending(score: np.ndarray) -> np.ndarray:
    """Candidate indices by descending score, ties by index (deterministic)."""
    return np.lexsort((np.arange(len(score)), -score))


def straddles_peak(problem: Problem) -> np.ndarray:
    """True for candidates that can be off the device at the no-policy peak op (SINGA's swappable
    blocks: last access before the peak, next access after it)."""
    sim = problem.simulator
    peak_op = int(np.argmax(memory_timeline(problem.workload, problem.hardware.alloc_granularity_bytes)))
    return (sim.drop < peak_op) & (sim.first_use > peak_op)


def ranking(problem: Problem, priority: str, mode: str) -> list[int]:
    """Candidates a strategy would swap, in its order of selection."""
    if priority not in PRIORITIES or mode not in MODES:
        raise ValueError(f"zhang-swap: unknown strategy {priority!r}/{mode!r}: expected {PRIORITIES} x {MODES}")
    scores = priority_scores(problem)
    order = [int(ci) for ci in _descending(scores[priority])]
    straddling = straddles_peak(problem)
    if mode == "no-overhead":
        return [ci for ci in order if straddling[ci] and scores["slack_s"][ci] >= 0]
    return [ci for ci in order if straddling[ci]] + [ci for ci in order if not straddling[ci]]


@register
class ZhangSwap(Searcher):
    """Zhang et al. 2019: swap variables by lifetime-derived priority, with or without overhead."""

    name = "zhang-swap"
    summary = "Zhang et al. 2019 (SINGA): swap by idle interval (DOA/AOA/WDOA/voting), no-overhead or stick-to-limit"

    def __init__(
        self,
        priorities: Sequence[str] = PRIORITIES,
        modes: Sequence[str] = MODES,
        lookaheads: Sequence[int] = LOOKAHEADS,
    ) -> None:
        self.priorities, self.modes, self.lookaheads = tuple(priorities), tuple(modes), tuple(lookaheads)

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        keep_all = problem.keep_all()
        first = problem.evaluate(keep_all)
        if first.feasible:  # budget-aware: nothing to swap
            return Proposal(keep_all, note="keep all")
        plans = [Plan(keep_all, problem.options, first, "keep all")]
        for priority in self.priorities:
            for mode in self.modes:
                steps = [(ci, SWAP) for ci in ranking(problem, priority, mode)]
                for lookahead in self.lookaheads:
                    options = dataclasses.replace(problem.options, prefetch_lookahead=lookahead)
                    actions, result = shortest_fitting_prefix(problem, steps, options)
                    plans.append(Plan(actions, options, result, f"{priority}, {mode}, look-ahead {lookahead}"))
        chosen = best_plan(plans)
        return Proposal(chosen.actions, chosen.options, note=chosen.label)
