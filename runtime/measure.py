"""Measure real training iterations: peak device memory and time.

NOTE [ Device memory on the CPU ]
    On CUDA the caching allocator's statistics give the peak (``torch.cuda.max_memory_allocated``). The CPU
    has no separate device memory and process RSS is useless (the allocator keeps freed pages, Python and
    libraries share the heap), so :class:`StorageTracker` counts exactly the storages that hold the
    training's tensors: the model's parameters and buffers, the batch, the optimizer state and gradients
    that exist when it starts, and every storage an aten op creates while it is active, until PyTorch
    releases it (a weak reference to the storage fires). Storages created inside :meth:`StorageTracker.host`
    are not counted: that is where the runtime keeps swapped tensors, the CPU's stand-in for host memory.
    Scratch buffers that kernels allocate internally are invisible to it (they are to the trace too).
    ``profiler_peak_bytes`` reads the CPU allocator's own events instead, for compiled code (dynamo does not
    compile under the tracker's dispatch mode): by default its highest point between aten ops, at each
    outermost op's end and at each allocation or free outside every op, which is what the storages hold
    (on a GroupNorm CNN under a recompute policy, eagerly, the tracker's peak to the byte, where the
    allocator's own highest point, with convolutions' scratch, was 14% above it); with ``scratch`` the
    allocator's highest point, scratch included, to cross-check.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from runtime.precision import TrainStep
from runtime.vocab import Batch, LossFn, batch_tensors

_ACTIVE: contextvars.ContextVar[StorageTracker | None] = contextvars.ContextVar("autotune_tracker", default=None)


def host_memory() -> contextlib.AbstractContextManager[None]:
    """Storages created inside are host memory for the active :class:`StorageTracker` (the runtime's
    swap store on the CPU); a no-op when no tracker is active."""
    tracker = _ACTIVE.get()
    return tracker.host() if tracker is not None else contextlib.nullcontext()


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages a training iteration uses on the CPU (NOTE [ Device memory on the CPU ])."""

    def __init__(self) -> None:
        super().__init__()
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> nbytes
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._host_depth = 0
        self.live_bytes = 0
        self.peak_bytes = 0

    def track(self, *tensors: Any) -> None:
        """Count storages that exist already (parameters, batch, optimizer state)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage in self._live:
            return
        n = storage.nbytes()
        self._live[storage] = n
        key = id(storage)
        self._refs[key] = weakref.ref(storage, functools.partial(self._release, key, n))
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int, n: int, _ref: object = None) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= n

    def __enter__(self) -> StorageTracker:
        self._token = _ACTIVE.set(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _ACTIVE.reset(self._token)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Storages created inside this block live in host memory: not counted."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._host_depth == 0:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._add(t.untyped_storage())
        return out


@dataclass
class IterationMeasurement:
    """One real training iteration."""

    peak_bytes: int  # peak device memory during the iteration, persistent state included
    iter_s: float
    samples_per_s: float
    reserved_bytes: int | None = None  # CUDA: the caching allocator's reserved peak (max_memory_reserved)
    # CUDA: how often the caching allocator found no room within the device's cap (``capped_memory``: what a
    # policy's budget allows) and freed its cached segments to try again, and how many segments it freed
    # (cudaFree synchronises the device: an iteration with retries runs slower than planned).
    alloc_retries: int | None = None
    segments_freed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_state(model: torch.nn.Module, batch: Batch, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors alive between iterations: parameters, buffers, gradients, optimizer state and the batch."""
    state: list[torch.Tensor] = [*model.parameters(), *model.buffers(), *batch_tensors(batch)]
    state += [p.grad for p in model.parameters() if p.grad is not None]
    state += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return state


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views and aliases counted once): what lives across
    steps, the baseline of :func:`profiler_peak_bytes`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@contextlib.contextmanager
def capped_memory(device: str, cap_bytes: int | None) -> Iterator[None]:
    """On a CUDA ``device`` with ``cap_bytes``: the caching allocator may hold at most that many bytes (its
    reserved bytes, ``torch.cuda.set_per_process_memory_fraction`` of the device's total), as a policy's
    budget is enforced by ``autotune train`` and the measured search; the limit is lifted after. Elsewhere,
    or with no cap: nothing."""
    if cap_bytes is None or torch.device(device).type != "cuda":
        yield
        return
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # "cuda" alone: the current device
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def run_iterations(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    *,
    steps: int,
    batch_size: int,
    around_step: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    warmup: int = 1,
    precision: str = "fp32",
    grad_accum: int = 1,
    cpu_peak: str = "tracker",
) -> list[IterationMeasurement]:
    """Run ``warmup`` then ``steps`` training iterations (zero_grad, forward, loss, backward, step) and
    measure each one's peak device memory and wall time. ``around_step`` wraps forward and backward (the
    runtime applies a policy there); ``precision`` bf16/fp16 runs the forward under torch.autocast (fp16
    with a GradScaler), as ``runtime.precision.TrainStep`` does for the tracer; ``grad_accum`` k runs k
    micro-batches of ``batch_size`` (each wrapped in ``around_step``) per optimizer step: one iteration,
    k x ``batch_size`` samples.

    On CUDA the allocator's statistics cost nothing, so each step measures both. On the CPU the storage
    tracker is a dispatch mode that slows every op, so the timed steps run without it and one more step,
    after them, measures the peak (the same for every step: the iteration is deterministic). ``cpu_peak``
    "profiler" measures that step with the CPU allocator's events instead (``profiler_peak_bytes``): for
    compiled code, which dynamo does not compile under the tracker's dispatch mode; kernel scratch is
    counted there too."""
    device = next(model.parameters()).device
    ctx = around_step or contextlib.nullcontext
    cuda = device.type == "cuda"
    step = TrainStep(precision, device.type, grad_accum=grad_accum)
    results: list[IterationMeasurement] = []
    for i in range(warmup + steps):
        elapsed, m = _one_step(model, batch, loss_fn, opt, step, ctx, device, track=cuda)
        if i >= warmup:
            results.append(
                IterationMeasurement(m.peak_bytes, elapsed, batch_size * grad_accum / elapsed, m.reserved_bytes,
                                     m.alloc_retries, m.segments_freed)
            )  # fmt: skip
    if not cuda and cpu_peak == "profiler":
        opt.zero_grad(set_to_none=True)

        def measured() -> None:
            _one_step(model, batch, loss_fn, opt, step, ctx, device, track=False)

        peak = profiler_peak_bytes(measured, held_bytes([*training_state(model, batch, opt), *step.state()]))
        for r in results:
            r.peak_bytes = peak
    elif not cuda:
        peak = _one_step(model, batch, loss_fn, opt, step, ctx, device, track=True)[1].peak_bytes
        for r in results:
            r.peak_bytes = peak
    opt.zero_grad(set_to_none=True)
    return results


def _one_step(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    step: TrainStep,
    ctx: Callable[[], contextlib.AbstractContextManager[Any]],
    device: torch.device,
    track: bool,
) -> tuple[float, _Meter]:
    """One iteration: its wall time, and what the meter read (with ``track``)."""
    opt.zero_grad(set_to_none=True)
    state = [*training_state(model, batch, opt), *step.state()]
    meter_cm = _peak_meter(device, state) if track else contextlib.nullcontext(_Meter())
    with meter_cm as meter:
        start = time.perf_counter()
        for _ in range(step.grad_accum):
            with ctx():
                loss = step.loss(model, batch, loss_fn)
                step.backward(loss)
                del loss
        step.step(opt)
        _sync(device)
        elapsed = time.perf_counter() - start
    return elapsed, meter


class _Meter:
    peak_bytes = 0
    reserved_bytes: int | None = None
    alloc_retries: int | None = None
    segments_freed: int | None = None


@contextlib.contextmanager
def _peak_meter(device: torch.device, state: list[torch.Tensor]) -> Iterator[_Meter]:
    meter = _Meter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)
        yield meter
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_stats(device)
        meter.peak_bytes = torch.cuda.max_memory_allocated(device)
        meter.reserved_bytes = torch.cuda.max_memory_reserved(device)
        meter.alloc_retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
        meter.segments_freed = after.get("num_device_free", 0) - before.get("num_device_free", 0)
        return
    tracker = StorageTracker()
    tracker.track(state)
    del state
    with tracker:
        yield meter
    meter.peak_bytes = tracker.peak_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def profiler_peak_bytes(fn: Callable[[], None], baseline_bytes: int, *, scratch: bool = False) -> int:
    """Peak of the CPU allocator while ``fn`` runs, from the profiler's raw allocation events, plus
    ``baseline_bytes`` already allocated before it (NOTE [ Device memory on the CPU ]): between aten ops
    (what the tensors hold), or with ``scratch`` at any instant (buffers that ops allocate and free inside
    themselves included). Slow: for compiled code and cross-checks, not the runtime."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    # The outermost aten ops, as (start, end): an op nested in another (aten::conv2d's aten::convolution) is
    # inside it.
    outer: list[tuple[int, int]] = []
    for s, t in sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::")):
        if outer and t <= outer[-1][1]:
            continue
        outer.append((s, t))
    live = peak = 0
    i = 0  # the first outer op not yet ended
    for e in memory:
        at = e.start_ns()
        while i < len(outer) and outer[i][1] < at:  # ops ended before this event: live as they left it
            peak = max(peak, live)
            i += 1
        live += e.nbytes()
        if scratch or i >= len(outer) or at < outer[i][0]:  # outside every op
            peak = max(peak, live)
    return baseline_bytes + max(peak, live)
