"""The op-by-op reference for :mod:`envs.simulator`: same rules, plain mechanics, for tests.

It walks every op in order with an explicit host clock, compute clock and copy-stream clocks and an explicit
set of live allocations, and regenerates recomputed tensors by walking their inputs at the moment they are
needed. It is slow (a Python loop over ops and tensors) and deliberately shares no code with
:class:`envs.simulator.Simulator` beyond the workload, the op and host times, the allocator rounding and the
choice of regions (runtime.plan, which the runtime shares too), so that their agreement on random policies
checks the fast one's bookkeeping. Rule numbers refer to NOTE [ Simulator semantics ].
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from runtime.hardware import HardwareProfile, host_times_s, op_times_s
from runtime.keys import runs_in
from runtime.plan import (
    RegionPlanner,
    as_run,
    compiled_replay_peak,
    held_outside,
    node_forward_end,
    node_uncached_casts,
    replay_copies,
)
from runtime.policy import PolicyOptions
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP, compressible, itemsize
from runtime.workload import Phase, TensorKind, Workload, rounded


def simulate_reference(
    w: Workload,
    hw: HardwareProfile,
    actions: Sequence[int],
    *,
    budget_bytes: int | None = None,
    options: PolicyOptions | None = None,
    allocations: list[Allocation] | None = None,
):  # type: ignore[no-untyped-def]
    """One iteration under ``actions``. ``allocations``, when given, receives every allocation and free of
    Rule 2's accounting in the order the walk makes them (envs.allocator.policy_requests replays them)."""
    from envs.simulator import SimResult, host_over  # the result type and the host side of Rule 2

    options = options or PolicyOptions()
    n, g = len(w.ops), hw.alloc_granularity_bytes
    op_s = op_times_s(w, hw)
    host_op = host_times_s(w, hw)
    hc, gpu = hw.host, hw.is_gpu
    compiled = bool(w.meta.get("compiled"))  # Rule 16: the twin of a compiled step
    h_kernel = hc.op_s if gpu else 0.0
    cands = w.candidates
    act = [int(a) for a in as_run(np.asarray(actions, dtype=np.int8), held_outside(w))]  # Rule 7: P11
    act = [  # Rule 8: only a floating-point tensor wider than the compression dtype is compressed, others kept
        KEEP if a == COMPRESS and not compressible(w.tensors[c.tensor].dtype, options.compress_dtype) else a
        for a, c in zip(act, cands, strict=True)
    ]
    cand_of = {c.tensor: i for i, c in enumerate(cands)}
    size = {t.id: rounded(t.nbytes, g) for t in w.tensors}
    free_keep: list[int] = [n - 1 if (f := w.tensors[c.tensor].free_op) is None else f for c in cands]
    first_use = [c.first_use(n) for c in cands]
    target = itemsize(options.compress_dtype)
    ratio = [max(1.0, itemsize(w.tensors[c.tensor].dtype) / target) for c in cands]
    pack_s = [hw.op_time_s(0.0, c.nbytes + c.nbytes / r, "fp32") for c, r in zip(cands, ratio, strict=True)]
    packed = [rounded(int(c.nbytes / r), g) for c, r in zip(cands, ratio, strict=True)]
    writers: dict[int, list[int]] = {}
    for op in w.ops:
        if op.phase == Phase.FORWARD:
            for out in op.outputs:
                if w.tensors[out].alloc_op != op.index:
                    writers.setdefault(out, []).append(op.index)
    if COMPRESS in act and RECOMPUTE in act:  # Rule 8, runtime/plan.py P12: what a replay reads is kept
        read = set()
        for ci in range(len(cands)):
            if act[ci] == RECOMPUTE:
                _, needed, remade = _closure(w, ci, cand_of, first_use[ci], writers)
                read |= needed | remade  # remade: live where a replay nested in an earlier one runs it
        act = [KEEP if a == COMPRESS and ci in read else a for ci, a in enumerate(act)]
    framed = bool(w.frames) and all(c.packs for c in cands) and not compiled  # Rule 16: no region compiled

    # Rule 11: regions, the candidates they serve, and what each one re-runs and holds.
    planner = RegionPlanner(w) if framed else None
    regions = planner.select(np.array(act, dtype=np.int8), options.region_nodes) if planner is not None else []
    frames = w.frames

    def within(f: int, region: int) -> bool:
        while f >= 0:
            if f == region:
                return True
            f = frames[f].parent
        return False

    served: set[int] = set()
    region_info = []
    for r in regions:
        assert planner is not None
        mine = planner.internal[r].tolist()
        served.update(mine)
        region_info.append(_region(w, r, mine, within, size, op_s, host_op, hc, options.region_nodes))
    handled = [a != KEEP and ci not in served for ci, a in enumerate(act)]

    # Rule 5: unpack points among the unserved, and when each copy back is issued.
    points = sorted({first_use[ci] for ci in range(len(cands)) if ci not in served and first_use[ci] < n})
    triggers: dict[int, list[int]] = {}  # issued in order of need: first backward use, then index
    carriers: set[int] = set()
    if gpu:
        for ci in sorted(range(len(cands)), key=lambda c: (first_use[c], c)):
            if act[ci] == SWAP and first_use[ci] < n:
                p = bisect.bisect_left(points, first_use[ci])
                at = points[max(0, p - options.prefetch_lookahead)]
                triggers.setdefault(at, []).append(ci)
                if options.prefetch_lookahead > 0:
                    carriers.update(c for c in range(len(cands)) if c not in served and first_use[c] == at)

    # Rule 13: observed packs; Rule 12: what they cost the host, where.
    host_at = [0.0] * (n + 1)
    device_at = [0.0] * (n + 1)
    overhead = 0.0
    pack_points: list[tuple[int, int]] = []  # (candidate, op of its first pack), in candidate order
    if framed:
        hooked = {f for ci in range(len(cands)) if handled[ci] or ci in carriers for f, _ in cands[ci].packs}

        seen_frames: dict[int, bool] = {}

        def observed(f: int) -> bool:
            if f not in seen_frames:
                seen_frames[f] = not any(within(f, r) for r in regions) and any(within(f, h) for h in hooked)
            return seen_frames[f]

        in_frame = [0] * len(frames)
        for ci, c in enumerate(cands):
            for j, (pf, after) in enumerate(c.packs):
                in_frame[pf] += 1
                if observed(pf):
                    host_at[after + 1] += hc.pack_s
                    host_at[min(first_use[ci], n)] += hc.unpack_s
                    overhead += hc.pack_s + hc.unpack_s
                    if j == 0:
                        pack_points.append((ci, after))
        first_bwd = next((op.index for op in w.ops if op.phase == Phase.BACKWARD), n)
        # Module calls with a hook: every call of a module one of whose calls is hooked or records.
        replaying = [ci for ci in range(len(cands)) if act[ci] == RECOMPUTE and ci not in served]
        record = {w.ops[op].frame for ci in replaying for op in _recorded(w, ci, cand_of, first_use, writers)}
        paths = {frames[fi].path for fi in hooked | record if fi >= 0}
        for frame in frames:
            if frame.path in paths:
                host_at[max(frame.first_op, 0)] += hc.frame_s
                overhead += hc.frame_s
        for frame in frames:
            others = max(0, frame.packs - in_frame[frame.index])
            if others and observed(frame.index):
                bwd = next((o.index for o in w.ops if o.phase == Phase.BACKWARD and o.module == frame.path), first_bwd)
                host_at[max(frame.first_op, 0)] += others * hc.pack_s
                host_at[bwd] += others * hc.unpack_s
                overhead += others * (hc.pack_s + hc.unpack_s)
    else:
        for ci, c in enumerate(cands):
            host_at[c.save_op + 1] += hc.pack_s
            host_at[min(first_use[ci], n)] += hc.unpack_s
            overhead += hc.pack_s + hc.unpack_s
            pack_points.append((ci, c.save_op))

    # Rule 12: the recorder, over the module calls whose ops a replay re-runs.
    replayed = [ci for ci in range(len(cands)) if act[ci] == RECOMPUTE and ci not in served]
    if replayed and hc.record_op_s > 0:
        recorded = [False] * n
        root = next((f for f in frames if f.path == "<root>"), None)
        for ci in replayed:
            for op in _recorded(w, ci, cand_of, first_use, writers):
                f = w.ops[op].frame
                if not framed:
                    for i in w.phase_range(Phase.FORWARD):
                        recorded[i] = True
                    break
                if f < 0:
                    continue
                lo, hi = frames[f].first_op, frames[f].last_op
                if f == 0:
                    lo = 0 if root is None or op < root.first_op else root.last_op + 1
                for i in range(lo, hi + 1):
                    recorded[i] = True
        for i in range(n):
            if recorded[i]:  # the op, and the quiet ops after it (Rule 12)
                host_at[i] += hc.record_op_s * (1 + w.ops[i].quiet_ops)
                overhead += hc.record_op_s * (1 + w.ops[i].quiet_ops)

    # Rule 4: release points of swapped tensors.
    handled_uses = [first_use[ci] for ci in range(len(cands)) if handled[ci] and first_use[ci] < n]
    first_handled = min(handled_uses, default=n)
    release_after: dict[int, int] = {}  # swapped candidate -> the op after which its bytes go
    release_before: dict[int, list[int]] = {}  # op before which the compute stream waits for these copies
    if gpu:
        order = [ci for ci, _ in pack_points]
        for ci in range(len(cands)):
            if act[ci] != SWAP:
                continue
            q = order.index(ci) + options.release_after
            if q < len(pack_points):
                release_after[ci] = pack_points[q][1]
                release_before.setdefault(pack_points[q][1] + 1, []).append(ci)
            else:
                release_after[ci] = first_handled - 1
                release_before.setdefault(first_handled, []).append(ci)

    # Fixed insertions: compress kernels, swaps' host costs, regions.
    for ci, c in enumerate(cands):
        if act[ci] == COMPRESS:
            device_at[c.save_op + 1] += pack_s[ci]
            host_at[c.save_op + 1] += h_kernel
        if act[ci] == SWAP:
            host_at[c.save_op + 1] += hc.swap_s
            overhead += hc.swap_s
            if not gpu:
                device_at[c.save_op + 1] += c.nbytes / hw.d2h_bytes_per_s
    stats = {"recompute": 0.0, "compress": sum(pack_s[ci] for ci in range(len(cands)) if act[ci] == COMPRESS)}
    stats["stall"] = 0.0 if gpu else sum(c.nbytes / hw.d2h_bytes_per_s for ci, c in enumerate(cands) if act[ci] == SWAP)
    for r, info in zip(regions, region_info, strict=True):
        host_at[max(frames[r].first_op, 0)] += info["own_s"]
        overhead += info["own_s"]
        if info["use"] < n:
            host_at[info["use"]] += info["own_s"] + info["rerun_host_s"]
            device_at[info["use"]] += info["rerun_s"]
            stats["recompute"] += info["rerun_s"]
            overhead += info["own_s"]

    uses: dict[int, list[int]] = {}
    for ci in range(len(cands)):
        if handled[ci] and first_use[ci] < n:
            uses.setdefault(first_use[ci], []).append(ci)
    for lst in uses.values():
        lst.sort(key=lambda ci: (cands[ci].unpack_seq, ci))  # Rule 7: in the order backward unpacks them

    # The walk.
    clock = {"host": 0.0, "dev": 0.0, "d2h": 0.0, "h2d": 0.0, "busy": 0.0}
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    fetched: dict[int, int] = {}
    materialized: dict[int, int] = {}
    cur = [0]  # the op the walk is at, for the allocations' record
    live: dict[tuple[str, int], int] = _Live(allocations, cur) if allocations is not None else {}
    ends: dict[tuple[str, int], int] = {}  # entries of live with their last op
    timeline: list[int] = []
    starts: list[float] = []
    held = 0
    replay_peak = 0
    transient = 0
    held_parts: list[int] = []  # the storages of ``held``, for the allocations' record
    held_ids: set[int] = set()  # ... by tensor id: a storage that nested recomputations both write, once
    ran_ids: set[int] = set()  # the ops they ran: an op that two of them run, once

    def block(host_s: float, device_s: float) -> None:
        """Work issued at once at this point (Rule 7's replays, Rule 8's unpacks, copies back)."""
        clock["busy"] += host_s
        if gpu:
            clock["host"] += host_s
            if device_s:
                clock["dev"] = max(clock["dev"], clock["host"]) + device_s
        else:
            clock["dev"] += host_s + device_s
            clock["host"] = clock["dev"]

    def wait(until: float) -> None:
        if until > clock["dev"]:
            stats["stall"] += until - clock["dev"]
            clock["dev"] = until

    def add(tag: str, ci: int, nbytes: int, last: int) -> None:
        live[(tag, ci)] = nbytes
        ends[(tag, ci)] = last

    def fetch(ci: int, i: int) -> None:
        nonlocal overhead
        fetched[ci] = i
        begin = max(clock["dev"], clock["h2d"], d2h_end[ci])
        clock["h2d"] = h2d_end[ci] = begin + cands[ci].nbytes / hw.h2d_bytes_per_s
        add("f", ci, size[cands[ci].tensor], free_keep[ci])
        overhead += hc.swap_s
        block(hc.swap_s, 0.0)

    def pack_copy(ci: int) -> None:
        """What the pack makes: a compressed candidate's packed form (Rule 8), a CPU swap's copy (Rule 4: the copy
        is device memory there)."""
        if act[ci] == COMPRESS:
            live[("p", ci)] = packed[ci]
        if act[ci] == SWAP and not gpu:
            add("c", ci, size[cands[ci].tensor], free_keep[ci])

    def instant(i: int, parts: list[int]) -> None:
        """Storages of ``parts`` bytes allocated and freed at once before op i, for the allocations' record (a
        recompute's temporaries: reused by the next op)."""
        if allocations is not None:
            handles = [-2 - 2 * n - j for j in range(len(parts))]
            allocations.extend(Allocation(i, h, z) for h, z in zip(handles, parts, strict=True))
            allocations.extend(Allocation(i, h, None) for h in handles)

    def materialize(ci: int, i: int) -> None:
        nonlocal held, overhead, held_parts, replay_peak
        if ci in materialized:
            return
        materialized[ci] = i
        c = cands[ci]
        if act[ci] == SWAP:
            if not gpu:
                return
            if ci not in fetched:
                fetch(ci, i)
            wait(h2d_end[ci])
        elif act[ci] == COMPRESS:  # Rule 8
            block(h_kernel, pack_s[ci])
            stats["compress"] += pack_s[ci]
            add("f", ci, size[c.tensor], free_keep[ci])
            replay_peak = max(replay_peak, sum(live.values()) + held)  # the packed form until the kernel is done
            live.pop(("p", ci), None)
        elif act[ci] == RECOMPUTE:  # Rule 7, walking the inputs now
            # As of now: maybe nested, before its use; what a region holds past its traced end is read as it is.
            closure, needed, _ = _closure(w, ci, cand_of, i, writers, extended)
            for dep in sorted(needed):
                if act[dep] != KEEP:
                    materialize(dep, i)
            ran = set(closure) - ran_ids
            ran_ids.update(ran)
            seconds = sum(op_s[j] for j in ran)
            host = sum(host_op[j] for j in ran) + len(ran) * hc.replay_op_s
            overhead += len(ran) * hc.replay_op_s
            block(host, seconds)
            stats["recompute"] += seconds
            add("f", ci, size[c.tensor], free_keep[ci])
            if compiled:  # Rule 16: its temporaries to their last reader in it, dropped when it is done
                own, parts = compiled_replay_peak(w, frozenset(closure), c.tensor, g)
                replay_peak = max(replay_peak, sum(live.values()) + own)
                if own:
                    instant(i, parts)
            else:  # R6: BN's stats copied; nested recomputations hold theirs until the outer one is done
                made = {x for j in closure for x in (*w.ops[j].outputs, *replay_copies(w, j))}
                temporaries = made - {c.tensor} - held_ids
                held_ids.update(temporaries)
                parts = [size[x] for x in sorted(temporaries)]
                held += sum(parts)
                held_parts = held_parts + parts

    for info in region_info:
        info["ends"] = {ci: (free_keep[ci] if last < 0 else last) for ci, last in info["regenerated"]}
    kept_end = list(free_keep)  # Rule 11: a kept output of a region, freed once nothing outside it reads it
    dropped_end = [c.free_if_dropped_op for c in cands]  # ... and a recomputed cast, by a node's forward
    for info in region_info:
        for ci, last in info["freed"].items():
            kept_end[ci] = min(kept_end[ci], last)
        for ci, last in info["uncached"].items():
            dropped_end[ci] = min(dropped_end[ci], last)
    for info in region_info:  # after every region's own: a node saves its arguments to its backward's end
        for ci, last in info["saved_args"].items():
            kept_end[ci] = max(kept_end[ci], last)

    uncached_plain = {tid: last for info in region_info for tid, last in info["uncached_plain"].items()}  # Rule 11
    extended: dict[int, int] = {}  # Rule 11: arguments a region holds, to their last op
    for info in region_info:
        for tid, last in info["held"]:
            extended[tid] = max(extended.get(tid, -1), last)
    in_place: set[int] = set()  # Rule 15: sums the runtime makes in the input it writes, which lives on
    as_traced = {j for info in region_info for j in info["out_of_place"]}  # ... not one with a term a node makes
    packed_in: dict[int, list[int]] = {}  # Rules 4, 8: op -> the candidates it packs as its own outputs
    for ci, c in enumerate(cands):
        if c.packed_in_op:
            packed_in.setdefault(c.save_op, []).append(ci)
    for op in w.ops:
        if op.in_place_into >= 0 and op.index not in as_traced:
            for tid in op.outputs:
                if w.tensors[tid].alloc_op == op.index:
                    in_place.add(tid)
                    free = w.tensors[tid].free_op
                    extended[op.in_place_into] = max(extended.get(op.in_place_into, -1), n if free is None else free)
    # What happens at each op, indexed once (the walk reads them in the same order as a scan would).
    copies_out: dict[int, list[int]] = {}  # Rule 4: the swapped candidates whose copy out starts before op i
    packs_before: dict[int, list[int]] = {}  # Rules 4, 8: the candidates packed once op i - 1 has ended
    for ci, c in enumerate(cands):
        if gpu and act[ci] == SWAP:
            copies_out.setdefault(c.save_op + 1, []).append(ci)
        if not c.packed_in_op:
            packs_before.setdefault(c.save_op + 1, []).append(ci)
    plain_free: dict[int, list[int]] = {}  # tensors no candidate is, by the op after which they go
    for t in w.tensors:
        if t.id not in cand_of:
            traced = uncached_plain.get(t.id, t.free_op if t.free_op is not None else n)
            plain_free.setdefault(max(traced, extended.get(t.id, -1)), []).append(t.id)
    cand_free: dict[int, list[tuple[int, int]]] = {}  # candidates' storages by the op after which they go:
    for ci, c in enumerate(cands):  # (candidate, 0 kept / 2 dropped / 3 swapped), 1 for a packed form (below)
        a = act[ci]
        if a == KEEP:
            cand_free.setdefault(kept_end[ci], []).append((ci, 0))
        if a in (RECOMPUTE, COMPRESS):
            cand_free.setdefault(dropped_end[ci], []).append((ci, 2))
        if a == SWAP:
            last = max(c.free_if_dropped_op, release_after[ci]) if gpu else c.free_if_dropped_op
            cand_free.setdefault(last, []).append((ci, 3))
    compressed = [ci for ci in range(len(cands)) if act[ci] == COMPRESS]
    for i, op in enumerate(w.ops):
        cur[0] = i
        transient = 0
        transient_parts: list[int] = []
        for ci in copies_out.get(i, []):
            begin = max(clock["dev"], clock["d2h"])  # Rule 4: the copy out, after op save_op
            clock["d2h"] = d2h_end[ci] = begin + cands[ci].nbytes / hw.d2h_bytes_per_s
        for ci in sorted(release_before.get(i, [])):
            wait(d2h_end[ci])
        for ci in triggers.get(i, []):
            if ci not in fetched:
                fetch(ci, i)
        for info in region_info:
            if info["use"] == i:  # Rule 11: the regenerated copies, and the recompute's own peak
                for ci, last in info["ends"].items():
                    add("r", ci, size[cands[ci].tensor], last)
                if info["transient"] > transient:
                    transient, transient_parts = info["transient"], info["transient_parts"]
        replay_peak = 0  # Rule 7: the most live while one replay at op i holds its temporaries
        for ci in uses.get(i, []):  # one after another: each with what those before it made, not those after
            held, held_parts = 0, []
            held_ids.clear()
            ran_ids.clear()
            materialize(ci, i)
            replay_peak = max(replay_peak, sum(live.values()) + held)
            if held:  # held during this replay, given back before the next one
                instant(i, held_parts)
        if i == 0:
            cur[0] = -1  # what exists before the iteration
            for t in w.tensors:
                if t.alloc_op < 0 and (t.free_op is None or t.free_op >= 0):
                    live[("t", t.id)] = size[t.id]
            cur[0] = 0
        recomputing = max(sum(live.values()) + transient, replay_peak)  # Rules 7, 11: before op i allocates outputs
        if transient:  # held during the region's recompute, given back before op i
            instant(i, transient_parts)
        for tid in op.outputs:
            if w.tensors[tid].alloc_op == i and tid not in in_place:
                live[("t", tid)] = size[tid]
        for ci in packs_before.get(i, []):  # Rules 4, 8: once op save_op has ended
            pack_copy(ci)
        # Op i on the clocks (Rule 1), after the fixed insertions before it.
        clock["busy"] += host_at[i] + host_op[i]
        if gpu:
            clock["host"] += host_at[i] + host_op[i]
            start = max(clock["dev"], clock["host"]) + device_at[i]
        else:
            start = clock["dev"] + host_at[i] + host_op[i] + device_at[i]
        starts.append(start)
        clock["dev"] = start + op_s[i]
        if not gpu:
            clock["host"] = clock["dev"]
        timeline.append(max(sum(live.values()) + op.workspace_bytes, recomputing))  # workspace: during the op
        if allocations is not None and op.workspace_bytes:
            allocations += [Allocation(i, -2 - n - i, op.workspace_bytes), Allocation(i, -2 - n - i, None)]
        packing = packed_in.get(i, [])
        for ci in packing:  # Rules 4, 8: op i packs its own output, its inputs still alive, its workspace gone
            pack_copy(ci)
        if packing:
            timeline[-1] = max(timeline[-1], sum(live.values()))

        # Releases after op i.
        for tid in plain_free.get(i, []):
            live.pop(("t", tid), None)
        for key in [key for key, last in ends.items() if last == i]:
            live.pop(key, None)
            del ends[key]
        unpacked = [(ci, 1) for ci in compressed if materialized.get(ci) == i]  # Rule 8: its kernel is done
        for ci, what in sorted(cand_free.get(i, []) + unpacked):
            live.pop(("p", ci) if what == 1 else ("t", cands[ci].tensor), None)

    end = max(clock["dev"], clock["host"])
    opt = w.phase_range(Phase.OPTIMIZER)
    t_opt_host = t_opt_dev = 0.0
    for i in opt:  # Rule 10: the optimizer ops alone, from idle
        if gpu:
            t_opt_host += host_op[i]
            t_opt_dev = max(t_opt_dev, t_opt_host) + op_s[i]
        else:
            t_opt_dev += host_op[i] + op_s[i]
    iter_s = end if w.grad_accum == 1 else w.grad_accum * (end - t_opt_dev) + t_opt_dev
    peak = max(timeline)
    swapped = sum(c.nbytes for ci, c in enumerate(cands) if act[ci] == SWAP)
    over = host_over(hw, swapped)
    return SimResult(
        peak_bytes=peak,
        iter_s=iter_s,
        samples_per_s=w.batch_size * w.grad_accum / iter_s,
        compute_s=sum(op_s),
        recompute_s=stats["recompute"],
        compress_s=stats["compress"],
        stall_s=stats["stall"],
        d2h_bytes=swapped,
        h2d_bytes=swapped if gpu else 0,
        feasible=(budget_bytes is None or peak <= budget_bytes) and not over,
        budget_bytes=budget_bytes,
        peak_op=timeline.index(peak),
        timeline={"op_start_s": starts, "live_bytes": [float(b) for b in timeline]},
        host_s=clock["busy"],
        overhead_s=overhead,
        regions=len(regions),
        host_over_bytes=over,
    )


class Allocation(NamedTuple):
    """One allocation (``nbytes``) or free (None) of the walk's accounting at op ``op``; ``handle`` names the
    storage (negative: a recompute's transient bytes or an op's workspace, allocated and freed at once);
    ``tensor``: the workload's tensor whose own bytes these are (-1: a copy, a packed form, a workspace)."""

    op: int
    handle: int
    nbytes: int | None
    tensor: int = -1


class _Live(dict[tuple[str, int], int]):
    """The walk's live set, telling ``sink`` each storage that enters and leaves it."""

    def __init__(self, sink: list[Allocation], cur: list[int]) -> None:
        super().__init__()
        self.sink, self.cur = sink, cur
        self.handles: dict[tuple[str, int], int] = {}
        self.next = 0

    def __setitem__(self, key: tuple[str, int], nbytes: int) -> None:
        if key not in self:
            self.handles[key] = self.next
            self.sink.append(Allocation(self.cur[0], self.next, nbytes, key[1] if key[0] == "t" else -1))
            self.next += 1
        super().__setitem__(key, nbytes)

    def pop(self, key: tuple[str, int], default: Any = None) -> Any:  # type: ignore[override]
        if key in self:
            self.sink.append(Allocation(self.cur[0], self.handles.pop(key), None))
        return super().pop(key, default)


def _closure(w, ci, cand_of, at, writers, held=None):  # type: ignore[no-untyped-def]
    """Rule 7: the ops re-run for candidate ``ci`` replayed just before op ``at``, its candidate inputs live there
    and those it re-makes, walking its inputs now. ``held``: tensor id -> the last op it is held to past its traced
    end (a region's arguments, Rule 11), resident until then."""
    c = w.candidates[ci]
    ran: set[int] = set(c.recompute_ops)
    pending = [(op, tid) for op in sorted(ran) for tid in w.ops[op].inputs]  # (reading op, tensor read)
    seen = {c.tensor}
    needed: set[int] = set()
    remade: set[int] = set()
    while pending:
        op, tid = pending.pop()
        if tid == c.tensor:
            continue
        info = w.tensors[tid]
        if info.alloc_op >= 0 and any(j > op for j in writers.get(tid, [])):
            # Written in place after this read: re-made as it was when read (its producer, the writers before).
            chain = [info.alloc_op, *[j for j in writers.get(tid, []) if j < op]]
        else:
            if tid in seen:
                continue
            seen.add(tid)
            if info.alloc_op < 0 or info.free_op is None or info.free_op >= at or (held or {}).get(tid, -1) >= at:
                if tid in cand_of:  # live at the use: materialized as its action says
                    needed.add(cand_of[tid])
                continue
            if tid in cand_of:
                remade.add(cand_of[tid])
            chain = [info.alloc_op, *writers.get(tid, [])]
        fresh = [j for j in chain if j not in ran]
        ran.update(chain)
        pending.extend((j, x) for j in fresh for x in w.ops[j].inputs)
    return ran, needed, remade


def _recorded(w, ci, cand_of, first_use, writers):  # type: ignore[no-untyped-def]
    """Rule 12: the ops whose module calls the recorder runs in for candidate ``ci``'s replay: its closure's, and
    the forward ops that write in place, after a closure op read it, what it read (runtime R11)."""
    ran = _closure(w, ci, cand_of, first_use[ci], writers)[0]
    later = {j for op in ran for tid in w.ops[op].inputs for j in writers.get(tid, []) if j > op}
    return sorted(ran | later)


def _parts(sizes: list[int], total: int) -> list[int]:
    """Storages summing to ``total``: the temporaries live at a recompute's peak (``sizes``, largest first)
    until they reach it, the last one cut; one more if they fall short."""
    out, left = [], total
    for z in sizes:
        if left <= 0:
            break
        out.append(min(z, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return out


def _region(w, r, mine, within, size, op_s, host_op, hc, nodes):  # type: ignore[no-untyped-def]
    """Rule 11 for region ``r`` (one node, or checkpointed): when it recomputes, what it re-runs and what it
    holds, walked op by op."""
    frame, n = w.frames[r], len(w.ops)
    path = frame.path
    owned = {op.index for op in w.ops if op.phase == Phase.BACKWARD and runs_in(op.module, path)}
    # Rule 15: a sum with a term the node makes is PyTorch's, in a new tensor, made in autograd's buffer once
    # the node has returned: not one of its ops.
    out_of_place = {
        op.index
        for op in w.ops
        if nodes
        and op.in_place_into >= 0
        and (op.index in owned or any(w.tensors[t].alloc_op in owned for t in op.inputs))
    }
    owned -= out_of_place
    inside = [ci for ci, c in enumerate(w.candidates) if any(within(f, r) for f, _ in c.packs)]
    if nodes:  # the node's backward starts before the call's first backward op and re-runs the whole call
        use = min(owned, default=n)
        rerun = list(range(frame.first_op, max(frame.first_op, frame.last_op) + 1))
    else:  # checkpoint: at the first unpack, up to the last op that saved something inside
        # The first unpack by a node of the call: where a node starts, before its first op (Candidate.first_use)
        use = n
        for ci in inside:
            c = w.candidates[ci]
            u = c.first_use(n)
            use = min(use, u if u in owned else min((b for b in c.bwd_uses if b in owned), default=n))
        last_pack = max(op for ci in inside for f, op in w.candidates[ci].packs if within(f, r))
        rerun = list(range(frame.first_op, max(frame.first_op, min(last_pack, frame.last_op)) + 1))
    regenerated = []
    freed = {}  # kept outputs: the original's last op, the call's own uses left out (they read the copy)
    uncached = {}  # recomputed ones a node's forward lets go earlier than traced (a weight's cast)
    # ... and casts no op saves (a bias's): tensor id -> the last op it lives to
    uncached_plain = node_uncached_casts(w, frame.first_op, frame.last_op) if nodes else {}
    for ci in inside:
        c = w.candidates[ci]
        if not frame.first_op <= c.producer <= frame.last_op:
            continue
        if ci in mine:
            regenerated.append((ci, -1))
            if nodes and (gone := node_forward_end(w, ci, frame.last_op)) < c.free_if_dropped_op:
                uncached[ci] = gone
        else:
            own = [b for b in c.bwd_uses if b in owned]
            regenerated.append((ci, max(own) if own else use))
            if all(b < use for b in c.bwd_uses if b not in owned):
                freed[ci] = max(c.free_if_dropped_op, use - 1)
    regen = {w.candidates[ci].tensor for ci, _ in regenerated}
    cand_tensors = {c.tensor for c in w.candidates}
    made = 0
    temps: dict[int, int] = {}  # tensor -> bytes, live during the re-run
    peak = 0
    at_peak: tuple[int, list[int]] = (0, [])  # (regenerated bytes made, temporaries' bytes) at the peak
    for j in rerun:
        for tid in w.ops[j].outputs:
            t = w.tensors[tid]
            if t.alloc_op != j:
                continue
            if tid in regen:
                made += size[tid]
            elif tid in cand_tensors:
                if nodes:
                    temps[tid] = size[tid]  # a candidate made again that nothing inside saves: to the re-run's end
            elif t.free_op is None or t.free_op >= j:
                temps[tid] = size[tid]
        if made + sum(temps.values()) > peak:
            peak, at_peak = made + sum(temps.values()), (made, sorted(temps.values(), reverse=True))
        for tid in [tid for tid in temps if w.tensors[tid].free_op == j and tid not in cand_tensors]:
            del temps[tid]
    total = sum(size[w.candidates[ci].tensor] for ci, _ in regenerated)
    last_bwd = max(owned, default=-1)
    held = [
        (tid, last_bwd)
        for tid in sorted(set(frame.args) - {-1} - cand_tensors)
        if w.tensors[tid].free_op is not None and w.tensors[tid].free_op < last_bwd
    ]
    # A node saves its candidate arguments (kept: plan P4) until its backward returns.
    saved_args = {ci: last_bwd for ci, c in enumerate(w.candidates) if nodes and c.tensor in frame.args}

    # Gradients into the call's backward (from a backward op outside it) and out of it to an op that frees
    # them outside it or adds them into an existing gradient live until it is done.
    def accumulates(j: int) -> bool:
        op = w.ops[j]
        return op.phase == Phase.BACKWARD and any(
            w.tensors[o].kind == TensorKind.GRADIENT and w.tensors[o].alloc_op != j for o in op.outputs
        )

    for tid, t in enumerate(w.tensors):
        if not nodes or t.free_op is None or t.free_op >= last_bwd or t.alloc_op < 0:
            continue
        made_outside = w.ops[t.alloc_op].phase == Phase.BACKWARD and t.alloc_op not in owned
        read_inside = any(tid in w.ops[j].inputs for j in owned)
        goes_out = t.alloc_op in owned and (t.free_op not in owned or accumulates(t.free_op))
        if (made_outside and read_inside) or goes_out:
            held.append((tid, last_bwd))
    packs = sum(f.packs for f in w.frames if within(f.index, r))
    own_s = hc.region_s + (0.0 if nodes else hc.region_pack_s * packs)
    return {
        "use": use,
        "rerun_s": sum(op_s[j] for j in rerun),
        "rerun_host_s": sum(host_op[j] for j in rerun),
        "own_s": own_s,
        "transient": max(0, peak - total),
        "transient_parts": _parts(at_peak[1], max(0, peak - total)),
        "regenerated": regenerated,
        "freed": freed,
        "uncached": uncached,
        "uncached_plain": uncached_plain,
        "saved_args": saved_args,
        "held": held,
        "out_of_place": out_of_place,
    }
