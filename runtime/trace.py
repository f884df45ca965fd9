"""Capture one training iteration of a PyTorch model as a :class:`~runtime.workload.Workload`.

Usage::

    w = capture(lambda: (model, batch, loss_fn), name="resnet18", batch_size=8, fake=True)

``build`` is called inside the capture so that, in fake mode, parameters and batch are FakeTensors: no
memory is allocated and ResNet-101 at batch 64 traces in seconds. In real mode the ops run on the device
and each op is timed.

NOTE [ What is recorded ]
    A ``TorchDispatchMode`` sees every aten op below autograd, in forward, backward and the optimizer step.
    For each op it records the storages read and written (see runtime/workload.py, NOTE [ Tensors are
    storages ]), FLOPs (PyTorch's own ``flop_counter`` formulas for matmuls, convolutions and attention;
    one per output element for everything else), bytes moved, the module it belongs to and, in real mode,
    its time. Ops that only alias (views, ``detach``) and ``prim`` metadata queries are not recorded.
    Each first pack of a storage also records whether it ran inside the last op recorded: autograd saves an
    op's inputs before its kernel runs, after making the op's node, and its outputs after the kernel, with
    no node made since (``torch.autograd._get_sequence_nr`` counts the nodes made): a tensor that its own op
    saves as an output is packed while that op's inputs are still alive (``Candidate.packed_in_op``).
    Releases are observed, not guessed: a weak reference to each storage object fires when PyTorch frees
    it, and the release is placed after the last recorded op. So the lifetimes include Python's own
    references (a local that outlives its last use), the autograd engine's releases in backward and the
    optimizer's temporaries.

NOTE [ Steady state ]
    The recorded iteration is a steady-state one: optimizer state exists before it starts (a warm-up step
    creates it: a full iteration in real mode, a step on zero gradients in fake mode), gradients are
    ``None`` at its start (``zero_grad(set_to_none=True)``) and are released at its end. In fake mode the
    zero gradients are those of the parameters the loss's graph reaches (a forward, walked back, nothing
    computed): a trainable parameter the loss never reads (an unused head) has no gradient in real training,
    so its optimizer makes no state for it; with zeros for every parameter the fake trace held that state
    too, and its shape fingerprint was not the real trace's, which ``autotune train`` refused.

NOTE [ Gradient accumulation ]
    With ``grad_accum`` k > 1 an optimizer step follows k micro-batches, each a forward and backward of
    ``batch_size`` samples (its loss divided by k). The first micro-batch creates the gradients, the others
    add to them, so from the second on the gradients live through the forward: those micro-batches, the
    last followed by the step, hold the iteration's peak. The recorded iteration is one of them: the
    gradients exist before it (zeros in fake mode, a real micro-batch's in real mode) and outlive it, then
    the step. The simulator runs its micro-batch part k times and its step once (Rule 10 in
    envs/simulator.py); a policy applies to every micro-batch alike (keys restart with each
    ``policy.applied``).

NOTE [ Modules of backward ops ]
    A forward module post-hook walks the autograd graph back from the module's outputs and tags each new
    node with the module path in ``node.metadata``; a pre-hook first tags the nodes that produced the
    module's inputs with the enclosing module, so work done between submodules is not credited to the next
    one. In backward, ``torch._C._current_autograd_node()`` gives the node whose ops are running, hence its
    forward module. Nodes that no module produced (the loss) are tagged ``<loss>``.

NOTE [ Drop pass ]
    Before the recorded iteration, one forward runs with pack hooks that keep only the key (no tensor),
    as the runtime does for a tensor it swaps or recomputes. The release points seen there are each
    candidate's ``free_if_dropped_op``: what the simulator must use when a policy drops the tensor. The
    forward of the drop pass runs the same ops in the same order as the recorded one, so op indices agree.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from runtime.errors import AutotuneError, ModelError, one_line
from runtime.hardware import HardwareProfile
from runtime.keys import OUTSIDE, ROOT, SavedTensorKeyer, block_paths, parameter_fingerprint
from runtime.partition import Partition, partitioned
from runtime.precision import TrainStep
from runtime.shared_grads import SharedGradients
from runtime.target import add_library_workspaces, fake_trace_choices, op_workspace_bytes, trace_key
from runtime.vocab import Batch, LossFn, batch_tensors
from runtime.workload import Candidate, Frame, OpInfo, Phase, TensorInfo, TensorKind, Workload

BuildFn = Callable[[], tuple[torch.nn.Module, Batch, LossFn]]

OPTIMIZERS = ("sgd", "adam", "adamw")
_MODULE_TAG = "autotune_module"


def make_optimizer(name: str, params: Any, foreach: bool | None = None) -> torch.optim.Optimizer:
    """The optimizers a workload can be traced with; hyper-parameters do not change memory or time.
    ``foreach`` None: PyTorch's default for the parameters' device (a GPU target's fake trace passes True,
    NOTE [ GPU-faithful fake traces ] G3)."""
    name = name.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
    raise AutotuneError(f"unknown optimizer '{name}': expected one of {', '.join(OPTIMIZERS)}")


# -- one tensor/op record per storage/op while capturing ------------------------------------------------
@dataclass
class _Tensor:
    id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    alloc_op: int
    free_op: int | None = None
    phase: Phase | None = None  # phase of the allocating op
    writers: list[int] = field(default_factory=list)
    readers: list[int] = field(default_factory=list)


# BatchNorm's saved mean and inverse standard deviation (outputs 1 and 2): the CPU and CUDA kernels keep them
# in float32 for bfloat16 and float16 inputs (their accumulation type), where the meta kernels that
# FakeTensorMode runs give them the input's dtype, half the bytes. Real-mode traces see the real ones.
_FP32_STATS = frozenset({"aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                         "aten.cudnn_batch_norm.default", "aten.miopen_batch_norm.default"})  # fmt: skip


class _Recorder(TorchDispatchMode):
    """Records ops, storages and their releases (NOTE [ What is recorded ])."""

    def __init__(self, time_ops: bool, target: HardwareProfile | None = None) -> None:
        super().__init__()
        self.ops: list[OpInfo] = []
        self.tensors: list[_Tensor] = []
        self.ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> tensor id
        self._refs: list[weakref.ref[Any]] = []
        self.phase = Phase.FORWARD
        self.paused = False
        self.closed = False
        self.module_of: Callable[[], str] = lambda: OUTSIDE
        self.frame_of: Callable[[], int] = lambda: -1  # innermost module call (NOTE [ Frames ])
        self._time_ops = time_ops
        self.target = target  # a fake trace's GPU target (G7's and G8's workspaces)
        self.ignored_keys: list[str] = []
        self.nodes_at_last_op = -1  # autograd nodes made when the last recorded op was dispatched
        self._cuda_events: list[tuple[int, Any, Any]] = []
        # Real CUDA traces read each op's workspace off the allocator (bytes allocated and released inside it).
        self._cuda_memory = time_ops and torch.cuda.is_available() and torch.cuda.is_initialized()
        # ... and where the host is apart from the device (CUDA), when the host reached each op.
        self._host_entry: list[float] | None = [] if self._cuda_memory else None

    # -- storages ----------------------------------------------------------------------------------------
    def register(self, t: torch.Tensor, kind: TensorKind, alloc_op: int = -1, fp32: bool = False) -> int:
        """``fp32``: the real kernel makes this output in float32 where the meta kernel said otherwise
        (:data:`_FP32_STATS`): count its bytes and dtype as the real one."""
        storage = t.untyped_storage()
        tid = self.ids.get(storage)
        if tid is not None:
            return tid
        tid = len(self.tensors)
        widen = fp32 and t.dtype.is_floating_point and t.dtype.itemsize < 4
        self.tensors.append(
            _Tensor(
                tid,
                storage.nbytes() * (4 // t.dtype.itemsize) if widen else storage.nbytes(),
                tuple(t.shape),
                "float32" if widen else str(t.dtype).removeprefix("torch."),
                kind,
                alloc_op,
                phase=self.phase if alloc_op >= 0 else None,
            )
        )
        self.ids[storage] = tid
        self._refs.append(weakref.ref(storage, self._released(tid)))
        return tid

    def _released(self, tid: int) -> Callable[[Any], None]:
        def callback(_ref: Any) -> None:
            if not self.closed:
                self.tensors[tid].free_op = len(self.ops) - 1

        return callback

    def tensor_id(self, t: torch.Tensor) -> int | None:
        return self.ids.get(t.untyped_storage())

    # -- ops ---------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.paused or func.namespace == "prim":
            return func(*args, **kwargs)
        entered = time.perf_counter()
        if self._cuda_memory:
            torch.cuda.reset_peak_memory_stats()  # the op's own high-water mark, for its workspace
        start = self._clock()
        out = func(*args, **kwargs)
        end = self._clock()
        if self._cuda_memory:
            workspace = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        else:  # NOTE [ GPU-faithful fake traces ] G7, G8 (0 unless a fake trace for a GPU)
            workspace = op_workspace_bytes(func, args, kwargs, self.target)

        written = written_tensors(func, args, kwargs)
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out_tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        new = [t for t in out_tensors if t.untyped_storage() not in self.ids]
        if not new and not written:  # an alias (view, detach) or a query: no memory effect, nothing to run
            if self.ops and self.phase == Phase.FORWARD:
                self.ops[-1].quiet_ops += 1  # ... but the runtime's recorder runs under it (Rule 12)
            return out

        index = len(self.ops)
        self.nodes_at_last_op = _nodes_made()
        inputs: list[int] = []
        for t in in_tensors:
            tid = self.register(t, TensorKind.BUFFER)  # unseen storage: state created before the capture
            if tid not in inputs:
                inputs.append(tid)
        stats = {id(t) for t in out_tensors[1:3]} if str(func) in _FP32_STATS else set()
        outputs = [self.register(t, TensorKind.TEMPORARY, alloc_op=index, fp32=id(t) in stats) for t in new]
        for t in written:
            tid = self.register(t, TensorKind.BUFFER)
            if tid not in outputs:
                outputs.append(tid)
                self.tensors[tid].writers.append(index)
        for tid in inputs:
            self.tensors[tid].readers.append(index)

        dtype = next((str(t.dtype).removeprefix("torch.") for t in out_tensors if t.is_floating_point()), "float32")
        forward = self.phase == Phase.FORWARD
        self.ops.append(
            OpInfo(
                index=index,
                name=str(func),
                phase=self.phase,
                module=self.module_of(),
                flops=_flops(func, args, kwargs, out, out_tensors),
                bytes_moved=sum(_view_bytes(t) for t in in_tensors) + sum(_view_bytes(t) for t in out_tensors),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                dtype=dtype,
                workspace_bytes=max(0, int(workspace)),
                frame=self.frame_of() if forward else -1,
                seeded=torch.Tag.nondeterministic_seeded in func.tags,
            )
        )
        if self._host_entry is not None:
            self._host_entry.append(entered)
        if self._time_ops:
            if isinstance(start, float):
                self.ops[-1].time_s = float(end) - start
            else:
                self._cuda_events.append((index, start, end))
        return out

    def _clock(self) -> Any:
        if not self._time_ops:
            return 0.0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def finish_timing(self) -> None:
        if self._cuda_events:
            torch.cuda.synchronize()
            for index, start, end in self._cuda_events:
                self.ops[index].time_s = start.elapsed_time(end) / 1e3
        if self._host_entry:  # each op's host time: from its dispatch to the next op's
            entries = self._host_entry
            for op, begin, end in zip(self.ops, entries, [*entries[1:], entries[-1]], strict=True):
                op.host_s = end - begin


@functools.cache
def written_arguments(func: Any, undeclared: tuple[int, ...] = ()) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument an op mutates (in-place and out= arguments), from its schema's alias
    annotations, plus the positions ``undeclared`` that it mutates without saying so; read once per op."""
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if (arg.alias_info is not None and arg.alias_info.is_write) or i in undeclared
    )


def written_tensors(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], undeclared: tuple[int, ...] = ()
) -> list[torch.Tensor]:
    """Tensors an op mutates (:func:`written_arguments`)."""
    out: list[torch.Tensor] = []
    for i, name in written_arguments(func, undeclared):
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def _view_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any, out_tensors: list[torch.Tensor]) -> float:
    fn = flop_registry.get(func.overloadpacket)
    if fn is not None:
        try:
            return float(fn(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not accept this overload's arguments: estimate below
            pass
    return float(sum(t.numel() for t in out_tensors))


# -- module attribution (NOTE [ Modules of backward ops ]) -------------------------------------------------
def _metadata(node: Any) -> dict[str, Any]:
    return cast(dict[str, Any], node.metadata)  # a dict attribute; typed as a method in torch's stubs


def _tag_graph(roots: Any, module: str) -> None:
    stack = [t.grad_fn for t in tree_leaves(roots) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or _MODULE_TAG in _metadata(node):
            continue
        _metadata(node)[_MODULE_TAG] = module
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def _outputs_of(out: Any) -> Any:
    # HF ModelOutput is a dict subclass; pytree may not know it.
    return list(out.values()) if isinstance(out, dict) else out


@contextlib.contextmanager
def _attribute_backward(model: torch.nn.Module, keyer: SavedTensorKeyer) -> Iterator[None]:
    handles = []
    for path, mod in model.named_modules():
        name = path or ROOT

        def pre(_m: torch.nn.Module, args: Any) -> None:
            _tag_graph(args, keyer.current_module)  # runs before the keyer's pre-hook pushes this module

        def post(_m: torch.nn.Module, _args: Any, out: Any, name: str = name) -> None:
            _tag_graph(_outputs_of(out), name)

        handles.append(mod.register_forward_pre_hook(pre, prepend=True))
        handles.append(mod.register_forward_hook(post, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _backward_module() -> str:
    node = torch._C._current_autograd_node()
    if node is None:
        return OUTSIDE
    return str(_metadata(node).get(_MODULE_TAG, OUTSIDE))


# -- module calls (NOTE [ Frames ] in runtime/workload.py) -------------------------------------------------
class _FrameLog:
    """The module calls of the recorded forward, and the frame each pack happens in."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.frames = [Frame(0, OUTSIDE, 0, -1, 0, -1)]
        self._stack = [0]
        self._calls: dict[str, int] = {}
        self._idle: list[str] = []  # calls without grad, running: not frames, as not in the keys
        self.packs: dict[int, list[tuple[int, int]]] = {}  # candidate tensor id -> (frame, last op) per pack
        self.active = True  # until the forward ends

    @property
    def current(self) -> int:
        return self._stack[-1]

    @contextlib.contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[_FrameLog]:
        handles = []
        for path, mod in model.named_modules():
            name = path or ROOT
            norm = isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)

            def pre(_m: torch.nn.Module, args: Any, kwargs: Any, name: str = name, norm: bool = norm) -> None:
                self._enter(name, norm, (args, kwargs))

            def post(_m: torch.nn.Module, _args: Any, _kwargs: Any, out: Any, name: str = name) -> None:
                self._leave(name, out)

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True, prepend=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _ids(self, values: Any) -> tuple[int, ...]:
        ids = (self.rec.tensor_id(t) for t in tree_leaves(values) if isinstance(t, torch.Tensor))
        return tuple(-1 if i is None else i for i in ids)

    def _enter(self, name: str, norm: bool, args: Any) -> None:
        if not self.active:
            return
        if not torch.is_grad_enabled():  # saves nothing, and the keys do not count it (runtime/keys.py)
            self._idle.append(name)
            return
        call = self._calls.get(name, 0)  # from 0 in each step, as in the keys (a second call of the model goes on)
        self._calls[name] = call + 1
        parent = self._stack[-1] if len(self._stack) > 1 else -1  # frame 0 encloses nothing
        n = len(self.rec.ops)
        frame = Frame(len(self.frames), name, call, parent, n, n - 1, args=self._ids(args), norm=norm)
        self.frames.append(frame)
        self._stack.append(frame.index)

    def _leave(self, name: str, out: Any) -> None:
        if self._idle and self._idle[-1] == name:
            self._idle.pop()
            return
        if not self.active or len(self._stack) == 1 or self.frames[self._stack[-1]].path != name:
            return
        frame = self.frames[self._stack.pop()]
        frame.last_op = len(self.rec.ops) - 1
        outputs = _outputs_of(out)
        frame.outputs = self._ids(outputs)
        frame.view_out = any(isinstance(t, torch.Tensor) and t._is_view() for t in tree_leaves(outputs))

    def end_forward(self) -> None:
        self.frames[0].last_op = len(self.rec.ops) - 1
        self.active = False


# -- the capture -------------------------------------------------------------------------------------------
def capture(
    build: BuildFn,
    *,
    name: str,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "sgd",
    fake: bool = True,
    device: str = "cpu",
    precision: str = "fp32",
    grad_accum: int = 1,
    target: HardwareProfile | None = None,
    partitions: Sequence[Partition] = (),
) -> Workload:
    """Trace one steady-state training iteration (NOTE [ Steady state ]) and return its Workload;
    ``precision`` fp32, or bf16/fp16 under torch.autocast (NOTE [ Precision ] in runtime.precision);
    ``grad_accum`` micro-batches per optimizer step (NOTE [ Gradient accumulation ]); ``target``, for a
    fake trace, the profile the plan is for: a GPU's takes that GPU's device-dependent choices (NOTE
    [ GPU-faithful fake traces ] in runtime/target.py); ``partitions``, submodules that run on slices of the
    batch (NOTE [ Partition ] in runtime/partition.py: the trace is taken as the runtime runs them)."""
    mode: contextlib.AbstractContextManager[Any] = FakeTensorMode() if fake else contextlib.nullcontext()
    gpu = fake and trace_key(target)[0]
    with mode, fake_trace_choices(target) if fake else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(_fake_conversions())
        model, batch, loss_fn = build()
        if isinstance(mode, FakeTensorMode):
            _own_fakes(model, mode)
        model.train()
        stack.enter_context(partitioned(model, partitions))
        opt = make_optimizer(optimizer, model.parameters(), foreach=True if gpu else None)
        step = TrainStep(precision, torch.device(device).type, fake=fake, grad_accum=grad_accum)
        try:
            _warm_up(model, batch, loss_fn, opt, step, full=not fake)
        except AutotuneError:
            raise
        except Exception as e:  # no hook of autotune's ran yet: the model's own failure
            raise ModelError(
                f"{name} raised in its first training step, run before any of autotune's hooks: "
                f"{type(e).__name__}: {one_line(e) or type(e).__name__}"
            ) from e
        if step.grad_accum > 1:  # the gradients of the micro-batches before this one
            _warm_up(model, batch, loss_fn, None, step, full=not fake)
        keyer = SavedTensorKeyer(model)
        with keyer.attached():
            dropped = _drop_pass(model, batch, loss_fn, opt, keyer, step)
            rec, cand_order, (saved_after, saved_in, unpacked, in_op), frames = _record(
                model, batch, loss_fn, opt, keyer, step, time_ops=not fake, target=target if gpu else None
            )
        # The median of five plain iterations: what a training step typically takes (NOTE [ Op time
        # calibration ]).
        plain = None if fake else _median_run([_plain_iteration_s(model, batch, loss_fn, opt, step) for _ in range(5)])
    w = _build_workload(
        rec,
        cand_order,
        saved_after,
        saved_in,
        unpacked,
        in_op,
        dropped,
        block_paths(model),
        frames,
        model=name,
        batch_size=batch_size,
        seq_len=seq_len,
        optimizer=optimizer,
        mode="fake" if fake else "real",
        device=_device_name(device),
    )
    w.precision = step.precision
    w.grad_accum = step.grad_accum
    if step.grad_accum > 1:
        opt.zero_grad(set_to_none=True)
    w.meta["plain_iter_s"] = None if plain is None else plain[0]
    w.meta["plain_host_s"] = None if plain is None else plain[1]
    w.meta["parameter_fingerprint"] = parameter_fingerprint(model)
    if fake:  # whose kernels a fake trace took (NOTE [ GPU-faithful fake traces ]): a GPU profile's, or the CPU's
        w.meta["traced_for"] = target.name if gpu and target is not None else "cpu"
    if partitions:
        w.meta["partitions"] = [p.to_dict() for p in partitions]
        w.compute_fingerprints()  # they are part of the structure
    if gpu:  # NOTE [ GPU-faithful fake traces ] G6: the libraries' workspaces, which no trace sees
        add_library_workspaces(w, trace_key(target)[1])
    elif not fake and torch.device(device).type == "cuda":
        add_library_workspaces(w, torch.cuda.get_device_capability(torch.device(device)))
    return w


def _median_run(runs: list[tuple[float, float | None]]) -> tuple[float, float | None]:
    """The run of median wall time (its host part with it)."""
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


def _plain_iteration_s(
    model: torch.nn.Module, batch: Batch, loss_fn: LossFn, opt: torch.optim.Optimizer, step: TrainStep
) -> tuple[float, float | None]:
    """Wall time of one iteration without the recorder (NOTE [ Op time calibration ] in runtime.hardware)
    and, on a GPU, the host's part of it: until the last op was issued, before waiting for the device."""
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step.backward(step.loss(model, batch, loss_fn))
    step.step(opt)
    issued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)
    return elapsed, (issued - start) if cuda else None


@contextlib.contextmanager
def _fake_conversions() -> Iterator[None]:
    """A factory that converts its model in place (``model.to(memory_format=torch.channels_last)``, a dtype)
    under FakeTensorMode: ``Module._apply`` swaps each fake parameter with its converted one
    (``torch.utils.swap_tensors``), which fails on a fake tensor the mode holds a weak reference to
    ("Couldn't swap Conv2d.weight"); there the parameter takes the converted one's data instead, which is what
    ``_apply`` does for real tensors. Through the whole fake trace: a model may convert a submodule in its
    forward too (Switch Transformers' router calls ``self.classifier.to(self.dtype)``, a no-op in eager)."""
    swap = torch.utils.swap_tensors

    def swap_or_set(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError as e:
            if "weakref" not in str(e) or not isinstance(t1, FakeTensor):
                raise
            with torch.no_grad():
                t1.data = t2.detach()

    torch.utils.swap_tensors = swap_or_set
    try:
        with fake_deepcopy():
            yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def fake_deepcopy() -> Iterator[None]:
    """``copy.deepcopy`` of a fake tensor (``nn.TransformerEncoder`` copies its layer) as a new fake tensor of the
    same shape, strides, dtype and device in the active fake mode. torch's copies a tensor whose data pointer
    reads non-zero through its storage's bytes: after a factory wrote into a fake tensor by indexing
    (``pad[1, 6:] = True``, a padding mask) that read memory that is not there, and the process died later
    ("corrupted double-linked list", a segmentation fault). A fake tensor has no values to copy."""
    own = FakeTensor.__dict__.get("__deepcopy__")  # (torch 2.14's is Tensor's, inherited)

    def deepcopy(self: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return cast(torch.Tensor, memo[id(self)])
        with detect_fake_mode() or self.fake_mode:
            new = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)
        new.requires_grad_(self.requires_grad)
        if isinstance(self, torch.nn.Parameter) or getattr(self, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new

    FakeTensor.__deepcopy__ = deepcopy  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own  # type: ignore[method-assign,assignment]


def _own_fakes(model: torch.nn.Module, mode: FakeTensorMode) -> None:
    """Parameters and buffers of another fake mode made this trace's. ``copy.deepcopy`` under a FakeTensorMode
    (``nn.TransformerEncoder`` copies its layer so) returns tensors of a fake mode of their own, no longer
    ``Parameter``s, which every later op refuses ("Mixing fake modes NYI"); a fake tensor has no values, so
    one of the same shape, strides, dtype and device in this mode stands in (a tensor shared by several
    modules stays one)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[tuple[dict[str, Any], bool], ...] = ((module._parameters, True), (module._buffers, False))
        for table, parameter in tables:
            for name, t in table.items():
                if not isinstance(t, FakeTensor) or t.fake_mode is mode:
                    continue
                new = made.get(id(t))
                if new is None:
                    with mode:
                        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                    if parameter:
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                table[name] = new


def _warm_up(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer | None,
    step: TrainStep,
    full: bool,
) -> None:
    """A full iteration (real mode), or gradients of zeros (fake mode: no compute to warm up), then the
    optimizer step that creates its state; ``opt`` None: only the gradients, kept (gradient accumulation)."""
    if full or step.scaler is not None:  # the scaler makes its state at its first scale()
        step.backward(step.loss(model, batch, loss_fn))
    else:
        loss = step.loss(model, batch, loss_fn)
        _check_loss(loss)
        trained = _reached(loss)  # NOTE [ Steady state ]
        for p in model.parameters():
            if p.requires_grad and id(p) in trained:
                p.grad = torch.zeros_like(p)
    if opt is None:
        return
    step.step(opt)
    opt.zero_grad(set_to_none=True)


def _check_loss(loss: Any) -> None:
    """What ``loss.backward()`` refuses, said as it says it, where the fake warm-up runs no backward (its first
    backward came in the recorded step, after autotune's hooks, and the error read as autotune's own)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss is a {type(loss).__name__}, not a tensor: backward needs a tensor")
    if loss.numel() != 1:
        raise RuntimeError(
            f"grad can be implicitly created only for scalar outputs (the loss has shape {tuple(loss.shape)})"
        )
    if not loss.requires_grad:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")


def _reached(loss: torch.Tensor) -> set[int]:
    """The ids of the leaves the graph of ``loss`` reaches (its ``AccumulateGrad`` nodes' tensors)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None:
            reached.add(id(leaf))
        todo.extend(n for n, _ in fn.next_functions)
    return reached


def _register_state(
    rec: _Recorder, model: torch.nn.Module, batch: Batch, opt: torch.optim.Optimizer, step: TrainStep
) -> None:
    for t in step.state():
        rec.register(t, TensorKind.OPTIMIZER_STATE)
    for p in model.parameters():
        if p.grad is not None:  # gradient accumulation: earlier micro-batches' gradients
            rec.register(p.grad, TensorKind.GRADIENT)
        rec.register(p, TensorKind.PARAMETER)
    for b in model.buffers():
        rec.register(b, TensorKind.BUFFER)
    for t in batch_tensors(batch):
        rec.register(t, TensorKind.INPUT)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                rec.register(v, TensorKind.OPTIMIZER_STATE)


def _drop_pass(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    keyer: SavedTensorKeyer,
    step: TrainStep,
) -> dict[str, int]:
    """Forward only, autograd keeping no saved tensor (NOTE [ Drop pass ]): key -> release op."""
    keyer.new_forward()
    rec = _Recorder(time_ops=False)
    _register_state(rec, model, batch, opt, step)
    keys: dict[int, str] = {}  # tensor id -> key

    def pack(t: torch.Tensor) -> str | None:
        rec.paused = True
        try:
            k = keyer.key_for(t)
            tid = rec.tensor_id(t)
            if k.key is not None and tid is not None:
                keys.setdefault(tid, k.key)
            return k.key
        finally:
            rec.paused = False

    def unpack(_key: Any) -> torch.Tensor:
        raise AssertionError("the drop pass never runs backward")

    with rec, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = step.scaled(step.loss(model, batch, loss_fn))
    end_of_forward = len(rec.ops) - 1
    released = {key: rec.tensors[tid].free_op for tid, key in keys.items()}
    del loss
    rec.closed = True
    # Still alive after the forward: something other than autograd holds it; dropping frees nothing.
    return {key: (op if op is not None and op <= end_of_forward else -1) for key, op in released.items()}


def _record(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    keyer: SavedTensorKeyer,
    step: TrainStep,
    time_ops: bool,
    target: HardwareProfile | None = None,
) -> tuple[
    _Recorder, dict[int, str], tuple[dict[int, int], dict[int, set[str]], dict[int, int], dict[int, bool]], _FrameLog
]:
    keyer.new_forward()
    rec = _Recorder(time_ops=time_ops, target=target)
    _register_state(rec, model, batch, opt, step)
    cand: dict[int, str] = {}  # tensor id -> key, in first-pack order
    saved_after: dict[int, int] = {}  # tensor id -> last op completed at its first pack
    in_op: dict[int, bool] = {}  # tensor id -> its first pack ran inside that op (its own output's save)
    saved_in: dict[int, set[str]] = {}  # tensor id -> modules whose ops saved it
    unpacked: dict[int, int] = {}  # tensor id -> the op backward runs next at its first unpack, in unpack order
    ignored: list[str] = rec.ignored_keys
    log = _FrameLog(rec)
    packs = log.packs

    def pack(t: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        rec.paused = True
        try:
            k = keyer.key_for(t)
            tid = rec.tensor_id(t)
            frame = log.current
            log.frames[frame].packs += 1
            if k.key is not None and tid is not None and rec.tensors[tid].phase == Phase.FORWARD:
                cand.setdefault(tid, k.key)
                saved_after.setdefault(tid, len(rec.ops) - 1)
                in_op.setdefault(tid, rec.nodes_at_last_op == _nodes_made() >= 0)
                saved_in.setdefault(tid, set()).add(keyer.current_module)
                packs.setdefault(tid, []).append((frame, len(rec.ops) - 1))
            else:
                tid = None
                if k.first_pack and k.key is not None:
                    ignored.append(k.key)  # saved but not made in forward (the batch, targets): not a candidate
            return tid, t.detach()  # not t itself: a saved output holding its own grad_fn would never be freed
        finally:
            rec.paused = False

    def unpack(packed: tuple[int | None, torch.Tensor]) -> torch.Tensor:
        # A backward node unpacks all it saved when it starts, before the first of its ops (a multiplication's
        # gradient unpacks both factors, then runs two ops): where the runtime materializes a tensor.
        tid, t = packed
        if tid is not None and rec.phase == Phase.BACKWARD:
            unpacked.setdefault(tid, len(rec.ops))
        return t

    def in_place(into: torch.Tensor, out: torch.Tensor) -> None:  # S4 of runtime/shared_grads.py
        op, tid = rec.ops[-1], rec.tensor_id(into)
        if tid is not None and rec.tensor_id(out) in op.outputs and tid in op.inputs:
            op.in_place_into = tid

    shared = SharedGradients(model, in_place=False, mark=in_place)
    with _attribute_backward(model, keyer), log.attached(model), shared.installed(), rec:
        rec.phase = Phase.FORWARD
        rec.module_of = lambda: keyer.current_module
        rec.frame_of = lambda: log.current
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            # The fp16 loss scaling saves the scale: inside the hooks, so it is known (and ignored) by key.
            # The loss as computed lives through backward, as the caller's ``loss`` does beside the scaled one
            # (``scaler.scale(loss).backward()``; 4 bytes under the measured peak in fp16 when it did not).
            unscaled = step.loss(model, batch, loss_fn)
            loss = step.scaled(unscaled)
        log.end_forward()
        _tag_graph(loss, OUTSIDE)
        rec.phase = Phase.BACKWARD
        rec.module_of = _backward_module
        loss.backward()
        del loss, unscaled
        rec.phase = Phase.OPTIMIZER
        rec.module_of = lambda: "<optimizer>"
        step.step(opt)
        for p in model.parameters():
            if p.grad is not None:
                rec.tensors[rec.register(p.grad, TensorKind.GRADIENT)].kind = TensorKind.GRADIENT
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    rec.tensors[rec.register(v, TensorKind.OPTIMIZER_STATE)].kind = TensorKind.OPTIMIZER_STATE
        if step.grad_accum == 1:
            opt.zero_grad(set_to_none=True)  # gradients die here, after the last op
    rec.closed = True
    rec.finish_timing()
    return rec, cand, (saved_after, saved_in, unpacked, in_op), log


def _build_workload(
    rec: _Recorder,
    cand: dict[int, str],
    saved_after: dict[int, int],
    saved_in: dict[int, set[str]],
    unpacked: dict[int, int],
    in_op: dict[int, bool],
    dropped: dict[str, int],
    blocks: dict[str, str],
    log: _FrameLog,
    **info: Any,
) -> Workload:
    unpack_seq = {tid: i for i, tid in enumerate(unpacked)}  # (a dict keeps the first unpacks' order)
    tensors = [
        TensorInfo(
            id=t.id,
            nbytes=t.nbytes,
            shape=t.shape,
            dtype=t.dtype,
            kind=TensorKind.ACTIVATION if t.id in cand else t.kind,
            alloc_op=t.alloc_op,
            free_op=t.free_op,
        )
        for t in rec.tensors
    ]
    n_fwd = sum(1 for op in rec.ops if op.phase == Phase.FORWARD)
    candidates = []
    for tid, key in cand.items():
        t = rec.tensors[tid]
        fwd_writers = [i for i in t.writers if i < n_fwd]
        fwd_uses = [i for i in t.readers + fwd_writers if i < n_fwd]
        chain = [t.alloc_op, *fwd_writers]
        needs = {i for op in chain for i in rec.ops[op].inputs} - {tid}
        last_fwd = max(fwd_uses, default=t.alloc_op)
        drop_at = dropped.get(key, -1)
        save_op = max(saved_after[tid], t.alloc_op, *fwd_writers)
        candidates.append(
            Candidate(
                key=key,
                tensor=tid,
                nbytes=t.nbytes,
                producer=t.alloc_op,
                writers=tuple(fwd_writers),
                save_op=save_op,
                last_fwd_use=last_fwd,
                bwd_uses=tuple(i for i in t.readers if rec.ops[i].phase == Phase.BACKWARD),
                # A release before the last use would be a tracing bug; -1 means dropping frees nothing.
                free_if_dropped_op=max(drop_at, last_fwd)
                if drop_at >= 0
                else (len(rec.ops) - 1 if t.free_op is None else t.free_op),
                recompute_inputs=tuple(sorted(needs)),
                block=_block(blocks, rec.ops[t.alloc_op].module),
                block_input=any(_block(blocks, m) != _block(blocks, rec.ops[t.alloc_op].module) for m in saved_in[tid]),
                packs=tuple(log.packs[tid]),
                unpack_op=unpacked.get(tid, -1),
                unpack_seq=unpack_seq.get(tid, -1),
                packed_in_op=in_op[tid] and save_op == saved_after[tid],
            )
        )
    w = Workload(
        ops=rec.ops,
        tensors=tensors,
        candidates=candidates,
        torch_version=torch.__version__,
        frames=log.frames,
        **info,
    )
    w.meta["ignored_keys"] = rec.ignored_keys
    w.compute_fingerprints()
    return w


def _nodes_made() -> int:
    """How many autograd nodes this thread has made (-1 where torch does not say)."""
    counter = getattr(torch.autograd, "_get_sequence_nr", None)
    return int(counter()) if counter is not None else -1


def _block(blocks: dict[str, str], module: str) -> str:
    return blocks.get(module, module)


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device
