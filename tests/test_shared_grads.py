"""A shared parameter's gradients summed in place (runtime/shared_grads.py, NOTE [ Shared parameters'
gradients ]; runtime R14, simulator Rule 15): PyTorch's sum bit for bit, one buffer of the parameter's size
less where PyTorch makes the sum in a new tensor, measured as simulated."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from envs.simulator import Simulator, compiled_twin, peak_floor, uniform_actions
from envs.simulator_reference import simulate_reference
from runtime.apply import PolicyRuntime
from runtime.hardware import get_profile
from runtime.measure import profiler_peak_bytes, run_iterations, training_state
from runtime.policy import Action, Policy
from runtime.shared_grads import SharedGradients, _Sum, shared_parameters
from runtime.trace import capture, make_optimizer
from runtime.vocab import KEEP, RECOMPUTE
from runtime.workload import Workload

V, D, B = 4096, 64, 8
W = V * D * 4  # the tied weight's bytes: 1 MiB


class TiedLM(nn.Module):
    """An embedding whose weight is also the output layer's, as GPT-2's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.wte(x))))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = TiedLM()
    return model, (torch.randint(0, V, (B,)), torch.randint(0, V, (B,))), _loss


def _grads(runtime: bool, run: Callable[[nn.Module, Any], None]) -> list[torch.Tensor]:
    model, batch, _ = _build()
    with SharedGradients(model).installed() if runtime else contextlib.nullcontext():
        run(model, batch)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _accumulate(model: nn.Module, batch: Any) -> None:
    for _ in range(2):  # gradient accumulation: the second sum is added into the first micro-batch's
        _loss(model, batch).backward()


def _retained(model: nn.Module, batch: Any) -> None:
    loss = _loss(model, batch)
    loss.backward(retain_graph=True)
    loss.backward()


def _unrun_edge(model: nn.Module, batch: Any) -> None:
    loss = _loss(model, batch)
    unused = model.head(torch.ones(3, D))  # an edge into the weight that this backward does not run
    loss.backward()
    del unused


def _bf16(model: nn.Module, batch: Any) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, batch)
    loss.backward()


@pytest.mark.parametrize(
    "run",
    [lambda m, b: _loss(m, b).backward(), _accumulate, _retained, _unrun_edge, _bf16],
    ids=["one backward", "accumulated", "retained graph", "an edge not run", "bf16 autocast"],
)
def test_the_sum_is_pytorchs_bit_for_bit(run: Callable[[nn.Module, Any], None]) -> None:
    assert [len(m) for m in shared_parameters(_build()[0]).values()] == [2]
    plain, shared = _grads(False, run), _grads(True, run)
    assert len(plain) == len(shared) == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, shared, strict=True))


def _trace(fake: bool) -> Workload:
    return capture(_build, name="tied", batch_size=B, fake=fake)


def test_the_trace_marks_the_sum_and_the_simulators_agree() -> None:
    """One op, in fake and real traces alike: the sum PyTorch makes of the head's gradient (a view, so not
    added into) and the embedding's; under every policy it costs W less there, without a policy it is as
    traced (Rule 15). The op-by-op simulator agrees, and the floor counts the saving."""
    w = _trace(fake=False)
    marked = [op for op in w.ops if op.in_place_into >= 0]
    assert [(op.name, op.module) for op in marked] == [("aten.add.Tensor", "wte")]
    assert w.tensors[marked[0].in_place_into].nbytes == W
    fake = _trace(fake=True)
    assert [(op.index, op.in_place_into) for op in fake.ops if op.in_place_into >= 0] == [
        (marked[0].index, marked[0].in_place_into)
    ]
    hw = get_profile("cpu")
    sim = Simulator(w, hw)
    keep = sim.run(uniform_actions(w, Action.KEEP))
    plain = sim.no_policy()
    assert plain.peak_op == marked[0].index  # the three buffers' op is this model's peak; without the third,
    assert keep.peak_op == marked[0].index - 1  # the embedding's backward is: the two and its input's gradient
    assert plain.peak_bytes - keep.peak_bytes == W - B * D * 4
    assert peak_floor(w, hw).bytes == keep.peak_bytes  # nothing else is live there that a policy could drop
    rng = np.random.default_rng(0)
    for vec in [uniform_actions(w, Action.KEEP), *(rng.integers(0, 3, len(w.candidates)) for _ in range(4))]:
        vec = np.asarray(vec, dtype=np.int8)
        assert sim.run(vec).peak_bytes == simulate_reference(w, hw, vec).peak_bytes
    # Rule 16: under torch.compile the sum is PyTorch's (aot_eager: a new tensor, as traced) unless inductor's
    # buffer reuse makes it in place (R14's saving).
    for backend, peak in (("aot_eager", plain.peak_bytes), ("inductor", keep.peak_bytes)):
        tw, th = compiled_twin(w, hw, backend)
        vec = uniform_actions(w, Action.KEEP)
        assert Simulator(tw, th).run(vec).peak_bytes == simulate_reference(tw, th, vec).peak_bytes == peak


def test_the_runtime_measures_what_the_simulator_plans() -> None:
    """Training for real on the CPU (the storage tracker): plain training at the no-policy peak, a keep-all
    policy through the runtime W below it, each exactly as simulated."""
    w = _trace(fake=False)
    sim = Simulator(w, get_profile("cpu"))
    policy = Policy.from_vector(w, uniform_actions(w, Action.KEEP), hardware="cpu")

    def measured(runtime: bool) -> int:
        model, batch, loss_fn = _build()
        opt = make_optimizer("sgd", model.parameters())
        around = PolicyRuntime(policy, model).step if runtime else None
        return run_iterations(model, batch, loss_fn, opt, steps=1, batch_size=B, around_step=around)[0].peak_bytes

    plain, applied = measured(False), measured(True)
    assert plain == sim.no_policy().peak_bytes
    assert applied == sim.run(policy).peak_bytes == plain - W + B * D * 4
    # Compiled under aot_eager the sum is PyTorch's again: the step holds plain training's peak, which the
    # simulator's twin of it plans (Rule 16), not the runtime's.
    model, batch, loss_fn = _build()
    opt = make_optimizer("sgd", model.parameters())
    cm = policy.compiled(model, backend="aot_eager")

    def step() -> None:
        loss_fn(cm, batch).backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    base = sum(t.untyped_storage().nbytes() for t in training_state(model, batch, opt))
    twin = Simulator(*compiled_twin(w, get_profile("cpu"), "aot_eager")).run(policy).peak_bytes
    assert profiler_peak_bytes(step, base) == twin == plain


def test_nothing_outlives_the_step() -> None:
    """No reference cycle keeps a step's sums (and through them its AccumulateGrad node and hooks) alive after
    the step: when the sum held its node, each step left one more pre-hook on the next until the garbage
    collector ran (checked with the collector off)."""
    model, batch, loss_fn = _build()
    shared = SharedGradients(model)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with shared.installed():
                loss_fn(model, batch).backward()
            with shared.installed():
                loss_fn(model, batch)  # a forward without its backward
        left = [o for o in gc.get_objects() if type(o) is _Sum]
    finally:
        gc.enable()
    assert left == []


class _MaskedLMHead(nn.Module):
    """BERT's masked-LM head: its ``bias`` is also its decoder's, one parameter under two names, used once."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(D, V)
        self.bias = self.decoder.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(h)


def test_a_parameter_two_modules_hold_and_one_op_uses_reaches_accumulate_grad_whole() -> None:
    """S1: the head's call and its decoder's both find the decoder's one edge into the bias; counted twice,
    its gradient was held back to the end of backward, so a post-accumulate hook (and DDP's, which all-reduced
    zeros) saw none, though ``.grad`` came out right. Now each hook sees plain training's gradient, bit for
    bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), _MaskedLMHead())
    batch = (torch.randn(B, D), torch.randint(0, V, (B,)))
    assert [len(m) for m in shared_parameters(model).values()] == [2]

    def seen(runtime: bool) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {}
        handles = [
            p.register_post_accumulate_grad_hook(
                lambda p, n=n: out.__setitem__(n, None if p.grad is None else p.grad.clone())
            )
            for n, p in model.named_parameters()
        ]
        model.zero_grad(set_to_none=True)
        with SharedGradients(model).installed() if runtime else contextlib.nullcontext():
            _loss(model, batch).backward()
        for h in handles:
            h.remove()
        return out

    plain, shared = seen(False), seen(True)
    assert set(plain) == set(shared) == {"0.weight", "0.bias", "2.bias", "2.decoder.weight"}  # 2.bias: the shared one
    for name, g in plain.items():
        got = shared[name]
        assert g is not None and got is not None and torch.equal(g, got), name


class _Encoder(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.mix = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(x)))


class _TiedEncoderDecoder(nn.Module):
    """T5's pattern: one embedding weight used by the encoder, the decoder and the output layer; backward
    reaches the head's use first, the decoder's next, the encoder's last."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(V, D)
        self.encoder = _Encoder(nn.Embedding(V, D))
        self.encoder.embed.weight = self.shared.weight
        self.cross = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(x)
        return self.head(torch.tanh(self.shared(x.flip(0)) + self.cross(memory)))


def _build_encoder_decoder() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    return _TiedEncoderDecoder(), (torch.randint(0, V, (B,)), torch.randint(0, V, (B,))), _loss


def test_a_use_inside_a_region_node_is_added_last_as_pytorch_adds_it() -> None:
    """S3 / R14: the encoder run as one node uses the shared embedding without a graph, so its gradient reaches
    the engine's buffer after the edges the hooks found. The last of those (the decoder's) passed its gradient
    to that buffer and the head's stayed held for AccumulateGrad: the decoder's and the encoder's were added
    first, in a new tensor, so the gradient differed from plain training's by rounding (2e-9 on a tiny T5), and
    three weight-sized gradients were live at once: 6,391,432 bytes measured against 4,298,376 planned (49%
    under; on a tiny T5 32,768 bytes, 1.2%). The last edge now hands its gradient over too: bit for bit, to the
    byte."""
    from tests.steps import same_bits, train_steps

    w = capture(_build_encoder_decoder, name="tied-encoder-decoder", batch_size=B, fake=False)
    vec = np.array([RECOMPUTE if c.key.startswith("encoder.") else KEEP for c in w.candidates], np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu")
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["encoder"]
    assert same_bits(train_steps(_build_encoder_decoder, policy, steps=3), train_steps(_build_encoder_decoder, None, 3))
    model, batch, loss_fn = _build_encoder_decoder()
    opt = make_optimizer("sgd", model.parameters())
    measured = run_iterations(
        model, batch, loss_fn, opt, steps=2, batch_size=B, around_step=PolicyRuntime(policy, model).step
    )
    assert [m.peak_bytes for m in measured] == [Simulator(w, get_profile("cpu")).run(policy).peak_bytes] * 2
