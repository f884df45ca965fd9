"""Simulate one training iteration under a keep / swap / recompute / compress policy, in about a millisecond.

NOTE [ Simulator semantics ] -- the runtime (runtime/apply.py) implements the same rules; cite them by number.

Rule 1 (streams). One compute stream runs the workload's ops in traced order, each taking
    ``runtime.hardware.op_times_s``. A device-to-host (D2H) and a host-to-device (H2D) copy stream each run
    their copies one at a time in the order issued, concurrently with compute and with each other (PCIe is
    full duplex, GPUs have a copy engine per direction). A copy of n bytes takes n / ``d2h_bytes_per_s``
    (or ``h2d_bytes_per_s``). On a profile without copy engines (``is_gpu`` false: the CPU, where "swap"
    moves bytes to a host store) copies run on the compute stream instead: each delays compute by its
    duration (counted as ``stall_s``) and is complete when compute resumes.
Rule 2 (memory). Memory is counted per op: the live bytes *during* op i are all allocations whose op
    interval [first, last] contains i; every allocation is rounded up to ``alloc_granularity_bytes``. Tensors
    that are not candidates keep their traced intervals [alloc_op, free_op]. An op's workspace (cuDNN,
    cuBLAS; measured by real CUDA traces) is live during that op alone. The peak is the maximum over ops;
    the policy is feasible when the peak is within the budget.
Rule 3 (keep). A kept candidate lives [producer, free_op], as traced.
Rule 4 (swap out). A swapped candidate's D2H copy is issued when op ``save_op`` ends (the pack hook: its value
    is final). Its device storage is released at the first op boundary where both the program has dropped
    it (after ``free_if_dropped_op``) and the copy has completed, i.e. it lives [producer, max(
    free_if_dropped_op, j - 1)] with j the first op that starts at or after the copy's end. (PyTorch's
    caching allocator reuses a block used by a side stream only once that stream's work is done.)
Rule 5 (prefetch). The unpack points U are the distinct first-backward-use ops of all candidates, sorted
    (the runtime's unpack hook fires there). The H2D copy of a swapped candidate whose first backward use is
    U[p] is issued just before op U[max(0, p - L)] runs, L = ``prefetch_lookahead`` (L = 0: on demand);
    copies due at the same op are issued in order of need (first backward use, then candidate index). A copy
    starts once the H2D stream is free and its own D2H copy has completed. Its device buffer is allocated
    at issue: it lives [issue op, free_op].
Rule 6 (stall). Before its first backward use u, the compute stream waits until a swapped tensor has
    arrived; the waiting is ``stall_s``.
Rule 7 (recompute). A recomputed candidate lives [producer, free_if_dropped_op]. Just before its first
    backward use u, the compute stream re-runs its closure: its producer chain (producer and in-place
    writers) and, recursively, the chains of its inputs that are not resident at u, where resident means
    persistent, live at u as traced (tensors that are not candidates), or a kept candidate. Candidate inputs
    that are swapped, recomputed or compressed are materialized first (Rules 6-8, in candidate order), at
    u, so their memory starts at u and lasts to their own free_op (they are not recomputed twice). The
    regenerated tensor lives [u, free_op]. Every other storage the closure's ops write (regenerated
    temporaries, other outputs of multi-output ops, copies of arguments an op would mutate) is held during
    the recompute only: nested recomputations hold theirs until the outermost one is done, separate ones at
    the same op run one after another. The recompute runs before op u allocates its own outputs, so the
    live bytes of op u are the larger of (live during u) and (live during u, less u's own allocations, plus
    the largest recompute's held bytes). Its time is the sum of the closure's op times (``recompute_s``).
Rule 8 (compress). A compressed candidate is cast to ``compress_dtype`` when ``save_op`` ends, by a kernel on
    the compute stream that reads n bytes and writes n / r (r = element size ratio, at least 1). The full
    storage lives [producer, free_if_dropped_op], the packed one [save_op, u]; just before u an unpack
    kernel (reads n / r, writes n) re-creates it, living [u, free_op]. Both kernels are ``compress_s``.
Rule 9 (time). ``iter_s`` is when the compute stream finishes: compute + recompute + compress + stall.
    ``samples_per_s`` = batch size / ``iter_s``.
Rule 10 (gradient accumulation). With ``grad_accum`` k > 1 the workload is one micro-batch that adds to
    existing gradients, then the optimizer step (NOTE [ Gradient accumulation ] in runtime.trace). The peak
    is the traced one; the iteration runs everything before the optimizer phase k times and the step once:
    ``iter_s`` = k (t - t_opt) + t_opt, with t Rule 9's time and t_opt the optimizer ops' compute time
    (nothing of a policy happens there), and ``samples_per_s`` = k x batch size / ``iter_s``.

Two implementations share these rules: :class:`Simulator` (vectorised, precomputed closures, for search)
and :func:`simulate_reference` (op by op with an explicit live set, for tests). They must agree exactly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from runtime.hardware import HardwareProfile, op_times_s
from runtime.policy import Action, Policy, PolicyOptions
from runtime.workload import Phase, Workload, memory_timeline, rounded, workspace_bytes

KEEP, SWAP, RECOMPUTE, COMPRESS = 0, 1, 2, 3
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass
class SimResult:
    """One simulated iteration. Times in seconds, sizes in bytes."""

    peak_bytes: int
    iter_s: float
    samples_per_s: float
    compute_s: float
    recompute_s: float
    compress_s: float
    stall_s: float
    d2h_bytes: int
    h2d_bytes: int
    feasible: bool
    budget_bytes: int | None
    peak_op: int
    timeline: dict[str, list[float]] | None = field(default=None, repr=False)  # op_start_s, live_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.timeline is None:
            d.pop("timeline")
        return d


def _itemsize(dtype: str) -> int:
    sizes = {"float64": 8, "float32": 4, "int64": 8, "int32": 4, "bool": 1, "uint8": 1, "int8": 1}
    return sizes.get(dtype, _ITEMSIZE.get(dtype, 4))


def _as_vector(w: Workload, policy: Policy | Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(policy, Policy):
        return policy.to_vector(w)
    vec = np.asarray(policy, dtype=np.int8)
    if vec.shape != (len(w.candidates),):
        raise ValueError(f"action vector of shape {vec.shape}, expected ({len(w.candidates)},)")
    return vec


def accumulated_s(w: Workload, t: float, optimizer_s: float) -> float:
    """Rule 10: the time of ``w.grad_accum`` micro-batches and one optimizer step, from one of each (``t``)."""
    return t if w.grad_accum == 1 else w.grad_accum * (t - optimizer_s) + optimizer_s


def optimizer_s(w: Workload, op_s: np.ndarray) -> float:
    """Compute time of the optimizer ops (Rule 10)."""
    ops = w.phase_range(Phase.OPTIMIZER)
    return float(op_s[ops.start : ops.stop].sum())


class Simulator:
    """Scores policies for one workload on one hardware profile (NOTE [ Simulator semantics ])."""

    def __init__(self, w: Workload, hw: HardwareProfile) -> None:
        self.w, self.hw = w, hw
        n = self.n_ops = len(w.ops)
        g = hw.alloc_granularity_bytes
        self.op_s = np.asarray(op_times_s(w, hw), dtype=np.float64)
        self.op_start_s = np.concatenate([[0.0], np.cumsum(self.op_s)[:-1]])
        self.compute_s = float(self.op_s.sum())
        self.optimizer_s = optimizer_s(w, self.op_s)
        cands = w.candidates
        self.k = k = len(cands)
        cand_of_tensor = {c.tensor: i for i, c in enumerate(cands)}
        self._cand_of_tensor = cand_of_tensor

        # Rule 2: tensors that are not candidates, as traced.
        self.base_live = memory_timeline(w, g, exclude=cand_of_tensor)  # workspaces included
        self.workspace = workspace_bytes(w)
        self.base_alloc = np.zeros(n, dtype=np.int64)  # bytes of non-candidate outputs each op allocates
        for t in w.tensors:
            if t.id not in cand_of_tensor and t.alloc_op >= 0 and (t.free_op is None or t.free_op >= t.alloc_op):
                self.base_alloc[t.alloc_op] += rounded(t.nbytes, g)

        self.size = np.array([rounded(c.nbytes, g) for c in cands], dtype=np.int64)
        self.nbytes = np.array([c.nbytes for c in cands], dtype=np.float64)
        self.producer = np.array([c.producer for c in cands], dtype=np.int64)
        self.save_op = np.array([c.save_op for c in cands], dtype=np.int64)
        self.drop = np.array([c.free_if_dropped_op for c in cands], dtype=np.int64)
        self.free_keep = np.array(
            [n - 1 if w.tensors[c.tensor].free_op is None else w.tensors[c.tensor].free_op for c in cands],
            dtype=np.int64,
        )
        # A candidate no backward op reads is never materialized: its first use is "after the end".
        self.first_use = np.array([c.bwd_uses[0] if c.bwd_uses else n for c in cands], dtype=np.int64)
        self.unpack_points = sorted({int(u) for u in self.first_use if u < n})
        self._u_pos = [bisect.bisect_left(self.unpack_points, int(u)) for u in self.first_use]
        self.sync_copies = not hw.is_gpu  # Rule 1
        self.d2h_s = self.nbytes / hw.d2h_bytes_per_s
        self.h2d_s = self.nbytes / hw.h2d_bytes_per_s
        self.closure_ops: list[frozenset[int]] = []  # Rule 7: the ops re-run to regenerate each candidate
        self._closures = [self._closure(i) for i in range(k)]
        self._compress_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        needed = np.flatnonzero(self.first_use < n)
        self._need_order = needed[np.lexsort((needed, self.first_use[needed]))]
        self._first_use_list = self.first_use.tolist()
        self._op_start_list = self.op_start_s.tolist()
        self._triggers: dict[int, np.ndarray] = {}

    def _trigger_ops(self, lookahead: int) -> np.ndarray:
        """Rule 5: the op before which each candidate's H2D copy is issued, for one look-ahead."""
        if lookahead not in self._triggers:
            up = np.array([*self.unpack_points, self.n_ops], dtype=np.int64)
            pos = np.array(self._u_pos, dtype=np.int64)
            self._triggers[lookahead] = up[np.maximum(0, pos - lookahead)]
        return self._triggers[lookahead]

    # -- Rule 7: static recompute closures ----------------------------------------------------------------
    def _closure(self, ci: int) -> tuple[float, int, tuple[int, ...]]:
        """(recompute seconds, transient bytes, candidate dependencies) of candidate ``ci``."""
        w, g = self.w, self.hw.alloc_granularity_bytes
        c = w.candidates[ci]
        u = int(self.first_use[ci])
        ops: set[int] = set(c.recompute_ops)
        deps: list[int] = []
        transient = 0
        stack = list(c.recompute_inputs)
        seen = {c.tensor}
        while stack:
            tid = stack.pop()
            if tid in seen:
                continue
            seen.add(tid)
            if tid in self._cand_of_tensor:
                deps.append(self._cand_of_tensor[tid])
                continue
            t = w.tensors[tid]
            if t.alloc_op < 0 or t.free_op is None or t.free_op >= u:
                continue  # resident: persistent, or still live at u as traced
            chain = [t.alloc_op, *self._writers(tid)]
            ops.update(chain)
            stack.extend(i for op in chain for i in w.ops[op].inputs)
        # Every storage the replayed ops write, but the target: regenerated temporaries, other outputs of
        # multi-output ops (BatchNorm's statistics), copies of arguments an op would mutate.
        self.closure_ops.append(frozenset(ops))
        outputs = {tid for op in ops for tid in w.ops[op].outputs} - {c.tensor}
        transient = sum(rounded(w.tensors[tid].nbytes, g) for tid in outputs)
        return float(self.op_s[sorted(ops)].sum()), transient, tuple(sorted(deps))

    def _writers(self, tid: int) -> list[int]:
        if not hasattr(self, "_writers_of"):
            writers: dict[int, list[int]] = {}
            for op in self.w.ops:
                if op.phase != Phase.FORWARD:
                    break
                for out in op.outputs:
                    if self.w.tensors[out].alloc_op != op.index:
                        writers.setdefault(out, []).append(op.index)
            self._writers_of = writers
        return self._writers_of.get(tid, [])

    def _compression(self, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(packed sizes, seconds of one pack or unpack kernel) per candidate (Rule 8)."""
        if dtype not in self._compress_cache:
            g, hw = self.hw.alloc_granularity_bytes, self.hw
            target = _ITEMSIZE[dtype]
            packed, cost = [], []
            for c in self.w.candidates:
                ratio = max(1.0, _itemsize(self.w.tensors[c.tensor].dtype) / target)
                packed.append(rounded(int(c.nbytes / ratio), g))
                cost.append(hw.op_time_s(0.0, c.nbytes + c.nbytes / ratio, "fp32"))
            self._compress_cache[dtype] = (np.array(packed, dtype=np.int64), np.array(cost))
        return self._compress_cache[dtype]

    # -- one evaluation -----------------------------------------------------------------------------------
    def run(
        self,
        policy: Policy | Sequence[int] | np.ndarray,
        *,
        budget_bytes: int | None = None,
        options: PolicyOptions | None = None,
        timeline: bool = False,
    ) -> SimResult:
        w, n = self.w, self.n_ops
        act = _as_vector(w, policy)
        if options is None:
            options = policy.options if isinstance(policy, Policy) else PolicyOptions()
        lookahead = max(0, int(options.prefetch_lookahead))
        packed, pack_s = self._compression(options.compress_dtype)
        insert = np.zeros(n + 1)  # seconds the compute stream spends before op i beyond the traced ops

        # Rule 8: pack kernels after save_op.
        comp = np.flatnonzero(act == COMPRESS)
        np.add.at(insert, self.save_op[comp] + 1, pack_s[comp])
        compress_s = float(pack_s[comp].sum())

        # Rule 4: D2H copies, FIFO in issue order. end_j = C_j + max_{m<=j}(issue_m - C_{m-1}).
        swp = np.flatnonzero(act == SWAP)
        swp = swp[np.lexsort((swp, self.save_op[swp]))]
        start_fwd = self.op_start_s + np.cumsum(insert)[:n]
        issue = start_fwd[self.save_op[swp]] + self.op_s[self.save_op[swp]]
        d2h_end = np.zeros(self.k)
        stall_s = 0.0
        if self.sync_copies:  # Rule 1: on the compute stream, done when compute resumes
            d2h_end[swp] = issue
            np.add.at(insert, self.save_op[swp] + 1, self.d2h_s[swp])
            stall_s = float(self.d2h_s[swp].sum())
        else:
            csum = np.cumsum(self.d2h_s[swp])
            d2h_end[swp] = csum + np.maximum.accumulate(issue - (csum - self.d2h_s[swp])) if len(swp) else csum

        # Rules 5-8 in backward: a walk over the ops where something happens.
        mat_op = [-1] * self.k  # op at which a dropped candidate is materialized again
        fetch_op = [-1] * self.k  # op at which a swapped candidate's H2D copy was issued
        h2d_end = [-1.0] * self.k
        extra: dict[int, int] = {}  # transient recompute bytes before an op (Rule 7)
        held = [0]  # transient bytes of the recomputation in progress
        # Candidates in order of need (first backward use, then index); Rule 5's trigger op is monotone in
        # that order, so issues and uses merge without sorting.
        order = self._need_order
        uses = order[act[order] != KEEP].tolist()
        fetches = order[act[order] == SWAP].tolist()
        trigger = self._trigger_ops(lookahead).tolist()
        first_use = self._first_use_list
        cum_insert = np.cumsum(insert)
        delay = float(cum_insert[n])  # every forward insertion precedes every backward event
        h2d_free = 0.0
        recompute_s = 0.0
        sync = self.sync_copies
        d2h = d2h_end.tolist()
        h2d_dur = self.h2d_s.tolist()
        actl = act.tolist()
        closures = self._closures
        unpack_cost = pack_s.tolist()
        op_start = self._op_start_list
        bwd_insert: dict[int, float] = {}

        def issue_h2d(ci: int, t: float, op: int) -> float:
            """Issue the copy back at time t; returns the compute time it takes (Rule 1, sync copies)."""
            nonlocal h2d_free, stall_s
            fetch_op[ci] = op
            if sync:
                h2d_end[ci] = t + h2d_dur[ci]
                stall_s += h2d_dur[ci]
                return h2d_dur[ci]
            begin = max(t, h2d_free, d2h[ci])
            h2d_free = h2d_end[ci] = begin + h2d_dur[ci]
            return 0.0

        def materialize(ci: int, op: int, t: float) -> float:
            nonlocal stall_s, recompute_s, compress_s
            if mat_op[ci] >= 0:
                return t
            mat_op[ci] = op  # first, so that a cycle through in-place writers cannot recurse forever
            a = actl[ci]
            if a == SWAP:
                if fetch_op[ci] < 0:
                    t += issue_h2d(ci, t, op)
                if h2d_end[ci] > t:
                    stall_s += h2d_end[ci] - t
                    t = h2d_end[ci]
            elif a == COMPRESS:
                t += unpack_cost[ci]
                compress_s += unpack_cost[ci]
            elif a == RECOMPUTE:
                seconds, transient, deps = closures[ci]
                for d in deps:
                    if actl[d] != KEEP:
                        t = materialize(d, op, t)
                t += seconds
                recompute_s += seconds
                held[0] += transient  # nested recomputations hold theirs until the outer one is done
            return t

        nf, f = len(fetches), 0
        for ci in uses:
            op = first_use[ci]
            while f < nf and trigger[fetches[f]] <= op:  # H2D issues due before this use (Rule 5)
                cf = fetches[f]
                f += 1
                if fetch_op[cf] < 0:
                    top = trigger[cf]
                    spent = issue_h2d(cf, op_start[top] + delay, top)
                    if spent:
                        bwd_insert[top] = bwd_insert.get(top, 0.0) + spent
                        delay += spent
            t = op_start[op] + delay
            held[0] = 0
            t_after = materialize(ci, op, t)
            if held[0] > extra.get(op, 0):  # separate recomputations at one op run one after the other
                extra[op] = held[0]
            if t_after > t:
                bwd_insert[op] = bwd_insert.get(op, 0.0) + (t_after - t)
                delay += t_after - t

        iter_s = accumulated_s(w, self.compute_s + delay, self.optimizer_s)
        # Rule 4: release op of each swapped storage, from op start times with every insertion.
        if bwd_insert:
            ops_idx = np.fromiter(bwd_insert.keys(), dtype=np.int64)
            np.add.at(insert, ops_idx, np.fromiter(bwd_insert.values(), dtype=np.float64))
            cum_insert = np.cumsum(insert)
        op_start_all = op_start + cum_insert[:n]
        rel = np.maximum(self.drop[swp], np.searchsorted(op_start_all, d2h_end[swp], side="left") - 1)

        # Rule 2: candidate intervals.
        keep = np.flatnonzero(act == KEEP)
        rec = np.flatnonzero(act == RECOMPUTE)
        mat = np.array(mat_op, dtype=np.int64)
        fet = np.array(fetch_op, dtype=np.int64)
        never = n  # a tensor never materialized in backward starts "after the end"
        starts = [self.producer[keep], self.producer[swp], self.producer[rec], self.producer[comp]]
        ends = [self.free_keep[keep], rel, self.drop[rec], self.drop[comp]]
        sizes = [self.size[keep], self.size[swp], self.size[rec], self.size[comp]]
        for group, first in ((swp, fet), (rec, mat), (comp, mat)):
            at = first[group]
            starts.append(np.where(at < 0, never, at))
            ends.append(self.free_keep[group])
            sizes.append(self.size[group])
        cm = mat[comp]
        starts.append(self.save_op[comp])
        ends.append(np.where(cm < 0, n - 1, cm))
        sizes.append(packed[comp])
        s_all, e_all, z_all = np.concatenate(starts), np.concatenate(ends), np.concatenate(sizes)
        ok = s_all <= e_all
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, s_all[ok], z_all[ok])
        np.add.at(delta, e_all[ok] + 1, -z_all[ok])
        live = self.base_live + np.cumsum(delta[:n])
        for op, b in extra.items():  # Rule 7: the recompute runs before op u allocates its own outputs
            live[op] = max(live[op], live[op] - self.base_alloc[op] - self.workspace[op] + b)
        peak_op = int(np.argmax(live))
        peak = int(live[peak_op])
        swapped_bytes = int(self.nbytes[swp].sum())
        return SimResult(
            peak_bytes=peak,
            iter_s=iter_s,
            samples_per_s=w.batch_size * w.grad_accum / iter_s,
            compute_s=self.compute_s,
            recompute_s=recompute_s,
            compress_s=compress_s,
            stall_s=stall_s,
            d2h_bytes=swapped_bytes,
            h2d_bytes=swapped_bytes,
            feasible=budget_bytes is None or peak <= budget_bytes,
            budget_bytes=budget_bytes,
            peak_op=peak_op,
            timeline={"op_start_s": op_start_all.tolist(), "live_bytes": live.tolist()} if timeline else None,
        )


def simulate(
    w: Workload,
    hw: HardwareProfile,
    policy: Policy | Sequence[int] | np.ndarray,
    *,
    budget_bytes: int | None = None,
    options: PolicyOptions | None = None,
    timeline: bool = False,
) -> SimResult:
    """One-off simulation; build a :class:`Simulator` once to score many policies."""
    return Simulator(w, hw).run(policy, budget_bytes=budget_bytes, options=options, timeline=timeline)


ACTION_CODES = {Action.KEEP: KEEP, Action.SWAP: SWAP, Action.RECOMPUTE: RECOMPUTE, Action.COMPRESS: COMPRESS}


def uniform_actions(w: Workload, action: Action) -> np.ndarray:
    """The same action for every candidate, as ``autotune simulate --action`` means it.

    For ``recompute``, block inputs (``Candidate.block_input``) are kept: recomputing them too would, by
    Rule 7, regenerate the whole forward at the first backward use and save nothing. Keeping them is what
    ``torch.utils.checkpoint`` on every block does."""
    vec = np.full(len(w.candidates), ACTION_CODES[action], dtype=np.int8)
    if action == Action.RECOMPUTE:
        vec[[i for i, c in enumerate(w.candidates) if c.block_input]] = KEEP
    return vec
