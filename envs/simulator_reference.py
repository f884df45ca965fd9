"""The op-by-op reference for :mod:`envs.simulator`: same rules, plain mechanics, for tests.

It walks every op in order with explicit stream clocks and an explicit set of live allocations, and
regenerates recomputed tensors by walking their inputs at the moment they are needed. It is slow (a Python
loop over ops and tensors) and deliberately shares no code with :class:`envs.simulator.Simulator` beyond
the workload, the op times and the allocator rounding, so that their agreement on random policies checks
the fast one's vectorised bookkeeping. Rule numbers refer to NOTE [ Simulator semantics ].
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from envs.simulator import COMPRESS, KEEP, RECOMPUTE, SWAP, SimResult, _itemsize, accumulated_s, optimizer_s
from runtime.hardware import HardwareProfile, op_times_s
from runtime.policy import PolicyOptions
from runtime.workload import Phase, Workload, rounded

_TARGET_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def simulate_reference(
    w: Workload,
    hw: HardwareProfile,
    actions: Sequence[int],
    *,
    budget_bytes: int | None = None,
    options: PolicyOptions | None = None,
) -> SimResult:
    options = options or PolicyOptions()
    n, g = len(w.ops), hw.alloc_granularity_bytes
    op_s = op_times_s(w, hw)
    cands = w.candidates
    act = [int(a) for a in actions]
    cand_of = {c.tensor: i for i, c in enumerate(cands)}
    size = {t.id: rounded(t.nbytes, g) for t in w.tensors}
    free_keep = [n - 1 if w.tensors[c.tensor].free_op is None else w.tensors[c.tensor].free_op for c in cands]
    first_use = [c.bwd_uses[0] if c.bwd_uses else n for c in cands]
    target = _TARGET_ITEMSIZE[options.compress_dtype]
    ratio = [max(1.0, _itemsize(w.tensors[c.tensor].dtype) / target) for c in cands]
    pack_s = [hw.op_time_s(0.0, c.nbytes + c.nbytes / r, "fp32") for c, r in zip(cands, ratio, strict=True)]
    packed = [rounded(int(c.nbytes / r), g) for c, r in zip(cands, ratio, strict=True)]
    writers: dict[int, list[int]] = {}
    for op in w.ops:
        if op.phase == Phase.FORWARD:
            for out in op.outputs:
                if w.tensors[out].alloc_op != op.index:
                    writers.setdefault(out, []).append(op.index)

    # Rule 5: unpack points and prefetch triggers.
    points = sorted({u for u in first_use if u < n})
    triggers: dict[int, list[int]] = {}  # issued in order of need: first backward use, then index
    for ci in sorted(range(len(cands)), key=lambda c: (first_use[c], c)):
        if act[ci] == SWAP and first_use[ci] < n:
            p = bisect.bisect_left(points, first_use[ci])
            triggers.setdefault(points[max(0, p - options.prefetch_lookahead)], []).append(ci)
    uses: dict[int, list[int]] = {}
    for ci, a in enumerate(act):
        if a != KEEP and first_use[ci] < n:
            uses.setdefault(first_use[ci], []).append(ci)

    live: dict[tuple[str, int], int] = {}  # ("t", tensor) device storage, ("f", cand) copy back, ("p", cand)
    t = 0.0
    d2h_free = h2d_free = 0.0
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    awaiting_copy: set[int] = set()  # swapped candidates the program has dropped, copy maybe still running
    materialized: dict[int, int] = {}  # candidate -> op at which it was materialized
    stats = {"recompute": 0.0, "compress": 0.0, "stall": 0.0}
    transient = 0  # the largest held bytes of one top-level recompute at this op
    held = 0  # held bytes of the recompute in progress (nested ones add up)
    timeline: list[int] = []
    starts: list[float] = []

    def issue_h2d(ci: int, now: float) -> float:
        """Issue the copy back at ``now``; returns the time compute resumes."""
        nonlocal h2d_free
        live[("f", ci)] = size[cands[ci].tensor]
        duration = w.candidates[ci].nbytes / hw.h2d_bytes_per_s
        if not hw.is_gpu:  # Rule 1: a copy on the compute stream
            h2d_end[ci] = now + duration
            stats["stall"] += duration
            return now + duration
        begin = max(now, h2d_free, d2h_end[ci])
        h2d_free = h2d_end[ci] = begin + duration
        return now

    def materialize(ci: int, now: float, i: int) -> float:
        nonlocal held
        if ci in materialized:
            return now
        materialized[ci] = i
        c = cands[ci]
        if act[ci] == SWAP:  # Rule 6
            if ci not in h2d_end:
                now = issue_h2d(ci, now)
            if h2d_end[ci] > now:
                stats["stall"] += h2d_end[ci] - now
                now = h2d_end[ci]
        elif act[ci] == COMPRESS:  # Rule 8
            now += pack_s[ci]
            stats["compress"] += pack_s[ci]
            live[("f", ci)] = size[c.tensor]
        elif act[ci] == RECOMPUTE:  # Rule 7, walking the inputs now
            ran: set[int] = set(c.recompute_ops)
            pending = list(c.recompute_inputs)
            seen = {c.tensor}
            needed: set[int] = set()  # candidates among the inputs: materialized first, in candidate order
            while pending:
                tid = pending.pop()
                if tid in seen:
                    continue
                seen.add(tid)
                if tid in cand_of:
                    needed.add(cand_of[tid])
                    continue
                info = w.tensors[tid]
                if info.alloc_op < 0 or info.free_op is None or info.free_op >= first_use[ci]:
                    continue
                chain = [info.alloc_op, *writers.get(tid, [])]
                ran.update(chain)
                pending.extend(x for op in chain for x in w.ops[op].inputs)
            for dep in sorted(needed):
                if act[dep] != KEEP:
                    now = materialize(dep, now, i)
            held += sum(size[x] for x in {x for j in ran for x in w.ops[j].outputs} - {c.tensor})
            seconds = sum(op_s[j] for j in ran)
            now += seconds
            stats["recompute"] += seconds
            live[("f", ci)] = size[c.tensor]
        return now

    for i, op in enumerate(w.ops):
        transient = 0
        for ci in triggers.get(i, []):
            if ci not in h2d_end:
                t = issue_h2d(ci, t)
        for ci in uses.get(i, []):
            held = 0
            t = materialize(ci, t, i)
            transient = max(transient, held)
        for ci in sorted(awaiting_copy):  # Rule 4: released at the first op starting after the copy
            if d2h_end[ci] <= t:
                awaiting_copy.discard(ci)
                del live[("t", cands[ci].tensor)]
        if i == 0:
            for info in w.tensors:
                if info.alloc_op < 0 and (info.free_op is None or info.free_op >= 0):
                    live[("t", info.id)] = size[info.id]
        recomputing = sum(live.values()) + transient  # Rule 7: before op i allocates its outputs
        for tid in op.outputs:
            if w.tensors[tid].alloc_op == i:
                live[("t", tid)] = size[tid]
        for ci, c in enumerate(cands):
            if act[ci] == COMPRESS and c.save_op == i:
                live[("p", ci)] = packed[ci]
        starts.append(t)
        timeline.append(max(sum(live.values()) + op.workspace_bytes, recomputing))  # workspace: during the op
        t += op_s[i]

        # After op i: the swap copies and pack kernels of tensors saved here (Rules 4, 8) ...
        copies_end = t
        for ci, c in enumerate(cands):
            if c.save_op == i and act[ci] == SWAP:
                duration = c.nbytes / hw.d2h_bytes_per_s
                if not hw.is_gpu:  # Rule 1: on the compute stream, complete when compute resumes
                    d2h_end[ci] = t
                    copies_end += duration
                    stats["stall"] += duration
                    continue
                begin = max(t, d2h_free)
                d2h_free = d2h_end[ci] = begin + duration
        t = copies_end
        for ci, c in enumerate(cands):
            if c.save_op == i and act[ci] == COMPRESS:
                t += pack_s[ci]
                stats["compress"] += pack_s[ci]
        # ... then releases.
        for info in w.tensors:
            if info.free_op == i and info.id not in cand_of:
                live.pop(("t", info.id), None)
        for ci, c in enumerate(cands):
            if act[ci] == KEEP and free_keep[ci] == i:
                live.pop(("t", c.tensor), None)
            if act[ci] != KEEP and free_keep[ci] == i:
                live.pop(("f", ci), None)
            if act[ci] == COMPRESS and materialized.get(ci) == i:
                live.pop(("p", ci), None)
            if act[ci] in (RECOMPUTE, COMPRESS) and c.free_if_dropped_op == i:
                live.pop(("t", c.tensor), None)
            if act[ci] == SWAP and c.free_if_dropped_op == i:
                awaiting_copy.add(ci)

    peak = max(timeline)
    swapped = sum(c.nbytes for ci, c in enumerate(cands) if act[ci] == SWAP)
    compute_s = sum(op_s)
    t = accumulated_s(w, t, optimizer_s(w, np.asarray(op_s, dtype=np.float64)))  # Rule 10
    return SimResult(
        peak_bytes=peak,
        iter_s=t,
        samples_per_s=w.batch_size * w.grad_accum / t,
        compute_s=compute_s,
        recompute_s=stats["recompute"],
        compress_s=stats["compress"],
        stall_s=stats["stall"],
        d2h_bytes=swapped,
        h2d_bytes=swapped,
        feasible=budget_bytes is None or peak <= budget_bytes,
        budget_bytes=budget_bytes,
        peak_op=timeline.index(peak),
        timeline={"op_start_s": starts, "live_bytes": [float(b) for b in timeline]},
    )
