"""The runtime on a CUDA device: pinned-memory swap on side streams, recompute with the CUDA RNG, and the
allocator's peak against the simulator's prediction. Skipped with a reason where there is no CUDA device
(CI has none); experiments/gpu_check.py runs them on a GPU machine."""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest
import torch

from envs.simulator import Simulator, uniform_actions
from runtime.apply import PolicyRuntime
from runtime.hardware import get_profile
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions
from runtime.trace import capture, make_optimizer
from tests.test_apply import _build as build_on
from tests.test_apply import _policies
from tests.test_apply import _step as step_on
from tests.test_apply import _steps as steps_on

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]

RESNET = ("resnet18", {"batch_size": 4, "image_size": 64})
GPT2 = ("gpt2", {"batch_size": 2, "seq_len": 64, "config_overrides": {"n_layer": 2}})  # dropout 0.1 on


@pytest.fixture(autouse=True)
def _deterministic():  # type: ignore[no-untyped-def]
    """cuDNN picks its algorithms by benchmarking unless told not to; the same algorithm for a replayed
    convolution is what makes recomputation bit-identical."""
    old = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = old


def _build(name: str, kwargs: dict):  # type: ignore[no-untyped-def,type-arg]
    return build_on(name, kwargs, "cuda")


def _step(name: str, kwargs: dict, policy: Policy | None, precision: str = "fp32"):  # type: ignore[no-untyped-def,type-arg]
    return step_on(name, kwargs, policy, "cuda", precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("name", "kwargs"), [RESNET, GPT2], ids=["resnet18", "gpt2-2layer-dropout"])
def test_gradients_bit_identical_on_cuda(name: str, kwargs: dict, precision: str) -> None:  # type: ignore[type-arg]
    """fp32 and CUDA autocast (bf16; fp16 with a GradScaler)."""
    w = capture(
        _build(name, kwargs), name=name, batch_size=kwargs["batch_size"], fake=False, device="cuda", precision=precision
    )
    ref_loss, ref_grads, ref_buffers = _step(name, kwargs, None, precision)
    for label, vec in _policies(w).items():
        policy = Policy.from_vector(w, vec, hardware="h200", options=PolicyOptions(prefetch_lookahead=2))
        loss, grads, buffers = _step(name, kwargs, policy, precision)
        assert torch.equal(loss, ref_loss), label
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), label
        assert all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers, strict=True)), label


def test_swap_moves_bytes_to_pinned_host_memory_and_reuses_the_buffers() -> None:
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=4, fake=False, device="cuda")
    policy = Policy.from_vector(w, uniform_actions(w, Action.SWAP), hardware="h200")
    model, batch, loss_fn = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    for _ in range(2):
        with rt.step() as stats:
            loss_fn(model, batch).backward()
    torch.cuda.synchronize()
    assert stats.swapped_bytes > 0
    buffers = list(rt._pinned.values())
    unpinned = sum(not b.is_pinned() for b in buffers if b.numel())  # an empty tensor is never pinned
    assert buffers and unpinned == 0, f"{unpinned} of {len(buffers)} host buffers are not pinned"
    assert sum(b.numel() for b in buffers) == stats.swapped_bytes  # one buffer per key, reused: no growth


def test_a_smaller_batch_swaps_through_the_larger_batchs_pinned_buffers() -> None:
    """A DataLoader's smaller last batch (R11: its own tables, learnt once): its copies out go to slices of
    the full batch's pinned buffers (none made for it), copies back and releases on the streams as planned,
    and every step's gradients equal plain training's."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=4, fake=False, device="cuda")
    options = PolicyOptions(prefetch_lookahead=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="h200", options=options)
    model, batch, loss_fn = _build(name, kwargs)()
    plain, _, _ = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    small = tuple(t[:3] for t in batch)
    buffers: dict[str, int] = {}
    for step, b in enumerate((batch, batch, small, batch, small)):
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with rt.step() as stats:
            loss_fn(model, b).backward()
        torch.manual_seed(step)
        loss_fn(plain, b).backward()
        torch.cuda.synchronize()
        assert stats.swaps > 0
        grads = zip(model.parameters(), plain.parameters(), strict=True)
        assert all(torch.equal(p.grad, q.grad) for p, q in grads), step
        if step == 1:
            buffers = {k: v.data_ptr() for k, v in rt._pinned.items()}
    assert {k: v.data_ptr() for k, v in rt._pinned.items()} == buffers  # the small batch made none


@pytest.mark.parametrize(("name", "kwargs"), [RESNET, GPT2], ids=["resnet18", "gpt2-2layer-dropout"])
def test_allocator_peak_matches_the_simulator(name: str, kwargs: dict) -> None:  # type: ignore[type-arg]
    """Keep, swap and recompute: the allocator's peak within 3% of the simulator's (the h200 profile's 512 B
    rounding). cuBLAS and cuDNN workspaces come from the same allocator and are not tensors the trace
    sees; they are what a miss would show."""
    w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"], fake=False, device="cuda")
    sim = Simulator(w, get_profile("h200"))
    misses = {}
    for label in ("keep", "swap", "recompute"):
        vec = _policies(w)[label]
        policy = Policy.from_vector(w, vec, hardware="h200")
        predicted = sim.run(policy).peak_bytes
        gc.collect()
        before = torch.cuda.memory_allocated()  # whatever earlier tests left: not this iteration's
        model, batch, loss_fn = _build(name, kwargs)()
        opt = make_optimizer("sgd", model.parameters())
        rt = PolicyRuntime(policy, model)
        measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=1, around_step=rt.step)[-1]
        peak = measured.peak_bytes - before
        assert measured.reserved_bytes is not None and measured.reserved_bytes >= measured.peak_bytes
        misses[label] = (predicted, peak, (predicted - peak) / peak)
        del model, batch, loss_fn, opt, rt
    assert all(abs(m[2]) <= 0.03 for m in misses.values()), misses


@pytest.mark.parametrize(("name", "kwargs"), [RESNET, GPT2], ids=["resnet18", "gpt2-2layer-dropout"])
def test_later_steps_are_bit_identical_on_cuda(name: str, kwargs: dict) -> None:  # type: ignore[type-arg]
    """Three steps under one runtime on CUDA: the learning step, then scoped hooks, checkpointed regions,
    swaps released at their pack points with the compute stream waiting on the copy's event (R3, R10,
    R11): every step's gradients equal plain training's."""
    w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"], fake=False, device="cuda")
    ref = steps_on(name, kwargs, None, device="cuda")
    for label, vec in _policies(w).items():
        for release in (1, 4):
            options = PolicyOptions(prefetch_lookahead=2, release_after=release)
            policy = Policy.from_vector(w, vec, hardware="h200", options=options)
            got = steps_on(name, kwargs, policy, device="cuda")
            for step, (a, b) in enumerate(zip(got, ref, strict=True)):
                assert torch.equal(a[0], b[0]), (label, release, step)
                assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)), (label, release, step)
                assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True)), (label, release, step)


def test_a_replay_waits_for_a_copy_back_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """R5 and R6: a replay that reads a swapped tensor whose copy back was issued earlier (prefetched, R4)
    waits for the copy, as backward's own unpack does. Every copy back is held up on its stream here (a sleep
    kernel before it), so a replay that did not wait would read the buffer before its bytes arrive: mixed
    policies on both models replay from such tensors (an H200 run's GPT-2 gradients differed once, by chance
    of timing, before replays waited)."""
    from runtime.vocab import RECOMPUTE, SWAP

    issue = PolicyRuntime._issue_fetch

    def late(self: PolicyRuntime, h: object) -> None:
        if self._cuda and not getattr(h, "issued", True):
            with torch.cuda.stream(self._h2d):
                torch.cuda._sleep(2_000_000)  # about a millisecond
        issue(self, h)  # type: ignore[arg-type]

    monkeypatch.setattr(PolicyRuntime, "_issue_fetch", late)
    for name, kwargs in (RESNET, GPT2):
        w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"], fake=False, device="cuda")
        ref = steps_on(name, kwargs, None, steps=2, device="cuda")
        policies = {k: v for k, v in _policies(w).items() if k.startswith("mixed")}
        n = len(w.candidates)
        policies["alternating"] = np.array([SWAP if i % 2 == 0 else RECOMPUTE for i in range(n)], np.int8)
        for label, vec in policies.items():
            policy = Policy.from_vector(w, vec, hardware="h200", options=PolicyOptions(prefetch_lookahead=2))
            got = steps_on(name, kwargs, policy, steps=2, device="cuda")
            for step, (a, b) in enumerate(zip(got, ref, strict=True)):
                assert torch.equal(a[0], b[0]), (name, label, step)
                assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)), (name, label, step)


def test_shared_gradients_on_cuda() -> None:
    """Runtime R14 on the GPU (runtime/shared_grads.py): the tied weight's gradient bit for bit PyTorch's,
    and the allocator's peak of backward lower by what the simulator plans from a CUDA trace of the same
    model (Rule 15: the bytes of the sums the trace saw PyTorch make in a new tensor; none where PyTorch adds
    in place already, which an H200 run measured: both peaks 4,230,656 B), within 10% of the weight's bytes
    (CUDA's embedding backward has its own temporaries)."""
    from runtime.shared_grads import SharedGradients
    from tests.test_shared_grads import B, TiedLM, W, _loss

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = TiedLM().cuda()
        return model, (torch.randint(0, 4096, (B,), device="cuda"), torch.randint(0, 4096, (B,), device="cuda")), _loss

    w = capture(build, name="tied", batch_size=B, fake=False, device="cuda")
    sim = Simulator(w, get_profile("h200"))
    planned = sim.no_policy().peak_bytes - sim.run(uniform_actions(w, Action.KEEP)).peak_bytes

    def step(shared: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = TiedLM().cuda()
        batch = (torch.randint(0, 4096, (B,), device="cuda"), torch.randint(0, 4096, (B,), device="cuda"))
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with SharedGradients(model).installed() if shared else contextlib.nullcontext():
            _loss(model, batch).backward()
        torch.cuda.synchronize()
        # On the host: gradients kept on the device would count in the next step's peak (an H200 run of this
        # test measured the shared step 1.07 MB over the plain one: the plain step's clones, still held).
        return [p.grad.cpu() for p in model.parameters()], torch.cuda.max_memory_allocated()

    (plain, plain_peak), (shared, shared_peak) = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, shared, strict=True))
    marked = [op.name for op in w.ops if op.in_place_into >= 0]
    assert abs((plain_peak - shared_peak) - planned) <= 0.1 * W, (plain_peak, shared_peak, planned, marked)
