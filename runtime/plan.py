"""Which mechanism serves each recomputed tensor: decided once per policy, from the workload it was made for.

NOTE [ Recompute mechanisms ]
    A recomputed candidate is served one of two ways. Where a policy recomputes everything one module call
    makes and keeps inside, the runtime runs that call as one autograd node that records no graph in forward
    and re-runs the call in backward (runtime/regions.py; its first step under ``torch.utils.checkpoint``):
    a *region*, no Python per op or per saved tensor (runtime R10, simulator Rule 11). The rules below say
    "the checkpoint" for either.
    Every other recomputed candidate is *replayed* from the recorded ops of its producer chain (R6, Rule 7).
    A module call R (a frame, NOTE [ Frames ] in runtime/workload.py) is a region when

    P1. it is a call of a submodule of the model (not the loss) whose module runs once per forward (the
        modules of backward ops carry no call index, so its backward is then its own);
    P2. every candidate made inside R (by an op R ran) and packed only inside it is recomputed (the
        checkpoint holds its packs, not the tensor: kept, it would be recomputed all the same), and there
        is one: those are the ones the region serves;
    P3. every candidate made inside R and packed after it too is kept if one of its packs is inside R
        (checkpoint holds that pack; a swap or compression would start late), and is not recomputed
        otherwise (its replay would need what R recomputes); one first packed inside R must be among the
        tensors R returns (the runtime names it there);
    P4. every candidate made before R and packed inside R is kept and is one of R's tensor arguments (the
        checkpoint's saved inputs hold it and the recompute reads it); so is every candidate among R's
        tensor arguments (checkpoint holds them until R's backward is done, whatever the policy says);
    P5. R's forward writes no module state except BatchNorm's running statistics (which the runtime keeps
        from changing again in the recompute, R10); random ops are fine (checkpoint replays the RNG state);
    P6. no candidate made outside R is replayed whose producer chain reads (Rule 7 of the simulator: its closure's
        candidate inputs, those it re-makes as temporaries included) one that R serves (one that another region
        serves is regenerated from that region's own inputs, which its checkpoint holds), nor one of R's kept
        outputs after that output's last backward use outside R (Rule 11 lets the original go there);
    P7. R's forward writes none of R's tensor arguments in place (an activation module with ``inplace=True``
        called on its own: the checkpoint holds the argument as the call got it, and refuses it in backward,
        written since; a node saves it too, N4);
    P8. R's forward runs no op whose kernel reads grad mode (``GRAD_MODE_KERNELS``: the CPU's oneDNN LSTM
        layer returns its workspace and rounds as in training only with grad mode on): a node runs the call's
        forward without grad, so its outputs would differ from plain training's in the last bits (9.3e-9 in a
        2-layer LSTM's gradients); a replay runs each op in the grad mode it had (R6) and is exact;
    P9. no tensor made before R and read inside it is written in place by a forward op after R (a buffer
        updated after its use, an EMA; an argument a later op writes into): the recompute would read it as
        written since, or (an argument, which the checkpoint holds) autograd refuses it in backward. BatchNorm's
        own updates of its running statistics do not count (the recompute does not read them in training
        mode, and rewrites them with their own values, R10);

    P10. As one node (``PolicyOptions.region_nodes``) only: no tensor with a gradient (floating point, not a
        buffer, not the batch) made before R is read by two or more ops inside R and by one outside it too
        (cross-attention's encoder states, read by the key and value projections of every decoder block; a
        parameter used twice inside and again elsewhere). The node returns its gradient already summed over
        R's uses, which autograd then adds to the others: another association than plain training's one by one
        (T5's encoder gradients off by 3.4e-8). Under checkpoint the recompute's graph joins backward and sums
        as plain training does. Nor does R return a view (``Frame.view_out``: InstanceNorm's output) that a
        forward op writes in place after R (a ``ReLU(inplace=True)``): a node's output that is a view cannot
        be (runtime/regions.py N4).

    and no enclosing call is a region (the outermost qualifying calls are chosen). By P2-P6 a region needs
    nothing from outside but its kept arguments, and no replay needs what a region recomputes, so regions
    and replays never depend on each other.

    P11. Before all of the above: a recomputed candidate whose storage something other than autograd holds
        until its first backward use (a custom ``autograd.Function`` that keeps it as a ``ctx`` attribute
        rather than saving it, a cache of the model's; the trace's drop pass sees it outlive the forward,
        ``free_if_dropped_op`` at or past that use) is kept (``held_outside``): dropping it frees nothing, and
        its replay finds it alive and re-runs nothing (runtime R6), so the runtime learns it as kept (R11) and
        the simulator plans it so (Rule 7).

    P12. Before all of the above, after P11: a compressed candidate that the replay of a recomputed one reads
        (``Closure.deps``: live at that one's first use, materialized first; and ``Closure.remade``, gone there
        but live where a replay nested in an earlier one's runs it, Rule 7) is kept (``replay_inputs_kept``).
        The replay would re-make from the rounded values what forward made from the exact ones, and where those
        values decide a shape (the boolean mask of ``x[x > 0.1]``) backward fails. ``Policy.from_vector`` writes
        it kept and both simulators plan it so (Rule 8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.keys import canonical_key, runs_in
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE
from runtime.workload import Phase, TensorKind, Workload, rounded

# P8: ops whose kernels read grad mode (found by running each with it on and off on the same inputs).
GRAD_MODE_KERNELS = frozenset({"aten.mkldnn_rnn_layer.default"})


@dataclass
class Region:
    """One module call recomputed as a region (NOTE [ Recompute mechanisms ])."""

    module: str  # module path, as in the keys
    call: int  # which call of it in the forward
    rng: bool  # it draws random numbers: checkpoint preserves the RNG state
    keys: list[str]  # the recomputed candidates it serves
    # Candidates first packed inside the call, which the runtime's keyer must still name (runtime R10):
    inputs: list[tuple[int, str]] = field(default_factory=list)  # (position among its tensor arguments, key)
    outputs: list[tuple[int, str]] = field(default_factory=list)  # (position among its returned tensors, key)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Region:
        return cls(
            module=str(d["module"]),
            call=int(d["call"]),  # type: ignore[call-overload]
            rng=bool(d["rng"]),
            keys=[canonical_key(str(k)) for k in d["keys"]],  # type: ignore[attr-defined]
            inputs=[(int(p), canonical_key(str(k))) for p, k in d.get("inputs", [])],  # type: ignore[attr-defined]
            outputs=[(int(p), canonical_key(str(k))) for p, k in d.get("outputs", [])],  # type: ignore[attr-defined]
        )


class RegionPlanner:
    """The regions of one workload for any action vector; built once, then :meth:`select` is vectorised
    (the simulator calls it for every policy it scores)."""

    def __init__(self, w: Workload, closures: list[Closure] | None = None) -> None:
        self.w = w
        frames = w.frames
        self.n_frames = len(frames)
        self.candidates = len(w.candidates)
        # Preorder: a frame's descendants are the frames after it up to end[f] (frames are logged in call order).
        end = np.arange(self.n_frames, dtype=np.int64)
        for f in reversed(frames):
            if f.parent >= 0:
                end[f.parent] = max(end[f.parent], end[f.index])
        self.end = end
        self._end_list: list[int] = end.tolist()
        calls: dict[str, int] = {}
        for f in frames:
            calls[f.path] = calls.get(f.path, 0) + 1
        writes_state = self._state_writers()
        grad_mode = np.array([op.name in GRAD_MODE_KERNELS for op in w.ops], dtype=bool)  # P8
        # P7: per forward op, the tensors it writes in place (made before it).
        written = [
            {t for t in op.outputs if w.tensors[t].alloc_op != op.index} if op.phase == Phase.FORWARD else set()
            for op in w.ops
        ]
        # P9: each tensor written in place by a forward op outside a BatchNorm call, and the last op that does.
        norm_frames = {f.index for f in frames if f.norm}
        last_write: dict[int, int] = {}
        for op in w.ops:
            if op.phase == Phase.FORWARD and op.frame not in norm_frames:
                for t in written[op.index]:
                    last_write[t] = op.index
        late_readers: dict[int, list[int]] = {t: [] for t in last_write}  # the forward ops that read each
        for op in w.ops:
            if op.phase == Phase.FORWARD:
                for t in op.inputs:
                    if t in late_readers:
                        late_readers[t].append(op.index)
        if closures is None:
            closures = closures_of(w)
        frame_of_producer = np.array([w.ops[c.producer].frame for c in w.candidates], dtype=np.int64)
        packed_in: list[set[int]] = [set() for _ in frames]  # candidates packed in each frame or below
        self.packed_in = packed_in
        for ci, c in enumerate(w.candidates):
            for pf, _ in c.packs:
                fi = pf
                while fi >= 0 and ci not in packed_in[fi]:
                    packed_in[fi].add(ci)
                    fi = frames[fi].parent
        # P6: (reader, read) pairs of candidates made in different calls, listed under every call that made
        # the read one but not the reader.
        pairs: list[list[tuple[int, int, bool]]] = [[] for _ in frames]
        n = len(w.ops)
        for ci, cl in enumerate(closures):
            reader_frames = set(self._ancestry(int(frame_of_producer[ci])))
            u = w.candidates[ci].first_use(n)
            for d in (*cl.deps, *cl.remade):  # a re-made one reads what its call made too
                for fi in self._ancestry(int(frame_of_producer[d])):
                    if fi not in reader_frames:
                        # ... and a kept output of the call, when the replay comes after its last use outside the
                        # call: the original is gone then (Rule 11), so the replay would re-make it from the call's
                        # ops (late).
                        path = frames[fi].path
                        out = [b for b in w.candidates[d].bwd_uses if not runs_in(w.ops[b].module, path)]
                        pairs[fi].append((ci, d, bool(out) and u > max(out)))
        producers = np.array([c.producer for c in w.candidates], dtype=np.int64)
        order = np.argsort(producers, kind="stable")
        cand_of = {c.tensor: i for i, c in enumerate(w.candidates)}

        must: dict[str, list[list[int]]] = {"recompute": [], "keep": [], "not_recompute": []}
        self.static_ok = np.zeros(self.n_frames, dtype=bool)
        self.node_ok = self._node_ok(last_write)  # P10
        self.rng = np.zeros(self.n_frames, dtype=bool)
        self.internal: list[np.ndarray] = []  # candidates a region of this call would serve, if recomputed
        self._inputs: list[list[tuple[int, int]]] = []
        self._outputs: list[list[tuple[int, int]]] = []
        for f in frames:
            lists: dict[str, list[int]] = {name: [] for name in must}
            inputs: list[tuple[int, int]] = []
            outputs: list[tuple[int, int]] = []
            ok = f.index > 0 and f.path != "<root>" and calls[f.path] == 1 and f.last_op >= f.first_op  # P1
            ok = ok and not writes_state[f.first_op : f.last_op + 1].any()  # P5
            ok = ok and not grad_mode[f.first_op : f.last_op + 1].any()  # P8
            if ok and f.args:  # P7: it writes none of its arguments in place
                arguments = set(f.args)
                ok = not any(written[op] & arguments for op in range(f.first_op, f.last_op + 1))
            if ok:  # P9: nothing it reads from before it is written in place after it
                ok = not any(
                    last > f.last_op
                    and w.tensors[t].alloc_op < f.first_op
                    and any(f.first_op <= r <= f.last_op for r in late_readers[t])
                    for t, last in last_write.items()
                )
            if ok:
                lo, hi = np.searchsorted(producers[order], [f.first_op, f.last_op + 1])
                made = set(order[lo:hi].tolist())
                args = {cand_of[t] for t in f.args if t in cand_of} - made
                for ci in sorted(args - packed_in[f.index]):
                    lists["keep"].append(ci)  # P4: held by the checkpoint's inputs
                for ci in sorted(made | packed_in[f.index]):
                    c = w.candidates[ci]
                    inside = [f.index <= pf <= end[f.index] for pf, _ in c.packs]
                    if ci not in made:  # P4: made before R, packed inside
                        lists["keep"].append(ci)
                        if c.tensor not in f.args:
                            ok = False
                        elif inside[0]:
                            inputs.append((f.args.index(c.tensor), ci))
                    elif all(inside):  # P2
                        lists["recompute"].append(ci)
                    elif any(inside):  # P3: packed inside and after
                        lists["keep"].append(ci)
                        if inside[0] and c.tensor not in f.outputs:
                            ok = False  # first packed inside, escaping some other way than R's returns
                        elif inside[0]:
                            outputs.append((f.outputs.index(c.tensor), ci))
                    else:
                        lists["not_recompute"].append(ci)  # P3: packed after R only
            self.static_ok[f.index] = ok and bool(lists["recompute"])  # P2: something to serve
            for name in must:
                must[name].append(lists[name])
            self._inputs.append(inputs)
            self._outputs.append(outputs)
            self.internal.append(np.array(lists["recompute"], dtype=np.int64))
            self.rng[f.index] = ok and any(w.ops[i].seeded for i in range(f.first_op, f.last_op + 1))
        # P2-P4 as one vectorised test: the (condition, candidate) pairs of the frames that may qualify, each
        # an index into the conditions stacked per candidate (not recomputed, not kept, recomputed), and its frame.
        checks = [
            (j * self.candidates + ci, f)
            for j, name in enumerate(must)
            for f, lst in enumerate(must[name])
            if self.static_ok[f]
            for ci in lst
        ]
        self._check_index = np.array([c for c, _ in checks], dtype=np.int64)
        self._check_frame = np.array([f for _, f in checks], dtype=np.int64)
        self._any_static = bool(self.static_ok.any())
        flat = [(f, reader, read, late) for f, lst in enumerate(pairs) for reader, read, late in lst]
        self._pair_frame, self._pair_reader, self._pair_read = (
            np.array([p[i] for p in flat], dtype=np.int64) for i in range(3)
        )
        self._pair_late = np.array([p[3] for p in flat], dtype=bool)

    def _node_ok(self, last_write: dict[int, int]) -> np.ndarray:
        """P10, per frame: no tensor with a gradient from before it is read twice inside it and again outside,
        and no view it returned is written in place after it."""
        w = self.w
        graded = {t.id for t in w.tensors if "float" in t.dtype and t.kind not in (TensorKind.BUFFER, TensorKind.INPUT)}
        readers: dict[int, list[int]] = {}  # the forward ops that read each, in-place writers of it aside
        for op in w.ops:
            if op.phase == Phase.FORWARD:
                for t in op.inputs:
                    if t in graded and t not in op.outputs:
                        readers.setdefault(t, []).append(op.index)
        ok = np.ones(self.n_frames, dtype=bool)
        for f in w.frames:
            if f.last_op < f.first_op:
                continue
            inside: dict[int, int] = {}
            for info in w.ops[f.first_op : f.last_op + 1]:
                for t in info.inputs:
                    if t in readers and w.tensors[t].alloc_op < f.first_op and t not in info.outputs:
                        inside[t] = inside.get(t, 0) + 1
            written_after = f.view_out and any(last_write.get(t, -1) > f.last_op for t in f.outputs)
            ok[f.index] = not written_after and not any(k >= 2 and len(readers[t]) > k for t, k in inside.items())
        return ok

    def _ancestry(self, f: int) -> list[int]:
        """``f`` and the calls enclosing it."""
        out = []
        while f >= 0:
            out.append(f)
            f = self.w.frames[f].parent
        return out

    def _state_writers(self) -> np.ndarray:
        """Per forward op: it writes a buffer (module state) outside a BatchNorm call (P5)."""
        w = self.w
        out = np.zeros(len(w.ops), dtype=bool)
        norm = {f.index for f in w.frames if f.norm}
        for op in w.ops:
            if op.phase != Phase.FORWARD:
                break
            if op.frame not in norm and any(w.tensors[t].kind == TensorKind.BUFFER for t in op.outputs):
                out[op.index] = True
        return out

    def select(self, act: np.ndarray, nodes: bool = True) -> list[int]:
        """Frame indices of the regions for action codes ``act`` (outermost first, in call order), run as one
        node each or under checkpoint (``nodes``, P10)."""
        if not self._any_static:
            return []
        rec = act == RECOMPUTE
        if not rec.any():  # P2: nothing to serve
            return []
        ok = self.static_ok & self.node_ok if nodes else self.static_ok.copy()
        ok[self._check_frame[np.concatenate([~rec, act != KEEP, rec])[self._check_index]]] = False
        if not ok.any():
            return []
        read = rec[self._pair_read] | (self._pair_late & (act[self._pair_read] == KEEP))
        pairs = read & rec[self._pair_reader]  # P6 pairs that may matter
        frames, readers = self._pair_frame[pairs], self._pair_reader[pairs]
        while True:  # P6 counts only readers that are replayed, which depends on the regions: to a fixpoint
            chosen = self._outermost(ok)
            if not len(frames):
                return chosen
            chosen_mask = np.zeros(self.n_frames, dtype=bool)
            chosen_mask[chosen] = True
            failing = frames[chosen_mask[frames] & ~self.served(chosen)[readers]]
            if not len(failing):
                return chosen
            ok[failing] = False  # fewer regions: more readers replayed, never fewer

    def _outermost(self, ok: np.ndarray) -> list[int]:
        chosen: list[int] = []
        covered = -1
        end = self._end_list
        for f in np.flatnonzero(ok).tolist():
            if f > covered:  # not inside a region chosen already
                chosen.append(f)
                covered = end[f]
        return chosen

    def served(self, regions: list[int]) -> np.ndarray:
        """Boolean mask over candidates: recomputed by one of ``regions``."""
        mask = np.zeros(self.candidates, dtype=bool)
        for f in regions:
            mask[self.internal[f]] = True
        return mask

    def inside(self, regions: list[int]) -> np.ndarray:
        """Boolean mask over frames: one of ``regions`` or inside one (their packs go to checkpoint)."""
        mask = np.zeros(self.n_frames, dtype=bool)
        for f in regions:
            mask[f : self._end_list[f] + 1] = True
        return mask

    def region(self, f: int) -> Region:
        """The policy file's record of region ``f``."""
        frame, cands = self.w.frames[f], self.w.candidates
        return Region(
            module=frame.path,
            call=frame.call,
            rng=bool(self.rng[f]),
            keys=[cands[ci].key for ci in self.internal[f].tolist()],
            inputs=[(pos, cands[ci].key) for pos, ci in self._inputs[f]],
            outputs=[(pos, cands[ci].key) for pos, ci in self._outputs[f]],
        )


# -- replay closures (Rule 7 of the simulator) -------------------------------------------------------------
# Ops that update arguments their schema does not mark as written: BatchNorm's running statistics
# (native_functions.yaml declares native_batch_norm's running_mean/running_var as plain ``Tensor?``). A replay
# passes copies of them (runtime R6), which the trace does not list among the op's outputs.
UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def replay_copies(w: Workload, op: int) -> list[int]:
    """Rule 7: the tensors that a replay of forward op ``op`` copies and holds besides its outputs: the buffers
    it reads where it writes them undeclared (``UNDECLARED_WRITES``: BatchNorm's running statistics). Copies of
    the arguments it declares written are among its outputs (the trace lists in-place writes there)."""
    info = w.ops[op]
    parts = info.name.split(".")
    if len(parts) < 2 or parts[1] not in UNDECLARED_WRITES:
        return []
    return [t for t in info.inputs if w.tensors[t].kind == TensorKind.BUFFER]


def compiled_replay_peak(w: Workload, ops: frozenset[int], target: int, granularity: int) -> tuple[int, list[int]]:
    """Simulator Rule 16: the temporaries of a replay of ``ops`` (every storage they make or copy but
    ``target``) as a compiled graph holds them, each from its op to the last of ``ops`` that reads it (one that
    none reads, during its op alone): the most live at once, and the rounded sizes of those live then, largest
    first."""
    order = sorted(ops)
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    for j in order:
        for t in w.ops[j].inputs:
            if t in born:
                last[t] = j
        for t in (*w.ops[j].outputs, *replay_copies(w, j)):
            if t != target and t not in born:
                born[t] = last[t] = j
    peak, at_peak = 0, []
    for j in order:
        sizes = [rounded(w.tensors[t].nbytes, granularity) for t in born if born[t] <= j <= last[t]]
        if sum(sizes) > peak:
            peak, at_peak = sum(sizes), sorted(sizes, reverse=True)
    return peak, at_peak


@dataclass(frozen=True)
class Closure:
    """What replaying one candidate re-runs: its producer chain and, recursively, the chains of the tensors
    it reads that are gone at its first backward use (freed, candidates past their last backward use
    included: ``remade``); ``deps``: the candidates it reads that are live there (materialized first when not
    kept)."""

    ops: frozenset[int]
    deps: tuple[int, ...]
    remade: tuple[int, ...] = ()


def forward_writers(w: Workload) -> dict[int, list[int]]:
    """Tensor -> the forward ops that write it in place (it was made before them), in order."""
    writers: dict[int, list[int]] = {}
    for op in w.ops:
        if op.phase != Phase.FORWARD:
            break
        for tid in op.outputs:
            if w.tensors[tid].alloc_op != op.index:
                writers.setdefault(tid, []).append(op.index)
    return writers


def closure_at(
    w: Workload,
    ci: int,
    u: int,
    writers: dict[int, list[int]],
    cand_of: dict[int, int],
    held: Mapping[int, int] | None = None,
) -> Closure:
    """Rule 7's closure of candidate ``ci`` replayed just before op ``u`` (``writers``: :func:`forward_writers`;
    ``cand_of``: tensor id -> candidate index; ``held``: tensor id -> the last op something holds it to past its
    traced end, a region's arguments (Rule 11): live until then, so read as it is, R6)."""
    held = held or {}
    c = w.candidates[ci]
    ops: set[int] = set(c.recompute_ops)
    deps: set[int] = set()
    remade: set[int] = set()
    todo = sorted(ops)  # ops whose inputs are still to resolve
    done: set[int] = set()
    made: set[int] = {c.tensor}  # tensors the closure makes from their producer
    while todo:
        at = todo.pop()
        if at in done:
            continue
        done.add(at)
        for tid in w.ops[at].inputs:
            if tid == c.tensor:
                continue
            t = w.tensors[tid]
            later = t.alloc_op >= 0 and any(j > at for j in writers.get(tid, ()))
            if later:  # written in place after this read: its value now is not the one read, so it is
                chain = [t.alloc_op, *(j for j in writers.get(tid, ()) if j < at)]  # re-made as of the read
            elif tid in made:
                continue
            elif t.alloc_op < 0 or t.free_op is None or t.free_op >= u or held.get(tid, -1) >= u:
                if tid in cand_of:  # live at u: the policy's action says how it is there (Rules 6-8)
                    deps.add(cand_of[tid])
                continue  # resident: persistent, or still live at u as traced
            else:  # gone at u, a candidate whose last backward use is past included: re-made as a temporary
                if tid in cand_of:
                    remade.add(cand_of[tid])
                made.add(tid)
                chain = [t.alloc_op, *writers.get(tid, [])]
            ops.update(chain)
            todo.extend(chain)
    return Closure(frozenset(ops), tuple(sorted(deps)), tuple(sorted(remade)))


def closures_of(w: Workload) -> list[Closure]:
    """Rule 7's closure of every candidate as of its own first backward use, in candidate order."""
    n = len(w.ops)
    cand_of = {c.tensor: i for i, c in enumerate(w.candidates)}
    writers = forward_writers(w)
    return [closure_at(w, ci, c.first_use(n), writers, cand_of) for ci, c in enumerate(w.candidates)]


def nested_closures(
    w: Workload,
    closures: Sequence[Closure],
    held: Mapping[int, int] | None = None,
    only: Sequence[int] | None = None,
) -> list[list[tuple[int, Closure]]]:
    """Rule 7's closures of each candidate as of the ops where a replay may run it nested in another's, before
    its own first use: ``[(from_op, closure), ...]`` ascending, each closure the one as of every op from
    ``from_op`` up to the next entry's (the first from op 0), the last one its own (``closures``, as of its
    first use). Earlier, fewer of the tensors its chain reads are gone: a tensor freed at op f is re-made by
    the replays from op f + 1 on and read as it is before, so those ops are where the closure can change.
    ``held`` (:func:`closure_at`): a tensor held past its traced end is gone, and re-made, from the op after
    that. ``only``: those candidates' rows alone, in that order (``closures`` still indexed by candidate)."""
    n = len(w.ops)
    cand_of = {c.tensor: i for i, c in enumerate(w.candidates)}
    writers = forward_writers(w)
    held = held or {}
    out: list[list[tuple[int, Closure]]] = []
    for ci in range(len(w.candidates)) if only is None else only:
        c = w.candidates[ci]
        u = c.first_use(n)
        own = closure_at(w, ci, u, writers, cand_of, held) if held else closures[ci]
        changes = sorted(
            {
                f + 1
                for op in own.ops
                for tid in w.ops[op].inputs
                if (t := w.tensors[tid]).alloc_op >= 0
                and t.free_op is not None
                and (f := max(t.free_op, held.get(tid, -1))) < u
                and tid != c.tensor
            }
        )
        if not changes:
            out.append([(0, own)])
            continue
        rows: list[tuple[int, Closure]] = []
        for i, start in enumerate([0, *changes]):
            # the same closure from ``start`` up to the next change; from the last one on, its own
            at = changes[0] - 1 if i == 0 else start
            cl = own if i == len(changes) else closure_at(w, ci, at, writers, cand_of, held)
            if not rows or rows[-1][1] != cl:
                rows.append((start, cl))
        out.append(rows)
    return out


def regions_for(w: Workload, act: np.ndarray, nodes: bool = True) -> list[Region]:
    """The regions of a policy with action codes ``act`` on ``w``, run as nodes or under checkpoint (one-off;
    the simulator keeps a planner)."""
    planner = RegionPlanner(w)
    return [planner.region(f) for f in planner.select(as_run(np.asarray(act), held_outside(w)), nodes)]


def deps_csr(closures: Sequence[Closure]) -> tuple[np.ndarray, np.ndarray]:
    """The closures' ``deps`` as CSR arrays: those of closure i are ``idx[ptr[i]:ptr[i + 1]]``."""
    ptr = np.concatenate([[0], np.cumsum([len(cl.deps) for cl in closures])]).astype(np.int64)
    return ptr, np.array([d for cl in closures for d in cl.deps], dtype=np.int64)


def reads_csr(closures: Sequence[Closure]) -> tuple[np.ndarray, np.ndarray]:
    """P12: the candidates each candidate's closure reads, ``deps`` and ``remade`` (CSR, as :func:`deps_csr`)."""
    return deps_csr([Closure(cl.ops, (*cl.deps, *cl.remade)) for cl in closures])


def replay_inputs_kept(act: np.ndarray, deps_ptr: np.ndarray, deps_idx: np.ndarray) -> np.ndarray:
    """P12: action codes ``act`` with every compressed candidate that a recomputed one's replay reads kept (the
    candidates the closures read as :func:`reads_csr` gives them)."""
    compressed = act == COMPRESS
    if not compressed.any():
        return act
    read = np.zeros(len(act), dtype=bool)
    read[deps_idx[np.repeat(act == RECOMPUTE, np.diff(deps_ptr))]] = True
    if not (read & compressed).any():
        return act
    return np.where(read & compressed, KEEP, act).astype(act.dtype)


def node_forward_end(w: Workload, ci: int, call_last_op: int) -> int:
    """The op where candidate ``ci``, made inside a region's call run as one node and recomputed, first goes
    (simulator Rule 11). The node runs the call's forward with autocast's cache off (runtime/regions.py: a cast
    cached without a graph would reach a later use outside the call without one), so a weight's cast made
    there (``_to_copy`` of a parameter, which the trace's cache held to the end of autocast's region) goes after
    its last forward reader inside the call; every other one at ``free_if_dropped_op``, as traced (a QA run: the
    plan 328,192 bytes over the measured peak on a tiny Llama in bf16, its MLP one node)."""
    c = w.candidates[ci]
    p = w.ops[c.producer]
    if (
        c.last_fwd_use < c.free_if_dropped_op
        and c.last_fwd_use <= call_last_op
        and p.name == "aten._to_copy.default"
        and any(w.tensors[t].kind == TensorKind.PARAMETER for t in p.inputs)
    ):
        return c.last_fwd_use
    return c.free_if_dropped_op


def node_uncached_casts(w: Workload, first_op: int, last_op: int) -> dict[int, int]:
    """Rule 11 as one node: the casts of parameters that a call (its forward ops ``first_op`` to ``last_op``) makes
    and no op saves (a bias's, which autocast casts for the product alone), which the trace's cache held past their
    last forward reader, all inside the call: tensor id -> that reader. The node runs the call's forward with the
    cache off (runtime/regions.py), so they go after it (:func:`node_forward_end` says the same of the saved ones)."""
    saved = {c.tensor for c in w.candidates}
    made = {
        t
        for op in w.ops[first_op : last_op + 1]
        if op.name == "aten._to_copy.default" and any(w.tensors[x].kind == TensorKind.PARAMETER for x in op.inputs)
        for t in op.outputs
        if w.tensors[t].alloc_op == op.index and t not in saved
    }
    if not made:
        return {}
    last: dict[int, int] = {}
    for op in w.ops:
        if op.phase != Phase.FORWARD:
            break
        for t in op.inputs:
            if t in made:
                last[t] = op.index
    return {t: r for t, r in last.items() if r <= last_op and (free := w.tensors[t].free_op) is not None and free > r}


def held_outside(w: Workload) -> np.ndarray:
    """P11: per candidate, whether something other than autograd holds its storage until its first backward use."""
    n = len(w.ops)
    return np.array([(u := c.first_use(n)) < n and c.free_if_dropped_op >= u for c in w.candidates], dtype=bool)


def as_run(act: np.ndarray, held: np.ndarray) -> np.ndarray:
    """P11: action codes ``act`` as they run, a recomputed candidate that is ``held`` outside autograd kept."""
    if not held.any():
        return act
    return np.where(held & (act == RECOMPUTE), KEEP, act).astype(act.dtype)
