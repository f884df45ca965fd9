"""Training steps with and without a policy, for the runtime's bit-identity tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from runtime.policy import Policy

Build = Callable[[], tuple[torch.nn.Module, Any, Callable[[torch.nn.Module, Any], torch.Tensor]]]


def train_steps(build: Build, policy: Policy | None, steps: int, buffers: bool = False) -> list[list[torch.Tensor]]:
    """Per step of SGD (lr 0.1) on a fresh ``build()``, under ``policy`` when given: the parameters' gradients
    after backward (those that have one), and with ``buffers`` the model's buffers too."""
    model, batch, loss_fn = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with policy.applied(model) if policy is not None else contextlib.nullcontext():
            loss_fn(model, batch).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out.append(grads + ([b.clone() for b in model.buffers()] if buffers else []))
        opt.step()
    return out


def same_bits(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    """Every tensor of every step equal, bit for bit."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def classifier(make: Callable[[], torch.nn.Module], x_shape: tuple[int, ...], classes: int) -> Build:
    """``build`` for ``make()`` fed a random batch of ``x_shape`` with cross-entropy on ``classes`` labels
    (the model made first after seeding, then the batch)."""

    def build() -> tuple[torch.nn.Module, Any, Callable[[torch.nn.Module, Any], torch.Tensor]]:
        torch.manual_seed(0)
        model = make()
        batch = (torch.randn(*x_shape), torch.randint(0, classes, (x_shape[0],)))
        return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    return build


def planned_and_measured(
    build: Build, w: Any, policy: Policy, batch_size: int, steps: int = 2
) -> tuple[int, list[int], Any]:
    """``policy`` on real-mode trace ``w`` of ``build``: the fast simulator's planned peak on the cpu profile
    (checked equal to the reference's for the policy's action codes and options), the runtime's measured peaks
    over ``steps`` steps of SGD, and the runtime."""
    from envs.simulator import Simulator
    from envs.simulator_reference import simulate_reference
    from runtime.apply import PolicyRuntime
    from runtime.hardware import get_profile
    from runtime.measure import run_iterations
    from runtime.trace import make_optimizer

    hw = get_profile("cpu")
    planned = Simulator(w, hw).run(policy).peak_bytes
    assert simulate_reference(w, hw, policy.to_vector(w), options=policy.options).peak_bytes == planned
    model, batch, loss_fn = build()
    rt = PolicyRuntime(policy, model)
    opt = make_optimizer("sgd", model.parameters())
    measured = run_iterations(model, batch, loss_fn, opt, steps=steps, batch_size=batch_size, around_step=rt.step)
    return planned, [m.peak_bytes for m in measured], rt
