"""HiGHS through highspy: a sparse MILP built as lists and handed to the solver in one go."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_INSTALL_HINT = "the milp searcher needs HiGHS: pip install 'highspy>=1.7'"


def _run_interruptible(hs: Any, h: Any) -> None:
    """``h.run()`` in a thread of its own, so that Ctrl-C (or SIGTERM's exception) reaches the caller at once: the
    solve is one C++ call, during which Python runs no signal handler; HiGHS's interrupt callbacks then stop it.
    Where this highspy has no callbacks, the plain call."""
    kinds = getattr(getattr(getattr(hs, "cb", None), "HighsCallbackType", None), "__members__", {})
    interrupts = [kinds[k] for k in ("kCallbackMipInterrupt",) if k in kinds]  # checked between the MIP's nodes
    reset = getattr(type(h), "resetThreadScheduler", None)
    if not interrupts or not hasattr(h, "setCallback") or reset is None:
        h.run()
        return
    stop = threading.Event()

    def interrupt(_kind: Any, _message: str, _out: Any, data_in: Any, _user: Any) -> None:
        if data_in is not None and stop.is_set():
            data_in.user_interrupt = True

    h.setCallback(interrupt, None)  # started once interrupted: a call into Python at every check slows the MIP
    done = threading.Event()
    failed: list[BaseException] = []

    def solve() -> None:
        try:
            h.run()
            reset(True)  # the scheduler's threads belong to this thread's solve: gone with it (as highspy's own)
        except BaseException as e:  # raised again in the caller's thread
            failed.append(e)
        finally:
            done.set()

    worker = threading.Thread(target=solve, name="highs", daemon=True)
    worker.start()
    try:
        while not done.wait(0.05):  # (a Thread.join that Ctrl-C interrupts can return early next time)
            pass
    except BaseException:
        stop.set()
        for kind in interrupts:
            h.startCallback(kind)  # (a flag the solver reads at its next check between nodes)
        done.wait()
        raise
    finally:
        worker.join()
        h.setCallback(None, None)
    if failed:
        raise failed[0]


def highspy_module() -> Any:
    try:
        import highspy
    except ImportError as e:  # pragma: no cover - highspy is a declared dependency
        raise ImportError(_INSTALL_HINT) from e
    return highspy


@dataclass
class Lin:
    """A linear expression: ``const + sum(coef * column)``."""

    terms: dict[int, float] = field(default_factory=dict)
    const: float = 0.0

    def add(self, col: int, coef: float) -> Lin:
        if coef:
            self.terms[col] = self.terms.get(col, 0.0) + coef
        return self

    def add_lin(self, other: Lin, scale: float = 1.0) -> Lin:
        for col, coef in other.terms.items():
            self.add(col, scale * coef)
        self.const += scale * other.const
        return self


@dataclass
class Solution:
    """What HiGHS returned."""

    status: str  # "optimal", "time_limit", "infeasible", "other"
    values: np.ndarray | None  # column values of the incumbent, None without one
    objective: float
    gap: float


class SparseMilp:
    """Columns and labelled rows; :meth:`solve` runs HiGHS."""

    def __init__(self) -> None:
        self.col_names: list[str] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.row_names: list[str] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_cols: list[list[int]] = []
        self.row_vals: list[list[float]] = []
        self.offset = 0.0

    def var(self, name: str, lb: float = 0.0, ub: float = math.inf, cost: float = 0.0, binary: bool = False) -> int:
        self.col_names.append(name)
        self.lower.append(lb)
        self.upper.append(1.0 if binary else ub)
        self.cost.append(cost)
        self.integer.append(binary)
        return len(self.col_names) - 1

    def row(self, name: str, expr: Lin, lo: float = -math.inf, hi: float = math.inf) -> int:
        """``lo <= expr <= hi`` (the expression's constant moves to the bounds)."""
        self.row_names.append(name)
        self.row_lower.append(lo - expr.const)
        self.row_upper.append(hi - expr.const)
        cols = [c for c, v in expr.terms.items() if v]
        self.row_cols.append(cols)
        self.row_vals.append([expr.terms[c] for c in cols])
        return len(self.row_names) - 1

    def solve(
        self, time_limit_s: float, seed: int, start: dict[int, float] | None = None, log: bool = False
    ) -> Solution:
        """Run HiGHS for at most ``time_limit_s`` from the (partial) solution ``start``; ``log``: its output."""
        hs = highspy_module()
        # highspy.Highs() enables callbacks in its constructor, which prints the HiGHS banner before
        # output_flag can be cleared; the core class it wraps does not (fall back to it if it moved).
        core = getattr(getattr(hs, "_core", None), "_Highs", None)
        h = core() if core is not None else hs.Highs()
        h.setOptionValue("output_flag", log)
        h.setOptionValue("time_limit", max(0.01, float(time_limit_s)))
        h.setOptionValue("random_seed", int(seed))
        h.setOptionValue("mip_rel_gap", 1e-6)
        # No "threads" option: HiGHS keeps one global scheduler per process, and a second HiGHS user asking
        # another thread count gets an error instead of a solve (seen when torch-budget had solved first).
        # The MIP search itself is deterministic under random_seed.
        lp = hs.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.col_names), len(self.row_names)
        inf = hs.kHighsInf
        lp.col_cost_ = np.asarray(self.cost, dtype=np.float64)
        lp.col_lower_ = np.asarray(self.lower, dtype=np.float64)
        lp.col_upper_ = np.clip(np.asarray(self.upper, dtype=np.float64), -inf, inf)
        lp.row_lower_ = np.clip(np.asarray(self.row_lower, dtype=np.float64), -inf, inf)
        lp.row_upper_ = np.clip(np.asarray(self.row_upper, dtype=np.float64), -inf, inf)
        lp.offset_ = self.offset
        lp.a_matrix_.format_ = hs.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.cumsum([0, *(len(c) for c in self.row_cols)]).astype(np.int32)
        lp.a_matrix_.index_ = np.fromiter((c for cols in self.row_cols for c in cols), dtype=np.int32)
        lp.a_matrix_.value_ = np.fromiter((v for vals in self.row_vals for v in vals), dtype=np.float64)
        lp.integrality_ = [hs.HighsVarType.kInteger if i else hs.HighsVarType.kContinuous for i in self.integer]
        lp.col_names_, lp.row_names_ = self.col_names, self.row_names
        h.passModel(lp)
        if start:
            idx = np.fromiter(start.keys(), dtype=np.int32)
            h.setSolution(len(idx), idx, np.fromiter(start.values(), dtype=np.float64))
        _run_interruptible(hs, h)
        status = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == hs.kSolutionStatusFeasible
        name = {
            hs.HighsModelStatus.kOptimal: "optimal",
            hs.HighsModelStatus.kTimeLimit: "time_limit",
            hs.HighsModelStatus.kInfeasible: "infeasible",
        }.get(status, "other")
        values = np.asarray(h.getSolution().col_value) if has_solution else None
        gap = float(info.mip_gap) if has_solution else math.inf
        return Solution(name, values, float(info.objective_function_value), gap)
