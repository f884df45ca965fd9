"""A policy applied to every forward and backward of a Lightning ``Trainer`` (automatic optimization).

Usage::

    from runtime.integrations.lightning import PolicyCallback

    trainer = L.Trainer(max_steps=100, callbacks=[PolicyCallback("model.policy.json")])
    trainer.fit(lit_module, train_dataloaders=loader)

How it follows Lightning's step (``_AutomaticOptimization.run``, Lightning 2): each batch is one micro-batch;
``on_train_batch_start`` comes before ``training_step``, which runs inside a closure, then the closure's
backward and ``on_after_backward``. With ``accumulate_grad_batches`` k, the first k - 1 closures run
directly and the k-th inside ``optimizer.step(closure)``, where ``on_before_optimizer_step`` follows the
backward. So a micro-batch opens at ``on_train_batch_start`` and closes at ``on_after_backward`` (or at
``on_train_batch_end``, when ``training_step`` returned None and nothing ran backward); ``on_exception``
and ``on_train_end`` close anything left open. ``on_train_start`` refuses a policy planned for another
``accumulate_grad_batches`` and makes the runtime, once, for the LightningModule (or its submodule
``module``).

Limit: an optimizer that calls its closure several times per step (LBFGS) runs only the first call under
the policy; the later ones run as plain PyTorch (their gradients are the same, their memory is not
planned). Manual optimization (``automatic_optimization = False``) has no such hooks: use
``with policy.applied(model):`` around forward and ``self.manual_backward(loss)`` in ``training_step``.
"""

from __future__ import annotations

import os
from typing import Any

from runtime.apply import RuntimeStats
from runtime.integrations._steps import PolicySteps, require
from runtime.policy import Policy

require("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

__all__ = ["PolicyCallback"]


class PolicyCallback(pl.Callback):  # type: ignore[misc]
    """Applies ``policy`` (a :class:`~runtime.policy.Policy` or a policy file's path) to every training
    batch's forward and backward; ``module`` names the submodule of the LightningModule the policy was made
    for (dotted, as in ``named_modules()``), None for the LightningModule itself.

    :attr:`stats` holds the :class:`~runtime.apply.RuntimeStats` of each micro-batch of the latest
    optimizer step; :attr:`steps` the :class:`~runtime.integrations.PolicySteps` underneath.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str], *, module: str | None = None, strict: bool = True):
        self.steps = PolicySteps(policy, module=module, strict=strict)

    @property
    def stats(self) -> list[RuntimeStats]:
        return self.steps.stats

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.close()
        self.steps.bind(pl_module)  # another model first (R12): its accumulation is not the point
        self.steps.check_grad_accum(trainer.accumulate_grad_batches, "Trainer(accumulate_grad_batches)")
        self.steps.check_optimizer(trainer.optimizers, "configure_optimizers()'s optimizer")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.steps.begin()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.end()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.steps.step_done()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps.end()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.steps.close()
