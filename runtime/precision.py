"""Training precision: fp32, or automatic mixed precision (``torch.autocast``) in bf16 or fp16.

NOTE [ Precision ]
A plan is made for one precision. Under autocast the saved activations are mostly bf16/fp16 (half the
bytes), autocast adds casts whose outputs are saved too (weights cast once per forward and cached by
autocast until its region ends; fp32 inputs of matmuls), matmuls and convolutions run at the tensor-core
rate of their dtype (``runtime.hardware.compute_class_for`` reads each op's dtype), and fp16 needs a
``torch.amp.GradScaler`` (its loss scaling is one more op per step and its unscale one more pass over the
gradients). The trace records all of it by running the iteration under the same autocast; a policy records
its precision, and both ``Policy.check_against`` and the runtime (at the first call of one of the model's
submodules in each step, from autocast's state: accelerate enters autocast inside the model's own forward)
refuse a run in another precision.

``TrainStep`` is the one place the forward, backward and optimizer step of an iteration are written, for
the tracer, the measurements and ``autotune train`` alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from runtime.errors import AutotuneError
from runtime.vocab import Batch, LossFn

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> str:
    p = str(precision).strip().lower()
    if p not in PRECISIONS:
        raise AutotuneError(
            f"unknown precision '{precision}': expected one of {', '.join(PRECISIONS)} "
            "(bf16 and fp16 are torch.autocast mixed precision), e.g. --precision bf16"
        )
    return p


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls and convolutions in (None for fp32: no autocast)."""
    return _DTYPES.get(check_precision(precision))


def active_precision(device_type: str) -> str:
    """The precision the code running now trains in, from autocast's state on ``device_type``."""
    if not torch.is_autocast_enabled(device_type):
        return "fp32"
    dtype = torch.get_autocast_dtype(device_type)
    return next((p for p, d in _DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


class TrainStep:
    """Forward under autocast, backward (scaled for fp16) and the optimizer step, for one precision.

    ``fake``: the iteration runs under FakeTensorMode, where GradScaler cannot read its inf check (a
    data-dependent ``.item()``): the step then unscales and steps unconditionally, which records the same
    ops as a step without overflow.
    """

    def __init__(
        self, precision: str = "fp32", device_type: str = "cpu", *, fake: bool = False, grad_accum: int = 1
    ) -> None:
        self.precision = check_precision(precision)
        self.grad_accum = check_grad_accum(grad_accum)
        self.device_type = device_type
        self.fake = fake
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type) if self.precision == "fp16" else None
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = autocast_dtype(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def loss(self, model: torch.nn.Module, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """One micro-batch's loss; divided by the number of micro-batches when gradients accumulate."""
        with self.autocast():
            loss: torch.Tensor = loss_fn(model, batch)
            if self.grad_accum > 1:
                loss = loss / self.grad_accum
        return loss

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: multiplied by the fp16 loss scale (autograd saves the scale)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scaled(loss).backward()

    def step(self, opt: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            opt.step()
        elif self.fake:
            self.scaler.unscale_(opt)
            opt.step()
            self.scaler.update()
        else:
            self.scaler.step(opt)
            self.scaler.update()

    def state(self) -> list[torch.Tensor]:
        """The scaler's tensors (scale and growth tracker), which live between iterations."""
        if self.scaler is None:
            return []
        return [t for t in (self.scaler._scale, self.scaler._growth_tracker) if isinstance(t, torch.Tensor)]


def check_grad_accum(k: int) -> int:
    if type(k) is not int or k < 1:
        raise AutotuneError(
            f"invalid gradient accumulation {k!r}: expected a whole number of micro-batches per optimizer step, "
            "1 or more, e.g. --grad-accum 4"
        )
    return k


def check_active(policy_precision: str, device_type: str, source: str = "policy") -> None:
    """Raise unless the code running now trains in ``policy_precision`` (see NOTE [ Precision ])."""
    active = active_precision(device_type)
    if active != policy_precision:
        how = (
            "run the forward outside torch.autocast"
            if policy_precision == "fp32"
            else f"run the forward under torch.autocast('{device_type}', dtype={_DTYPES[policy_precision]})"
        )
        raise AutotuneError(
            f"{source} was made for {policy_precision} training but this forward runs in {active} "
            f"(autocast {'on' if active != 'fp32' else 'off'}); search a policy for it with "
            f"`autotune search ... --precision {active}`, or {how}"
        )
