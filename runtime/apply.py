"""Apply a policy to eager PyTorch training: keep, swap, recompute or compress each saved activation.

Usage::

    policy = load_policy("resnet101.policy.json")
    with policy.applied(model):              # one forward and its backward
        loss = criterion(model(x), y)
        loss.backward()

or, to reuse pinned buffers and streams across iterations, one :class:`PolicyRuntime` and ``rt.step()``.

NOTE [ Runtime mechanics ] -- the twin of envs/simulator.py; "Rule n" cites its NOTE [ Simulator semantics ].
    R1. Recognition. A :class:`~runtime.keys.SavedTensorKeyer` on the model names every storage autograd
        packs, as the tracer did; the policy's action for that key decides. A key the policy does not know
        is kept, counted and reported once (the saved batch and targets are listed in the policy's schedule
        and kept silently). All packs of one storage share one handle, so views come back as views.
    R2. Keep: the pack hook returns a detached alias (a saved output holding its own grad_fn would
        otherwise never be freed).
    R3. Swap out (Rule 4): at the first pack, the storage's bytes are copied to host memory: on CUDA into a
        pinned buffer (one per key, reused across iterations) on a dedicated device-to-host stream that
        first waits for the compute stream. The handle holds the device bytes until the copy's event has
        completed (polled at every pack and unpack), then lets go: the block is released when the copy
        ends, as the simulator plans, and the allocator's statistics say so (``record_stream`` would hide
        the block's true lifetime from ``max_memory_allocated``). On the CPU the copy goes to a host store
        that the memory tracker does not count (runtime.measure.host_memory) and the handle holds nothing.
        Tensors on another device than the model's (attention's RNG seed on the host) are kept.
    R4. Prefetch (Rule 5): when backward first unpacks a tensor of unpack rank r, the copies back of every
        swapped tensor of rank <= r + L are issued, in rank order, on a host-to-device stream that waits
        for the compute stream (so the copy starts where the GPU is, not where Python is) and for the
        tensor's own copy out. The device buffer is allocated at issue.
    R5. Stall (Rule 6): before a swapped tensor is used, the compute stream waits for its copy.
    R6. Recompute (Rule 7): while the forward runs, a dispatch mode records every op (name, arguments as
        storage references with their layout and version, random-number state for random ops). At the
        first unpack, the tensor's producer chain is replayed from resident storages: alive ones are used
        as they are, candidates that are swapped, recomputed or
        compressed are brought back first (and kept for their own use), other missing inputs are replayed
        recursively and dropped afterwards. Arguments an op would mutate that are not being regenerated
        (BatchNorm's running statistics) are passed as copies, so replay changes no module state. The
        recorder records from the start of the step to the first unpack (forward and loss), then passes
        ops through. Limit: an input modified in place after its use cannot be detected (views made over
        a storage do not share the original tensor's version counter).
    R7. Compress (Rule 8): at the first pack, a cast to the policy's dtype; at the first unpack, a cast
        back. Lossy, allowed only by the policy's ``lossy`` option.
    R8. Compress and swap apply to what the simulator says they do: compress only to floating-point
        tensors wider than the target dtype (others are kept, as envs.simulator treats them).
    R9. A handle drops its device copy after the last unpack of its storage (the pack count of the
        forward), so the memory lives until the last backward node that needs it is done, as when kept.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from runtime.keys import SavedTensorKeyer
from runtime.measure import host_memory
from runtime.policy import Action, Policy
from runtime.precision import check_active
from runtime.trace import written_tensors

_COMPRESS_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": getattr(torch, "float8_e4m3fn", torch.bfloat16)}


# -- R6: the forward recorder ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    """A tensor argument as a storage reference with its layout."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _OpRecord:
    index: int
    func: Any
    spec: _Spec  # how to rebuild (args, kwargs) from leaves
    leaves: list[Any]  # flattened (args, kwargs), tensors replaced by _Ref
    outputs: list[int | None]  # storage id of each flattened output (None: not a tensor)
    writes: frozenset[int]  # leaf positions the op mutates
    rng: tuple[torch.Tensor, torch.Tensor | None] | None  # (cpu, cuda) state before a random op


# An aten op's arguments are flat: tensors, scalars, and lists of them (``Tensor[]``, ``Tensor?[]``), positional
# or keyword. Flattening one level of lists is therefore exact, and far cheaper than torch.utils._pytree,
# which the recorder would otherwise call on every forward op.
_Spec = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]  # (list lengths or -1, kwarg names, kwarg lengths)


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


class _Recorder(TorchDispatchMode):
    """Records forward ops so that the runtime can replay producer chains (R6)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[_OpRecord] = []
        self.sid_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> id
        self.storage: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.writers: dict[int, list[int]] = {}  # storage id -> ops that allocated or wrote it, in order
        self.recording = True  # until backward starts (R6)
        self.paused = False  # inside the runtime's own hooks: their ops are not the model's

    def sid(self, storage: torch.UntypedStorage) -> int:
        sid = self.sid_of.get(storage)
        if sid is None:
            sid = len(self.storage)
            self.sid_of[storage] = sid
            self.storage[sid] = weakref.ref(storage)
        return sid

    def ref(self, t: torch.Tensor) -> _Ref:
        return _Ref(self.sid(t.untyped_storage()), t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.recording or self.paused:
            return func(*args, **kwargs)
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            rng = (torch.get_rng_state(), cuda)
        leaves, spec = _flatten_args(args, kwargs)
        writes = _written_positions(func, args, kwargs, leaves)
        refs = [self.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        out = func(*args, **kwargs)
        out_leaves = _flatten_out(out)
        index = len(self.ops)
        outputs: list[int | None] = []
        for x in out_leaves:
            if not isinstance(x, torch.Tensor):
                outputs.append(None)
                continue
            known = x.untyped_storage() in self.sid_of
            sid = self.sid(x.untyped_storage())
            outputs.append(sid)
            if not known:
                self.writers.setdefault(sid, []).append(index)
        for pos in writes:
            ref = refs[pos]
            assert isinstance(ref, _Ref)
            self.writers.setdefault(ref.sid, []).append(index)
        self.ops.append(_OpRecord(index, func, spec, refs, outputs, frozenset(writes), rng))
        return out


# Ops that update arguments their schema does not mark as written: BatchNorm's running statistics
# (native_functions.yaml declares native_batch_norm's running_mean/running_var as plain ``Tensor?``).
_UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def _written_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any]) -> list[int]:
    """Leaf positions (in the flattened (args, kwargs)) of tensors the op mutates, from its schema."""
    positions: list[int] = []
    mutated = written_tensors(func, args, kwargs, _UNDECLARED_WRITES.get(func.overloadpacket.__name__, ()))
    for t in mutated:
        positions.extend(p for p, x in enumerate(leaves) if x is t)
    return positions


# -- handles -------------------------------------------------------------------------------------------------
@dataclass
class _Handle:
    """One storage packed under a non-keep action (R3-R8)."""

    key: str
    action: Action
    nbytes: int
    rank: int
    sid: int | None = None  # recorder storage id (recompute)
    packs: int = 0
    unpacks: int = 0
    host: torch.Tensor | None = None  # swap: bytes in host memory
    d2h_done: Any = None
    h2d_done: Any = None
    packed: torch.Tensor | None = None  # compress: the cast copy
    device: torch.UntypedStorage | None = None  # the storage back on the device
    issued: bool = False
    leaving: torch.Tensor | None = None  # swap on CUDA: the device bytes until the copy out is done
    views: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)


@dataclass
class _Packed:
    handle: _Handle
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Kept:
    """A kept tensor whose unpack is a prefetch trigger (R4)."""

    tensor: torch.Tensor
    rank: int


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
          offset: int) -> torch.Tensor:  # fmt: skip
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass
class RuntimeStats:
    """What one step did, for reports and tests."""

    packs: int = 0
    swapped_bytes: int = 0
    recomputed_ops: int = 0
    compressed_bytes: int = 0
    unknown_keys: list[str] = field(default_factory=list)


class PolicyRuntime:
    """Applies one policy to one model, step after step (NOTE [ Runtime mechanics ])."""

    def __init__(self, policy: Policy, model: torch.nn.Module) -> None:
        self.policy = policy
        self.model = model
        self.device = next(iter(model.parameters())).device
        self.keyer = SavedTensorKeyer(model)
        self.ranks = policy.schedule.unpack_rank if policy.schedule else {}
        self.ignored = set(policy.schedule.ignored_keys) if policy.schedule else set()
        self.lookahead = policy.options.prefetch_lookahead
        self.compress_dtype = _COMPRESS_DTYPES[policy.options.compress_dtype]
        self.needs_hooks = any(a != Action.KEEP for a in policy.actions.values())
        self.needs_recorder = any(a == Action.RECOMPUTE for a in policy.actions.values())
        self.needs_triggers = any(a == Action.SWAP for a in policy.actions.values()) and self.lookahead > 0
        self._pinned: dict[str, torch.Tensor] = {}  # R3: one pinned buffer per key, reused
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        self._reported: set[str] = set()
        self.stats = RuntimeStats()

    @contextlib.contextmanager
    def step(self, force_hooks: bool = False) -> Iterator[RuntimeStats]:
        """One forward and its backward under the policy. ``force_hooks`` installs the hooks even for an
        all-keep policy (to measure their overhead)."""
        self.stats = RuntimeStats()
        with self._precision_checked():
            if not (self.needs_hooks or force_hooks):
                yield self.stats
                return
            with self._hooked():
                yield self.stats

    @contextlib.contextmanager
    def _precision_checked(self) -> Iterator[None]:
        """At the step's first module call, refuse a forward in another precision than the policy's (NOTE
        [ Precision ] in runtime.precision): one global pre-hook that removes itself."""
        handle: torch.utils.hooks.RemovableHandle | None = None

        def hook(_module: torch.nn.Module, _args: Any) -> None:
            assert handle is not None
            handle.remove()
            check_active(self.policy.precision, self.device.type)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _hooked(self) -> Iterator[None]:
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Handle, while it lives
        self._handles: list[_Handle] = []  # every handle of this step
        self._by_sid: dict[int, _Handle] = {}  # recorder storage id -> handle (recompute)
        self._swapped: list[_Handle] = []  # in rank order once sorted (R4)
        self._next_fetch = 0
        self._leaving: collections.deque[_Handle] = collections.deque()  # copies out in flight, in order
        self._recorder = _Recorder(self.device) if self.needs_recorder else None
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.keyer.attached(global_hooks=True))
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
                if self._recorder is not None:
                    stack.enter_context(self._recorder)
                yield
        finally:
            self._recorder = None
            for h in self._leaving:  # backward waited for every copy out (R5): nothing is in flight
                h.leaving = None
            self._leaving.clear()
            self._handles = []
            self._by_sid = {}
            self._swapped = []

    # -- pack ----------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if self._recorder is None:
            return self._pack_now(t)
        # The runtime's own ops (copies, casts, views) are not the model's: they bypass the recorder, which
        # costs a Python call per op (R6).
        with self._without_recorder():
            return self._pack_now(t)

    @contextlib.contextmanager
    def _without_recorder(self) -> Iterator[None]:
        """Take the recorder off the dispatch-mode stack while the runtime's own ops run (when it is on top;
        a mode entered inside the step stays, and the recorder's pause flag does the job). Other modes, the
        CPU memory tracker among them, still see every op."""
        if _get_current_dispatch_mode() is self._recorder:
            with _pop_mode_temporarily():
                yield
            return
        assert self._recorder is not None
        self._recorder.paused = True
        try:
            yield
        finally:
            self._recorder.paused = False

    def _reap(self) -> None:
        """Release the device bytes of every copy out that has finished (R3). The copies run in order on one
        stream, so the first unfinished one ends the walk."""
        while self._leaving and self._leaving[0].d2h_done.query():
            self._leaving.popleft().leaving = None

    def _pack_now(self, t: torch.Tensor) -> Any:
        self.stats.packs += 1
        if self._leaving:
            self._reap()
        keyed = self.keyer.key_for(t)
        if keyed.key is None:
            return t.detach()
        action = self.policy.actions.get(keyed.key)
        if action is None:
            if keyed.key not in self.ignored and keyed.key not in self._reported:
                self._reported.add(keyed.key)
                self.stats.unknown_keys.append(keyed.key)
                warnings.warn(f"autotune: saved tensor {keyed.key!r} is not in the policy for "
                              f"{self.policy.model}; it is kept", stacklevel=2)  # fmt: skip
            return t.detach()
        if action == Action.COMPRESS and not _compressible(t.dtype, self.compress_dtype):
            action = Action.KEEP  # R8
        if t.device != self.device:
            action = Action.KEEP  # R2: not device memory (attention's RNG seed and offset on the host)
        if action == Action.KEEP:  # R2
            rank = self.ranks.get(keyed.key, -1)
            return _Kept(t.detach(), rank) if self.needs_triggers else t.detach()
        storage = t.untyped_storage()
        handle = self._by_storage.get(storage)
        if handle is None:
            handle = _Handle(keyed.key, action, storage.nbytes(), self.ranks.get(keyed.key, -1))
            if self._recorder is not None:
                handle.sid = self._recorder.sid(storage)
                self._by_sid[handle.sid] = handle
            self._by_storage[storage] = handle
            self._handles.append(handle)
            self._first_pack(handle, t, storage)
        handle.packs += 1
        return _Packed(handle, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _first_pack(self, h: _Handle, t: torch.Tensor, storage: torch.UntypedStorage) -> None:
        if h.action == Action.SWAP:  # R3
            self.stats.swapped_bytes += h.nbytes
            src = _bytes_of(storage)
            if self._cuda:
                buf = self._pinned.get(h.key)
                if buf is None or buf.numel() != h.nbytes:
                    buf = self._pinned[h.key] = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=True)
                self._d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h):
                    buf.copy_(src, non_blocking=True)
                    h.d2h_done = torch.cuda.Event()
                    h.d2h_done.record()
                h.leaving = src  # R3: held until the copy is done (_reap), never reused under it
                self._leaving.append(h)
                h.host = buf
            else:
                with host_memory():
                    h.host = src.clone()
            self._swapped.append(h)
        elif h.action == Action.COMPRESS:  # R7
            self.stats.compressed_bytes += h.nbytes
            with torch.no_grad():
                h.packed = _bytes_of(storage).view(t.dtype).to(self.compress_dtype)
            h.views.append((t.dtype, (), (), 0))
        elif h.action == Action.RECOMPUTE:  # R6: nothing to do now; the recorder has its producer
            assert h.sid is not None

    # -- unpack --------------------------------------------------------------------------------------------
    def _unpack(self, p: Any) -> torch.Tensor:
        if self._recorder is None:
            return self._unpack_now(p)
        self._recorder.recording = False  # backward has started (R6)
        with self._without_recorder():  # as in _pack; replays record nothing either
            return self._unpack_now(p)

    def _unpack_now(self, p: Any) -> torch.Tensor:
        if self._leaving:
            self._reap()
        if isinstance(p, torch.Tensor):
            return p
        if isinstance(p, _Kept):
            self._prefetch_upto(p.rank)
            return p.tensor
        h: _Handle = p.handle
        if self.needs_triggers:
            self._prefetch_upto(h.rank)  # R4
        out = _view(self._materialize(h), p.dtype, p.size, p.stride, p.offset)
        h.unpacks += 1
        if h.unpacks >= h.packs:  # R8: the last backward node that needs it holds it from here
            h.device = None
            h.unpacks = h.packs = 0
        return out

    def _prefetch_upto(self, rank: int) -> None:
        if self._next_fetch == 0 and self._swapped:
            self._swapped.sort(key=lambda x: x.rank)
        while self._next_fetch < len(self._swapped) and self._swapped[self._next_fetch].rank <= rank + self.lookahead:
            self._issue_fetch(self._swapped[self._next_fetch])
            self._next_fetch += 1

    def _issue_fetch(self, h: _Handle) -> None:
        if h.issued:
            return
        h.issued = True
        assert h.host is not None
        dev = torch.empty(h.nbytes, dtype=torch.uint8, device=self.device)
        if self._cuda:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
            self._h2d.wait_event(h.d2h_done)
            with torch.cuda.stream(self._h2d):
                dev.copy_(h.host, non_blocking=True)
                h.h2d_done = torch.cuda.Event()
                h.h2d_done.record()
            dev.record_stream(self._h2d)
        else:
            dev.copy_(h.host)  # the host copy stays until the step ends, should the tensor be needed again
        self._hold(h, dev.untyped_storage())

    def _hold(self, h: _Handle, storage: torch.UntypedStorage) -> None:
        h.device = storage
        if self._recorder is not None and h.sid is not None:
            self._recorder.storage[h.sid] = weakref.ref(storage)  # replays find it while anything holds it

    def _materialize(self, h: _Handle) -> torch.UntypedStorage:
        """The storage back on the device (R5-R7), regenerated if it was released and is needed again."""
        if h.device is None and self._recorder is not None and h.sid is not None:
            alive = self._recorder.storage[h.sid]()
            if alive is not None:  # released by the handle but still held (by the node that unpacked it)
                h.device = alive
        if h.action == Action.SWAP:
            if h.device is None:
                h.issued = False  # released and needed again: fetch anew
            self._issue_fetch(h)
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(h.h2d_done)  # R5
        elif h.device is not None:
            return h.device
        elif h.action == Action.COMPRESS:
            if h.packed is None:
                raise RuntimeError(f"autotune: compressed tensor {h.key!r} was needed after its release")
            with torch.no_grad():
                self._hold(h, h.packed.to(h.views[0][0]).untyped_storage())
            h.packed = None
        elif h.action == Action.RECOMPUTE:
            assert self._recorder is not None and h.sid is not None
            with torch.no_grad():
                self._hold(h, _Replayer(self).storage(h.sid, len(self._recorder.ops)))
        assert h.device is not None
        return h.device


def _compressible(dtype: torch.dtype, target: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize > target.itemsize


class _Replayer:
    """Regenerates storages by replaying recorded ops (R6)."""

    def __init__(self, rt: PolicyRuntime) -> None:
        self.rt = rt
        assert rt._recorder is not None
        self.rec = rt._recorder
        self.handles = rt._by_sid
        self.made: dict[int, torch.UntypedStorage] = {}  # temporaries regenerated in this replay

    def storage(self, sid: int, before: int) -> torch.UntypedStorage:
        """The storage ``sid`` as it was just before op ``before`` (or at the end of the forward)."""
        if sid in self.made:
            return self.made[sid]
        alive = self.rec.storage[sid]()
        if alive is not None:
            return alive
        handle = self.handles.get(sid)
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

    def _run(self, op: _OpRecord, target: int, current: torch.UntypedStorage | None) -> torch.UntypedStorage:
        leaves: list[Any] = []
        for pos, leaf in enumerate(op.leaves):
            if not isinstance(leaf, _Ref):
                leaves.append(leaf)
                continue
            if leaf.sid == target:
                assert current is not None, "an op writes a storage before its producer"
                leaves.append(_view(current, leaf.dtype, leaf.size, leaf.stride, leaf.offset))
                continue
            storage = self.storage(leaf.sid, op.index)
            t = _view(storage, leaf.dtype, leaf.size, leaf.stride, leaf.offset)
            if pos in op.writes:
                t = t.clone()  # e.g. BatchNorm's running statistics: replay must not update them twice
            leaves.append(t)
        args, kwargs = _unflatten_args(leaves, op.spec)
        with _rng_state(op.rng, self.rt.device):
            out = op.func(*args, **kwargs)
        self.rt.stats.recomputed_ops += 1
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


@contextlib.contextmanager
def _rng_state(rng: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> Iterator[None]:
    if rng is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        yield


# -- Policy.applied --------------------------------------------------------------------------------------------
# The runtimes of a model live on the model (a runtime holds its model: a weak-keyed table would never let
# go of either), under a name no nn.Module uses; they go with it.
_RUNTIMES_ATTR = "_autotune_runtimes"


@contextlib.contextmanager
def applied(policy: Policy, model: torch.nn.Module) -> Iterator[RuntimeStats]:
    """``with applied(policy, model):`` one forward and backward under the policy (see the module docs)."""
    per_model: dict[int, PolicyRuntime] = model.__dict__.setdefault(_RUNTIMES_ATTR, {})
    rt = per_model.get(id(policy))
    if rt is None or rt.policy is not policy:
        rt = per_model[id(policy)] = PolicyRuntime(policy, model)
    with rt.step() as stats:
        yield stats
