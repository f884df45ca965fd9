"""A policy applied to the micro-batches of an accelerate training loop.

Usage::

    from runtime.integrations.accelerate import applied

    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model), applied(accelerator, model, policy):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()

``applied`` is ``policy.applied`` on the module ``accelerator.prepare`` wrapped (a DDP wrapper's parameters
are named ``module.*``, so the policy applies to the inner module, as with DDP in plain PyTorch), after
checking that the accelerator accumulates as many micro-batches as the policy was planned for. The
runtime is made once per module and policy and reused. ``opt.step()`` inside the block is fine: the
runtime's hooks only act on autograd's saved tensors, which an optimizer step does not make.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from runtime.apply import RuntimeStats, check_model
from runtime.integrations._steps import PolicySteps, require
from runtime.policy import Policy

require("accelerate", "hf")

__all__ = ["applied"]


@contextlib.contextmanager
def applied(
    accelerator: Any,
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str],
    *,
    module: str | None = None,
    strict: bool = True,
) -> Iterator[RuntimeStats]:
    """``with applied(accelerator, model, policy):`` one micro-batch's forward and backward under ``policy``.

    ``model`` may be what ``accelerator.prepare`` returned; ``policy`` a Policy or a policy file's path (loaded once
    while the file is unchanged, so each call reuses one runtime); ``module`` names the submodule the policy was
    made for (dotted, of the unwrapped model), None for the whole model. Raises AutotuneError when
    ``accelerator.gradient_accumulation_steps`` differs from the policy's ``grad_accum``.
    """
    steps = PolicySteps(policy, module=module, strict=strict)  # a path loads here
    target = steps.target(accelerator.unwrap_model(model))
    if strict:  # another model first: its accumulation is not the point (runtime R12)
        check_model(steps.policy, target)
    steps.check_grad_accum(accelerator.gradient_accumulation_steps, "Accelerator(gradient_accumulation_steps)")
    steps.check_optimizer(getattr(accelerator, "_optimizers", []), "the prepared optimizer")
    with steps.policy.applied(target, strict=strict) as stats:
        yield stats
