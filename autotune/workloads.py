"""From a model name to a captured Workload: the glue between the model zoo and runtime.trace."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from autotune.models import build_model, check_factory_accepts, given_image_size, takes_image_size, takes_seq_len
from runtime.errors import AutotuneError, ModelError
from runtime.hardware import HardwareProfile
from runtime.partition import Partition
from runtime.precision import check_grad_accum, check_precision
from runtime.trace import OPTIMIZERS, capture
from runtime.workload import Workload

MODES = ("fake", "real")


@dataclass
class TraceRequest:
    """What to trace. ``batch_size`` None means the model family's default."""

    model: str
    batch_size: int | None = None
    seq_len: int | None = None
    image_size: int | None = None  # torchvision models and factories; None: the model's default
    optimizer: str = "sgd"
    mode: str = "fake"
    device: str = "cpu"
    precision: str = "fp32"  # fp32, or bf16/fp16 under torch.autocast (runtime.precision)
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step
    # The profile the plan is for: a fake trace for a GPU takes its device-dependent choices (fused attention,
    # foreach optimizers; NOTE [ GPU-faithful fake traces ] in runtime/target.py). Real traces ignore it.
    target: HardwareProfile | None = None
    # Submodules run on slices of the batch (runtime/partition.py): the trace is taken with them in place.
    partitions: tuple[Partition, ...] = ()

    def validate(self) -> None:
        self.precision = check_precision(self.precision)
        check_grad_accum(self.grad_accum)
        if self.batch_size is not None and self.batch_size <= 0:
            raise AutotuneError(
                f"invalid batch size {self.batch_size}: expected a positive integer, e.g. --batch-size 64"
            )
        if self.seq_len is not None and self.seq_len <= 0:
            raise AutotuneError(f"invalid --seq-len {self.seq_len}: expected a positive integer, e.g. --seq-len 1024")
        if self.image_size is not None and self.image_size <= 0:
            raise AutotuneError(
                f"invalid --image-size {self.image_size}: expected a positive number of pixels, e.g. --image-size 32"
            )
        if self.optimizer.lower() not in OPTIMIZERS:
            raise AutotuneError(f"unknown optimizer '{self.optimizer}': expected one of {', '.join(OPTIMIZERS)}")
        if self.mode not in MODES:
            raise AutotuneError(
                f"unknown trace mode '{self.mode}': expected 'fake' (no memory, seconds) "
                "or 'real' (runs on the device, measures op times)"
            )
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise AutotuneError(
                f"device '{self.device}' requested but CUDA is not available here; "
                "use --device cpu, or run on a machine with a GPU"
            )
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise AutotuneError(f"unknown device '{self.device}': expected cpu, cuda or cuda:N")
        if self.mode == "fake" and self.device != "cpu":
            raise AutotuneError(
                "fake-mode traces run on the CPU's kernels (no GPU is needed for them); "
                "use --mode real with --device cuda to trace on the GPU"
            )


def check_sizes(model: str, seq_len: int | None, image_size: int | None, source: str | None = None) -> None:
    """``--seq-len`` and ``--image-size`` where they apply to ``model``, before any long work; ``source``: the
    policy file they were read from (its ``seq_len`` and ``image_size`` fields, not flags)."""
    for field, value, applies, flagged in (
        ("seq_len", seq_len, takes_seq_len, f"--seq-len {seq_len} given for image model {model!r}: it only applies "
         "to language models (gpt2*, bert-base) and factories; leave it unset"),
        ("image_size", image_size, takes_image_size, f"--image-size {image_size} given for language model {model!r}: "
         "it only applies to torchvision models and factories; leave it unset (--seq-len sizes a language model's "
         "samples)"),
    ):  # fmt: skip
        if value is not None and not applies(model):
            if source is None:
                raise AutotuneError(flagged)
            raise AutotuneError(
                f"{source}: {field} {value} does not apply to {model!r}: the policy was made for another model, or "
                f"edited; search one for {model} with `autotune search --model {model} ...`"
            )
    check_factory_accepts(model, seq_len=seq_len, image_size=image_size)


def trace_model(req: TraceRequest) -> tuple[Workload, float]:
    """Build the model named in ``req`` and capture one training iteration. Returns (workload, seconds)."""
    req.validate()
    built: dict[str, int | None] = {}

    def build():  # type: ignore[no-untyped-def]
        # batch_size None: the model's default (a factory may fix its own batch size).
        entry = build_model(
            req.model, batch_size=req.batch_size, seq_len=req.seq_len, image_size=req.image_size, device=req.device
        )
        built["seq_len"], built["batch_size"] = entry.seq_len, entry.batch_size
        return entry.module, entry.batch, entry.loss_fn

    start = time.perf_counter()
    try:
        with _fake_failures(req):
            w = capture(
                build,
                name=req.model,
                batch_size=req.batch_size or 0,  # set from the built model below
                seq_len=req.seq_len,
                optimizer=req.optimizer.lower(),
                fake=req.mode == "fake",
                device=req.device,
                precision=req.precision,
                grad_accum=req.grad_accum,
                target=req.target if req.mode == "fake" else None,
                partitions=req.partitions,
            )
    except ModelError as e:
        sizes = _sizes(req)
        raise ModelError(
            f"{e}; does {req.model} run at {sizes}? try another size"
            if sizes
            else f"{e}; fix the model (its factory, forward or loss), or report it here if it trains without autotune",
            reason=e.reason,
        ) from e.__cause__
    except FakeTraceError as e:
        if req.target is not None and req.target.is_gpu:
            raise
        # A plan for this CPU: a real trace on it is the same plan, with measured op times. Said once it ran:
        # where the real kernel refuses the arguments too, the model's error is the one to read.
        traced = trace_model(dataclasses.replace(req, mode="real", device="cpu"))
        warnings.warn(f"autotune: {e.what}: traced for real on this CPU instead", stacklevel=2)
        return traced
    w.seq_len = built.get("seq_len")
    w.batch_size = built["batch_size"] or 0
    w.image_size = given_image_size(req.model, req.image_size)
    w.compute_fingerprints()  # the shape fingerprint hashes the batch size, sequence length and image size set now
    w.meta["device_profile"] = device_profile(req.device) if req.mode == "real" else None
    return w, time.perf_counter() - start


class FakeTraceError(AutotuneError):
    """A model that a fake trace cannot run (:func:`_fake_failures`); ``what`` says why, in a clause."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


class _MetaFailures(logging.Filter):
    """The ops whose fake (meta) kernel raised, from FakeTensorMode's log of it, which it keeps from the
    terminal (a traceback per op, before the error it re-raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("failed while attempting to run meta for") and record.args:
            self.ops.append(str(record.args[0]))  # type: ignore[index]
            return False
        return True


@contextlib.contextmanager
def _fake_failures(req: TraceRequest) -> Iterator[None]:
    """A model that reads tensor values while it is built or run (``.item()``, ``nonzero``, shapes that
    depend on data) cannot be traced without running it: fake tensors have no values. Nor one that runs an
    op whose fake kernel refuses what the real one takes (transformers' Mixtral experts call
    ``torch._grouped_mm`` in fp32, which the CPU runs and the meta kernel refuses). Each said in one line with
    the way out (a real trace on this machine), where it failed with an internal error or blamed the factory."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    fake_errors = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
    meta = _MetaFailures()
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addFilter(meta)
    try:
        yield
    except Exception as e:
        cause = e.__cause__ if isinstance(e, AutotuneError) else e
        if req.mode != "fake":
            raise
        detail = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}"
        if meta.ops and not isinstance(cause, fake_errors):
            what = f"{req.model}'s op {meta.ops[-1]} refused its arguments under fake tensors ({detail})"
        elif isinstance(cause, fake_errors):
            what = (f"{req.model} reads tensor values while it is built or run ({detail}: .item(), nonzero, shapes "
                    "that depend on the data), which a fake trace cannot")  # fmt: skip
        else:
            raise
        # Where the real kernel refuses the arguments too, the model fails as it is: the real trace says so.
        sizes = _sizes(req)
        at = f" at {sizes}" if sizes else ""
        raise FakeTraceError(
            f"{what}; if {req.model} trains{at} without autotune, it is the fake kernel: a plan for a GPU profile "
            "traces with fake tensors, so plan for this machine instead (--gpu cpu traces it for real), or profile "
            "it with --mode real",
            what,
        ) from None
    finally:
        logger.removeFilter(meta)


def _sizes(req: TraceRequest) -> str:
    """The sizes the user set, as flags (``--image-size 16``), where a model may not run at them."""
    given = [f"--seq-len {req.seq_len}" if req.seq_len is not None else "",
             f"--image-size {req.image_size}" if req.image_size is not None else ""]  # fmt: skip
    return " and ".join(g for g in given if g)


def device_profile(device: str) -> str | None:
    """The profile name that marks op times as measured on this device (see runtime.hardware.op_times_s)."""
    if device == "cpu":
        return "cpu"
    from runtime.hardware import detect

    found = detect()
    return found.profile.name if found.profile is not None else None
