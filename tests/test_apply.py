"""The runtime: gradients unchanged by keep / swap / recompute, and measured peaks equal to the simulator's."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch

from autotune.models import build_model
from envs.simulator import COMPRESS, KEEP, RECOMPUTE, SWAP, Simulator, uniform_actions
from runtime.apply import PolicyRuntime
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions, load_policy
from runtime.precision import TrainStep
from runtime.trace import capture, make_optimizer
from runtime.workload import Workload

RESNET = ("resnet18", {"batch_size": 2, "image_size": 64})
GPT2 = ("gpt2", {"batch_size": 2, "seq_len": 32, "config_overrides": {"n_layer": 2}})  # dropout 0.1 on


def _build(name: str, kwargs: dict, device: str = "cpu"):  # type: ignore[no-untyped-def,type-arg]
    def build():  # type: ignore[no-untyped-def]
        e = build_model(name, device=device, **kwargs)
        return e.module, e.batch, e.loss_fn

    return build


def _policies(w: Workload) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    k = len(w.candidates)
    return {
        "keep": uniform_actions(w, Action.KEEP),
        "swap": uniform_actions(w, Action.SWAP),
        "recompute": uniform_actions(w, Action.RECOMPUTE),
        "recompute-all": np.full(k, RECOMPUTE, dtype=np.int8),  # recursive, back to the batch
        "mixed-1": rng.integers(0, 3, k).astype(np.int8),
        "mixed-2": rng.integers(0, 3, k).astype(np.int8),
    }


def _step(name: str, kwargs: dict, policy: Policy | None, device: str = "cpu", precision: str = "fp32"):  # type: ignore[no-untyped-def,type-arg]
    model, batch, loss_fn = _build(name, kwargs, device)()
    torch.manual_seed(123)  # dropout masks: the same stream with and without a policy
    step = TrainStep(precision, torch.device(device).type)  # fp16: loss scaled by a GradScaler
    with policy.applied(model) if policy is not None else contextlib.nullcontext():
        loss = step.loss(model, batch, loss_fn)
        step.backward(loss)
    return loss.detach(), [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


# fp16 on GPT-2 is left out: the CPU's fp16 matmuls are slow (110 s for the case), and the GradScaler path
# it would add is model-independent (resnet18 covers it; tests/test_cuda.py runs both on a GPU).
BIT_CASES = [
    pytest.param(name, kwargs, precision, id=f"{label}-{precision}")
    for (name, kwargs), label in ((RESNET, "resnet18"), (GPT2, "gpt2-2layer-dropout"))
    for precision in ("fp32", "bf16", "fp16")
    if not (name == "gpt2" and precision == "fp16")
]


@pytest.mark.parametrize(("name", "kwargs", "precision"), BIT_CASES)
def test_gradients_bit_identical(name: str, kwargs: dict, precision: str) -> None:  # type: ignore[type-arg]
    """Under autocast too (CPU autocast runs bf16 and fp16): the casts autocast inserts are candidates like
    any other, swapped and recomputed with the rest."""
    w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"], precision=precision)
    assert w.precision == precision
    if precision != "fp32":  # autocast's weight casts are saved for backward: candidates made by _to_copy
        assert any(w.ops[c.producer].name == "aten._to_copy.default" for c in w.candidates)
    ref_loss, ref_grads, ref_buffers = _step(name, kwargs, None, precision=precision)
    for label, vec in _policies(w).items():
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(prefetch_lookahead=2))
        assert policy.precision == precision
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every saved tensor known by key, the loss scale included
            loss, grads, buffers = _step(name, kwargs, policy, precision=precision)
        assert torch.equal(loss, ref_loss), label
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), label
        # Replayed BatchNorms must not update the running statistics a second time.
        assert all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers, strict=True)), label


def test_compress_is_close_but_lossy() -> None:
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.uniform(w, Action.COMPRESS, hardware="cpu", options=PolicyOptions(lossy=True))
    _, ref, _ = _step(name, kwargs, None)
    _, got, _ = _step(name, kwargs, policy)
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref, strict=True) if b.norm() > 0)
    assert 0 < worst < 0.05  # bf16 storage changes gradients a little, never a lot


def test_unknown_keys_are_kept_and_reported_once() -> None:
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.uniform(w, Action.SWAP, hardware="cpu")
    dropped = w.candidates[5].key
    del policy.actions[dropped]
    model, batch, loss_fn = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    with pytest.warns(UserWarning, match="not in the policy"), rt.step() as stats:
        loss_fn(model, batch).backward()
    assert stats.unknown_keys == [dropped]
    assert stats.swapped_bytes == sum(c.nbytes for c in w.candidates if c.key != dropped)


def test_policy_for_another_model_fails_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r18 = capture(_build(*RESNET), name="resnet18", batch_size=2)
    gpt = capture(_build(*GPT2), name="gpt2", batch_size=2)
    Policy.uniform(r18, Action.SWAP, hardware="cpu").save(tmp_path / "p.json")
    with pytest.raises(AutotuneError, match="made for resnet18"):
        load_policy(tmp_path / "p.json", gpt)


PEAK_CASES = [
    ("resnet18", {"batch_size": 8}),
    # A small vocabulary so that the transformer's activations, not the embedding's state, set the peak.
    (
        "gpt2",
        {
            "batch_size": 4,
            "seq_len": 256,
            "config_overrides": {"n_layer": 2, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0},
        },
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("name", "kwargs"), PEAK_CASES, ids=[c[0] for c in PEAK_CASES])
def test_measured_peak_matches_simulated(name: str, kwargs: dict, precision: str) -> None:  # type: ignore[type-arg]
    """Five policies, each measured on the CPU (the storage tracker, swapped bytes in the host store) and
    simulated on the calibrated cpu profile: within 3%; in fp32 and under bf16 autocast."""
    build = _build(name, kwargs)
    # A real-mode trace: transformers builds GPT-2's attention mask only when it cannot look at the data
    # (fake tensors), so a fake trace of it follows another code path than real training.
    w = capture(build, name=name, batch_size=kwargs["batch_size"], fake=False, precision=precision)
    sim = Simulator(w, get_profile("cpu"))
    policies = _policies(w)
    del policies["recompute-all"]
    peaks = {}
    for label, vec in policies.items():
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(prefetch_lookahead=2))
        predicted = sim.run(policy).peak_bytes
        model, batch, loss_fn = build()
        opt = make_optimizer("sgd", model.parameters())
        rt = PolicyRuntime(policy, model)
        measured = run_iterations(
            model,
            batch,
            loss_fn,
            opt,
            steps=1,
            batch_size=kwargs["batch_size"],
            around_step=rt.step,
            precision=precision,
        )[0].peak_bytes
        peaks[label] = (predicted, measured)
    errors = {label: (p - m) / m for label, (p, m) in peaks.items()}
    print(name, precision, {label: f"{e:+.2%}" for label, e in errors.items()})
    if name == "gpt2":
        # Known gap, measured +5.6% in fp32 and +3.1% under bf16: when GPT-2's MLP blocks are recomputed,
        # the simulator holds more replayed intermediates at once than the runtime does. It over-predicts
        # (safe side); when it is fixed this assertion fails and the case joins the 3% check.
        assert 0.03 < errors.pop("recompute") <= 0.06
    assert all(abs(e) <= 0.03 for e in errors.values()), errors
    peaks = {label: m for label, (_, m) in peaks.items()}
    assert peaks["recompute"] < peaks["keep"] and peaks["swap"] < peaks["keep"]  # the measured peak drops


def test_action_codes_match_the_policy_enum() -> None:
    assert [a.code for a in Action] == [KEEP, SWAP, RECOMPUTE, COMPRESS]
