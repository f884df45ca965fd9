"""SuperNeurons: liveness analysis, offloading of convolution outputs, cost-aware recomputation.

Wang, Ye, Zhao, Wu, Li, Song, Xu and Kraska, "SuperNeurons: Dynamic GPU Memory Management for Training
Deep Neural Networks", PPoPP 2018. Three techniques of its runtime (Sec. 3), which together bring the
peak down towards the largest layer's own footprint:

1. **Liveness Analysis**: a tensor is freed right after its last use. Our simulator already
   does this for every policy (Rules 2-3), so there is nothing to decide.
2. **Unified Tensor Pool**: the outputs of convolution layers, which are expensive to
   recompute but take long enough to hide a transfer, are offloaded to host memory in forward and
   prefetched in backward one layer ahead of their use. A Tensor Cache with LRU replacement keeps them on
   the device while memory suffices, so only what must be evicted moves.
3. **Cost-Aware Recomputation**: the outputs of cheap layers (pooling, activation,
   normalization, dropout, element-wise) are freed in forward and recomputed in backward from the nearest
   convolution output; convolutions and matrix products are never recomputed.

Adaptations to our setting:
- Static policy from one traced iteration: the Tensor Cache's LRU eviction becomes offloading in forward
  order (the least recently used convolution output is the earliest one), stopping once the budget
  holds; the recomputation is ranked by recompute seconds per byte freed (the cheapest first, the
  paper's "cost-aware"), also stopping once the budget holds.
- The paper applies recomputation unconditionally and lets the cache offload on demand, while its
  evaluation adds offloading before recomputation; we simulate both orders and keep the faster plan
  within the budget (the lower peak when neither fits).
- A cheap output is recomputed only if regenerating it re-runs no expensive op (Rule 7 would otherwise
  re-run the convolution behind a ReLU that autograd did not save).
- Transformers have no convolutions: matrix-product and attention outputs take their place.
- Prefetch one layer ahead is ``prefetch_lookahead = 1`` (Rule 5). The paper's choice between speed- and
  memory-centric recomputation per segment is fixed by Rule 7 (a regenerated tensor stays until its last
  use: the speed-centric strategy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, apply_until_fits, register
from agents.heuristics._selection import Plan, best_plan, closure_classes, forward_order
from runtime.vocab import RECOMPUTE, SWAP

CHEAP_CLASSES = frozenset({"activation", "norm", "pool", "dropout", "elementwise"})
CONV_CLASSES = frozenset({"conv"})
TRANSFORMER_CLASSES = frozenset({"matmul", "attention"})  # stand-ins for convolutions (see above)
SUPERNEURONS_LOOKAHEAD = 1  # the Unified Tensor Pool prefetches one layer ahead


def rankings(problem: Problem) -> tuple[list[int], list[int]]:
    """(convolution outputs to offload, in LRU = forward order; cheap outputs to recompute, cheapest
    seconds per byte first, ties in forward order).

    A convolution output is a candidate whose regeneration would re-run a convolution: the convolution's
    own output, or the ReLU applied to it when autograd saved only the latter (Caffe, which SuperNeurons
    extends, runs that ReLU in place, so it *is* the convolution's output there)."""
    w, feats = problem.workload, problem.simulator.features
    order = forward_order(w)
    classes = closure_classes(problem.simulator)
    heavy = CONV_CLASSES if any(classes[ci] & CONV_CLASSES for ci in order) else TRANSFORMER_CLASSES
    offload = [ci for ci in order if classes[ci] & heavy]
    position = {ci: p for p, ci in enumerate(order)}
    cheap = [ci for ci in order if feats.producer_class[ci] in CHEAP_CLASSES and classes[ci] <= CHEAP_CLASSES]
    cheap.sort(key=lambda ci: (feats.recompute_s[ci] / max(1, feats.nbytes[ci]), position[ci]))
    return offload, cheap


@register
class SuperNeurons(Searcher):
    """Wang et al. PPoPP 2018: offload convolution outputs (LRU), recompute cheap layers (cost-aware)."""

    name = "superneurons"
    summary = "Wang et al. PPoPP 2018 (SuperNeurons): offload conv outputs, recompute cheap layers"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        options = dataclasses.replace(problem.options, prefetch_lookahead=SUPERNEURONS_LOOKAHEAD)
        offload, cheap = rankings(problem)
        steps_offload = [(ci, SWAP) for ci in offload]
        steps_recompute = [(ci, RECOMPUTE) for ci in cheap]
        plans = []
        for label, first, second in (
            ("offload, then recompute", steps_offload, steps_recompute),
            ("recompute, then offload", steps_recompute, steps_offload),
        ):
            actions, result = apply_until_fits(problem, first, options=options)
            if not result.feasible:
                actions, result = apply_until_fits(problem, second, start=actions, options=options)
            plans.append(Plan(actions, options, result, label))
            if result.feasible and not np.any(actions):
                break  # the budget holds with nothing dropped
        chosen = best_plan(plans)
        return Proposal(chosen.actions, chosen.options, note=chosen.label)
