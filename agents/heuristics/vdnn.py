"""vDNN: offload the input feature maps of convolution layers during forward, prefetch them in backward.

Rhu, Gimelshein, Clemons, Zulfiqar and Keckler, "vDNN: Virtualized Deep Neural Networks for Scalable,
Memory-Efficient Neural Network Design", MICRO 2016. Sec. III, its core operations: as the forward reaches
layer n, its input feature map X is offloaded to host memory (on a stream of its own, overlapped with layer
n's computation) and released once the copy completes; in backward, while layer n runs, the X of layer
n - 1 is prefetched so that it is there when needed. Its memory-transfer policies: vDNN_conv offloads the X
of convolution layers only (they take long enough to hide the copy), vDNN_all the X of every layer, and
vDNN_dyn picks the cheapest of these that trains within the memory at hand.

Adaptations to our setting:
- Only saved activations (``workload.candidates``) can be offloaded: an X that backward does not read, or
  the input batch, is not ours to swap.
- "Convolution layer" generalises to the compute-bound layers of a model without convolutions: in a
  transformer, the inputs of matrix products and attention (vDNN predates them; they play the same role:
  long kernels under which a copy hides).
- The one-layer-ahead prefetch is ``prefetch_lookahead = 1`` (Rule 5 of the simulator: the copy back is
  issued one unpack point before its first backward use).
- vDNN_dyn becomes budget-aware: X's are offloaded in forward order (the order vDNN issues them), first
  those of the convolution layers (vDNN_conv), then, only if the budget still does not hold, those of all
  other layers (vDNN_all), stopping at the first policy within the budget. vDNN_dyn's other knob, the
  choice of convolution algorithm and its workspace, has no counterpart in our workloads.
"""

from __future__ import annotations

import dataclasses

from agents.base import Problem, Proposal, SearchContext, Searcher, apply_until_fits, register
from agents.heuristics._selection import forward_order
from runtime.vocab import SWAP

CONV_CLASSES = frozenset({"conv"})
TRANSFORMER_CLASSES = frozenset({"matmul", "attention"})  # the stand-in for convolutions (see above)
VDNN_LOOKAHEAD = 1  # vDNN prefetches one layer ahead


def layer_inputs(problem: Problem) -> tuple[list[int], list[int]]:
    """(vDNN_conv offloads, the further vDNN_all offloads), each in forward order: candidates read by a
    convolution (by a matrix product or attention when the model has no convolution) in forward, then
    those read by any other forward op."""
    feats = problem.simulator.features
    order = forward_order(problem.workload)
    heavy = CONV_CLASSES if any(c & CONV_CLASSES for c in feats.consumer_classes) else TRANSFORMER_CLASSES
    conv = [ci for ci in order if feats.consumer_classes[ci] & heavy]
    rest = [ci for ci in order if feats.consumer_classes[ci] and not feats.consumer_classes[ci] & heavy]
    return conv, rest


@register
class VDNN(Searcher):
    """Rhu et al. 2016 (vDNN_dyn, budget-aware): offload convolution inputs, then all layer inputs."""

    name = "vdnn"
    summary = "Rhu et al. MICRO 2016 (vDNN): offload conv-layer inputs in forward, prefetch one layer ahead"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        # vDNN waits for each layer's offload before the next layer runs: release at the next pack point.
        options = dataclasses.replace(problem.options, prefetch_lookahead=VDNN_LOOKAHEAD, release_after=1)
        conv, rest = layer_inputs(problem)
        actions, result = apply_until_fits(problem, [(ci, SWAP) for ci in conv], options=options)
        stage = "vDNN_conv"
        if not result.feasible and rest:
            actions, result = apply_until_fits(problem, [(ci, SWAP) for ci in rest], start=actions, options=options)
            stage = "vDNN_all"
        n_swapped = int((actions == SWAP).sum())
        return Proposal(actions, options, note=f"{stage}: {n_swapped} layer inputs offloaded")
