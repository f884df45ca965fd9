"""Helpers shared by the simpler published heuristics (none, checkpoint-sqrt, vdnn, superneurons,
zhang-swap, torch-budget): forward order, recompute closures, and picking the best of several plans.

Everything here reads the workload and the simulator's own numbers, so a heuristic ranks tensors by the
costs the simulator charges (NOTE [ Simulator semantics ] in envs/simulator.py; rules cited by number).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from agents.base import Problem
from envs.features import op_class
from envs.simulator import SimResult, Simulator
from runtime.policy import PolicyOptions
from runtime.workload import Workload


@dataclass
class Plan:
    """One candidate answer of a heuristic: actions, the options to simulate them with, and the result."""

    actions: np.ndarray
    options: PolicyOptions
    result: SimResult
    label: str  # which variant of the paper produced it, for the proposal's note


def forward_order(w: Workload) -> list[int]:
    """Candidate indices in the order the forward pass produces them (producer op, then index)."""
    return sorted(range(len(w.candidates)), key=lambda i: (w.candidates[i].producer, i))


def all_closure_ops(sim: Simulator) -> list[frozenset[int]]:
    """Per candidate, the ops Rule 7 re-runs to regenerate it when its candidate inputs are resident (the
    simulator's own closures)."""
    return sim.closure_ops


def closure_classes(sim: Simulator) -> list[frozenset[str]]:
    """Per candidate, the op classes (``envs.features.op_class``) of the ops regenerating it re-runs."""
    return [frozenset(op_class(sim.w.ops[op].name) for op in ops) for ops in sim.closure_ops]


def minor_outputs(w: Workload) -> np.ndarray:
    """True for a candidate that shares its producer op with a larger candidate (BatchNorm's saved mean and
    inverse std next to its output, nll_loss's total weight). The papers drop or recompute a *layer*; Rule 7
    regenerates one storage at a time, so recomputing such a sibling would re-run the whole op for a few
    hundred bytes. Heuristics that recompute whole segments keep them."""
    main: dict[int, int] = {}
    for i, c in enumerate(w.candidates):
        j = main.get(c.producer)
        if j is None or c.nbytes > w.candidates[j].nbytes:
            main[c.producer] = i
    return np.array([main[c.producer] != i for i, c in enumerate(w.candidates)], dtype=bool)


def better(a: Plan, b: Plan | None) -> bool:
    """Is ``a`` better than ``b``: feasible beats infeasible; among feasible plans the faster (then the
    smaller peak); among infeasible ones the smaller shortfall (the peak, and host bytes over its bound). Ties
    keep ``b``, the earlier, so the choice is deterministic."""
    if b is None:
        return True
    if a.result.feasible != b.result.feasible:
        return a.result.feasible
    if a.result.feasible:
        return (a.result.iter_s, a.result.peak_bytes) < (b.result.iter_s, b.result.peak_bytes)
    return a.result.shortfall_bytes < b.result.shortfall_bytes


def best_plan(plans: Iterable[Plan]) -> Plan:
    chosen: Plan | None = None
    for plan in plans:
        if better(plan, chosen):
            chosen = plan
    if chosen is None:
        raise ValueError("best_plan: no plans to choose from")
    return chosen


def shortest_fitting_prefix(
    problem: Problem,
    ranked: Sequence[tuple[int, int]],
    options: PolicyOptions,
    start: np.ndarray | None = None,
) -> tuple[np.ndarray, SimResult]:
    """The shortest prefix of the ``(candidate, action)`` steps whose policy fits the budget, by bisection
    over the prefix length; every step when none fits.

    This is :func:`agents.base.apply_until_fits` in O(log k) simulations instead of O(k), for heuristics
    that try many rankings. The two agree whenever fitting is monotone in the prefix (more memory dropped,
    lower peak); where the simulator's timing makes it not quite monotone, the prefix returned still fits,
    it may just not be the very first one that does."""
    base = problem.keep_all() if start is None else start.copy()

    def policy(length: int) -> np.ndarray:
        actions = base.copy()
        for ci, action in ranked[:length]:
            actions[ci] = action
        return actions

    result = problem.evaluate(base, options)
    if result.feasible or not ranked:
        return base, result
    full = policy(len(ranked))
    full_result = problem.evaluate(full, options)
    if not full_result.feasible:
        return full, full_result
    lo, hi, hi_result = 0, len(ranked), full_result  # prefix lo does not fit, prefix hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_result = problem.evaluate(policy(mid), options)
        if mid_result.feasible:
            hi, hi_result = mid, mid_result
        else:
            lo = mid
    return policy(hi), hi_result
