"""A parametric policy rule: a handful of knobs that turn into a whole per-tensor policy.

The per-tensor space (4^k with k ~ 400 for ResNet-101) is too large for a black-box sampler, so the Optuna
searchers search the knobs of this rule instead (the "parametric scoring rules" of the design notes):

1. Each candidate gets the cheaper of its allowed actions (:attr:`RuleParams.class_mode` restricts them per
   producer op class): swap costs the transfer time a copy cannot hide under its idle window
   (``swap_out + swap_in - hide * idle``, never below zero, plus ``1%`` of the transfer so that among hidden
   copies the shorter wins), scaled by ``swap_bias``; recompute costs its closure's time
   (envs/features.py), scaled by ``recompute_bias``.
2. Candidates are ranked by cost per byte, ``cost / nbytes ** size_exp``, and later tensors are made dearer
   by ``1 + late_bias * fwd_position`` (early activations live longest, so freeing them helps most peaks).
   Swaps, in that order, are capped at ``swap_share`` times the bytes the device-to-host link moves during
   the forward (a swapped tensor frees memory only once its copy is done); beyond the cap a candidate is
   recomputed instead.
3. From a start policy (keep-all, or a baseline's policy, of which the share ``revert`` of its costliest
   non-keep decisions is first given back to keep), the shortest prefix of that ranking (over the
   candidates the start keeps) which fits the budget is applied (a coarse grid of prefix lengths, then
   bisection below the first that fits: O(log k) simulations). If the start already
   fits, its most expensive non-keep decisions (by the same score) are reverted to keep instead, as many as
   still fit: a baseline that over-shoots the budget gives the throughput back.

Peak memory is not exactly monotone in the prefix length (a copy that stops being hidden can hold memory
longer), so the binary search is a heuristic: the result is always simulated and reported as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from agents.base import Problem
from envs.features import OP_CLASSES
from envs.simulator import SimResult
from runtime.policy import PolicyOptions
from runtime.vocab import KEEP, RECOMPUTE, SWAP

CLASS_MODES = ("any", "swap", "recompute", "keep")
LOOKAHEADS = (0, 1, 2, 4, 8, 16, 32)  # 0: copy back on demand
GRID_POINTS = 9  # prefix lengths tried before bisection (see rule_actions)


@dataclass(frozen=True)
class RuleParams:
    lookahead: int = 2
    hide: float = 1.0
    swap_bias: float = 1.0
    recompute_bias: float = 1.0
    size_exp: float = 1.0
    late_bias: float = 0.0
    revert: float = 0.0  # share of the start's non-keep decisions given back first, costliest first
    swap_share: float = 1.0  # swapped bytes at most this times what the link moves during the forward
    class_mode: dict[str, str] = field(default_factory=dict)  # op class -> one of CLASS_MODES ("any" if absent)


def present_classes(problem: Problem) -> list[str]:
    """The producer op classes of this workload's candidates, in OP_CLASSES order."""
    seen = set(problem.simulator.features.producer_class)
    return [c for c in OP_CLASSES if c in seen]


def ranked_moves(problem: Problem, params: RuleParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(candidate order, the action each gets, its score), best (cheapest per byte) first; candidates whose
    class is set to keep are left out."""
    f = problem.simulator.features
    transfer = f.swap_out_s + f.swap_in_s
    swap_cost = params.swap_bias * (np.maximum(0.0, transfer - params.hide * f.idle_s) + 0.01 * transfer)
    rec_cost = params.recompute_bias * np.where(np.isfinite(f.recompute_s), f.recompute_s, np.inf)
    modes = np.array([params.class_mode.get(c, "any") for c in f.producer_class])
    swap_cost = np.where((modes == "any") | (modes == "swap"), swap_cost, np.inf)
    rec_cost = np.where((modes == "any") | (modes == "recompute"), rec_cost, np.inf)
    size = np.maximum(f.nbytes, 1).astype(np.float64)
    late = 1.0 + params.late_bias * f.fwd_position
    swap_score = swap_cost / size**params.size_exp * late
    rec_score = rec_cost / size**params.size_exp * late
    action = np.where(rec_score < swap_score, RECOMPUTE, SWAP).astype(np.int8)
    score = np.minimum(swap_score, rec_score)
    movable = np.flatnonzero(np.isfinite(score))
    order = movable[np.argsort(score[movable], kind="stable")]
    # A swapped tensor frees its memory only once its copy is done: past what the link moves while the
    # forward runs, swaps do not lower the peak at the start of backward. Beyond that cap, recompute.
    cap = params.swap_share * problem.hardware.d2h_bytes_per_s * problem.simulator.forward_s
    swapped = 0.0
    keep_in = np.ones(len(order), dtype=bool)
    for i, ci in enumerate(order.tolist()):
        if action[ci] != SWAP:
            continue
        if swapped + size[ci] <= cap:
            swapped += size[ci]
        elif np.isfinite(rec_score[ci]):
            action[ci] = RECOMPUTE
        else:
            keep_in[i] = False
    order = order[keep_in]
    return order, action[order], score[order]


def rule_actions(
    problem: Problem,
    params: RuleParams,
    start: np.ndarray | None = None,
    evaluate: Callable[[np.ndarray, PolicyOptions], SimResult] | None = None,
) -> tuple[np.ndarray, PolicyOptions, SimResult]:
    """The rule's policy for ``problem`` from ``start`` (keep-all by default): actions, options, result."""
    options = replace(problem.options, prefetch_lookahead=int(params.lookahead))
    run = evaluate or (lambda a, o: problem.evaluate(a, o))
    base = problem.keep_all() if start is None else np.asarray(start, dtype=np.int8).copy()
    order, acts, _ = ranked_moves(problem, params)
    if params.revert > 0 and np.any(base != KEEP):
        changed = set(np.flatnonzero(base != KEEP).tolist())
        costly = [int(c) for c in order[::-1] if int(c) in changed] + sorted(changed - set(order.tolist()))
        base[costly[: int(np.ceil(params.revert * len(costly)))]] = KEEP
    result = run(base, options)
    if result.feasible:
        return _relax(base, result, order, options, run)
    free = base[order] == KEEP  # moves only over what the start keeps
    order, acts = order[free], acts[free]

    def at(p: int) -> np.ndarray:
        a = base.copy()
        a[order[:p]] = acts[:p]
        return a

    # Peak is not monotone in the prefix (recomputing a chain regenerates all of it at once), so a coarse
    # grid first: the smallest fitting grid point, then bisection below it.
    grid = sorted({round(x) for x in np.linspace(0, len(order), GRID_POINTS)} - {0})
    lo, hi, best, best_result = 0, -1, base, result
    for g in grid:
        a = at(g)
        r = run(a, options)
        if r.feasible:
            hi, best, best_result = g, a, r
            break
        if r.shortfall_bytes < best_result.shortfall_bytes:
            best, best_result = a, r
        lo = g
    if hi < 0:
        return best, options, best_result  # nothing this rule can do fits: report the lowest peak it reached
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a = at(mid)
        r = run(a, options)
        if r.feasible:
            hi, best, best_result = mid, a, r
        else:
            lo = mid
    return best, options, best_result


def _relax(
    actions: np.ndarray,
    result: SimResult,
    order: np.ndarray,
    options: PolicyOptions,
    run: Callable[[np.ndarray, PolicyOptions], SimResult],
) -> tuple[np.ndarray, PolicyOptions, SimResult]:
    """Revert to keep the start's costliest non-keep decisions (the rule's ranking read from the end) for as
    long as the policy still fits: the longest such suffix, by binary search."""
    changed = set(np.flatnonzero(actions != KEEP).tolist())
    if not changed:
        return actions, options, result
    # Costliest first: the ranking reversed, then candidates the rule would never move (class set to keep).
    ranked = [int(c) for c in order[::-1] if int(c) in changed]
    ranked += sorted(changed - set(ranked))

    def at(p: int) -> np.ndarray:
        a = actions.copy()
        a[ranked[:p]] = KEEP
        return a

    lo, hi = 0, len(ranked)  # at(lo) fits; find the longest reverted prefix that still fits
    best, best_result = actions, result
    while lo < hi:
        mid = (lo + hi + 1) // 2
        a = at(mid)
        r = run(a, options)
        if r.feasible:
            lo, best, best_result = mid, a, r
        else:
            hi = mid - 1
    if best_result.samples_per_s < result.samples_per_s:  # reverting made it slower (a hidden copy): keep start
        return actions, options, result
    return best, options, best_result


def params_from_dict(values: dict[str, object], classes: Sequence[str]) -> RuleParams:
    """RuleParams from an Optuna trial's params (see agents/optuna_search.py for the names)."""
    return RuleParams(
        lookahead=int(values.get("lookahead", 2)),  # type: ignore[call-overload]
        hide=float(values.get("hide", 1.0)),  # type: ignore[arg-type]
        swap_bias=float(values.get("swap_bias", 1.0)),  # type: ignore[arg-type]
        recompute_bias=float(values.get("recompute_bias", 1.0)),  # type: ignore[arg-type]
        size_exp=float(values.get("size_exp", 1.0)),  # type: ignore[arg-type]
        late_bias=float(values.get("late_bias", 0.0)),  # type: ignore[arg-type]
        revert=float(values.get("revert", 0.0)),  # type: ignore[arg-type]
        swap_share=float(values.get("swap_share", 1.0)),  # type: ignore[arg-type]
        class_mode={c: str(values.get(f"class_{c}", "any")) for c in classes},
    )
