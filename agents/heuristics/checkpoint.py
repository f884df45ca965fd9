"""Sublinear-memory checkpointing: keep segment boundaries, recompute the rest in backward.

Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost", arXiv:1602.04751, 2016.
Sec. 4 ("Trade Computation for Memory") drops intermediate results in forward and re-runs the ops that made
them in backward, from a *mirror plan* (Algorithm 1): the forward is cut into segments, only the segment
outputs are stored, and each segment is re-run from its stored input when backward reaches it. Three plans
from the paper, each simulated here; the cheapest feasible one wins:

1. **sqrt(n) segmentation** ("An O(sqrt n) Memory Cost Algorithm"): n stage splitting points, a checkpoint
   every ``round(sqrt(n))`` of them, so the stored outputs and the largest segment are both O(sqrt n).
2. **Memory planning with budget** (Algorithm 2): walk the forward in topological order summing the bytes
   of the outputs since the last checkpoint; at a stage splitting point, if that sum exceeds B, store the
   point and reset. It returns x (stored bytes) and y (largest segment); the paper searches B around
   sqrt(x * y). We follow the authors' released planner (MXNet memonger, ``search_plan``): three rounds of
   B <- sqrt(x * y / 2) from B = 0, then a grid of six B values up to sqrt(2) times the last guess.
3. **Drop the results of low cost operations** (the subsection of that name; MXNet's default mirror):
   keep the outputs of convolutions and matrix products, recompute the cheap layers (normalization,
   activation, pooling, element-wise) from them.

Adaptations to our setting:
- Units are saved activations (``workload.candidates``), not MXNet graph nodes. The stage splitting
  points are the block boundaries the trace marks (``Candidate.block_input``: a tensor saved in a block
  other than its producer's, the articulation points of a residual network); a workload without blocks
  (a plain chain) uses every candidate.
- A dropped candidate is marked ``recompute``; Rule 7 of the simulator regenerates it recursively from the
  nearest kept tensors, which is exactly the paper's segment re-run.
- Small sibling outputs of a multi-output op (BatchNorm's saved statistics) are kept: see
  :func:`agents.heuristics._selection.minor_outputs`.
- The paper's planners minimise memory; ours must meet a budget at the best throughput, so each plan is
  simulated and the fastest one within the budget is returned (the lowest peak when none fits). With a
  budget the no-policy run already meets, nothing is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, apply_until_fits, register
from agents.heuristics._selection import Plan, best_plan, closure_classes, forward_order, minor_outputs
from runtime.vocab import KEEP, RECOMPUTE
from runtime.workload import Workload

# Op classes (envs.features.op_class) whose outputs "drop the results of low cost operations" keeps.
EXPENSIVE_CLASSES = frozenset({"conv", "matmul", "attention"})
_MEMONGER_BEGIN = 3  # memonger's ``nbegin``: rounds of B <- sqrt(x * y / 2)
_MEMONGER_TRIALS = 6  # memonger's ``ntrial``: grid steps after them


def splitting_points(w: Workload) -> list[int]:
    """Stage splitting points in forward order: the block boundaries, or every candidate if none."""
    order = forward_order(w)
    boundaries = [i for i in order if w.candidates[i].block_input]
    return boundaries or order


def mirror_plan(w: Workload, checkpoints: set[int]) -> np.ndarray:
    """Algorithm 1's input: store the checkpoints (and minor sibling outputs), recompute everything else."""
    actions = np.full(len(w.candidates), RECOMPUTE, dtype=np.int8)
    actions[sorted(checkpoints)] = KEEP
    actions[minor_outputs(w)] = KEEP
    return actions


def sqrt_checkpoints(w: Workload) -> set[int]:
    """The O(sqrt n) plan: with n splitting points, keep every ``round(sqrt(n))``-th, counting from the
    first (16 layers: the 4th, 8th, 12th and 16th outputs)."""
    points = splitting_points(w)
    step = max(1, round(math.sqrt(len(points))))
    return {ci for j, ci in enumerate(points) if (j + 1) % step == 0}


def budget_checkpoints(w: Workload, segment_bytes: float) -> tuple[set[int], int, int]:
    """Algorithm 2 ("Memory Planning with Budget") for a segment budget B = ``segment_bytes``: returns the
    checkpoints, x (bytes stored at checkpoints) and y (bytes of the largest segment)."""
    points = set(splitting_points(w))
    kept: set[int] = set()
    temp_bytes = stored_bytes = largest_bytes = 0
    for ci in forward_order(w):
        temp_bytes += w.candidates[ci].nbytes
        if ci in points and temp_bytes > segment_bytes:
            kept.add(ci)
            stored_bytes += w.candidates[ci].nbytes
            largest_bytes = max(largest_bytes, temp_bytes)
            temp_bytes = 0
    return kept, stored_bytes, largest_bytes


def memonger_budgets(w: Workload) -> Iterator[float]:
    """The segment budgets B that the authors' ``search_plan`` tries, in its order."""
    threshold, min_threshold = 0.0, math.inf
    for _ in range(_MEMONGER_BEGIN):
        yield threshold
        _, stored_bytes, largest_bytes = budget_checkpoints(w, threshold)
        min_threshold = min(min_threshold, largest_bytes)
        threshold = math.sqrt(stored_bytes * largest_bytes / 2)
    step = (threshold * math.sqrt(2) - min_threshold) / _MEMONGER_TRIALS
    if step > 0:
        for k in range(1, _MEMONGER_TRIALS + 1):
            yield min_threshold + k * step


@register
class SqrtCheckpointing(Searcher):
    """Chen et al. 2016: sqrt(n) segments, Algorithm 2's budgeted segments, or dropping cheap layers;
    the fastest plan within the budget."""

    name = "checkpoint-sqrt"
    summary = "Chen et al. 2016, sublinear memory: keep segment boundaries, recompute segments (sqrt(n), Alg. 2)"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        w, options = problem.workload, problem.options
        keep_all = problem.keep_all()
        first = problem.evaluate(keep_all, options)
        if first.feasible:  # budget-aware: nothing to drop
            return Proposal(keep_all, note="keep all")
        plans = [Plan(keep_all, options, first, "keep all")]

        sqrt_actions = mirror_plan(w, sqrt_checkpoints(w))
        plans.append(Plan(sqrt_actions, options, problem.evaluate(sqrt_actions, options), "sqrt(n) segments"))

        seen: set[bytes] = {sqrt_actions.tobytes()}
        for segment_bytes in memonger_budgets(w):
            actions = mirror_plan(w, budget_checkpoints(w, segment_bytes)[0])
            if actions.tobytes() in seen:
                continue
            seen.add(actions.tobytes())
            label = f"Algorithm 2, B={segment_bytes / 2**20:.1f} MiB"
            plans.append(Plan(actions, options, problem.evaluate(actions, options), label))

        # "Drop the results of low cost operations", in forward order until the budget holds.
        feats = problem.simulator.features
        minor, classes = minor_outputs(w), closure_classes(problem.simulator)
        cheap = [
            (ci, RECOMPUTE)
            for ci in forward_order(w)
            if feats.producer_class[ci] not in EXPENSIVE_CLASSES
            and not minor[ci]
            and not classes[ci] & EXPENSIVE_CLASSES
        ]
        actions, result = apply_until_fits(problem, cheap, options=options)
        plans.append(Plan(actions, options, result, "drop low-cost results"))

        chosen = best_plan(plans)
        return Proposal(chosen.actions, chosen.options, note=chosen.label)
