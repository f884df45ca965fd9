"""The 0-1 knapsack solvers of ``torch.compile``'s activation-memory budget, reproduced.

Source: torch/_functorch/_activation_checkpointing/knapsack.py (torch 2.14). Each takes the items' memory
(normalised: a fraction of the activation memory), their runtimes and the memory capacity, and returns
``(runtime of the saved items, saved indices, indices allowed to be recomputed)``: saving an item means
not recomputing it, so the knapsack *maximises the runtime it saves* within the memory. The solver is
``torch._functorch.config.activation_memory_budget_solver``: ``"dp"`` (the default), ``"greedy"`` or
``"ilp"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KnapsackResult = tuple[float, list[int], list[int]]
DP_SCALE = 10_000  # torch's ``S``: memory fractions are quantised to 1/10000 of the activation memory


def greedy_knapsack(memory: Sequence[float], runtimes: Sequence[float], max_memory: float) -> KnapsackResult:
    """Take items by descending runtime per memory while they fit (torch's ``greedy_knapsack``)."""
    items = sorted(range(len(runtimes)), key=lambda i: _ratio(runtimes[i], memory[i]), reverse=True)
    total_memory = total_runtime = 0.0
    saved: list[int] = []
    recompute: list[int] = []
    for i in items:
        if total_memory + memory[i] <= max_memory:
            total_memory += memory[i]
            total_runtime += runtimes[i]
            saved.append(i)
        else:
            recompute.append(i)
    return total_runtime, saved, recompute


def _ratio(runtime: float, memory: float) -> float:
    # torch divides by the memory and would raise on a zero-size item; such an item costs nothing to save.
    return runtime / memory if memory > 0 else float("inf")


def dp_knapsack(memory: Sequence[float], runtimes: Sequence[float], max_memory: float) -> KnapsackResult:
    """Pseudo-polynomial DP over memory quantised to 1/``DP_SCALE`` (torch's ``dp_knapsack``): float32
    table, rows copied then relaxed, and the same backtracking, so ties break the same way."""
    quantized = [round(m * DP_SCALE) for m in memory]
    capacity = round(max_memory * DP_SCALE)
    n = len(memory)
    dp = np.zeros((n + 1, capacity + 1), dtype=np.float32)  # dp[i, j]: best runtime of items < i within j
    for i in range(1, n + 1):
        q, r = quantized[i - 1], np.float32(runtimes[i - 1])
        dp[i, :] = dp[i - 1, :]
        if q == 0:
            dp[i, :] = dp[i - 1, :] + r
        elif q <= capacity:
            dp[i, q:] = np.maximum(dp[i - 1, q:], dp[i - 1, :-q] + r)
    saved: list[int] = []
    recompute: list[int] = []
    j = capacity
    for i in range(n, 0, -1):
        if dp[i, j] != dp[i - 1, j]:
            saved.append(i - 1)
            j -= quantized[i - 1]
        else:
            recompute.append(i - 1)
    saved.reverse()
    return float(dp[n, capacity]), saved, recompute


def ilp_knapsack(memory: Sequence[float], runtimes: Sequence[float], max_memory: float) -> KnapsackResult:
    """The knapsack as a MILP (torch's ``ilp_knapsack`` calls scipy's ``milp``, which runs HiGHS; we call
    HiGHS directly, a dependency of this project)."""
    try:
        import highspy
    except ImportError:  # pragma: no cover - highspy is a declared dependency
        raise RuntimeError("torch-budget: the 'ilp' solver needs HiGHS: pip install highspy") from None
    n = len(memory)
    if n == 0:
        return 0.0, [], []
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    cols = np.arange(n, dtype=np.int32)
    for _ in range(n):
        h.addVar(0.0, 1.0)  # x_i = 1: item i is saved
    h.changeColsCost(n, cols, -np.asarray(runtimes, dtype=np.float64))  # maximise the saved runtime
    h.changeColsIntegrality(n, cols, np.array([highspy.HighsVarType.kInteger] * n))
    # Constraint: the saved items' memory is within the capacity.
    h.addRow(-highspy.kHighsInf, float(max_memory), n, cols, np.asarray(memory, dtype=np.float64))
    h.run()
    x = h.getSolution().col_value
    saved = [i for i in range(n) if x[i] > 0.5]
    recompute = [i for i in range(n) if x[i] <= 0.5]
    return float(sum(runtimes[i] for i in saved)), saved, recompute


SOLVERS = {"dp": dp_knapsack, "greedy": greedy_knapsack, "ilp": ilp_knapsack}
