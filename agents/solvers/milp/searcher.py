"""The ``milp`` searcher: solve the model (model.py), check the answer on the simulator, repair with no-good
cuts and a tighter budget while it is over (NOTE [ MILP model ], Repairs)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, Status, register
from agents.solvers.milp.data import MAX_UNITS, MilpData, decision_units
from agents.solvers.milp.model import Built, build_milp
from envs.simulator import SimResult
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP

_DEFAULT_TIME_LIMIT_S = 30.0
_REPAIRS = 8  # re-solves when the simulator finds the answer over budget (NOTE [ MILP model ], Repairs)
_CUTS_BEFORE_TIGHTENING = 3  # no-good cuts alone for this many re-solves, then also a tighter budget


def _unit_vector(data: MilpData, unit_action: Sequence[int]) -> np.ndarray:
    """Candidate actions from one action per unit (candidates outside the units are kept)."""
    actions = data.problem.keep_all()
    for members, a in zip(data.units, unit_action, strict=True):
        actions[members] = a
    return actions


def _unit_actions(data: MilpData, built: Built, values: np.ndarray) -> list[int]:
    """The action of each unit in a HiGHS solution (the largest of its binaries)."""
    return [max(data.actions, key=lambda a: values[built.x[u, a]]) for u in range(len(data.units))]


@dataclass
class _Start:
    """A warm start: one action per unit and its simulated result (it fits the budget)."""

    unit_action: list[int]
    result: SimResult
    source: str

    def columns(self, built: Built) -> dict[int, float]:
        return {col: float(self.unit_action[u] == a) for (u, a), col in built.x.items()}


def _warm_start(data: MilpData) -> _Start | None:
    """The fastest policy the simulator finds within the budget among keep-all, recompute-all and
    checkpoint-dp's answer mapped onto the units (a unit is recomputed when checkpoint-dp recomputes any of
    its candidates). It gives HiGHS an incumbent from the start, and the searcher one to return if HiGHS
    gets no time at all."""
    from agents.solvers.checkpoint_dp import CheckpointDP  # a sibling solver, and cheap (a linear DP)

    problem, units = data.problem, range(len(data.units))
    tries = {"keep-all": [KEEP for _ in units]}
    if RECOMPUTE in data.actions:
        dp = CheckpointDP()._search(problem, SearchContext()).actions
        tries["recompute-all"] = [RECOMPUTE for _ in units]
        tries["checkpoint-dp"] = [RECOMPUTE if np.any(dp[m] == RECOMPUTE) else KEEP for m in data.units]
    best: _Start | None = None
    for source, unit_action in tries.items():
        r = problem.evaluate(_unit_vector(data, unit_action))
        if r.feasible and (best is None or r.iter_s < best.result.iter_s):
            best = _Start(unit_action, r, source)
    return best


@register
class MilpSearcher(Searcher):
    """Checkmate-style MILP over units with keep / swap / recompute (and compress if allowed), solved by
    HiGHS, its answer verified by the simulator (NOTE [ MILP model ])."""

    name = "milp"
    summary = "Checkmate (Jain et al. 2020) + POET-style paging: MILP over units, HiGHS"
    exact = True

    def __init__(self, max_units: int = MAX_UNITS, log: bool = False) -> None:
        self.max_units = max_units  # decision units (the MILP's size: 3 binaries each)
        self.log = log  # print HiGHS's own log

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        started = time.perf_counter()
        limit_s = ctx.time_limit_s if ctx.time_limit_s is not None else _DEFAULT_TIME_LIMIT_S
        acts = (KEEP, SWAP, RECOMPUTE, COMPRESS) if problem.allow_compress else (KEEP, SWAP, RECOMPUTE)
        # Memory in units of a power of two, about 2^-14 of the budget or of all activations: well-scaled rows.
        scale_bytes = max(problem.budget_bytes, int(problem.simulator.size.sum()), 1)
        mem_unit = float(2 ** max(0, int(math.log2(scale_bytes / 2**14))))
        data = MilpData(problem, decision_units(problem, self.max_units), acts, mem_unit)
        if not data.units:
            return Proposal(problem.keep_all(), note="no candidate is large enough to decide: all kept")
        start = _warm_start(data)
        budget = problem.budget_bytes
        notes: list[str] = []
        no_goods: list[list[int]] = []
        for attempt in range(_REPAIRS + 1):
            built = build_milp(data, budget, no_goods)
            size = f"{len(data.units)} units, {len(built.milp.col_names)} columns, {len(built.milp.row_names)} rows"
            left_s = limit_s - (time.perf_counter() - started)
            sol = built.milp.solve(left_s, ctx.seed, start.columns(built) if start else None, self.log)
            if sol.values is None and sol.status == "infeasible" and attempt == 0:
                if start is not None:  # the model is conservative somewhere: the simulator has the last word
                    return self._fallback(data, start, None, [f"model infeasible ({size}) but not the simulator"])
                return self._least_peak(data, ctx.seed, started, limit_s, [f"model infeasible ({size})"])
            if sol.values is None:
                notes.append(f"HiGHS {sol.status} without an incumbent ({size})")
                return self._fallback(data, start, Status.TIMEOUT if sol.status == "time_limit" else None, notes)
            unit_action = _unit_actions(data, built, sol.values)
            actions = _unit_vector(data, unit_action)
            result = problem.evaluate(actions)
            model_iter_s = sol.objective / 1e3
            gap = sol.gap if math.isfinite(sol.gap) else None
            notes.append(
                f"HiGHS {sol.status} (gap {sol.gap:.2e}, {size}): model {model_iter_s:.6f} s,"
                f" simulated {result.iter_s:.6f} s, peak {result.peak_bytes} B for budget {problem.budget_bytes} B"
            )
            if result.feasible:
                agree = math.isclose(result.iter_s, model_iter_s, rel_tol=1e-6, abs_tol=1e-9)
                if sol.status == "time_limit":
                    return Proposal(actions, status=Status.TIMEOUT, gap=gap, note="; ".join(notes))
                if sol.status == "optimal" and agree and budget == problem.budget_bytes:
                    return Proposal(actions, status=Status.OPTIMAL, gap=gap, note="; ".join(notes))
                notes.append("the simulator disagrees with the model: status from the simulator")
                return Proposal(actions, note="; ".join(notes))
            if time.perf_counter() - started >= limit_s:
                return self._fallback(data, start, Status.TIMEOUT, notes)
            # Over budget: cut the assignment off, and after a few cuts also lower the budget by the excess.
            no_goods.append(unit_action)
            if len(no_goods) > _CUTS_BEFORE_TIGHTENING:
                budget -= result.peak_bytes - problem.budget_bytes  # the model was optimistic by this much
            notes.append(f"over budget in the simulator: cut off, re-solving for {budget} B")
        return self._fallback(data, start, None, [*notes, f"no answer within the budget after {_REPAIRS} re-solves"])

    def _fallback(self, data: MilpData, start: _Start | None, status: Status | None, notes: list[str]) -> Proposal:
        """The warm start when the MILP gave nothing the simulator accepts (all kept if there is none)."""
        if start is None:
            return Proposal(data.problem.keep_all(), status=status, note="; ".join([*notes, "all kept"]))
        note = f"the warm start ({start.source}) instead"
        return Proposal(_unit_vector(data, start.unit_action), status=status, note="; ".join([*notes, note]))

    def _least_peak(self, data: MilpData, seed: int, started: float, limit_s: float, notes: list[str]) -> Proposal:
        """No policy fits the model: its least-peak incumbent, or keep-all if that peaks lower; INFEASIBLE."""
        problem = data.problem
        built = build_milp(data, None)
        sol = built.milp.solve(max(limit_s - (time.perf_counter() - started), 0.1), seed, log=self.log)
        actions = problem.keep_all()
        if sol.values is not None:
            least = _unit_vector(data, _unit_actions(data, built, sol.values))
            if problem.evaluate(least).peak_bytes < problem.evaluate(actions).peak_bytes:
                actions = least
        note = f"least peak of the model: HiGHS {sol.status}" + ("" if sol.values is not None else ", all kept")
        return Proposal(actions, status=Status.INFEASIBLE, note="; ".join([*notes, note]))
