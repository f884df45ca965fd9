"""Tensor partition (MegTaiChi, shared/seeds/002): a module call that runs on slices of the batch.

NOTE [ Partition ] -- simulator Rule 14 (envs/simulator.py) and runtime R13 cite it.
    Q1. What runs. A partition ``(module, chunks)`` makes every call of that submodule run its own
        ``forward`` once per slice of the batch: the call's first tensor argument gives the batch size B
        (its first dimension); every tensor argument whose first dimension is B, positional or keyword,
        nested in lists, tuples or dicts, is cut into ``chunks`` slices along it (``torch.tensor_split``:
        views, sizes differing by one at most when ``chunks`` does not divide B); other arguments are passed
        whole to every slice. The slices' outputs are concatenated along the first dimension, tensor by
        tensor (``torch.cat``); an output that is not a tensor must be the same for every slice (the first
        is returned). The module's own hooks run once per call (``__call__`` is not repeated), its
        submodules' once per slice: their calls are counted per slice in the keys (NOTE [ Key format ]),
        so each slice's saved tensors are candidates of their own.
    Q2. Backward. Autograd's engine runs, among the nodes ready, the one made last (the highest sequence
        number), so the concatenation's backward hands each slice its gradient and the last slice's
        backward runs whole before the one before it starts: only one slice's gradients and recomputed
        tensors are live at a time. Nothing is assumed here: the trace is taken with the partition in place
        (``runtime.trace.capture(partitions=...)``), so the workload holds the ops, lifetimes and order
        that the runtime runs, and the simulator's rules apply to it unchanged.
    Q3. What may be partitioned: a submodule (not the model itself: ``--grad-accum`` splits the whole step)
        that is not inside another partition, and whose output for one sample depends on that sample
        alone. BatchNorm in training mode computes statistics over the batch, so a module holding one is
        refused (:func:`check_partitions`); so is a batch that cannot be cut into ``chunks`` slices. A batch
        coupling this cannot see (a custom op reducing over the first dimension) changes the results: test
        such a model with and without the partition before using one.
    Q4. Numbers. Every slice computes the same per-sample values as the whole batch (the same kernels on
        fewer rows), but a reduction over the batch in backward (a weight's gradient) becomes ``chunks``
        partial sums added in turn: another summation order, so gradients are not bit-identical to
        unpartitioned training. They are bit-identical to training with the same partition and no policy
        (tests/test_partition.py), and differ from unpartitioned training by rounding only: for a
        gradient ``g = sum_b x_b`` over B floats summed in any order, ``|g_part - g| <= 2 * gamma(B) *
        sum_b |x_b|`` with ``gamma(n) = n u / (1 - n u)``, ``u`` the dtype's unit roundoff (Higham,
        Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4, applied to both orders). So a
        policy file carries its partitions and ``options.allow_partition: true``, the user's consent, as
        ``lossy`` is for compression; a policy with partitions and without it is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from runtime.errors import AutotuneError
from runtime.step_only import step_forward


@dataclass(frozen=True)
class Partition:
    """One submodule whose calls run on ``chunks`` slices of the batch (NOTE [ Partition ])."""

    module: str  # module path, as in the keys (e.g. "features")
    chunks: int  # slices of the batch, at least 2

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 2:
            raise AutotuneError(
                f"partition of {self.module!r} into {self.chunks!r} chunks: expected an integer of at least 2 "
                "(1 chunk is no partition)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "chunks": self.chunks}

    @classmethod
    def from_dict(cls, d: Any) -> Partition:
        return cls(module=str(d["module"]), chunks=int(d["chunks"]))

    def __str__(self) -> str:
        return f"{self.module}/{self.chunks}"


def parse_partitions(items: Sequence[Any] | None) -> tuple[Partition, ...]:
    """Partitions from a policy file's or a workload's list of ``{"module", "chunks"}`` (None: none)."""
    return tuple(p if isinstance(p, Partition) else Partition.from_dict(p) for p in items or ())


def partition_label(items: Sequence[Any] | None) -> str:
    """How a search names the partitions a workload was traced with (``blocks.0/4``, several comma-separated;
    ``none``): an Optuna choice, a line of the search's output."""
    return ", ".join(str(p) for p in parse_partitions(items)) or "none"


def batch_coupled(module: torch.nn.Module) -> str | None:
    """The path below ``module`` ("" for itself) of a submodule whose output couples the samples of a batch
    in training (Q3), or None."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training:
            return name
    return None


def check_partitions(model: torch.nn.Module, partitions: Sequence[Partition]) -> None:
    """Q3: raise :class:`AutotuneError` for a partition the model cannot run (unknown or root module, one
    inside another, batch statistics inside)."""
    paths = [p.module for p in partitions]
    for p in partitions:
        if not p.module:
            raise AutotuneError(
                "a partition of the whole model: partition a submodule (e.g. a stage of blocks), or split the "
                "step with --grad-accum"
            )
        try:
            model.get_submodule(p.module)
        except AttributeError:
            top = [n for n, m in model.named_children() if any(True for _ in m.children())][:4]
            e_g = f" (its own with submodules: {', '.join(repr(n) for n in top)})" if top else ""
            raise AutotuneError(
                f"partition of {p.module!r}: the model has no such submodule; name one as in "
                f"`model.named_modules()`{e_g}"
            ) from None
        outer = [q for q in paths if q != p.module and p.module.startswith(q + ".")]
        if outer:
            raise AutotuneError(
                f"partition of {p.module!r} inside the partition of {outer[0]!r}: partitions cannot nest; keep one"
            )
        if paths.count(p.module) > 1:
            raise AutotuneError(f"{p.module!r} is partitioned twice: keep one partition of it")
    for p in partitions:
        coupled = batch_coupled(model.get_submodule(p.module))
        if coupled is not None:
            where = f"{p.module}.{coupled}" if coupled else p.module
            raise AutotuneError(
                f"partition of {p.module!r}: {where} is a BatchNorm in training mode, whose "
                "statistics span the batch, so slices would change the results (NOTE [ Partition ] Q3); "
                "partition a module without one"
            )


def _sliced_forward(forward: Any, path: str, chunks: int) -> Any:
    """Q1: ``forward`` run once per slice of the batch, outputs concatenated."""

    @functools.wraps(forward)
    def partitioned_forward(*args: Any, **kwargs: Any) -> Any:
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not leaves or leaves[0].dim() == 0:
            raise AutotuneError(
                f"partition of {path!r}: its call got no batched tensor argument (expected the batch along the "
                "first dimension of its first tensor argument); partition another module"
            )
        batch = leaves[0].shape[0]
        if batch < chunks:
            raise AutotuneError(
                f"partition of {path!r} into {chunks} chunks: the call's batch has {batch} samples; use at most "
                f"{batch} chunks, or a larger batch"
            )
        slices: dict[int, tuple[torch.Tensor, ...]] = {}  # id(argument) -> its slices

        def cut(x: Any, i: int) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
                return x
            parts = slices.get(id(x))
            if parts is None:
                parts = slices[id(x)] = torch.tensor_split(x, chunks)
            return parts[i]

        outs = []
        for i in range(chunks):
            part = functools.partial(cut, i=i)
            outs.append(forward(*tree_map(part, args), **tree_map(part, kwargs)))
        slices.clear()
        flat, spec = tree_flatten(outs[0])
        rest = [tree_flatten(o)[0] for o in outs[1:]]
        joined = []
        for j, first in enumerate(flat):
            if isinstance(first, torch.Tensor):
                parts = [first, *(r[j] for r in rest)]
                if any(p.dim() == 0 for p in parts):
                    raise AutotuneError(
                        f"partition of {path!r}: output {j} is a scalar tensor, which cannot be joined along the "
                        "batch; partition a module whose tensor outputs are batch-first"
                    )
                joined.append(torch.cat(parts))
            else:
                joined.append(first)
        return tree_unflatten(joined, spec)

    return partitioned_forward


@contextlib.contextmanager
def partitioned(model: torch.nn.Module, partitions: Sequence[Partition]) -> Iterator[None]:
    """Within the block, each partitioned submodule's calls run sliced (Q1); restored after. The wrapper is an
    instance attribute ``forward``, as the runtime's regions install theirs (runtime R10): a region wrapper
    made inside this block calls the sliced forward."""
    if not partitions:
        yield
        return
    check_partitions(model, partitions)
    installed: list[tuple[torch.nn.Module, Any]] = []
    try:
        for p in partitions:
            mod = model.get_submodule(p.module)
            own = mod.__dict__.get("forward")
            installed.append((mod, own))
            mod.__dict__["forward"] = step_forward(_sliced_forward(mod.forward, p.module, p.chunks), mod, own)
        yield
    finally:
        for mod, own in reversed(installed):
            if own is None:
                del mod.__dict__["forward"]
            else:
                mod.__dict__["forward"] = own
