"""A policy applied to every forward and backward of a Hugging Face ``transformers.Trainer``.

Usage::

    from runtime.integrations.hf import PolicyCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PolicyCallback("gpt2.policy.json")])
    trainer.train()

How it follows the Trainer's step (``Trainer._run_epoch``, transformers 5): an optimizer step runs
``gradient_accumulation_steps`` micro-batches, each one ``training_step`` (forward, loss, backward).
``on_step_begin`` comes before the first micro-batch's ``training_step``, ``on_substep_end`` after each
micro-batch but the last, and ``on_pre_optimizer_step`` after the last one's backward (and after gradient
clipping), before ``optimizer.step()``. So a micro-batch opens at ``on_step_begin`` and ``on_substep_end``
and closes at the next ``on_substep_end`` or at ``on_pre_optimizer_step``; ``on_step_end`` and
``on_train_end`` close anything still open. ``on_train_begin`` refuses a policy planned for another
``gradient_accumulation_steps`` and makes the runtime, once, for ``self.model`` (the model the Trainer
hands its callbacks, not a DDP or accelerate wrapper, as with DDP in plain PyTorch).

A callback sees no exception: if ``trainer.train()`` raises inside a micro-batch (the runtime's own
refusal of a forward in another precision than the policy's included), that micro-batch stays open, its
saved-tensor hooks installed for whatever runs next in the process, until the next ``trainer.train()`` or
``callback.close()``. The callback is also a context manager that closes it on the way out::

    with PolicyCallback("gpt2.policy.json") as cb:
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from runtime.apply import RuntimeStats
from runtime.integrations._steps import PolicySteps, require
from runtime.policy import Policy

require("transformers", "hf")

from transformers import TrainerCallback  # noqa: E402

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["PolicyCallback"]


class PolicyCallback(TrainerCallback):  # type: ignore[misc]
    """Applies ``policy`` (a :class:`~runtime.policy.Policy` or a policy file's path) to every micro-batch's
    forward and backward of the Trainer it is given to; ``module`` names the submodule the policy was made
    for (dotted, as in ``model.named_modules()``), None for the whole model.

    :attr:`stats` holds the :class:`~runtime.apply.RuntimeStats` of each micro-batch of the latest
    optimizer step (bytes swapped, ops recomputed, regions, unknown keys); :attr:`steps` the
    :class:`~runtime.integrations.PolicySteps` underneath (``steps.runtime``, ``steps.micro_batches``).
    """

    def __init__(self, policy: Policy | str | os.PathLike[str], *, module: str | None = None, strict: bool = True):
        self.steps = PolicySteps(policy, module=module, strict=strict)

    @property
    def stats(self) -> list[RuntimeStats]:
        return self.steps.stats

    def close(self) -> None:
        """Close a micro-batch left open (after ``trainer.train()`` raised)."""
        self.steps.close()

    def __enter__(self) -> PolicyCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.steps.close()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.steps.close()  # what an earlier train() that raised left open
        self.steps.bind(kwargs["model"])  # another model first (R12): its accumulation is not the point
        self.steps.check_grad_accum(args.gradient_accumulation_steps, "TrainingArguments.gradient_accumulation_steps")
        if kwargs.get("optimizer") is not None:
            self.steps.check_optimizer(kwargs["optimizer"], "the Trainer's optimizer")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.steps.begin()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.steps.begin()  # closes the micro-batch that ended, opens the next one

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.steps.step_done()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.steps.step_done()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.steps.close()
