"""One policy applied to the micro-batches of a training loop whose hooks open and close them."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from runtime.apply import PolicyRuntime, RuntimeStats
from runtime.errors import AutotuneError
from runtime.policy import Policy, load_policy

# The optimizers a policy can be planned with, by the state they keep per parameter (runtime.trace.make_optimizer).
_STATE = {"sgd": "momentum", "adam": "moments", "adamw": "moments"}


class MissingDependency(AutotuneError, ImportError):
    """A framework an integration needs is not installed (an ImportError too, so ``except ImportError``
    holds)."""


def require(name: str, extra: str) -> ModuleType:
    """Import ``name`` or raise :class:`MissingDependency` with the pip command that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingDependency(
            f"runtime.integrations needs {name!r}, which cannot be imported here ({exc}): install it with "
            f"`pip install autotune[{extra}]`"
        ) from exc


def _load(path: str | os.PathLike[str]) -> Policy:
    """The policy file at ``path``, one :class:`Policy` while the file is unchanged: a loop that passes the path
    at every micro-batch (accelerate's ``applied``) reuses the runtime made for it, and what it learnt (R11)."""
    try:
        p = Path(path).resolve()
        st = p.stat()
    except OSError:
        return load_policy(path)  # its own error, with the fix
    return _load_file(str(p), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _load_file(path: str, mtime_ns: int, size: int) -> Policy:
    return load_policy(path)


class PolicySteps:
    """A policy applied to one model (or one of its submodules), one micro-batch at a time.

    ``bind(model)`` makes one :class:`~runtime.apply.PolicyRuntime` for the module the policy is for, reused
    for every later micro-batch (so what its first step learned is kept, NOTE [ Runtime mechanics ] R11).
    ``begin()`` opens a micro-batch (``rt.step()``) before its forward, ``end()`` closes it after its
    backward; ``step_done()`` marks an optimizer step, after which :attr:`stats` holds what the runtime did
    in each micro-batch of that step. ``end()`` and ``close()`` are safe to call when nothing is open.

    Args:
        policy: a :class:`~runtime.policy.Policy` or the path of a policy file.
        module: the dotted name of the submodule the policy was made for (``model.get_submodule(module)``),
            None for the whole model.
        strict: refuse a model whose parameters are not those the policy was made for (runtime R12).
    """

    def __init__(self, policy: Policy | str | os.PathLike[str], *, module: str | None = None, strict: bool = True):
        self.policy = policy if isinstance(policy, Policy) else _load(policy)
        self.module = module or None
        self.strict = strict
        self.runtime: PolicyRuntime | None = None
        self.stats: list[RuntimeStats] = []  # the micro-batches of the latest optimizer step
        self.micro_batches = 0  # micro-batches run under the policy so far
        self._window: list[RuntimeStats] = []
        self._open: contextlib.ExitStack | None = None

    # -- set-up ------------------------------------------------------------------------------------------
    def check_grad_accum(self, micro_batches: int, setting: str) -> None:
        """Refuse a loop that accumulates another number of micro-batches than the policy was planned for:
        from the second micro-batch on the gradients live through the forward, so the peak differs."""
        if micro_batches != self.policy.grad_accum:
            p = self.policy
            raise AutotuneError(
                f"{setting}={micro_batches}, but the policy for {p.model} was planned for {p.grad_accum} "
                f"micro-batch{'es' if p.grad_accum != 1 else ''} per optimizer step: search one for this loop "
                f"with `autotune search --model {p.model} --grad-accum {micro_batches} ...`, or set {setting}="
                f"{p.grad_accum}"
            )

    def check_optimizer(self, optimizers: Any, setting: str) -> None:
        """Refuse a loop whose optimizer keeps other state than the one the policy was planned with (its state
        is part of the peak: AdamW keeps two buffers per parameter where SGD with momentum keeps one)."""
        planned = self.policy.optimizer
        for opt in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
                opt = opt.optimizer  # accelerate's AcceleratedOptimizer (an Optimizer itself), Lightning's wrapper
            runs = _STATE.get(type(opt).__name__.lower())
            if planned is None or runs is None or runs == _STATE.get(planned):
                continue
            p = self.policy
            raise AutotuneError(
                f"{setting} is {type(opt).__name__}, but the policy for {p.model} was planned with {planned}, whose "
                "state differs (the state is part of the peak): search one for this loop with `autotune search "
                f"--model {p.model} --optimizer {type(opt).__name__.lower()} ...`, or train with {planned}"
            )

    def target(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the policy applies to: ``model`` or its submodule named ``module``."""
        if self.module is None:
            return model
        try:
            return model.get_submodule(self.module)
        except AttributeError:
            names = [n for n, _ in model.named_modules() if n and "." not in n][:5]
            raise AutotuneError(
                f"module={self.module!r} names no submodule of {type(model).__name__}: expected a dotted name "
                f"from model.named_modules() (top level: {', '.join(names) or 'none'}); leave module unset to "
                "apply the policy to the whole model"
            ) from None

    def bind(self, model: torch.nn.Module) -> PolicyRuntime:
        """The runtime for ``model``'s target module, made once (again only if the target changes)."""
        target = self.target(model)
        if self.runtime is None or self.runtime.model is not target:
            self.close()
            self.runtime = PolicyRuntime(self.policy, target, strict=self.strict)
        return self.runtime

    # -- micro-batches -----------------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._open is not None

    def begin(self, model: torch.nn.Module | None = None) -> RuntimeStats:
        """Open one micro-batch (closing one left open). ``model`` binds first when given."""
        self.end()
        if model is not None:
            self.bind(model)
        if self.runtime is None:
            raise AutotuneError("PolicySteps.begin() before bind(model): bind the model the policy applies to first")
        stack = contextlib.ExitStack()
        stats = stack.enter_context(self.runtime.step())
        self._open = stack
        self._window.append(stats)
        self.micro_batches += 1
        return stats

    def end(self) -> None:
        """Close the open micro-batch, if any (after its backward)."""
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()

    def step_done(self) -> None:
        """An optimizer step follows: close what is open; :attr:`stats` becomes this step's micro-batches."""
        self.end()
        if self._window:
            self.stats, self._window = self._window, []

    def close(self) -> None:
        """Close anything open (after training, or after an exception left a micro-batch open)."""
        self.end()
