"""The simulator's event walk (NOTE [ Simulator semantics ], Rules 1, 4-8 and 12), its live bytes (Rule 2) and
the host and compute seconds a policy adds before ops (Rules 8, 12, 13), compiled.

:meth:`envs.simulator.Simulator.run` computes everything that does not depend on the order of events with
array operations, then walks the events of backward (and of forward, where a release point waits for a copy)
one by one: the host and compute clocks, the copy streams, and what each first use materializes. That walk
is the one part that cannot be vectorised, and in Python it took most of an evaluation's time (about 70% on
ResNet-101 for a random policy). :func:`walk` is written in the subset of Python that numba compiles
(numbers, NumPy arrays, loops) and is compiled once on first use, its machine code cached next to this file
(``cache=True``), so later processes load it in milliseconds; so are :func:`live_bytes`, the memory count
that follows the walk, and :func:`host_adds`, which precedes it: about a hundred small array operations in
NumPy (which packs are observed, which module calls hooked, which ops recorded), a quarter of an
evaluation's time.

Each function is the only implementation of its part: with ``NUMBA_DISABLE_JIT=1`` it runs as plain Python, much more
slowly, which is how to step through it in a debugger. The op-by-op reference
(envs/simulator_reference.py) stays the independent check of all three.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from numba.extending import register_jitable

# Event kinds, in the order they happen at one op (Simulator.run: keys 4 x op + kind).
COPY_OUT, RELEASE, COPY_BACK, USE = 0, 1, 2, 3


def walk(
    pos: np.ndarray,
    kind: np.ndarray,
    cis: np.ndarray,
    n: int,
    hcum: np.ndarray,
    dcum: np.ndarray,
    reach: np.ndarray,
    begin_at: int,
    at_start: bool,
    ih: float,
    ed: float,
    compress_s: float,
    recompute_s: float,
    sync: bool,
    timeline: bool,
    act: np.ndarray,
    row_bounds: np.ndarray,
    row_from: np.ndarray,
    deps_ptr: np.ndarray,
    deps_idx: np.ndarray,
    rec_device: np.ndarray,
    rec_transient: np.ndarray,
    temp_ptr: np.ndarray,
    temp_idx: np.ndarray,
    temp_bytes: np.ndarray,
    n_tensors: int,
    drop_nested: bool,
    ops_ptr: np.ndarray,
    ops_idx: np.ndarray,
    op_s: np.ndarray,
    host_op_s: np.ndarray,
    replay_op_s: float,
    rec_own: np.ndarray,
    rec_host: np.ndarray,
    unpack_cost: np.ndarray,
    h2d_dur: np.ndarray,
    d2h_dur: np.ndarray,
    d2h_end: np.ndarray,
    h_op: float,
    swap_host: float,
    keep: int,
    swap: int,
    recompute: int,
    compress: int,
    cand_size: np.ndarray,
    packed_size: np.ndarray,
    extra: np.ndarray,
    moved: np.ndarray,
    floors: np.ndarray,
) -> tuple[float, float, float, float, float, float, float, int, int]:
    """Walk the events ``pos`` (op before which each happens, in order), ``kind`` and ``cis`` (candidate), then
    the end at op ``n``.

    Between two ops with events the clocks advance over the segment of ops in between (Rule 1): ``hcum`` and
    ``dcum`` are the host's and the compute stream's cumulative seconds before each op, ``reach`` each op's
    (when the host has issued it, less the compute before it); the walk starts at op ``begin_at``, at its
    events there first where ``at_start``; ``compress_s`` and ``recompute_s`` are those before the walk,
    added to in order. ``d2h_end`` holds each swapped candidate's copy-out end where forward was settled
    before the walk, and receives those the walk issues. A recomputed candidate's closure is a *row*
    (``row_bounds``, ``row_from``: :func:`_row`), and the closures' arrays (``deps_ptr`` to ``rec_host``) are
    per row. Writes, per op, what its recomputes hold above the candidates made there (``extra``, Rule 7:
    replays one after another, each holding its temporaries with what the ones before made, less all that the
    op's replays make, ``cand_size`` bytes each; nested ones hold theirs until the outer one is done, or with
    ``drop_nested`` (Rule 16, a compiled step) each its own ``rec_transient`` with what was made before it and
    itself; Rule 8: an unpack holds its packed form, ``packed_size``, until its kernel has made the full one),
    each candidate made again in backward and where (``moved``: candidate, op, ...) and, with ``timeline``,
    the clocks after the events at each op (``floors``: op, host, device rows).

    Returns (host clock, compute clock, stall, host's dynamic work, its runtime part, compress seconds,
    recompute seconds, entries written to ``moved``, rows written to ``floors``).
    """
    k = act.shape[0]
    mat_op = np.zeros(k, dtype=np.bool_)  # materialized (Rules 6-8)
    fetched = np.zeros(k, dtype=np.bool_)  # its copy back issued (Rule 5)
    h2d_end = np.zeros(k, dtype=np.float64)
    items = np.empty(k, dtype=np.int64)  # what one expansion materializes, in order (Rule 7)
    item_rows = np.empty(k, dtype=np.int64)  # ... and the closure row of each recomputed one
    stack = np.empty(k, dtype=np.int64)
    stack_row = np.empty(k, dtype=np.int64)
    stack_at = np.empty(k, dtype=np.int64)
    held_at = np.full(n_tensors, -1, dtype=np.int64)  # the event whose recompute holds each storage (Rule 7)
    ran_at = np.full(n, -1, dtype=np.int64)  # ... and the event whose recompute ran each op
    stall_s = 0.0
    host_dyn = 0.0
    own_dyn = 0.0  # the runtime's own part of it (copies back, replays)
    d2h_free = 0.0
    h2d_free = 0.0
    n_moved = 0
    n_floors = 0
    use_at = -1  # the op of the last replays (Rule 7): what they made so far, and the most held with it
    made_at = 0
    top_at = 0
    prev = begin_at  # where the segment being walked starts
    at = begin_at if at_start else -1
    n_events = pos.shape[0]
    for e in range(n_events + 1):
        if e < n_events:
            x = pos[e]
            ev = kind[e]
            ci = cis[e]
        else:  # the end, as an event of no kind: the walk reads the last segment's clocks there
            x = n
            ev = 4
            ci = -1
        if x != at:  # Rule 1 over the ops since the last event, none inside
            if timeline and at >= 0:
                floors[n_floors, 0] = at
                floors[n_floors, 1] = ih
                floors[n_floors, 2] = ed
                n_floors += 1
            hp, dp, hn, dn = hcum[prev], dcum[prev], hcum[x], dcum[x]
            top = reach[prev] if prev < x else 0.0  # the largest reach in the segment
            for i in range(prev + 1, x):
                if reach[i] > top:
                    top = reach[i]
            prev = x
            if sync:
                ed = ed + (hn - hp) + (dn - dp)
                ih = ed
            else:
                e_dev, e_host = ed - dp, ih - hp + top
                ih = ih + hn - hp
                ed = dn + (e_dev if e_dev > e_host else e_host)
            at = x
        if ev == USE:  # Rules 6-8 at x: dynamic work issued as blocks (Rule 12), the device running each after
            if mat_op[ci]:
                continue
            if x != use_at:
                if use_at >= 0:
                    extra[use_at] = top_at - made_at
                use_at, made_at, top_at = x, 0, 0
            ready = act[ci] != recompute
            r = -1
            if not ready:  # recomputed: ready when its candidate inputs are kept or there already
                ready = True
                r = _row(ci, x, row_bounds, row_from)
                for j in range(deps_ptr[r], deps_ptr[r + 1]):
                    d = deps_idx[j]
                    if not mat_op[d] and act[d] != keep:
                        ready = False
                        break
            if ready:
                mat_op[ci] = True
                items[0] = ci
                item_rows[0] = r
                n_items = 1
            else:
                n_items = _expand(
                    ci, x, act, row_bounds, row_from, deps_ptr, deps_idx, keep, recompute, mat_op, items, item_rows,
                    stack, stack_row, stack_at,
                )  # fmt: skip
            held = 0  # nested recomputations hold theirs until the outer one is done
            for i in range(n_items):
                c = items[i]
                a = act[c]
                if a == swap:
                    if sync:
                        continue
                    if not fetched[c]:
                        own_dyn += swap_host
                        fetched[c] = True
                        moved[n_moved] = c
                        moved[n_moved + 1] = x
                        n_moved += 2
                        made_at += cand_size[c]
                        h2d_free = _copy_back(c, ed, h2d_free, d2h_end, h2d_dur, h2d_end)
                        host_dyn += swap_host
                        ih += swap_host
                    until = h2d_end[c]
                    if until > ed:
                        stall_s += until - ed
                        ed = until
                    continue
                if a == compress:
                    host = h_op
                    device = unpack_cost[c]
                    compress_s += device
                elif n_items == 1:
                    r = item_rows[i]
                    device = rec_device[r]
                    own_dyn += rec_own[r]
                    host = rec_host[r]
                    recompute_s += device
                    held += rec_transient[r]
                else:  # nested: an op that two of them run runs once, a storage they write is made once (R6)
                    r = item_rows[i]
                    device = 0.0
                    host = 0.0
                    for j in range(ops_ptr[r], ops_ptr[r + 1]):
                        o = ops_idx[j]
                        if ran_at[o] != e:
                            ran_at[o] = e
                            device += op_s[o]
                            host += host_op_s[o] + replay_op_s
                            own_dyn += replay_op_s
                    recompute_s += device
                    if drop_nested:  # Rule 16: each holds its own, with what was made before it and itself
                        if made_at + cand_size[c] + rec_transient[r] > top_at:
                            top_at = made_at + cand_size[c] + rec_transient[r]
                    else:
                        for j in range(temp_ptr[r], temp_ptr[r + 1]):
                            t = temp_idx[j]
                            if held_at[t] != e:
                                held_at[t] = e
                                held += temp_bytes[j]
                moved[n_moved] = c
                moved[n_moved + 1] = x
                n_moved += 2
                made_at += cand_size[c]
                if a == compress:  # Rule 8: its packed form, held by what ran here before it, and to its kernel's end
                    top_at += packed_size[c]
                    if made_at + held + packed_size[c] > top_at:
                        top_at = made_at + held + packed_size[c]
                host_dyn += host
                if sync:
                    ed += host + device
                    ih = ed
                else:
                    ih += host
                    if device:
                        if ih > ed:
                            ed = ih
                        ed += device
            if made_at + held > top_at:
                top_at = made_at + held
        elif ev == COPY_BACK:
            if not fetched[ci]:  # Rule 5: the copy back, issued as a block of no device work
                own_dyn += swap_host
                fetched[ci] = True
                h2d_free = _copy_back(ci, ed, h2d_free, d2h_end, h2d_dur, h2d_end)
                host_dyn += swap_host  # (not on the CPU: no copies there)
                ih += swap_host
        elif ev == RELEASE:
            until = d2h_end[ci]
            if until > ed:
                stall_s += until - ed
                ed = until
        elif ev == COPY_OUT:
            begin = ed if ed > d2h_free else d2h_free
            d2h_free = begin + d2h_dur[ci]
            d2h_end[ci] = d2h_free
    if use_at >= 0:
        extra[use_at] = top_at - made_at
    if timeline and at >= 0:
        floors[n_floors, 0] = at
        floors[n_floors, 1] = ih
        floors[n_floors, 2] = ed
        n_floors += 1
    return ih, ed, stall_s, host_dyn, own_dyn, compress_s, recompute_s, n_moved, n_floors


@register_jitable
def _copy_back(
    ci: int, ed: float, h2d_free: float, d2h_end: np.ndarray, h2d_dur: np.ndarray, h2d_end: np.ndarray
) -> float:
    """Rule 5: candidate ``ci``'s copy back, issued with the compute stream at ``ed``: it starts once its copy
    out has ended, the compute stream is there and the H2D stream is free; its end is written to ``h2d_end``
    and returned (the H2D stream is free from then)."""
    begin = d2h_end[ci]
    if ed > begin:
        begin = ed
    if h2d_free > begin:
        begin = h2d_free
    h2d_end[ci] = begin + h2d_dur[ci]
    return float(h2d_end[ci])


@register_jitable
def _row(ci: int, x: int, row_bounds: np.ndarray, row_from: np.ndarray) -> int:
    """Rule 7: the row of candidate ``ci``'s closure as of a replay just before op ``x``: the last of its rows
    (runtime.plan.nested_closures; ``row_bounds[2 ci]:row_bounds[2 ci + 1]``) that holds from ``x`` or before."""
    r = row_bounds[2 * ci + 1] - 1
    while r > row_bounds[2 * ci] and row_from[r] > x:
        r -= 1
    return r


@register_jitable  # plain Python called from Python, compiled into walk where walk is compiled
def _expand(
    ci: int,
    x: int,
    act: np.ndarray,
    row_bounds: np.ndarray,
    row_from: np.ndarray,
    deps_ptr: np.ndarray,
    deps_idx: np.ndarray,
    keep: int,
    recompute: int,
    mat_op: np.ndarray,
    items: np.ndarray,
    item_rows: np.ndarray,
    stack: np.ndarray,
    stack_row: np.ndarray,
    stack_at: np.ndarray,
) -> int:
    """Rule 7: what materializing recomputed ``ci`` just before op ``x`` materializes, written to ``items`` in
    order, each recomputed one's closure row (as of ``x``) to ``item_rows`` (returns how many): its candidate
    inputs that are not kept (recursively, in candidate order), then itself; depth first, by an explicit stack."""
    n_items = 0
    mat_op[ci] = True  # first, so that a cycle through in-place writers cannot recurse forever
    stack[0] = ci
    stack_row[0] = _row(ci, x, row_bounds, row_from)
    stack_at[0] = deps_ptr[stack_row[0]]
    depth = 1
    while depth:
        top = stack[depth - 1]
        tr = stack_row[depth - 1]
        j = stack_at[depth - 1]
        if j == deps_ptr[tr + 1]:  # its inputs done: itself
            items[n_items] = top
            item_rows[n_items] = tr
            n_items += 1
            depth -= 1
            continue
        stack_at[depth - 1] = j + 1
        d = deps_idx[j]
        if not mat_op[d] and act[d] != keep:
            mat_op[d] = True
            if act[d] == recompute:
                stack[depth] = d
                stack_row[depth] = _row(d, x, row_bounds, row_from)
                stack_at[depth] = deps_ptr[stack_row[depth]]
                depth += 1
            else:
                items[n_items] = d
                item_rows[n_items] = -1
                n_items += 1
    return n_items


@functools.cache
def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by numba (once per process; its machine code is cached on disk)."""
    import numba

    return numba.njit(cache=True, nogil=True)(fn)  # type: ignore[no-any-return]


def compiled() -> Callable[..., Any]:
    """:func:`walk`, compiled."""
    return _jit(walk)


def live_bytes(
    n: int,
    act: np.ndarray,
    handled: np.ndarray,
    served: np.ndarray,
    regions: bool,
    copies: bool,
    swapping: bool,
    sync: bool,
    swp: np.ndarray,
    release_op: np.ndarray,
    trigger_all: np.ndarray,
    moved: np.ndarray,
    n_moved: int,
    size_f: np.ndarray,
    keep_end: np.ndarray,
    drop_end: np.ndarray,
    drop: np.ndarray,
    producer: np.ndarray,
    save_op: np.ndarray,
    keep_end_from_save: np.ndarray,
    free_keep: np.ndarray,
    first_use: np.ndarray,
    used: np.ndarray,
    packed_f: np.ndarray,
    in_op: np.ndarray,
    ws: np.ndarray,
    region_at: np.ndarray,
    region_w: np.ndarray,
    live_keep_delta: np.ndarray,
    extra: np.ndarray,
    alloc_ws: np.ndarray,
    keep: int,
    swap: int,
    compress: int,
) -> np.ndarray:
    """Rule 2: the live bytes during each op under the policy, as changes to keep-all's (``live_keep_delta``,
    op to op): each candidate not kept holds its storage to ``free_if_dropped_op`` (a swapped one to its
    release point ``release_op``, in ``swp``'s order; without copy engines its copy [save_op + 1, free_op]); what
    is made again in backward (copied back, regenerated, unpacked: at its first use, its copy back's trigger
    op, or where ``moved`` says) to its free op; a compressed one's packed bytes [save_op + 1, its unpack - 1]
    (at the unpack, in ``extra``); the
    regions' intervals (``region_at``, ``region_w``); and, Rules 7 and 11, the recompute held before op u
    allocates its own outputs (``extra``). A copy or packed form made inside op save_op (``in_op``: the op
    packs its own output) is also live during that op once its workspace (``ws``) is gone (Rules 4, 8).
    Byte counts are exact in float64, so the order of the sums is free. An interval that ends before it
    starts holds nothing (its end moves to just before its start)."""
    k = act.shape[0]
    delta = np.zeros(n + 1)
    packing = np.zeros(n)  # Rules 4, 8: made inside op save_op, after its kernel
    bop = first_use.copy()
    made = np.zeros(k, dtype=np.bool_)
    for ci in range(k):
        a = act[ci]
        if a == keep:
            continue
        z = size_f[ci]
        delta[keep_end[ci]] += z  # not kept: storage until free_if_dropped_op
        delta[drop_end[ci]] -= z
        if copies and a == swap:
            bop[ci] = trigger_all[ci]
        made[ci] = handled[ci] and used[ci] and not (sync and swapping and a == swap)  # Rule 4: no copy back
    for j in range(swp.shape[0]):
        ci = swp[j]
        z = size_f[ci]
        if copies:  # ... a swapped one's until its release point, if later (Rule 4)
            late = max(max(drop[ci], release_op[j]), producer[ci] - 1) + 1
            delta[drop_end[ci]] += z
            delta[late] -= z
        elif swapping:  # Rule 4 without copy engines: the copy is device memory, [save_op + 1, free_op]
            delta[save_op[ci] + 1] += z
            delta[keep_end_from_save[ci]] -= z
            if in_op[ci]:
                packing[save_op[ci]] += z
    for i in range(0, n_moved, 2):
        made[moved[i]] = True
        bop[moved[i]] = moved[i + 1]
    for ci in range(k):
        if regions and served[ci]:
            made[ci] = False  # a region regenerates it (Rule 11)
        if made[ci]:  # copied back, regenerated, unpacked: [op, free_op] (Rules 5, 7, 8)
            z = size_f[ci]
            b = bop[ci]
            delta[b] += z
            delta[max(free_keep[ci], b - 1) + 1] -= z
        if act[ci] == compress:  # packed: [save_op + 1, u - 1], to the end if never unpacked (Rule 8)
            delta[save_op[ci] + 1] += packed_f[ci]
            if in_op[ci]:
                packing[save_op[ci]] += packed_f[ci]
            if made[ci]:
                delta[max(bop[ci], save_op[ci] + 1)] -= packed_f[ci]
    for j in range(region_at.shape[0]):  # Rule 11: regenerated copies, held arguments
        delta[region_at[j]] += region_w[j]
    live = np.empty(n)
    acc = 0.0
    for i in range(n):
        acc += delta[i] + live_keep_delta[i]
        held = extra[i]
        live[i] = max(acc, acc - alloc_ws[i] + held) if held else acc
        if packing[i]:
            live[i] = max(live[i], acc - ws[i] + packing[i])
    return live


def compiled_live() -> Callable[..., Any]:
    """:func:`live_bytes`, compiled."""
    return _jit(live_bytes)


def host_adds(
    n: int,
    act: np.ndarray,
    handled: np.ndarray,
    served: np.ndarray,
    regions: bool,
    outside: np.ndarray,
    has_frames: bool,
    carry: bool,
    trigger_all: np.ndarray,
    used: np.ndarray,
    first_use: np.ndarray,
    pack_cand: np.ndarray,
    pack_frame: np.ndarray,
    frame_reach: np.ndarray,
    first_pack_frame: np.ndarray,
    pack_cost_frame: np.ndarray,
    pack_cost_at: np.ndarray,
    pack_cost_s: np.ndarray,
    frame_packs: np.ndarray,
    clo_ptr: np.ndarray,
    clo_frames: np.ndarray,
    loss_before_root: np.ndarray,
    span_lo: np.ndarray,
    span_hi: np.ndarray,
    loss_hi: int,
    frame_path: np.ndarray,
    n_paths: int,
    frame_first_op: np.ndarray,
    frame_s: float,
    pack_after: np.ndarray,
    pack_unpack_op: np.ndarray,
    pack_s: float,
    unpack_s: float,
    forward_lo: int,
    forward_hi: int,
    save_after: np.ndarray,
    compress_kernel_s: np.ndarray,
    compress_host_s: float,
    record_on: bool,
    record_s: np.ndarray,
    record_weight: np.ndarray,
    swp: np.ndarray,
    sync: bool,
    d2h_dur: np.ndarray,
    swap_host: float,
    swap: int,
    recompute: int,
    compress: int,
    hx: np.ndarray,
    dx: np.ndarray,
    point: np.ndarray,
) -> tuple[int, int, float, bool]:
    """The host and compute seconds a policy adds before ops, fixed before the walk (Rules 8, 12, 13), into
    ``hx`` and ``dx`` (zeros, n + 1 each), in this order: the observed packs' and unpacks' costs, the hooked
    module calls', the compress kernels' (and their issue), the recorder's ops', the copies out's. Fills
    ``point`` (per candidate: its first pack is a pack point, Rule 13) where the workload has frames. Returns
    (packs observed, hooked calls, the recorder's weight (ops it runs, views and queries counted), whether
    anything went into ``dx``)."""
    k = act.shape[0]
    # Rule 13's carriers: the candidates first used where a copy back is due (a swapped candidate is served by
    # no region, so its copy is due at its own trigger op).
    watched = handled.copy()
    if carry:
        due = np.zeros(n + 1, dtype=np.bool_)
        for ci in range(k):
            if act[ci] == swap and used[ci]:
                due[trigger_all[ci]] = True
        for ci in range(k):
            if due[first_use[ci]] and not (regions and served[ci]):
                watched[ci] = True
    n_observed = 0
    frame_calls = 0
    weight = 0.0
    n_replayed = 0
    if has_frames:
        nf = frame_reach.shape[0]
        hooked = np.zeros(nf, dtype=np.bool_)
        for j in range(pack_cand.shape[0]):
            if watched[pack_cand[j]]:
                hooked[pack_frame[j]] = True
        # A frame is observed when it or one enclosing it is hooked: a hooked frame before it in preorder reaches
        # it (frames are in preorder; ``frame_reach``: one past the last frame inside).
        obs = np.zeros(nf, dtype=np.bool_)
        top = 0
        for f in range(nf):
            if hooked[f] and frame_reach[f] > top:
                top = frame_reach[f]
            obs[f] = top > f and (outside[f] if regions else True)
        for ci in range(k):
            point[ci] = obs[first_pack_frame[ci]]
        # Each observed pack's cost after its op, its unpack's at its tensor's first use, and those of the packs
        # of tensors that are not candidates.
        for j in range(pack_cost_frame.shape[0]):
            if obs[pack_cost_frame[j]]:
                hx[pack_cost_at[j]] += pack_cost_s[j]
        for f in range(nf):
            if obs[f]:
                n_observed += frame_packs[f]
        # The frames the recorder runs in: those of the replayed candidates' closure ops, and the ops it records
        # under them (their spans; the loss's from op 0 when a closure needs it before the model).
        span = np.zeros(n + 1, dtype=np.int64)  # +1 where a span starts, -1 one past its end
        in_closure = np.zeros(nf, dtype=np.bool_)
        loss = False
        for ci in range(k):
            if handled[ci] and act[ci] == recompute:
                n_replayed += 1
                loss = loss or loss_before_root[ci]
                for j in range(clo_ptr[ci], clo_ptr[ci + 1]):
                    f = clo_frames[j]
                    if not in_closure[f]:
                        in_closure[f] = True
                        hooked[f] = True
                        if span_hi[f] >= span_lo[f] >= 0:
                            span[span_lo[f]] += 1
                            span[span_hi[f] + 1] -= 1
        called = np.zeros(n_paths, dtype=np.bool_)
        for f in range(nf):
            if hooked[f]:
                called[frame_path[f]] = True
        for f in range(nf):
            if called[frame_path[f]]:
                hx[frame_first_op[f]] += frame_s
                frame_calls += 1
    else:  # one pack per candidate, after save_op, every one observed
        for ci in range(k):
            hx[pack_after[ci]] += pack_s
        for ci in range(k):
            hx[pack_unpack_op[ci]] += unpack_s
        n_observed = k
        for ci in range(k):
            if handled[ci] and act[ci] == recompute:
                n_replayed += 1
    # Rule 8: pack kernels after save_op.
    touched = False
    for ci in range(k):
        if act[ci] == compress:
            dx[save_after[ci]] += compress_kernel_s[ci]
            hx[save_after[ci]] += compress_host_s
            touched = True
    # Rule 12: the recorder's ops.
    if n_replayed and record_on:
        if has_frames:
            depth = 0
            if loss:
                span[0] += 1
                span[loss_hi + 1] -= 1
            for i in range(n):
                depth += span[i]
                if depth > 0:
                    hx[i] += record_s[i]
                    weight += record_weight[i]
        else:
            for i in range(forward_lo, forward_hi):
                hx[i] += record_s[i]
                weight += record_weight[i]
    # Rule 4: the copies out, in issue order.
    for j in range(swp.shape[0]):
        ci = swp[j]
        if sync:  # Rule 1: the copy on the one clock, done when it resumes
            dx[save_after[ci]] += d2h_dur[ci]
            touched = True
        hx[save_after[ci]] += swap_host  # Rule 12: the copy out's own host work, everywhere
    return n_observed, frame_calls, weight, touched


def compiled_host() -> Callable[..., Any]:
    """:func:`host_adds`, compiled."""
    return _jit(host_adds)
