"""The vocabulary every layer shares: what can be done with a saved tensor (its action and its code in
action vectors), the size of an element of each dtype the workloads name, and the shape of a training
batch and its loss function. Defined once here; the tracer, the runtime, the simulators, the planner, the
environment, the searchers and the model zoo take them from this module."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

Batch = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
"""A tuple of tensors (``module(*batch)``), or a mapping of keyword arguments (``module(**batch)``, as the
Hugging Face Trainer feeds a model)."""
# The batch is Any here: each loss knows the one form of batch it is paired with (a tuple's loss unpacks it),
# and a Callable taking the union would refuse every loss written for one form.
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(module, batch) -> scalar loss``: runs the forward pass and the loss, not the backward."""


def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors, in order (a mapping's values in its order)."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    return [t for t in values if isinstance(t, torch.Tensor)]


class Action(str, enum.Enum):
    """What the runtime does with one saved activation; ``code`` is its index in action vectors."""

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"
    COMPRESS = "compress"

    @property
    def code(self) -> int:
        return ACTIONS.index(self)


ACTIONS: tuple[Action, ...] = (Action.KEEP, Action.SWAP, Action.RECOMPUTE, Action.COMPRESS)  # codes 0..3
ACTION_NAMES: tuple[str, ...] = tuple(a.value for a in ACTIONS)  # index = action code
N_ACTIONS = len(ACTIONS)
# The codes as plain ints, for action vectors (numpy int8).
KEEP, SWAP, RECOMPUTE, COMPRESS = (a.code for a in ACTIONS)

#: Bytes per element of the dtypes a workload names (``TensorInfo.dtype``: torch's name without "torch.").
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (4 for a dtype not in :data:`ITEMSIZE`)."""
    return ITEMSIZE.get(dtype, 4)


def compressible(dtype: str, target: str) -> bool:
    """Rule 8 (envs/simulator.py): a floating-point tensor wider than the compression dtype ``target``."""
    return dtype.startswith(("float", "bfloat")) and itemsize(dtype) > itemsize(target)


__all__ = [
    "ACTIONS",
    "ACTION_NAMES",
    "COMPRESS",
    "ITEMSIZE",
    "KEEP",
    "N_ACTIONS",
    "RECOMPUTE",
    "SWAP",
    "Action",
    "Batch",
    "LossFn",
    "batch_tensors",
    "compressible",
    "itemsize",
]
