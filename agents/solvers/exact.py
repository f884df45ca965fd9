"""An exact yardstick on the simulator's own rules: branch and bound with the simulator as the oracle.

NOTE [ Exact yardstick ]

What it solves: the fastest feasible policy over every action of every *unit* (a candidate, or a set of
candidates decided together: blocks, for a real model) and, where a policy swaps, every prefetch look-ahead
and release point the searchers choose from (``agents.rule.LOOKAHEADS`` x ``agents.base.RELEASES``), as the
simulator (envs/simulator.py) scores it. Candidates in no unit are kept. Proven optimal when the tree is
exhausted; otherwise (time limit) the best policy found and a proven lower bound on every unit policy's
iteration time, so ``gap`` says how far the answer can be from the optimum.

The tree decides the units one at a time, largest first, keep before swap, recompute, compress. A node is
cut when one of two bounds, each a consequence of the simulator's rules whatever the undecided units do,
rules it out:

B1 (memory). Under every action a candidate is live over [producer, free_if_dropped_op] and over its
    [first, last] backward use (``envs.simulator.peak_floor``'s argument: Rules 3, 4, 5, 7, 8, 11); a kept
    one over [producer, free_op] (Rule 3); tensors that are not candidates and workspaces as traced (Rule 2),
    and recomputes only add (Rules 7, 11). The live bytes of each op are at least the sum of those
    intervals, the undecided and non-kept units at their minimum; the node is infeasible when their maximum
    exceeds the budget.
B2 (time). The iteration lasts at least (Rule 9, then Rule 10 for gradient accumulation):
    a. the compute stream's work: every op once (Rule 1), the producer op of every recomputed candidate
       once more (a replay re-runs its closure, Rule 7, a region every op up to its last pack, Rule 11:
       either way the producer; an op shared by several recomputed candidates counted once), a compressed
       candidate's pack kernel and, when backward reads it, its unpack kernel (Rule 8; none for one that some
       candidate's replay reads: recomputing that one keeps it, runtime/plan.py P12); on a profile
       without copy engines also each swap's copy out and its ``swap_s`` (Rules 1, 4, 12: one clock);
    b. on a GPU, the host's: every op's h_i and each copy out's ``swap_s`` (Rule 12);
    c. on a GPU, per swapped candidate c read in backward: the compute stream's ops up to its save_op, its
       copy out, its copy back, then the ops from its first backward use on (Rules 4-6: the copy out
       starts after save_op, the copy back after the copy out, the use waits for it);
    d. on a GPU, each copy stream's total over the swapped candidates read in backward: their copies out one
       after another from the first one's save_op's end; their copies back one after another from when the
       first copy out could end, the last before the latest first use among them (Rules 1, 5, 6).
    Stalls, host costs of hooks, regions and replays are >= 0 and left out. A node is cut when its bound is
    not below the best iteration time found.
B1 and B2 are checked against the simulator on random policies in tests/test_exact.py (never above it).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from agents.base import RELEASES
from agents.rule import LOOKAHEADS
from envs.problem import Problem
from envs.simulator import SimResult, accumulated_s
from runtime.policy import PolicyOptions
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP

Cands = Sequence[int] | np.ndarray  # candidate indices
_TIE = 1e-9  # relative: a node whose bound is within this of the best time cannot hold a better policy


@dataclass
class ExactResult:
    """The branch and bound's answer. ``optimal``: the tree was exhausted, so ``actions`` is the optimum over
    the unit policies (None: proven that none fits). Otherwise ``bound_s`` is a proven lower bound on the
    iteration time of every unit policy that fits."""

    actions: np.ndarray | None
    options: PolicyOptions | None
    result: SimResult | None
    optimal: bool
    bound_s: float  # no unit policy that fits runs faster (math.inf: none fits)
    nodes: int
    evaluations: int
    elapsed_s: float

    @property
    def samples_per_s(self) -> float:
        return self.result.samples_per_s if self.result is not None else 0.0

    @property
    def bound_samples_per_s(self) -> float:
        """Upper bound on the throughput of every unit policy that fits (0 when none fits)."""
        return 0.0 if math.isinf(self.bound_s) else self.samples_per_s_at(self.bound_s)

    def samples_per_s_at(self, iter_s: float) -> float:
        if self.result is None or self.result.iter_s <= 0:
            return 0.0
        return self.result.samples_per_s * self.result.iter_s / iter_s

    @property
    def gap(self) -> float:
        """1 - answer / bound on samples/s: 0 when proven optimal."""
        if self.optimal or self.result is None:
            return 0.0
        return max(0.0, 1.0 - self.bound_s / self.result.iter_s)


class Bounds:
    """B1 and B2 of NOTE [ Exact yardstick ] for one problem, per candidate."""

    def __init__(self, problem: Problem) -> None:
        sim = problem.simulator
        w, n = problem.workload, sim.n_ops
        self.n = n
        self.is_gpu = not sim.sync_copies
        hw = problem.hardware
        # B1: the live bytes with every candidate at its minimum, to which a kept one adds the rest of its
        # traced life; each interval [lo, hi] of inclusive ops, clipped to that life.
        self.size = sim.size.astype(np.int64)
        floor = sim.base_live.astype(np.int64).copy()
        self.extra_if_kept: list[tuple[np.ndarray, np.ndarray]] = []  # (ops, bytes) kept adds over the minimum
        for c, cand in enumerate(w.candidates):
            lo, hi = int(sim.producer[c]), int(sim.free_keep[c])
            least = np.zeros(n, dtype=bool)
            least[lo : min(int(sim.drop[c]), hi) + 1] = True
            if cand.bwd_uses:
                least[max(min(cand.bwd_uses), lo) : min(max(cand.bwd_uses), hi) + 1] = True
            floor[least] += self.size[c]
            kept = np.zeros(n, dtype=bool)
            kept[lo : hi + 1] = True
            ops = np.flatnonzero(kept & ~least)
            self.extra_if_kept.append((ops, np.full(len(ops), self.size[c], dtype=np.int64)))
        self.floor = floor
        # B2.
        self.op_s = sim.op_s
        self.compute_s = float(sim.op_s.sum())
        self.dcum = np.concatenate([[0.0], np.cumsum(sim.op_s)])
        self.producer = sim.producer
        self.first_use = sim.first_use
        self.save_op = sim.save_op
        self.d2h_s, self.h2d_s = sim.d2h_s, sim.h2d_s
        self.swap_s = hw.host.swap_s
        self.host_s = float(sim.host_op_s.sum()) if self.is_gpu else 0.0
        packed_cost = sim.compression(problem.options.compress_dtype)[1]
        packed_cost = packed_cost * sim.compressible(problem.options.compress_dtype)  # others are kept (Rule 8)
        self.compress_s = packed_cost * np.where(self.first_use < n, 2.0, 1.0)
        # ... and none for one a replay may read: with its reader recomputed it is kept (runtime/plan.py P12).
        self.compress_s[sim._reads_idx] = 0.0
        self.optimizer_alone = sim._optimizer_alone
        self.w = w

    def peak_bound(self, kept: Iterable[int]) -> int:
        """B1 with the candidates ``kept`` kept and every other at its minimum."""
        live = self.floor.copy()
        for c in kept:
            ops, b = self.extra_if_kept[c]
            live[ops] += b
        return int(live.max()) if self.n else 0

    def time_bound(self, swapped: Cands, recomputed: Cands, compressed: Cands) -> float:
        """B2 for the candidates so decided (every other kept, or undecided: either adds nothing here)."""
        n = self.n
        rec_ops = {int(self.producer[c]) for c in recomputed}
        compute = self.compute_s + float(self.op_s[sorted(rec_ops)].sum()) if rec_ops else self.compute_s
        compute += float(self.compress_s[list(compressed)].sum()) if len(compressed) else 0.0
        t = compute
        if len(swapped):
            s = np.asarray(swapped, dtype=np.int64)
            if not self.is_gpu:
                t = compute + float(self.d2h_s[s].sum()) + self.swap_s * len(s)
            else:
                t = max(t, self.host_s + self.swap_s * len(s))
                out_end = self.dcum[self.save_op[s] + 1] + self.d2h_s[s]
                read = self.first_use[s] < n  # copied back: read in backward
                used = s[read]
                if len(used):
                    ue = self.first_use[used]
                    chain = out_end[read] + self.h2d_s[used] + (self.compute_s - self.dcum[ue])
                    t = max(t, float(chain.max()))
                    back_from = float(out_end.min())
                    t = max(t, back_from + float(self.h2d_s[used].sum()) + self.compute_s - self.dcum[int(ue.max())])
                    t = max(t, float(self.dcum[int(self.save_op[used].min()) + 1]) + float(self.d2h_s[used].sum()))
        elif self.is_gpu:
            t = max(t, self.host_s)
        return accumulated_s(self.w, t, self.optimizer_alone)


@dataclass
class _Best:
    iter_s: float = math.inf
    actions: np.ndarray | None = None
    options: PolicyOptions | None = None
    result: SimResult | None = None


def _leaf_options(problem: Problem, vec: np.ndarray) -> list[PolicyOptions]:
    base = problem.options
    if np.any(vec == COMPRESS):
        base = dataclasses.replace(base, lossy=True)
    if not np.any(vec == SWAP):
        return [base]
    return [dataclasses.replace(base, prefetch_lookahead=la, release_after=r) for la in LOOKAHEADS for r in RELEASES]


def solve_exact(
    problem: Problem,
    units: Sequence[Sequence[int]] | None = None,
    time_limit_s: float = math.inf,
    incumbent: tuple[np.ndarray, PolicyOptions] | None = None,
    stop: Callable[[], bool] | None = None,
) -> ExactResult:
    """The optimum over ``units`` (default: every candidate its own unit), or the best found and a proven
    bound when ``time_limit_s`` (or ``stop``) ends it first. ``incumbent``: a policy to start from (a
    searcher's answer), which only speeds the proof up."""
    started = time.perf_counter()
    sim = problem.simulator
    bounds = Bounds(problem)
    unit_list = [list(u) for u in (units if units is not None else [[c] for c in range(sim.k)])]
    unit_list.sort(key=lambda u: -int(bounds.size[u].sum()))
    actions = [KEEP, SWAP, RECOMPUTE] + ([COMPRESS] if problem.allow_compress else [])
    vec = np.zeros(sim.k, dtype=np.int8)
    best = _Best()
    counts = {"nodes": 0, "evaluations": 0}
    open_bounds: list[float] = []  # bounds of the subtrees left unexplored when time ran out

    def evaluate(v: np.ndarray, opts: PolicyOptions) -> None:
        counts["evaluations"] += 1
        r = sim.run(v, budget_bytes=problem.budget_bytes, options=opts)
        if r.feasible and r.iter_s < best.iter_s:
            best.iter_s, best.actions, best.options, best.result = r.iter_s, v.copy(), opts, r

    if incumbent is not None:
        evaluate(np.asarray(incumbent[0], dtype=np.int8), incumbent[1])

    def out_of_time() -> bool:
        return time.perf_counter() - started > time_limit_s or (stop is not None and stop())

    decided = {c for u in unit_list for c in u}
    kept: list[int] = [c for c in range(sim.k) if c not in decided]
    swapped: list[int] = []
    recomputed: list[int] = []
    compressed: list[int] = []
    lists = {KEEP: kept, SWAP: swapped, RECOMPUTE: recomputed, COMPRESS: compressed}

    def node(depth: int) -> None:
        counts["nodes"] += 1
        if bounds.peak_bound(kept) > problem.budget_bytes:
            return
        lb = bounds.time_bound(swapped, recomputed, compressed)
        if lb >= best.iter_s * (1 - _TIE):
            return
        if out_of_time():
            open_bounds.append(lb)
            return
        if depth == len(unit_list):
            for opts in _leaf_options(problem, vec):
                evaluate(vec, opts)
                if best.iter_s <= lb * (1 + _TIE):
                    return  # no other options can beat the bound this one reached
            return
        unit = unit_list[depth]
        for a in actions:
            vec[unit] = a
            lists[a].extend(unit)
            node(depth + 1)
            del lists[a][len(lists[a]) - len(unit) :]
        vec[unit] = KEEP

    node(0)
    return ExactResult(
        actions=best.actions,
        options=best.options,
        result=best.result,
        optimal=not open_bounds,
        bound_s=min([best.iter_s, *open_bounds]),
        nodes=counts["nodes"],
        evaluations=counts["evaluations"],
        elapsed_s=time.perf_counter() - started,
    )


__all__ = ["Bounds", "ExactResult", "solve_exact"]
