"""A policy applied inside the training loops people use: the Hugging Face ``transformers.Trainer``
(:mod:`runtime.integrations.hf`), Lightning (:mod:`runtime.integrations.lightning`) and accelerate
(:mod:`runtime.integrations.accelerate`).

Each loop runs one forward and its backward per micro-batch, and gets the policy around exactly that: one
:class:`~runtime.apply.PolicyRuntime` per model, reused across steps, and its ``step()`` opened before each
micro-batch's forward and closed after its backward, from the hooks the framework offers. A loop that
accumulates gradients must accumulate as many micro-batches as the policy was planned for (``grad_accum``):
the loops check it when training starts. :class:`PolicySteps` is that mechanism without a framework, for a
loop of your own whose hooks are callbacks rather than a ``with`` block.

Only the framework in use is imported, by its own module; each says how to install it when it is missing
(``pip install autotune[hf]``, ``autotune[lightning]``).
"""

from runtime.integrations._steps import MissingDependency, PolicySteps

__all__ = ["MissingDependency", "PolicySteps"]
