"""Recompute by replay (runtime R6): record the forward's ops where a replayed chain needs them, and re-run a
saved tensor's producer chain in backward. Used by runtime.apply for the recomputed tensors that no
checkpointed region serves (NOTE [ Recompute mechanisms ] in runtime/plan.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.plan import UNDECLARED_WRITES as _UNDECLARED_WRITES
from runtime.trace import written_arguments

if TYPE_CHECKING:
    from runtime.apply import PolicyRuntime

Frame = tuple[str, int]  # (module path, call), as in the keys


@dataclass(frozen=True)
class _Ref:
    """A tensor argument as a storage reference with its layout."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# An aten op's arguments are flat: tensors, scalars, and lists of them (``Tensor[]``, ``Tensor?[]``), positional
# or keyword. Flattening one level of lists is therefore exact, and far cheaper than torch.utils._pytree,
# which the recorder would otherwise call on every forward op.
_Spec = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]  # (list lengths or -1, kwarg names, kwarg lengths)


@dataclass
class OpRecord:
    index: int
    func: Any
    spec: _Spec  # how to rebuild (args, kwargs) from leaves
    leaves: list[Any]  # flattened (args, kwargs), tensors replaced by _Ref
    outputs: list[int | None]  # storage id of each flattened output (None: not a tensor)
    writes: frozenset[int]  # leaf positions the op mutates
    rng: tuple[torch.Tensor, torch.Tensor | None] | None  # (cpu, cuda) state before a random op
    frame: Frame | None  # the innermost module call it ran in (first steps only: to learn where to record)
    # Grad mode when it ran: some kernels read it (the CPU's oneDNN LSTM makes its workspace output and rounds
    # as in training only with grad mode on), and backward, where replays run, turns it off.
    grad: bool = True


def _flatten_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], _Spec]:
    leaves: list[Any] = []
    arg_lens = _flatten_into(args, leaves)
    kw_lens = _flatten_into(kwargs.values(), leaves)
    return leaves, (arg_lens, tuple(kwargs), kw_lens)


def _flatten_into(values: Iterable[Any], leaves: list[Any]) -> tuple[int, ...]:
    """Append each value (the items of a list or tuple) to ``leaves``; each one's length (-1: not a list)."""
    lens: list[int] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            lens.append(len(v))
            leaves.extend(v)
        else:
            lens.append(-1)
            leaves.append(v)
    return tuple(lens)


def _unflatten_args(leaves: list[Any], spec: _Spec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    arg_lens, names, kw_lens = spec
    pos = 0
    values: list[Any] = []
    for n in (*arg_lens, *kw_lens):
        if n < 0:
            values.append(leaves[pos])
            pos += 1
        else:
            values.append(list(leaves[pos : pos + n]))
            pos += n
    return tuple(values[: len(arg_lens)]), dict(zip(names, values[len(arg_lens) :], strict=True))


def _flatten_out(out: Any) -> list[Any]:
    """An op's outputs: one tensor, or a tuple of tensors and lists of tensors."""
    if not isinstance(out, (list, tuple)):
        return [out]
    flat: list[Any] = []
    for x in out:
        if isinstance(x, (list, tuple)):
            flat.extend(x)
        else:
            flat.append(x)
    return flat


class Recorder(TorchDispatchMode):
    """Records forward ops so that the runtime can replay producer chains (R6). It is active for the
    whole forward in a first step (``frame_of`` names each op's module call) and, from then on, only
    inside the module calls whose ops were replayed (R11)."""

    def __init__(self, device: torch.device, frame_of: Callable[[], Frame] | None = None) -> None:
        super().__init__()
        self.device = device
        self.frame_of = frame_of
        self.ops: list[OpRecord] = []
        self._sid_at: dict[int, int] = {}  # storage (its StorageImpl's address) -> id, checked by self.storage
        self.storage: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.writers: dict[int, list[int]] = {}  # storage id -> ops that allocated or wrote it, in order
        self.recording = True  # until backward starts (R6)
        self.paused = False  # inside the runtime's own hooks: their ops are not the model's
        self.replayed: set[int] = set()  # indices of the ops some replay re-ran
        self.depth = 0  # module calls entered that record (R11)
        # R6: storages made before the recording (buffers, arguments of the model) that a recorded op read
        # since their last in-place write; before the next such write, a copy of each is kept, so that a replay
        # reads what was read: (storage, the writing op) -> the storage as it was before that op.
        self._external: set[int] = set()
        self._external_read: set[int] = set()
        self.before_write: dict[tuple[int, int], torch.UntypedStorage] = {}
        # Constants made from Python data in forward (``torch.tensor(0.1)``, ``t[..., 0] = 0``: lifted by
        # ``aten.lift_fresh``), which no op makes again: held for the step, tiny (R6).
        self._constants: list[torch.Tensor] = []

    def release_rng(self) -> None:
        """Let go of the random-number states (R6): every replay that needed them is done."""
        for op in self.ops:
            if op.rng is not None and op.rng is not _UNUSED:
                op.rng = _RELEASED
        self.before_write.clear()  # ... and the copies of storages as read, and the constants (R6)
        self._constants.clear()

    def sid(self, storage: torch.UntypedStorage) -> int:
        return self._sid(storage)[0]

    def written_after(self, index: int) -> Iterator[int]:
        """The recorded ops after op ``index`` that write in place a storage it read (or wrote)."""
        for leaf in self.ops[index].leaves:
            if isinstance(leaf, _Ref):
                yield from (j for j in self.writers.get(leaf.sid, ()) if j > index)

    def _sid(self, storage: torch.UntypedStorage) -> tuple[int, bool]:
        """(the storage's id, whether it is new). A freed storage's address can be reused: an entry counts only
        while its weak reference still gives this storage (recording is over before anything rebinds one)."""
        at = storage._cdata
        sid = self._sid_at.get(at)
        if sid is not None and self.storage[sid]() is storage:
            return sid, False
        sid = len(self.storage)
        self._sid_at[at] = sid
        self.storage[sid] = weakref.ref(storage)
        return sid, True

    def ref(self, t: torch.Tensor) -> _Ref:
        sid, new = self._sid(t.untyped_storage())
        if new:
            self._external.add(sid)  # first seen as an argument: made before the recording
        return _Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.recording or self.paused or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)  # backward (a checkpointed region's recompute included)
        random, written = _schema_of(func)
        rng = None
        if random is not None and _draws_nothing(random, args, kwargs):
            rng = _UNUSED
        elif random is not None:  # () for an op that always draws (rand_like, normal_): a state to replay it
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            rng = (torch.get_rng_state(), cuda)
        leaves, spec = _flatten_args(args, kwargs)
        writes = _written_positions(written, args, kwargs, leaves) if written else []
        refs = [self.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        index = len(self.ops)
        for pos in writes:  # R6: a storage from before the recording, read since its last write, about to change
            sid = refs[pos].sid  # type: ignore[union-attr]
            if sid in self._external_read:
                self._external_read.discard(sid)
                self.before_write[(sid, index)] = leaves[pos].untyped_storage().clone()
        if not func.is_view:  # a view reads nothing (the runtime's own detach of a kept pack among them)
            for pos, ref in enumerate(refs):
                if isinstance(ref, _Ref) and ref.sid in self._external and pos not in writes:
                    self._external_read.add(ref.sid)
        out = func(*args, **kwargs)
        if func is _LIFT_FRESH:
            self._constants.append(out)
        out_leaves = _flatten_out(out)
        outputs: list[int | None] = []
        for x in out_leaves:
            if not isinstance(x, torch.Tensor):
                outputs.append(None)
                continue
            sid, new = self._sid(x.untyped_storage())
            outputs.append(sid)
            if new:
                self.writers.setdefault(sid, []).append(index)
        for pos in writes:
            ref = refs[pos]
            assert isinstance(ref, _Ref)
            self.writers.setdefault(ref.sid, []).append(index)
        frame = self.frame_of() if self.frame_of is not None else None
        self.ops.append(
            OpRecord(index, func, spec, refs, outputs, frozenset(writes), rng, frame, torch.is_grad_enabled())
        )
        return out


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


# Arguments of a random op whose value here makes its result independent of the random state (R6): a
# probability of 0 (dropout's ``p``, attention's ``dropout_p``, an RNN's ``dropout``) or ``train`` off.
_NO_DRAW = {"p": 0.0, "dropout_p": 0.0, "dropout": 0.0, "train": False}

# Per op: None where it draws no random numbers, else the (position, name, value) of each argument that can
# make its draws irrelevant (possibly none); then the (position, name) of each argument it mutates.
_Random = tuple[tuple[int, str, Any], ...] | None
_SCHEMAS: dict[Any, tuple[_Random, tuple[tuple[int, str], ...]]] = {}


def _schema_of(func: Any) -> tuple[_Random, tuple[tuple[int, str], ...]]:
    """(whether and how the op draws random numbers, the (position, name) of each argument it mutates, those
    of ``_UNDECLARED_WRITES`` included): read once per op."""
    known = _SCHEMAS.get(func)
    if known is None:
        written = written_arguments(func, _UNDECLARED_WRITES.get(func.overloadpacket.__name__, ()))
        random = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            args = func._schema.arguments
            random = tuple((i, a.name, _NO_DRAW[a.name]) for i, a in enumerate(args) if a.name in _NO_DRAW)
        known = _SCHEMAS[func] = (random, written)
    return known


def _draws_nothing(random: tuple[tuple[int, str, Any], ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a random op's arguments make its result independent of the random state (dropout at p=0, SDPA
    at ``dropout_p`` 0 as every transformer without dropout calls it on the CPU): then a replay needs no state."""
    for i, name, value in random:
        given = args[i] if i < len(args) else kwargs.get(name)
        if given is not None and not isinstance(given, torch.Tensor) and given == value:
            return True
    return False


def _written_positions(
    written: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any]
) -> list[int]:
    """Leaf positions (in the flattened (args, kwargs)) of the tensors in the arguments an op mutates."""
    positions: list[int] = []
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                positions.extend(p for p, x in enumerate(leaves) if x is t)
    return positions


def view_of(storage: torch.UntypedStorage, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
            offset: int) -> torch.Tensor:  # fmt: skip
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _reads(op: OpRecord, sid: int) -> bool:
    """Whether ``op`` takes storage ``sid`` as an argument (an in-place writer), rather than making it."""
    return any(isinstance(leaf, _Ref) and leaf.sid == sid for leaf in op.leaves)


class Replayer:
    """Regenerates storages by replaying recorded ops (R6)."""

    def __init__(self, rt: PolicyRuntime, rec: Recorder) -> None:
        self.rt = rt
        self.rec = rec
        self.handles = rt._by_sid
        self.made: dict[int, torch.UntypedStorage] = {}  # temporaries regenerated in this replay
        self.as_of: dict[tuple[int, int], torch.UntypedStorage] = {}  # (storage, writers re-run): R6's stale reads

    def storage(self, sid: int, before: int) -> torch.UntypedStorage:
        """The storage ``sid`` as it was just before op ``before`` (or at the end of the forward)."""
        from runtime.policy import Action

        writers = self.rec.writers.get(sid, [])
        if writers and writers[-1] > before:
            # Written in place after op ``before`` read it (the CPU's GRU cell clones one chunk of its gates,
            # then multiplies that chunk in place): what is there now is not what was read, so it is re-made
            # as it was then: made before the recording (a buffer updated after its use, an EMA), the copy the
            # recorder kept before that write; else from its producer and the writers before (Rule 7 counts
            # those ops), when the recording holds its producer; else it is used as it is.
            chain = [i for i in writers if i < before]
            kept = self.rec.before_write.get((sid, next(i for i in writers if i >= before)))
            if kept is not None:  # made before the recording: the recorder's copy as it was read
                return kept
            if chain and not _reads(self.rec.ops[chain[0]], sid):
                key = (sid, len(chain))
                if key not in self.as_of:
                    then: torch.UntypedStorage | None = None
                    for index in chain:
                        then = self._run(self.rec.ops[index], sid, then)
                    assert then is not None
                    self.as_of[key] = then
                return self.as_of[key]
        if sid in self.made:
            return self.made[sid]
        alive = self.rec.storage[sid]()
        handle = self.handles.get(sid)
        if handle is not None and handle.unpacked and not handle.packs:
            # Past its last unpack (R9): gone unless a backward node still holds it; re-made below as a
            # temporary of this replay, like a kept tensor that backward freed (Rule 7), not held again.
            handle = None
        if alive is not None:
            if handle is not None and handle.action == Action.SWAP and handle.issued:
                # A copy back already issued (R4) may still be on its way: the compute stream waits for it
                # (R5), as for backward's own unpack; the replay's ops would otherwise read the buffer first.
                return self.rt._materialize(handle)
            return alive
        if handle is not None and (handle.device is not None or handle.action != Action.RECOMPUTE):
            return self.rt._materialize(handle)  # held already, or brought back (swap, compress)
        chain = [i for i in self.rec.writers.get(sid, []) if i < before]
        if not chain:
            raise RuntimeError(f"autotune: cannot recompute a saved tensor: storage {sid} has no recorded producer")
        result: torch.UntypedStorage | None = None
        for index in chain:
            result = self._run(self.rec.ops[index], sid, result)
        assert result is not None
        if handle is not None:
            handle.device = result  # a candidate: held until its own unpacks (Rule 7)
        self.rec.storage[sid] = weakref.ref(result)  # found alive by later replays while anything holds it
        self.made[sid] = result
        return result

    def _run(self, op: OpRecord, target: int, current: torch.UntypedStorage | None) -> torch.UntypedStorage:
        leaves: list[Any] = []
        for pos, leaf in enumerate(op.leaves):
            if not isinstance(leaf, _Ref):
                leaves.append(leaf)
                continue
            if leaf.sid == target:
                assert current is not None, "an op writes a storage before its producer"
                leaves.append(view_of(current, leaf.dtype, leaf.size, leaf.stride, leaf.offset))
                continue
            storage = self.storage(leaf.sid, op.index)
            t = view_of(storage, leaf.dtype, leaf.size, leaf.stride, leaf.offset)
            if pos in op.writes:
                t = t.clone()  # e.g. BatchNorm's running statistics: replay must not update them twice
            leaves.append(t)
        args, kwargs = _unflatten_args(leaves, op.spec)
        # As it ran in forward (R6): grad mode included, which backward turns off. Nothing the replay reads
        # requires grad (storages viewed anew), so no graph is recorded either way.
        with _rng_state(op.rng, self.rt.device), torch.set_grad_enabled(op.grad):
            out = op.func(*args, **kwargs)
        self.rt.stats.recomputed_ops += 1
        self.rec.replayed.add(op.index)
        out_leaves = _flatten_out(out)
        for sid, x in zip(op.outputs, out_leaves, strict=False):
            if sid is not None and isinstance(x, torch.Tensor) and sid != target and sid not in self.made:
                self.made[sid] = x.untyped_storage()  # another output of the same op (BatchNorm's stats)
        if target in op.outputs:
            x = out_leaves[op.outputs.index(target)]
            assert isinstance(x, torch.Tensor)
            return x.untyped_storage()
        assert current is not None
        return current  # an in-place writer: the target was updated in place


_RELEASED: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0, dtype=torch.uint8), None)  # Recorder.release_rng
# A random op whose arguments make its draws irrelevant (``_draws_nothing``): replayed with the random state
# forked (what it draws does not leak into the step's), from whatever state there is, also after the release.
_UNUSED: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0, dtype=torch.uint8), None)


@contextlib.contextmanager
def _rng_state(rng: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> Iterator[None]:
    if rng is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    if rng is _UNUSED:
        with torch.random.fork_rng(devices=devices):
            yield
        return
    if rng is _RELEASED:
        raise RuntimeError(
            "autotune: a replay needed the random-number state of a forward op after the step's last replay let "
            "it go (runtime R6): a second backward through the same graph (retain_graph=True) cannot replay "
            "random ops; keep those tensors in the policy, or run one backward per forward"
        )
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        yield
