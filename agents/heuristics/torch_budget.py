"""What ``torch.compile`` recomputes under ``torch._functorch.config.activation_memory_budget``.

Not a paper: PyTorch's min-cut partitioner (torch/_functorch/partitioners.py, torch 2.14,
``choose_saved_values_set``), recompute only. The budget is a fraction of the activation memory, 0 (save
only the inputs, recompute everything) to 1 (the runtime-optimised default). Below 1 it proceeds in stages
and returns the first whose saved activations fit the fraction:

1. *more aggressive* min-cut: every op in the recomputable allowlist (pointwise ops, views, and the
   normalisations, which torch.compile decomposes into them) is free to recompute; everything else is
   banned (must be saved if backward needs it).
2. *aggressive* min-cut: the allowlist is dropped; banned are only compute-intensive ops (``mm``,
   ``addmm``, ``bmm``, ``convolution``, the attention kernels, ``upsample_bilinear2d``, ``_scaled_mm``),
   random ops (``native_dropout``, ``rand_like``, ``randn_like``) and reductions (output more than 4x
   smaller than the inputs).
3. *knapsack*: the banned nodes become items, memory = size / activation memory, runtime = the
   estimate of ``activation_memory_budget_runtime_estimator`` (``"flops"``, the default: FLOPs from
   ``FlopCounterMode``; ``"profile"``: benchmarked). The 0-1 knapsack (``_knapsack.SOLVERS``) keeps the
   items of largest total runtime within the fraction; the others are un-banned (``dont_ban``) and the
   min-cut recomputes them. Items are sorted by size, largest first, before solving (it decides ties).

Adaptations to our setting:
- The min-cut works on the joint FX graph; we work on saved activations (``workload.candidates``). A
  candidate is *free* at a stage when every op that regenerating it re-runs (Rule 7's closure) is free at
  that stage; freed candidates are recomputed, the others kept. A cheap output whose regeneration would
  re-run a banned op (a ReLU behind a convolution autograd did not save) is an item like the banned op.
- The fraction is the activation share of our budget: (budget - the bytes at the no-policy peak that are
  not saved activations) / (all saved-activation bytes). Its denominator is torch's ``max_act_size``
  (keeping every saved activation is our runtime-optimised default; ``min_act_size``, the inputs, is 0
  because inputs and parameters are not candidates).
- The runtime estimator defaults to ``"profile"``, the simulator's own recompute seconds (torch's
  ``"profile"`` benchmarks each op; the simulator is our benchmark); ``"flops"`` is torch's default.
- torch fuses recomputed pointwise ops into backward kernels and counts them free; the simulator charges
  their op time. Small sibling outputs of a multi-output op (BatchNorm's statistics) are kept, since
  Rule 7 would re-run the whole op for each (see ``_selection.minor_outputs``).
- torch trusts its fraction; we simulate. If the plan's peak exceeds the budget (recomputation
  materialises tensors at once, Rule 7), the fraction is lowered by bisection to the largest value whose
  plan fits; of the plans tried, the fastest within the budget is returned (the lowest peak if none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, register
from agents.heuristics._knapsack import SOLVERS
from agents.heuristics._selection import Plan, all_closure_ops, best_plan, minor_outputs
from envs.features import op_class
from runtime.vocab import KEEP, RECOMPUTE
from runtime.workload import OpInfo, Workload

# torch's compute_intensive_ops and random_ops, by aten packet name.
_COMPUTE_INTENSIVE = re.compile(
    r"^(mm|addmm|bmm|convolution|convolution_backward|_scaled_dot_product_flash_attention"
    r"|_scaled_dot_product_efficient_attention|_flash_attention_forward|_efficient_attention_forward"
    r"|upsample_bilinear2d|_scaled_mm)$"
)
_RANDOM = re.compile(r"^(native_dropout|rand_like|randn_like|bernoulli_?)$")
# Op classes the recomputable allowlist covers once torch.compile has decomposed them (pointwise ops,
# views, reductions like sum/mean/var_mean, softmax and the normalisations).
_ALLOWLIST_CLASSES = frozenset({"activation", "elementwise", "norm"})
_NOT_ALLOWLISTED = re.compile(r"^(embedding|cat)$")
_BISECTION_STEPS = 14  # 2^-14 of the fraction: finer than the DP's 1/10000 quantisation
ESTIMATORS = ("profile", "flops")


def _packet(op: OpInfo) -> str:
    """``"aten.convolution.default"`` -> ``"convolution"``."""
    return op.name.removeprefix("aten.").split(".")[0]


def _is_reduction(w: Workload, op: OpInfo) -> bool:
    """torch's ``ban_recompute_reductions``: the output is more than 4x smaller than the inputs."""
    in_bytes = sum(w.tensors[t].nbytes for t in op.inputs)
    out_bytes = sum(w.tensors[t].nbytes for t in op.outputs)
    return out_bytes * 4 < in_bytes


def banned_ops(w: Workload, stage: str) -> np.ndarray:
    """Per op, True when the ``stage`` ("more_aggressive" or "aggressive") min-cut bans recomputing it."""
    banned = np.zeros(len(w.ops), dtype=bool)
    for op in w.ops:
        packet = _packet(op)
        if stage == "more_aggressive":
            banned[op.index] = op_class(op.name) not in _ALLOWLIST_CLASSES or bool(_NOT_ALLOWLISTED.match(packet))
        else:
            banned[op.index] = bool(_COMPUTE_INTENSIVE.match(packet) or _RANDOM.match(packet))
        banned[op.index] |= _is_reduction(w, op)
    return banned


@dataclass
class Partitioner:
    """The per-candidate facts the stages need, computed once per problem."""

    weights: np.ndarray  # memory of each candidate as a fraction of all saved-activation bytes
    runtimes: np.ndarray  # the estimator's runtime of regenerating each candidate
    free_more: np.ndarray  # bool: recomputable in the more-aggressive stage
    free_aggr: np.ndarray  # bool: recomputable in the aggressive stage
    minor: np.ndarray  # bool: small sibling outputs, always kept

    @classmethod
    def build(cls, problem: Problem, estimator: str = "profile") -> Partitioner:
        if estimator not in ESTIMATORS:
            raise ValueError(f"torch-budget: unknown runtime estimator {estimator!r}: expected one of {ESTIMATORS}")
        w, sim = problem.workload, problem.simulator
        closures = all_closure_ops(sim)
        more, aggr = banned_ops(w, "more_aggressive"), banned_ops(w, "aggressive")
        if estimator == "profile":
            runtimes = sim.features.recompute_s.astype(np.float64)
        else:
            runtimes = np.array([max(1.0, sum(w.ops[op].flops for op in ops)) for ops in closures])
        total = float(sim.size.sum())
        return cls(
            weights=sim.size / max(1.0, total),
            runtimes=runtimes,
            free_more=np.array([not any(more[list(ops)]) for ops in closures], dtype=bool),
            free_aggr=np.array([not any(aggr[list(ops)]) for ops in closures], dtype=bool),
            minor=minor_outputs(w),
        )

    def saved(self, fraction: float, solver: str = "dp") -> np.ndarray:
        """Per candidate, True when ``choose_saved_values_set(memory_budget=fraction)`` saves it."""
        k = len(self.weights)
        if fraction >= 1.0:
            return np.ones(k, dtype=bool)  # the runtime-optimised default
        if fraction <= 0.0:
            return self.minor.copy()  # torch saves only the inputs
        for free in (self.free_more, self.free_aggr):
            if self.weights[~free].sum() < fraction:
                return ~free | self.minor
        # The knapsack over the banned candidates, largest first as torch sorts them (a stable sort).
        items = [int(i) for i in np.argsort(-self.weights, kind="stable") if not self.free_aggr[i]]
        _, chosen, _ = SOLVERS[solver](
            [float(self.weights[i]) for i in items], [self.runtimes[i] for i in items], fraction
        )
        saved = self.minor.copy()
        saved[[items[j] for j in chosen]] = True
        return saved


def activation_fraction(problem: Problem) -> float:
    """The activation share of the budget: (budget - other bytes at the no-policy peak) / saved bytes."""
    sim = problem.simulator
    live = sim.base_live + _candidate_live(problem)
    peak_op = int(np.argmax(live))
    other_bytes = int(sim.base_live[peak_op])
    return (problem.budget_bytes - other_bytes) / max(1.0, float(sim.size.sum()))


def _candidate_live(problem: Problem) -> np.ndarray:
    """Bytes of kept candidates live during each op with no policy (Rule 3)."""
    sim = problem.simulator
    delta = np.zeros(sim.n_ops + 1, dtype=np.int64)
    np.add.at(delta, sim.producer, sim.size)
    np.add.at(delta, sim.free_keep + 1, -sim.size)
    return np.cumsum(delta[: sim.n_ops])


@register
class TorchMemoryBudget(Searcher):
    """torch.compile's activation-memory-budget partitioner (recompute only), fitted to our budget."""

    name = "torch-budget"
    summary = "torch.compile activation_memory_budget: 0-1 knapsack over banned recomputes (min-cut partitioner)"

    def __init__(self, solver: str = "dp", estimator: str = "profile") -> None:
        if solver not in SOLVERS:
            raise ValueError(f"torch-budget: unknown solver {solver!r}: expected one of {sorted(SOLVERS)}")
        self.solver, self.estimator = solver, estimator

    def plan(self, problem: Problem, fraction: float, partitioner: Partitioner | None = None) -> np.ndarray:
        """Actions for one fraction: recompute what the partitioner does not save."""
        part = partitioner or Partitioner.build(problem, self.estimator)
        return np.where(part.saved(fraction, self.solver), KEEP, RECOMPUTE).astype(np.int8)

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        options = problem.options
        part = Partitioner.build(problem, self.estimator)
        tried: dict[bytes, Plan] = {}

        def attempt(fraction: float) -> Plan:
            actions = self.plan(problem, fraction, part)
            key = actions.tobytes()
            if key not in tried:
                label = f"memory_budget={fraction:.4f}"
                tried[key] = Plan(actions, options, problem.evaluate(actions, options), label)
            return tried[key]

        start = min(1.0, max(0.0, activation_fraction(problem)))
        if not attempt(start).result.feasible and start > 0.0:
            lo, hi = 0.0, start  # our adaptation: lower the fraction until the simulated peak fits
            for _ in range(_BISECTION_STEPS):
                mid = (lo + hi) / 2
                if attempt(mid).result.feasible:
                    lo = mid
                else:
                    hi = mid
        chosen = best_plan(tried.values())
        return Proposal(chosen.actions, chosen.options, note=chosen.label)
