"""Least-peak checkpoint selection on a chain, by dynamic programming.

Hong, Tsai, Wang, Liu and Wu, "GPU Memory Usage Optimization for Backward Propagation in Deep Network
Training" (seed 001). Forward keeps a subset of the layer outputs (the *checkpoints*); backward regenerates
every other output from the nearest checkpoint below it. The paper finds the subset with the least peak
memory by an O(n^3) dynamic programme and, after revising its objective, in O(n). Only the abstract was
available to us, so the memory model and both recurrences below are derived from our simulator's rules
(envs/simulator.py, NOTE [ Simulator semantics ]) on a chain, not transcribed from the paper.

NOTE [ Chain memory model ]
    Layers 0..n-1 run in order; layer i reads output i-1 (the input batch for i = 0, which is persistent)
    and writes output i of ``sizes[i]`` bytes, which its backward reads. K is the set of checkpoints and
    C(j) the bytes of the checkpoints at or below j. With P(j) = sizes[0] + ... + sizes[j]:
    - forward of layer i (Rules 2, 3, 7: a dropped output dies once the next layer has read it):
      C(i - 2) + sizes[i - 1] + sizes[i] + fwd_other_bytes[i];
    - backward of layer j, j in K: C(j) + bwd_other_bytes[j] (the outputs above j are freed, the
      segment below j is not regenerated yet);
    - backward of layer j, j not in K, k the checkpoint below it (-1: none): Rule 7 regenerates the whole
      segment k+1..t (t its top) when backward reaches t, each output living until its own backward, so
      C(k) + P(j) - P(k) + bwd_other_bytes[j].
    The peak is the largest of these 2n terms. ``*_other_bytes`` are the bytes that are no layer output
    (parameters, the batch, gradients). On tests.synthetic.chain_workload the model is exact: its peak is
    the simulator's for every checkpoint set (tests/test_solvers.py checks all of them).

    Assumption: fwd_other_bytes[i] <= bwd_other_bytes[i] for every i (backward holds at least what forward
    did, plus gradients). It makes every forward term inside a segment no larger than the backward term of
    the same layer, which is what lets the O(n) form skip them.

NOTE [ The recurrences ]
    G(k) is the peak of everything after checkpoint k (its own backward, the forward of k+1 and all later
    layers), minus C(k); the answer is G(-1) with the virtual checkpoint -1 of size 0:
        G(k) = max(own(k), min over the next checkpoint m > k, or none, of cost(k, m))
        own(k) = max(bwd_other[k], sizes[k+1] + fwd_other[k+1])
        cost(k, m) = max(max_{k < j < m} (P(j) + bwd_other[j]) - P(k),            (the segment k+1..m-1)
                         sizes[m] + max(G(m), sizes[m-1] + fwd_other[m] if m > k+1))  (m and beyond)
    "none" is m = n with the second term absent. The O(n^3) form evaluates every segment maximum by walking
    it. The O(n) form keeps the candidates m on a stack ordered by m, with a(m) = max_{k<j<m} (P(j) +
    bwd_other[j]) non-decreasing and b(m) (the second term) strictly decreasing down the stack (a candidate
    with a larger m and no smaller b is dominated for every earlier k). As k decreases, a grows by a common
    running maximum (the top entries it overtakes merge into one) and P(k) shrinks, so the crossing
    between a(m) - P(k) and b(m), where the minimum lies, only moves up the stack: a pointer finds it in
    amortised O(1).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, Status, register
from envs.simulator import SimResult
from runtime.vocab import KEEP, RECOMPUTE

_NONE = -1  # "no further checkpoint" in a choice table
_MAX_LAYERS = 256  # longer chains are coarsened (min_recompute_checkpoints is O(n^2 * labels) per bound)
_BISECTIONS = 12  # model bounds tried between the least and the largest model peak (budget-aware search)
_MAX_LABELS = 64  # Pareto labels kept per checkpoint in min_recompute_checkpoints (more: thinned)


@dataclass(frozen=True)
class ChainModel:
    """A chain of n layers for NOTE [ Chain memory model ]. Sizes in bytes."""

    sizes: tuple[int, ...]  # bytes of each layer's output (what a checkpoint keeps)
    fwd_other_bytes: tuple[int, ...]  # bytes that are no layer output, live during each layer's forward
    bwd_other_bytes: tuple[int, ...]  # the same during each layer's backward

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        fwd_other_bytes: Sequence[int] | None = None,
        bwd_other_bytes: Sequence[int] | None = None,
    ) -> ChainModel:
        """Validate and build; the other bytes default to 0."""
        n = len(sizes)
        fwd = tuple(int(x) for x in (fwd_other_bytes if fwd_other_bytes is not None else [0] * n))
        bwd = tuple(int(x) for x in (bwd_other_bytes if bwd_other_bytes is not None else [0] * n))
        if len(fwd) != n or len(bwd) != n:
            raise ValueError(f"ChainModel: {n} sizes but {len(fwd)} forward and {len(bwd)} backward other bytes")
        if any(int(s) < 0 for s in sizes):
            raise ValueError(f"ChainModel: negative layer size in {list(sizes)}")
        bad = [i for i in range(n) if fwd[i] > bwd[i]]
        if bad:
            i = bad[0]
            raise ValueError(
                f"ChainModel: fwd_other_bytes[{i}]={fwd[i]} > bwd_other_bytes[{i}]={bwd[i]}; the model assumes "
                "backward holds at least what forward does (NOTE [ Chain memory model ]): raise bwd_other_bytes"
            )
        return cls(tuple(int(s) for s in sizes), fwd, bwd)

    @property
    def n(self) -> int:
        return len(self.sizes)


def chain_peak_bytes(model: ChainModel, checkpoints: Collection[int]) -> int:
    """Peak of the chain with ``checkpoints`` kept, term by term (NOTE [ Chain memory model ])."""
    s, n = model.sizes, model.n
    keep = [False] * n
    for i in checkpoints:
        keep[i] = True
    ckpt_below = [0] * (n + 1)  # ckpt_below[i + 1] = C(i)
    for i in range(n):
        ckpt_below[i + 1] = ckpt_below[i] + (s[i] if keep[i] else 0)
    peak = 0
    for i in range(n):  # forward of layer i
        prev = s[i - 1] if i > 0 else 0
        peak = max(peak, ckpt_below[max(i - 1, 0)] + prev + s[i] + model.fwd_other_bytes[i])
    last, segment = -1, 0  # checkpoint below, bytes regenerated since it
    for j in range(n):  # backward of layer j
        if keep[j]:
            last, segment = j, 0
            peak = max(peak, ckpt_below[j + 1] + model.bwd_other_bytes[j])
        else:
            segment += s[j]
            peak = max(peak, ckpt_below[last + 1] + segment + model.bwd_other_bytes[j])
    return peak


def _prefix(model: ChainModel) -> tuple[list[int], list[int]]:
    """P(j) and Q(j) = P(j) + bwd_other[j], shifted by one so that index 0 is j = -1 (P = 0)."""
    p = [0]
    for x in model.sizes:
        p.append(p[-1] + x)
    q = [-math.inf] + [p[j + 1] + model.bwd_other_bytes[j] for j in range(model.n)]
    return p, q  # type: ignore[return-value]


def _own(model: ChainModel, k: int) -> float:
    """own(k) of NOTE [ The recurrences ]: checkpoint k's backward and layer k+1's forward, minus C(k)."""
    n, s = model.n, model.sizes
    terms = [model.bwd_other_bytes[k] if k >= 0 else -math.inf]
    if k + 1 < n:
        terms.append(s[k + 1] + model.fwd_other_bytes[k + 1])
    return max(terms)


def _next_term(model: ChainModel, g: list[float], k: int, m: int) -> float:
    """Second term of cost(k, m): checkpoint m and everything above it, minus C(k)."""
    s = model.sizes
    own_fwd = s[m - 1] + model.fwd_other_bytes[m] if m > k + 1 else -math.inf
    return s[m] + max(g[m + 1], own_fwd)


def _walk(choice: list[int], n: int) -> frozenset[int]:
    """The checkpoint set from a table of next checkpoints (index k + 1 holds the choice after k)."""
    out, k = [], -1
    while k < n - 1 and choice[k + 1] != _NONE:
        k = choice[k + 1]
        out.append(k)
    return frozenset(out)


def min_peak_checkpoints_cubic(model: ChainModel) -> tuple[int, frozenset[int]]:
    """Least peak and a checkpoint set attaining it: NOTE [ The recurrences ], every segment walked, O(n^3)."""
    n = model.n
    p, q = _prefix(model)
    g = [0.0] * (n + 1)  # g[k + 1] = G(k)
    choice = [_NONE] * (n + 1)
    for k in range(n - 1, -2, -1):
        best, arg = -math.inf if k == n - 1 else math.inf, _NONE
        for m in [*range(k + 1, n), n]:  # m = n: no further checkpoint
            seg = max((q[j + 1] for j in range(k + 1, m)), default=-math.inf) - p[k + 1]
            cost = seg if m == n else max(seg, _next_term(model, g, k, m))
            if cost < best:
                best, arg = cost, (m if m < n else _NONE)
        g[k + 1] = max(_own(model, k), best)
        choice[k + 1] = arg
    return int(g[0]), _walk(choice, n)


def min_peak_checkpoints_linear(model: ChainModel) -> tuple[int, frozenset[int]]:
    """The same answer as :func:`min_peak_checkpoints_cubic`, in amortised O(n) (NOTE [ The recurrences ])."""
    n = model.n
    p, q = _prefix(model)
    g = [0.0] * (n + 1)
    choice = [_NONE] * (n + 1)
    # The candidate stack, bottom first: next checkpoint m (n: none), a(m), b(m). Down the stack (towards
    # index 0) m grows, a does not decrease, b strictly decreases.
    ms: list[int] = [n]
    a: list[float] = [-math.inf]
    b: list[float] = [-math.inf]
    ptr = 0  # the lowest index whose b >= a - P(k): the crossing

    def cost(i: int, x: float) -> float:
        return max(a[i] - x, b[i])

    for k in range(n - 1, -2, -1):
        x = p[k + 1]
        if k < n - 1:
            # Candidate m = k + 1 becomes "m > k + 1" for this k: its forward term joins b.
            if ms[-1] == k + 2 and k + 2 < n:
                b[-1] = _next_term(model, g, k, k + 2)
            # The segment of every candidate now includes layer k + 1: a <- max(a, Q(k + 1)). The entries it
            # overtakes (a prefix from the top) all become equal; the deepest has the least b and survives.
            qk = q[k + 2]
            if a[-1] <= qk:
                while len(ms) >= 2 and a[-2] <= qk:
                    ms.pop(), a.pop(), b.pop()
                a[-1] = qk
            # New candidate m = k + 1 (empty segment); it dominates the entries with b no smaller.
            b_new = model.sizes[k + 1] + g[k + 2]
            while ms and b[-1] >= b_new:
                ms.pop(), a.pop(), b.pop()
            ms.append(k + 1)
            a.append(-math.inf)
            b.append(b_new)
        h = len(ms)
        ptr = min(ptr, h)
        while ptr > 0 and b[ptr - 1] >= a[ptr - 1] - x:  # only the top entry can have turned true
            ptr -= 1
        while ptr < h and b[ptr] < a[ptr] - x:
            ptr += 1
        best, arg = math.inf, _NONE
        for i in (ptr - 1, ptr):
            if 0 <= i < h and cost(i, x) < best:
                best, arg = cost(i, x), ms[i]
        g[k + 1] = max(_own(model, k), best)
        choice[k + 1] = arg if arg < n else _NONE
    return int(g[0]), _walk(choice, n)


def min_recompute_checkpoints(
    model: ChainModel, recompute_s: Sequence[float], bound_bytes: int
) -> tuple[float, frozenset[int]] | None:
    """Checkpoints of least recompute time (the sum of ``recompute_s`` over the other layers) whose model
    peak is at most ``bound_bytes``, or None if no set fits.

    Forward over the chain with Pareto labels (C(k), seconds) per checkpoint k: every term between two
    checkpoints is C(k) plus a constant, so a label with no smaller C and no smaller time is dominated, and
    the labels that fit a term are a prefix of those sorted by C. Exact while at most ``_MAX_LABELS``
    labels survive per checkpoint (beyond that, an evenly spaced subset of the front is kept)."""
    n, s, fwd = model.n, model.sizes, model.fwd_other_bytes
    p, q = _prefix(model)
    rsum = np.concatenate([[0.0], np.cumsum(np.asarray(recompute_s, dtype=np.float64))])
    # Labels arriving at checkpoint k (index k + 1): arrays C, seconds, previous checkpoint, its label index.
    arriving: list[list[tuple[np.ndarray, np.ndarray, int, np.ndarray]]] = [[] for _ in range(n + 1)]
    arriving[0] = [(np.zeros(1, dtype=np.int64), np.zeros(1), -2, np.full(1, -1))]
    fronts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None] = [None] * (n + 1)
    best: tuple[float, int, int] | None = None  # (seconds, last checkpoint, its label)
    for k in range(-1, n):
        if not arriving[k + 1]:
            continue
        c_all = np.concatenate([a[0] for a in arriving[k + 1]])
        t_all = np.concatenate([a[1] for a in arriving[k + 1]])
        prev_k = np.concatenate([np.full(len(a[0]), a[2]) for a in arriving[k + 1]])
        prev_i = np.concatenate([a[3] for a in arriving[k + 1]])
        arriving[k + 1] = []
        order = np.lexsort((t_all, c_all))
        c_all, t_all, prev_k, prev_i = c_all[order], t_all[order], prev_k[order], prev_i[order]
        running = np.minimum.accumulate(t_all)
        pareto = np.concatenate([[True], t_all[1:] < running[:-1]])  # strictly faster than every smaller C
        idx = np.flatnonzero(pareto)
        if len(idx) > _MAX_LABELS:
            idx = idx[np.unique(np.linspace(0, len(idx) - 1, _MAX_LABELS).round().astype(np.int64))]
        front = fronts[k + 1] = (c_all[idx], t_all[idx], prev_k[idx], prev_i[idx])
        c, t = front[0], front[1]
        own = _own(model, k)
        seg_max = -math.inf  # max Q(j) over the segment k+1..m-1
        for m in [*range(k + 1, n), n]:
            if m > k + 1:
                seg_max = max(seg_max, q[m])  # q[m] is Q(m - 1)
            tail = seg_max - p[k + 1]
            if c[0] + tail > bound_bytes:
                break  # the segment term only grows with m, and no label has a smaller C
            if m < n:
                tail = max(tail, s[m] + s[m - 1] + fwd[m] if m > k + 1 else s[m])
            fits = int(np.searchsorted(c, bound_bytes - max(own, tail), side="right"))
            if fits == 0:
                continue
            seconds = rsum[m] - rsum[k + 1]  # layers k+1..m-1 are recomputed
            if m == n:
                i = int(np.argmin(t[:fits]))
                if best is None or t[i] + seconds < best[0]:
                    best = (float(t[i] + seconds), k, i)
            else:
                arriving[m + 1].append((c[:fits] + s[m], t[:fits] + seconds, k, np.arange(fits)))
    if best is None:
        return None
    seconds, k, i = best
    out = []
    while k >= 0:
        out.append(k)
        came_from = fronts[k + 1]
        assert came_from is not None  # a label was built there
        k, i = int(came_from[2][i]), int(came_from[3][i])
    return seconds, frozenset(out)


# -- the searcher ---------------------------------------------------------------------------------------------
@dataclass
class Chain:
    """The workload seen as a chain: units of candidates in forward order, and the model over them."""

    units: list[list[int]]  # candidate indices of each layer
    model: ChainModel
    recompute_s: list[float]  # Rule 7 closure seconds of each unit's candidates
    exact: bool  # one candidate per unit, each reading only the previous one: a true chain


def chain_of(problem: Problem, max_layers: int = _MAX_LAYERS) -> Chain:
    """Layers are the runs of candidates between the *cuts*: candidates that no recompute dependency
    (``recompute_deps``) jumps over. On a chain every candidate is a cut; in a residual network the cuts
    are the block outputs, so a layer is a block. This is the approximation for graphs that are no chain:
    a kept layer keeps all its candidates, a recomputed one recomputes all of them. Beyond ``max_layers``
    layers, adjacent ones are merged (the lightest pair first)."""
    sim = problem.simulator
    feats = sim.features
    k = feats.k
    # Forward order by save_op, where a candidate's value is final (an in-place writer may come after its
    # producer allocated the storage: a residual sum written into a BatchNorm output, then ReLU'd).
    order = sorted(range(k), key=lambda i: (int(sim.save_op[i]), i))
    pos = {c: i for i, c in enumerate(order)}
    jumped = np.zeros(k + 1, dtype=np.int64)  # difference array over positions strictly inside an edge
    for c in range(k):
        for d in feats.recompute_deps[c]:
            lo, hi = sorted((pos[d], pos[c]))
            if hi - lo > 1:
                jumped[lo + 1] += 1
                jumped[hi] -= 1
    inside = np.cumsum(jumped)[:k]
    units: list[list[int]] = [[]]
    for i, c in enumerate(order):
        units[-1].append(c)
        if inside[i] == 0 and i < k - 1:
            units.append([])
    while len(units) > max_layers:  # the budget-aware family is O(n^2) per bound: merge the lightest pair
        i = min(range(len(units) - 1), key=lambda i: int(sim.size[units[i] + units[i + 1]].sum()))
        units[i : i + 2] = [units[i] + units[i + 1]]
    base = sim.base_live
    sizes, fwd, bwd, rec = [], [], [], []
    for unit in units:
        lo, hi = int(sim.producer[unit].min()), int(sim.save_op[unit].max())
        uses = sim.first_use[unit]
        first = int(uses.min()) if np.any(uses < sim.n_ops) else sim.n_ops - 1
        last = int(sim.free_keep[unit].max())
        sizes.append(int(sim.size[unit].sum()))
        f = int(base[lo : hi + 1].max())
        fwd.append(f)
        bwd.append(max(f, int(base[min(first, last) : last + 1].max())))  # the model needs bwd >= fwd
        rec.append(float(feats.recompute_s[unit].sum()))
    exact = all(len(u) == 1 for u in units) and all(
        feats.recompute_deps[units[i][0]] == ((units[i - 1][0],) if i else ()) for i in range(len(units))
    )
    return Chain(units, ChainModel.of(sizes, fwd, bwd), rec, exact)


def chain_actions(problem: Problem, chain: Chain, checkpoints: Collection[int]) -> np.ndarray:
    """Keep the candidates of the checkpoint layers, recompute all others."""
    actions = np.full(problem.n, RECOMPUTE, dtype=np.int8)
    for layer in checkpoints:
        actions[chain.units[layer]] = KEEP
    return actions


@register
class CheckpointDP(Searcher):
    """Least-peak checkpoints of a chain by dynamic programming (seed 001); budget-aware: of the checkpoint
    sets found for a range of memory bounds, the fastest whose simulated peak fits."""

    name = "checkpoint-dp"
    summary = "Hong et al.: least-peak checkpoint subset of a chain, O(n) dynamic programme"
    exact = True

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        if problem.n == 0:
            return Proposal(problem.keep_all(), note="no candidate: nothing to checkpoint")
        chain = chain_of(problem)
        model = chain.model
        least_peak, least_set = min_peak_checkpoints_linear(model)
        all_peak = chain_peak_bytes(model, range(model.n))
        # The family: the least-peak set, keep-all, and the least-recompute sets under model bounds between
        # them: the budget itself, then a bisection for the largest bound whose set the simulator accepts.
        sets: dict[frozenset[int], int] = {least_set: least_peak, frozenset(range(model.n)): all_peak}
        results: dict[frozenset[int], SimResult] = {}

        def fits(bound: int) -> bool:
            found = min_recompute_checkpoints(model, chain.recompute_s, bound)
            if found is None:
                return False
            ks = found[1]
            sets.setdefault(ks, chain_peak_bytes(model, ks))
            if ks not in results:
                results[ks] = problem.evaluate(chain_actions(problem, chain, ks))
            return results[ks].feasible

        fits(problem.budget_bytes)
        lo, hi = least_peak, max(least_peak, all_peak)
        for _ in range(_BISECTIONS):
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        for ks in sets:
            if ks not in results:
                results[ks] = problem.evaluate(chain_actions(problem, chain, ks))
        scored = [(results[ks], ks) for ks in sorted(sets, key=sorted)]
        fitting = [(r, ks) for r, ks in scored if r.feasible]
        if fitting:
            result, chosen = min(fitting, key=lambda rk: (rk[0].iter_s, rk[0].peak_bytes))
        else:
            result, chosen = min(scored, key=lambda rk: (rk[0].peak_bytes, rk[0].iter_s))
        model_peak = sets[chosen]
        agrees = chain.exact and result.peak_bytes == model_peak
        proved = agrees and model_peak == least_peak
        where = (
            f"{model.n} layers, {'an exact chain' if chain.exact else 'blocks between dependency cuts'}; "
            f"least model peak {least_peak} B, chosen set {sorted(chosen)} model {model_peak} B, "
            f"simulated {result.peak_bytes} B"
        )
        if proved:
            status = Status.OPTIMAL if result.feasible else Status.INFEASIBLE
            verdict = "least peak of the checkpoint model, confirmed by the simulator"
            if not result.feasible:
                verdict = "proved: no checkpoint set fits (least model peak, confirmed by the simulator, over budget)"
            return Proposal(chain_actions(problem, chain, chosen), status=status, gap=0.0, note=f"{verdict}; {where}")
        why = "model and simulator disagree" if not agrees else "fastest fitting set, not the least-peak one"
        return Proposal(chain_actions(problem, chain, chosen), note=f"{why}: status from the simulator; {where}")
