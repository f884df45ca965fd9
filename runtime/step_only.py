"""What the runtime installs on a model's modules for one step (runtime/apply.py R18): its forward hooks and
the forwards it puts in place of a module's (regions, partitions). A copy of the model made inside the step
(``copy.deepcopy``: an EMA or SWA model made at the first step) gets none of them, and pickling the model
inside the step (``torch.save(model)``) is refused with the way out.

Without this a deep copy kept the step's hooks and forwards, which are bound to the original model and its
runtime (``copy.deepcopy`` copies functions by reference): the copy computed with the original's weights and
refused its own steps.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from runtime.errors import AutotuneError

_SAVED_INSIDE = (
    "the model is pickled inside `with policy.applied(model)`, where its modules carry the step's hooks; save "
    "it after the step (its state_dict can be saved anywhere)"
)


def _left_behind(*args: Any, **kwargs: Any) -> None:
    """What a copy made inside a step holds where the original holds a step's hook: nothing done."""
    return None


class StepHook(functools.partial):  # type: ignore[type-arg]
    """A forward (pre-)hook for one step: called as the function it wraps (no Python frame of its own)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _left_behind

    def __reduce__(self) -> Any:
        raise AutotuneError(_SAVED_INSIDE)


class StepForward(functools.partial):  # type: ignore[type-arg]
    """A module's forward for one step, in its ``__dict__``: a copy gets the forward the module had before."""

    module: torch.nn.Module
    own: Any  # the instance attribute ``forward`` there was before the step's, or None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.own is not None:
            return copy.deepcopy(self.own, memo)
        new = memo.get(id(self.module))
        if new is None:  # the forward copied alone, not with its module
            return type(self.module).forward.__get__(self.module)
        return type(new).forward.__get__(new)

    def __reduce__(self) -> Any:
        raise AutotuneError(_SAVED_INSIDE)


def step_forward(fn: Any, module: torch.nn.Module, own: Any) -> StepForward:
    """``fn`` as a step's forward of ``module``, which had ``own`` as an instance attribute (or None)."""
    f = StepForward(fn)
    f.module = module
    f.own = own
    return f
