"""MegTaiChi: evict by the next access that the iteration's regular access pattern predicts, rematerialize.

"MegTaiChi: Dynamic Tensor-based Memory Management Optimization for DNN Training" (the abstract in
shared/seeds/002). MegTaiChi tracks, at run time, when each tensor is accessed; training iterations repeat
the same pattern, so the next access of every tensor is known from the previous iteration, and its
dynamic planner coordinates two levers on it: tensor *partition* (running an operation on slices of its
input) and *rematerialization* (evicting a tensor and recomputing it before its next access).

Our reading, beside DTR (agents/heuristics/dtr.py), which is MegTaiChi's own baseline:
- The access pattern is the traced iteration's (an iteration repeats it): every candidate's producer, its
  forward uses and its first backward use.
- Eviction: the iteration is replayed op by op with the memory capped at the budget (DTR's replay,
  ``dtr_replay``), and where an op would pass it, the resident evictable tensor whose next access lies
  furthest ahead goes first (Belady's rule, which a known pattern makes possible: DTR must guess from
  staleness instead); among equally distant ones the one with the least recompute time per byte. Evicted
  tensors become ``recompute`` (MegTaiChi rematerializes; it does not swap). The same static adaptation as
  DTR's: only tensors past their last forward use and not yet needed in backward are evictable.
- Partition is not this searcher's choice within one run: a policy decides per tensor of one traced model,
  and slices change the model's trace. autotune finds the candidate partitions from the same access pattern
  (the calls that run the op where the floor lies, NOTE [ Choosing a partition ] in autotune/partitions.py),
  traces each, and the search runs on each and takes the fastest answer (C4), so with ``--allow-partition``
  this searcher plans the slices' tensors like every other one.
"""

from __future__ import annotations

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, register
from agents.heuristics.dtr import dtr_replay, evict_at_peak
from runtime.vocab import RECOMPUTE


@register
class MegTaiChi(Searcher):
    """MegTaiChi (shared/seeds/002) as a static policy: under the budget, evict the tensor whose next
    access is furthest ahead in the iteration's access pattern, and recompute it."""

    name = "megtaichi"
    summary = "MegTaiChi (seed 002): evict by furthest next access in the iteration's pattern, rematerialize"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        sim = problem.simulator
        cost_per_byte = np.asarray(sim.features.recompute_s, dtype=float) / np.maximum(1, sim.size)
        tie = 1e-3 * cost_per_byte / (cost_per_byte.max() or 1.0)  # below one op of distance: breaks ties only

        def furthest_next_access(c: int, i: int, _now_s: float, _evicted: np.ndarray, _last: np.ndarray) -> float:
            # Lower is evicted sooner: the furthest first backward use, then the cheapest to recompute.
            return -float(sim.first_use[c] - i) + float(tie[c])

        log = dtr_replay(sim, problem.budget_bytes, score=furthest_next_access)
        actions = problem.keep_all()
        actions[[e.candidate for e in log]] = RECOMPUTE
        # The replay's reading can differ from the simulator's (closure intermediates held during a
        # recompute): keep evicting by the same rule at the simulated peak until it fits.
        extra = evict_at_peak(
            problem,
            actions,
            problem.evaluate(actions),
            lambda p: lambda c: furthest_next_access(c, p, 0.0, actions, actions),
        )
        return Proposal(actions, note=f"{len(log)} evictions in the replay, {extra} after it")
