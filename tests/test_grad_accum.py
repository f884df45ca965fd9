"""Gradient accumulation (NOTE [ Gradient accumulation ] in runtime.trace): the traced micro-batch holds the
gradients, a policy applied to every micro-batch leaves the accumulated gradients bit-identical, the
measured peak of k micro-batches and a step matches the simulator, and a plan for k refuses another k."""

from __future__ import annotations

import pytest
import torch

from envs.simulator import Simulator
from runtime.apply import PolicyRuntime, RuntimeStats
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions
from runtime.precision import TrainStep
from runtime.trace import capture, make_optimizer
from runtime.workload import TensorKind
from tests.test_apply import RESNET, _build, _check_done, _policies
from tests.test_precision import _mlp


def test_traced_micro_batch_holds_the_gradients() -> None:
    one = capture(_mlp, name="mlp", batch_size=4)
    acc = capture(_mlp, name="mlp", batch_size=4, grad_accum=3)
    assert acc.grad_accum == 3
    grads = [t for t in acc.tensors if t.kind == TensorKind.GRADIENT]
    # Both Linears' weights and biases: (64 x 32 + 32 + 32 x 10 + 10) floats, there before and after.
    assert len(grads) == 4 and all(t.persistent for t in grads)
    assert sum(t.nbytes for t in grads) == 4 * (64 * 32 + 32 + 32 * 10 + 10)
    assert not any(t.kind == TensorKind.GRADIENT and t.persistent for t in one.tensors)
    # The same saved tensors, under the same keys (keys restart with every micro-batch); the loss / k in
    # forward, its gradient in backward.
    assert [c.key for c in acc.candidates] == [c.key for c in one.candidates]
    divs = [sum(op.name == "aten.div.Tensor" for op in w.ops) for w in (one, acc)]
    assert divs == [0, 2]


def test_accumulated_gradients_bit_identical() -> None:
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"], grad_accum=2)

    done: list[RuntimeStats] = []

    def accumulate(policy: Policy | None) -> list[torch.Tensor]:
        model, batch, loss_fn = _build(name, kwargs)()
        step = TrainStep(grad_accum=2)
        for _ in range(2):
            if policy is None:
                step.backward(step.loss(model, batch, loss_fn))
            else:
                with policy.applied(model) as stats:
                    step.backward(step.loss(model, batch, loss_fn))
                done.append(stats)
        return [p.grad for p in model.parameters()]

    ref = accumulate(None)
    for label, vec in _policies(w).items():
        got = accumulate(Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(prefetch_lookahead=2)))
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), label
        for stats in done[-2:]:  # each micro-batch did what the policy says
            _check_done(w, vec, stats, label)


def test_policy_for_another_accumulation_is_refused() -> None:
    one = capture(_mlp, name="mlp", batch_size=4)
    acc = capture(_mlp, name="mlp", batch_size=4, grad_accum=4)
    with pytest.raises(AutotuneError, match=r"1 micro-batch per optimizer step but the workload accumulates 4"):
        Policy.uniform(one, Action.SWAP, hardware="cpu").check_against(acc)
    assert Policy.uniform(acc, Action.SWAP, hardware="cpu").grad_accum == 4


@pytest.mark.slow
def test_measured_peak_of_accumulation_matches_simulated() -> None:
    """Three micro-batches and a step, measured on the CPU for keep, swap, recompute and two mixed policies,
    against the simulator (Rule 10: the traced micro-batch's peak): within 3%, and above one micro-batch's."""
    name, kwargs = "resnet18", {"batch_size": 4, "image_size": 96}
    build = _build(name, kwargs)
    w = capture(build, name=name, batch_size=4, fake=False, grad_accum=3)
    single = capture(build, name=name, batch_size=4, fake=False)
    sim = Simulator(w, get_profile("cpu"))
    errors = {}
    policies = _policies(w)
    del policies["recompute-all"]
    for label, vec in policies.items():
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(prefetch_lookahead=2))
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model)
        opt = make_optimizer("sgd", model.parameters())
        measured = run_iterations(model, batch, loss_fn, opt, steps=1, batch_size=4, around_step=rt.step, grad_accum=3)[
            0
        ].peak_bytes
        errors[label] = sim.run(policy).peak_bytes / measured - 1
        if label == "keep":
            one = Simulator(single, get_profile("cpu")).run(Policy.uniform(single, Action.KEEP, hardware="cpu"))
            assert measured > one.peak_bytes  # the gradients live through the later micro-batches' forward
    print({label: f"{e:+.2%}" for label, e in errors.items()})
    assert all(abs(e) <= 0.03 for e in errors.values()), errors


@pytest.mark.parametrize(("planned", "runs", "set_to_none", "warns"), [
    (1, 2, True, True), (2, 2, True, False), (2, 1, True, True), (1, 2, False, False), (1, 1, True, False),
])  # fmt: skip
def test_a_plain_loop_that_accumulates_otherwise_than_planned_is_told(
    planned: int, runs: int, set_to_none: bool, warns: bool
) -> None:
    """R20: a policy planned for one micro-batch per optimizer step, applied in a loop of two, ran without a
    word (a QA run): its plan holds the gradients through another number of forwards. The runtime counts the
    steps between gradient resets and warns once; a loop that zeroes in place is not counted."""
    import warnings

    w = capture(_mlp, name="mlp", batch_size=4, grad_accum=planned)
    policy = Policy.from_vector(w, [Action.RECOMPUTE.code] * len(w.candidates), hardware="cpu")
    model, batch, loss_fn = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(4):  # optimizer steps
            for _ in range(runs):
                with policy.applied(model):
                    loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    told = [str(s.message) for s in said if "between gradient resets" in str(s.message)]
    assert len(told) == (1 if warns else 0), told
    if warns:
        assert f"planned for {planned} micro-batch" in told[0] and f"runs {runs} between" in told[0], told[0]


def test_a_batch_larger_than_planned_is_told_once_and_a_smaller_one_not() -> None:
    """R11: a policy planned for batch 4 applied at batch 8 ran without a word (a QA run), its plan's memory
    not holding the step. A larger batch warns once; a loader's smaller last batch says nothing."""
    import warnings

    w = capture(_mlp, name="mlp", batch_size=4)
    policy = Policy.from_vector(w, [Action.RECOMPUTE.code] * len(w.candidates), hardware="cpu")
    model, (x, y), loss_fn = _mlp()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for k in (0.5, 1, 2, 3):  # samples: 2, 4 (planned), 8, 12
            batch = (x[:2], y[:2]) if k == 0.5 else (x.repeat(int(k), 1), y.repeat(int(k)))
            with policy.applied(model):
                loss_fn(model, batch).backward()
    told = [str(s.message) for s in said if "larger inputs" in str(s.message)]
    assert told == ["autotune: the policy for mlp applied to larger inputs than it was planned for: batch 8 "
                    "(planned 4); it applies, but the step holds more memory than its plan (R11): search one for "
                    "these sizes"]  # fmt: skip
