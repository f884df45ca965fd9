"""The runtime: gradients unchanged by keep / swap / recompute, and measured peaks equal to the simulator's."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autotune.models import build_model
from envs.simulator import Simulator, uniform_actions
from runtime.apply import PolicyRuntime, RuntimeStats
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions, load_policy
from runtime.precision import TrainStep
from runtime.step_only import _left_behind
from runtime.trace import capture, make_optimizer
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload
from tests.steps import Build, classifier, planned_and_measured, same_bits, train_steps

RESNET = ("resnet18", {"batch_size": 2, "image_size": 64})
GPT2 = ("gpt2", {"batch_size": 2, "seq_len": 32, "config_overrides": {"n_layer": 2}})  # dropout 0.1 on
# The same with a 512-token vocabulary: the language-model head no longer dominates each step.
GPT2_SMALL_VOCAB = ("gpt2", {**GPT2[1], "config_overrides": {"n_layer": 2, "vocab_size": 512, "bos_token_id": 0,
                                                              "eos_token_id": 0}})  # fmt: skip


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
    return _step_and_stats(name, kwargs, policy, device, precision)[:3]


def _step_and_stats(name: str, kwargs: dict, policy: Policy | None, device: str = "cpu", precision: str = "fp32"):  # type: ignore[no-untyped-def,type-arg]
    """One step: the loss, gradients, buffers, and what the runtime did (None without a policy)."""
    model, batch, loss_fn = _build(name, kwargs, device)()
    torch.manual_seed(123)  # dropout masks: the same stream with and without a policy
    step = TrainStep(precision, torch.device(device).type)  # fp16: loss scaled by a GradScaler
    with policy.applied(model) if policy is not None else contextlib.nullcontext() as stats:
        loss = step.loss(model, batch, loss_fn)
        step.backward(loss)
    grads, buffers = [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]
    return loss.detach(), grads, buffers, stats


def _check_done(w: Workload, vec: np.ndarray, stats: RuntimeStats, label: str) -> None:
    """Bit-identical gradients cannot tell a runtime that does nothing: what it did is what the policy says.
    Every swapped candidate's bytes were copied (on the CPU all of them: R3); every recomputed one was
    regenerated, by a region or a replay; an all-keep policy did nothing."""
    swapped = sum(c.nbytes for c, a in zip(w.candidates, vec, strict=True) if a == SWAP)
    assert stats.swapped_bytes == swapped, (label, stats.swapped_bytes, swapped)
    recomputes = bool(np.any(vec == RECOMPUTE))
    assert (stats.regions + stats.recomputed_ops > 0) == recomputes, (label, stats)
    assert stats.compressed_bytes == 0 and stats.unknown_keys == []


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
            loss, grads, buffers, stats = _step_and_stats(name, kwargs, policy, precision=precision)
        assert torch.equal(loss, ref_loss), label
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), label
        # Replayed BatchNorms must not update the running statistics a second time.
        assert all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers, strict=True)), label
        _check_done(w, vec, stats, label)


def test_compress_is_close_but_lossy() -> None:
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.uniform(w, Action.COMPRESS, hardware="cpu", options=PolicyOptions(lossy=True))
    _, ref, _ = _step(name, kwargs, None)
    _, got, _ = _step(name, kwargs, policy)
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref, strict=True) if b.norm() > 0)
    assert 0 < worst < 0.05  # bf16 storage changes gradients a little, never a lot


class _PooledIndices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.c2, self.fc = (
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.Conv2d(8, 32, 3, padding=1),
            torch.nn.Linear(32, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.nn.functional.max_pool2d(self.c(x), 3, stride=1, padding=1)
        return self.fc(torch.tanh(self.c2(p)).mean((2, 3)))


def test_a_compressed_int64_index_is_planned_kept() -> None:
    """Rule 8 / R8: only a floating-point tensor wider than the compression dtype is compressed; max_pool2d's
    int64 indices are kept by the runtime. The simulator had planned them packed to a quarter: 570,884 bytes
    against 626,180 measured (9.7% under, a QA model); now to the byte in both simulators."""
    from envs.simulator_reference import simulate_reference

    build = classifier(_PooledIndices, (8, 3, 12, 12), 5)
    w = capture(build, name="pooled", batch_size=8, fake=False)
    indices = [i for i, c in enumerate(w.candidates) if w.tensors[c.tensor].dtype == "int64"]
    assert len(indices) == 1
    vec = np.full(len(w.candidates), KEEP, dtype=np.int8)
    vec[indices] = COMPRESS
    options = PolicyOptions(lossy=True)
    hw = get_profile("cpu")
    policy = Policy.from_vector(w, vec, hardware="cpu", options=options)
    planned = Simulator(w, hw).run(policy).peak_bytes
    assert planned == Simulator(w, hw).run(np.full(len(w.candidates), KEEP, dtype=np.int8)).peak_bytes
    assert simulate_reference(w, hw, vec, options=options).peak_bytes == planned
    model, batch, loss_fn = build()
    rt = PolicyRuntime(policy, model)
    measured = run_iterations(model, batch, loss_fn, make_optimizer("sgd", model.parameters()), steps=2,
                              batch_size=8, around_step=rt.step)  # fmt: skip
    assert [m.peak_bytes for m in measured] == [planned] * 2 and rt.stats.compressed_bytes == 0


def test_a_frozen_backbone_is_named_as_why_keys_went_unused() -> None:
    """A policy searched with every layer trainable, run with the first layers frozen: they save nothing (or
    other tensors), and the warning said the policy was "planned on another version of the model, or edited by
    hand?" (a QA run). It now says that parameters are frozen and to search again with them frozen."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.uniform(w, Action.SWAP, hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    for n, p in model.named_parameters():
        if n.startswith(("conv1", "bn1", "layer1")):
            p.requires_grad_(False)
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    said = f"{frozen} of the model's parameters are frozen"
    with pytest.warns(UserWarning, match=said) as caught, PolicyRuntime(policy, model).step():
        loss_fn(model, batch).backward()
    assert not any("another version" in str(c.message) for c in caught)


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
    # Many: one warning for the step, not one each (a policy searched on another device's trace printed 72).
    for c in w.candidates[6:12]:
        del policy.actions[c.key]
    model, batch, loss_fn = _build(name, kwargs)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PolicyRuntime(policy, model).step() as stats:
            loss_fn(model, batch).backward()
    said = [str(x.message) for x in caught if "not in the policy" in str(x.message)]
    assert len(stats.unknown_keys) == 7 and len(said) == 1 and "7 saved tensors" in said[0] and "4 more" in said[0]
    assert "unused" not in said[0]  # every action the policy has named a tensor of the step
    # A key edited by hand: the warning named the tensor the policy lost, not the action for a key that names none.
    policy.actions[dropped + "x"] = Action.SWAP
    model, batch, loss_fn = _build(name, kwargs)()
    unused = re.escape(f"for 1 key that this step did not save are unused ('{dropped}x': planned on another version")
    with pytest.warns(UserWarning, match=unused), PolicyRuntime(policy, model).step():
        loss_fn(model, batch).backward()
    # A policy planned for a GPU and run on the CPU: the kernels saved other tensors, nothing was edited.
    policy = dataclasses.replace(policy, hardware="a100-40gb")
    model, batch, loss_fn = _build(name, kwargs)()
    other = re.escape(f"('{dropped}x': planned for a100-40gb, whose kernels save other tensors than this CPU's)")
    with pytest.warns(UserWarning, match=other), PolicyRuntime(policy, model).step():
        loss_fn(model, batch).backward()


def test_a_second_call_of_the_model_says_its_tensors_are_kept_and_no_action_of_the_first_unused() -> None:
    """A model called twice in a step (a siamese loss) under a policy that recomputes in regions: the second
    call's tensors are kept, said once. The warning also called the first call's region keys and the keeps at
    their inputs unused, "planned on another version of the model, or edited by hand?" (a QA run): a region's
    saved tensors pass no hook of the runtime's, and a keep is no action left unused."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["recompute"], hardware="cpu")
    assert policy.schedule is not None and policy.schedule.regions
    model, (x, y), loss_fn = _build(name, kwargs)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with policy.applied(model) as stats:
            (loss_fn(model, (x, y)) + loss_fn(model, (x.flip(-1), y))).backward()
    said = [str(c.message) for c in caught if "not in the policy" in str(c.message)]
    assert stats.regions > 0 and len(said) == 1 and "they are kept" in said[0], said
    assert "unused" not in said[0], said[0]


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
# Under bf16 autocast, smaller: a CPU without native bf16 (no AVX512-BF16 or AMX) emulates its kernels, and
# the sizes above took 590 s (ResNet-18) and 1,105 s (GPT-2) on such a 2-core machine. GPT-2 narrower, so that
# its activations still set the peak at fewer tokens.
BF16_SIZES = {
    "resnet18": {"batch_size": 2},
    "gpt2": {
        "batch_size": 2,
        "seq_len": 128,
        "config_overrides": {**PEAK_CASES[1][1]["config_overrides"], "n_embd": 256, "n_head": 4},
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("name", "kwargs"), PEAK_CASES, ids=[c[0] for c in PEAK_CASES])
def test_measured_peak_matches_simulated(name: str, kwargs: dict, precision: str) -> None:  # type: ignore[type-arg]
    """Five policies, each measured on the CPU (the storage tracker, the host store of swapped bytes
    counted: on the CPU it is the same memory) and simulated on the calibrated cpu profile: within 3%; in
    fp32 and under bf16 autocast. Block recompute runs through checkpointed regions (runtime R10)."""
    kwargs = {**kwargs, **BF16_SIZES[name]} if precision == "bf16" else kwargs
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
    assert all(abs(e) <= 0.03 for e in errors.values()), errors
    peaks = {label: m for label, (_, m) in peaks.items()}
    assert peaks["recompute"] < peaks["keep"]  # the measured peak drops...
    assert peaks["swap"] >= peaks["keep"]  # ... but not by swapping on the CPU: its host store is counted


def test_nested_replays_that_make_the_same_storage_hold_it_once() -> None:
    """Rule 7 / R6: recomputing every saved tensor makes the first backward op re-make the whole forward, one
    replay nesting the others. The replays of the pooled features' clone (saved by the head) and of the mask
    read from it before ``masked_fill_`` wrote it re-run the same ops; the runtime makes each storage once
    (``Replayer.made``), and the simulator counts it once: its peak was 49% over the measured one (7,965,948
    bytes planned, 5,344,248 measured), now within a few bytes, in both simulators."""
    from envs.simulator_reference import simulate_reference
    from tests.fixtures_models import WhereMaskNet

    build = classifier(WhereMaskNet, (4, 3, 32, 32), 10)
    w = capture(build, name="where-mask", batch_size=4, fake=False)
    vec = np.full(len(w.candidates), RECOMPUTE, dtype=np.int8)
    hw = get_profile("cpu")
    planned = Simulator(w, hw).run(vec)
    assert simulate_reference(w, hw, vec).peak_bytes == planned.peak_bytes
    assert w.ops[planned.peak_op].phase.value == "backward"
    model, batch, loss_fn = build()
    rt = PolicyRuntime(Policy.from_vector(w, vec, hardware="cpu"), model)
    opt = make_optimizer("sgd", model.parameters())
    measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=4, around_step=rt.step)
    assert rt.stats.recomputed_ops > 0
    for m in measured:
        assert abs(planned.peak_bytes - m.peak_bytes) <= 64, (planned.peak_bytes, m.peak_bytes)


@pytest.mark.parametrize(
    "recomputed, swapped",
    [
        (("<root>#0.3:Relu",), ()),  # reads the chain from z, kept and freed by a * a's backward
        (("<root>#0.0:Tanh", "<root>#0.1:Addmm"), ()),  # tanh's replay reads p after pow's backward freed it
        (("bn#0.1:nograd",), ("bn#0.0:Convolution",)),  # the mean's replay reads the swapped input
        (None, ()),  # every tensor recomputed
    ],
    ids=["kept", "recomputed", "swapped", "all"],
)
def test_a_replay_re_makes_what_backward_freed_before_it_as_a_temporary(
    recomputed: tuple[str, ...] | None, swapped: tuple[str, ...]
) -> None:
    """Rule 7 / R6, R9: a replay that reads a saved tensor whose last backward use is past finds it gone,
    whatever its action, and re-makes it as a temporary. The simulator had planned a kept one as resident, and
    the runtime had held a handled one again after its last unpack, to the step's end, or, on the CPU, a swap's
    copy until no replay was left. Measured over planned before: kept 388,776 vs 356,008 bytes (+9.2%),
    swapped +2.4%, all recomputed +10.4% (the second case was already exact here; on a QA model with a layer
    before ``p`` it was +0.8%). Now planned to the byte in both simulators; gradients are plain training's."""
    from tests.fixtures_models import FreedBeforeReplay

    build = classifier(FreedBeforeReplay, (32, 16), 10)
    w = capture(build, name="freed", batch_size=32, fake=False)
    keys = [c.key for c in w.candidates]
    if recomputed is None:
        vec = uniform_actions(w, Action.RECOMPUTE)
    else:
        vec = np.array([RECOMPUTE if k in recomputed else SWAP if k in swapped else KEEP for k in keys], np.int8)
        assert (vec != KEEP).sum() == len(recomputed) + len(swapped)
    rt = _planned_to_the_byte(build, w, vec, 32)
    assert rt.stats.recomputed_ops > 0


def _planned_to_the_byte(
    build: Build, w: Workload, vec: np.ndarray, batch_size: int, lossy: bool = False
) -> PolicyRuntime:
    """Action codes ``vec`` on real-mode trace ``w``: the fast simulator's peak, the reference's and the runtime's
    measured one equal over two steps, and gradients plain training's bit for bit. Returns the runtime."""
    from envs.simulator_reference import simulate_reference

    hw, opts = get_profile("cpu"), PolicyOptions(lossy=lossy)
    policy = Policy.from_vector(w, vec, hardware="cpu", options=opts)
    planned = Simulator(w, hw).run(vec, options=opts).peak_bytes
    assert Simulator(w, hw).run(policy).peak_bytes == planned  # as the file says (P12 may have kept some)
    assert simulate_reference(w, hw, vec, options=opts).peak_bytes == planned
    model, batch, loss_fn = build()
    rt = PolicyRuntime(policy, model)
    opt = make_optimizer("sgd", model.parameters())
    measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=batch_size, around_step=rt.step)
    assert [m.peak_bytes for m in measured] == [planned] * 2
    assert same_bits(train_steps(build, policy, steps=2), train_steps(build, None, steps=2))
    return rt


@pytest.mark.parametrize("swapped", [False, True], ids=["u*v", "v*u"])
def test_replays_at_one_node_run_in_the_order_it_unpacks_them(swapped: bool) -> None:
    """Rule 7: two recomputed factors of one product, the second made from the first. MulBackward0 unpacks its
    second factor first: for ``u * v`` the replay of ``v`` runs first and re-makes ``u`` nested inside it, holding
    ``u``'s temporaries until ``v``'s ends. The simulator had replayed them in candidate order (``u`` alone, then
    ``v``): 593,536 bytes planned against 659,072 measured (11.0% under). The trace now records the unpack
    order (``Candidate.unpack_seq``) and both simulators follow it; ``v * u`` keeps the order it had."""
    from tests.fixtures_models import ProductOfChains

    build = classifier(lambda: ProductOfChains(swapped=swapped), (256, 16), 10)
    w = capture(build, name="product", batch_size=256, fake=False)
    keys = ["<root>#0.1:Tanh", "<root>#0.2:Relu", "<root>#0.3:Tanh"]
    vec = np.array([RECOMPUTE if c.key in keys else KEEP for c in w.candidates], np.int8)
    assert (vec == RECOMPUTE).sum() == 3
    u, v = (next(c for c in w.candidates if c.key == k) for k in (keys[0], keys[2]))
    assert u.first_use(len(w.ops)) == v.first_use(len(w.ops))  # one node unpacks both ...
    assert (v.unpack_seq < u.unpack_seq) != swapped  # ... the second factor first
    _planned_to_the_byte(build, w, vec, 256)


def test_a_replay_nested_in_an_earlier_one_re_makes_only_what_is_gone_there() -> None:
    """Rule 7: the two views of the stack that ``st[0] * st[1]`` saves are recomputed, and so is the head's
    input, whose replay (at backward's first op) re-makes that product and so the stack, nested in it. The
    stack's closure was taken as of its own first use, where ``where``'s output is gone and re-made; at the
    head's backward it is still live and the runtime reads it. Planned 16,344 bytes (about one 64 x 64 tensor)
    above the measured peak (271,448 against 255,104: +6.4%). Both simulators now take a nested replay's closure
    as of the op where it runs (runtime.plan.nested_closures)."""
    from runtime.plan import closures_of, nested_closures
    from tests.fixtures_models import StackedWhere

    build = classifier(StackedWhere, (64, 16), 10)
    w = capture(build, name="stacked-where", batch_size=64, fake=False)
    vec = np.array([RECOMPUTE if ":Select" in c.key or c.key.startswith("head#") else KEEP for c in w.candidates])
    assert (vec == RECOMPUTE).sum() == 2
    views, head = (int(i) for i in np.flatnonzero(vec == RECOMPUTE))
    n = len(w.ops)
    rows = nested_closures(w, closures_of(w))[views]
    at_head = [cl for start, cl in rows if start <= w.candidates[head].first_use(n)][-1]
    where = {op for op in rows[-1][1].ops if w.ops[op].name.startswith("aten.where")}
    assert where and not where & at_head.ops  # re-made as of its own use, read as it is at the head's
    _planned_to_the_byte(build, w, vec.astype(np.int8), 64)


@pytest.mark.parametrize(
    "make, x_shape, recomputed",
    [
        ("PooledChain", (8, 3, 12, 12), ("<root>#0.0:Relu", "<root>#0.1:Convolution", "<root>#0.2:nograd")),
        ("TwoLayerLSTM", (4, 5, 8), ("rnn#0.8:MkldnnRnnLayer", "rnn#0.10:nograd")),
    ],
    ids=["pool", "lstm"],
)
def test_replays_at_one_op_hold_their_temporaries_one_after_another(
    make: str, x_shape: tuple[int, ...], recomputed: tuple[str, ...]
) -> None:
    """Rule 7: the replays due at one backward op run one after another, each dropping its temporaries before the
    next starts, so while one holds them the candidates the later ones make are not there yet. Both simulators
    counted every candidate made at the op as live beside the largest replay's temporaries: max_pool2d's input
    and indices 233,408 bytes planned against 214,976 measured (+8.6%); an LSTM layer's cell state and workspace
    (one op makes both, replayed once for each) 114,496 against 91,008 (+25.8%)."""
    from tests import fixtures_models

    build = classifier(getattr(fixtures_models, make), x_shape, 10)
    w = capture(build, name=make, batch_size=x_shape[0], fake=False)
    vec = np.array([RECOMPUTE if c.key in recomputed else KEEP for c in w.candidates], np.int8)
    assert (vec == RECOMPUTE).sum() == len(recomputed)
    uses = {w.candidates[i].first_use(len(w.ops)) for i in np.flatnonzero(vec == RECOMPUTE)}
    assert len(uses) < len(recomputed)  # some are due at one op
    _planned_to_the_byte(build, w, vec, x_shape[0])


@pytest.mark.parametrize("nodes", [False, True], ids=["checkpoint", "node"])
def test_a_checkpointed_region_recomputes_where_a_node_of_it_first_unpacks(nodes: bool) -> None:
    """Rule 11 / R10: torch.utils.checkpoint re-runs the call at the first unpack of a tensor saved inside it, and
    a backward node unpacks what it saved when it starts, before its first op: the output projection's node
    starts with a product that reads no saved tensor. Both simulators placed the recompute at the first op that
    reads one, after that product's output: 39,076 bytes planned against 37,028 measured (5.5% over). Now to the
    byte; as one node the region runs before its call's first backward op, as before."""
    from tests.fixtures_models import AttentionNet

    build = classifier(AttentionNet, (4, 8, 8), 5)
    w = capture(build, name="attention", batch_size=4, fake=False)
    vec = np.array(
        [RECOMPUTE if c.key.startswith("att") and c.key != "att.ln#0.0:View" else KEEP for c in w.candidates], np.int8
    )
    policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["att"]
    planned, measured, _ = planned_and_measured(build, w, policy, 4)
    assert measured == [planned] * 2, (planned, measured)


@pytest.mark.parametrize(
    "make, x_shape, own",
    [("PooledChain", (8, 3, 12, 12), "<root>#0.2:nograd"), ("TwoLayerLSTM", (4, 5, 8), "rnn#0.10:nograd")],
    ids=["pool", "lstm"],
)
def test_a_cpu_swap_of_an_output_its_own_op_saves_is_copied_inside_that_op(
    make: str, x_shape: tuple[int, ...], own: str
) -> None:
    """Rule 4 / R3 on the CPU: autograd packs an op's inputs before its kernel and its own outputs after it, while
    its inputs are still alive, so a swap's copy of max_pool2d's indices or of an LSTM layer's workspace exists
    during that op. The trace now tells the two apart (``Candidate.packed_in_op``, from the autograd nodes made
    since the op). Both simulators counted every copy from the op after: max_pool2d's indices alone were already
    exact, every candidate swapped 196,176 bytes planned against 214,608 measured (8.6% under); the workspace alone
    91,008 against 111,472 (18.4% under), every candidate 91,008 against 116,208 (21.7% under). Now to the byte."""
    from tests import fixtures_models

    build = classifier(getattr(fixtures_models, make), x_shape, 10)
    w = capture(build, name=make, batch_size=x_shape[0], fake=False)
    by_key = {c.key: c for c in w.candidates}
    assert by_key[own].packed_in_op and by_key["<loss>#0.0:LogSoftmax"].packed_in_op  # saved as their op's outputs
    assert not by_key["fc#0.0:Mean" if make == "PooledChain" else "head#0.0:Mul"].packed_in_op  # as a reader's input
    for vec in (
        np.array([SWAP if c.key == own else KEEP for c in w.candidates], np.int8),
        np.full(len(w.candidates), SWAP, np.int8),
    ):
        policy = Policy.from_vector(w, vec, hardware="cpu")
        planned, measured, _ = planned_and_measured(build, w, policy, x_shape[0])
        assert measured == [planned] * 2, (int(vec.sum()), planned, measured)


def test_a_tied_weights_sum_with_a_term_from_a_node_is_planned_as_pytorch_makes_it() -> None:
    """Rule 15 / R14: the runtime sums a shared parameter's gradients in place where its hooks see the uses (in
    forward, with a graph). An embedding inside a region run as one node is used without one, so the sum of its
    gradient and the tied head's is PyTorch's, in a new tensor, made once the node has returned (the gradient of
    the node's output gone); both simulators planned it in place, inside the node: 2,318,984 bytes against
    2,835,080 measured (22% under; +3.1% on a tiny BERT). Now to the byte, as a node and under checkpoint (where
    the hooks see both uses)."""
    from tests.fixtures_models import TiedEmbedding

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        ids = torch.randint(0, 1024, (2, 4))
        loss = torch.nn.functional.cross_entropy
        return TiedEmbedding(), (ids, torch.randint(0, 1024, (8,))), lambda m, b: loss(m(b[0]), b[1])

    w = capture(build, name="tied", batch_size=2, fake=False)
    vec = np.array([RECOMPUTE if c.key.startswith("emb.") else KEEP for c in w.candidates], np.int8)
    for nodes in (True, False):
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
        assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["emb"]
        planned, measured, _ = planned_and_measured(build, w, policy, 2)
        assert measured == [planned] * 2, (nodes, planned, measured)


@pytest.mark.parametrize("nodes", [False, True], ids=["checkpoint", "node"])
def test_an_argument_two_regions_hold_is_held_once(nodes: bool) -> None:
    """Rule 11: a region holds its call's tensor arguments that are not candidates until its backward is done. Two
    calls read one such tensor (Llama's q_proj and v_proj its normed input under autocast, which saves the casts):
    the fast simulator held it once per region, the reference once, as the runtime does: on this model 1,680,776
    bytes planned by the fast one, 1,648,008 by the reference and measured (in a QA sweep, 4 to 6 of 150 random
    policies on tiny Llama and BERT in fp16 and bf16, by 64 or 128 KiB). Now both, to the byte."""
    from tests.fixtures_models import TwoReaders

    build = classifier(TwoReaders, (16, 32), 10)
    w = capture(build, name="two-readers", batch_size=16, fake=False)
    vec = np.array([RECOMPUTE if c.key.startswith(("a.", "b.")) else KEEP for c in w.candidates], np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["a", "b"]
    planned, measured, _ = planned_and_measured(build, w, policy, 16)  # it asserts the two simulators agree
    assert measured == [planned] * 2, (planned, measured)


@pytest.mark.parametrize("nodes", [False, True], ids=["checkpoint", "node"])
def test_a_replay_reads_what_a_region_holds(nodes: bool) -> None:
    """Rule 7 with Rule 11: a tensor that a region holds as its argument past its traced end is live there, and a
    replay outside the region reads it as it is (R6) rather than re-making it. The plan re-made it, with the wide
    product it is summed from, as temporaries: 6,262,912 bytes planned by both simulators against 5,288,576
    measured (18% over; on a tiny BERT under fp16 autocast, where the query projection's region holds the layer's
    input, 2.8-3.5% over in a QA run). Now both, to the byte."""
    from tests.fixtures_models import HeldReader

    build = classifier(HeldReader, (512, 32), 10)
    w = capture(build, name="held-reader", batch_size=512, fake=False)
    vec = np.array([RECOMPUTE if c.key.startswith(("a.", "<root>#0.0:Exp")) else KEEP for c in w.candidates], np.int8)
    assert (vec == RECOMPUTE).sum() == 2
    policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["a"]
    planned, measured, _ = planned_and_measured(build, w, policy, 512)  # it asserts the two simulators agree
    assert measured == [planned] * 2, (planned, measured)


def test_a_batchnorm_replay_holds_the_copies_of_its_running_statistics() -> None:
    """Rule 7 / R6: a replay of BatchNorm passes copies of its running statistics (the op writes them, undeclared
    in its schema), which the trace does not list among the op's outputs. Recomputing its input and one saved
    statistic, the plan was 256 bytes (one 64-channel statistic) under the measured peak, in 10 of 42 random
    resnet18 policies. The copies now count among the replay's temporaries."""
    from tests.fixtures_models import ConvBNReLU

    build = classifier(ConvBNReLU, (2, 3, 16, 16), 10)
    w = capture(build, name="conv-bn", batch_size=2, fake=False)
    keys = ("bn#0.0:Convolution", "bn#0.2:nograd")
    vec = np.array([RECOMPUTE if c.key in keys else KEEP for c in w.candidates], np.int8)
    assert (vec == RECOMPUTE).sum() == 2
    _planned_to_the_byte(build, w, vec, 2)


def test_backward_runs_without_the_recorder() -> None:
    """R6: the recorder (a dispatch mode) was still on the stack when the first step called backward, and
    ``prod``'s backward takes another path under any dispatch mode: whatever a policy recomputed, even the
    loss's log-softmax, gradients differed from plain training by up to 3.7e-9 (a QA run). Backward now runs
    with the recorder off the stack, in the first step and after."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.fixtures_models import ProductOfStack

    class Noop(TorchDispatchMode):
        def __torch_dispatch__(self, f, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return f(*args, **(kwargs or {}))

    torch.manual_seed(0)
    x, g = torch.randn(2, 64, 64, requires_grad=True), torch.randn(64, 64)
    (plain_grad,) = torch.autograd.grad(x.prod(0), x, g)
    y = x.prod(0)
    with Noop():
        (moded,) = torch.autograd.grad(y, x, g)
    assert not torch.equal(plain_grad, moded)  # what the test would see if backward ran under the recorder
    build = classifier(ProductOfStack, (64, 16), 10)
    w = capture(build, name="prod", batch_size=64, fake=False)
    plain = train_steps(build, None, steps=2)
    for i in range(len(w.candidates)):
        vec = np.array([RECOMPUTE if j == i else KEEP for j in range(len(w.candidates))], np.int8)
        assert same_bits(train_steps(build, Policy.from_vector(w, vec, hardware="cpu"), steps=2), plain), i


@pytest.mark.parametrize(
    "compressed",
    [("<root>#0.2:Relu",), ("c2#0.0:MaxPool2DWithIndices", "<root>#0.2:Relu", "c3#0.0:MaxPool2DWithIndices"), None],
    ids=["relu", "three", "all"],
)
def test_a_compressed_tensors_packed_form_goes_once_it_is_unpacked(compressed: tuple[str, ...] | None) -> None:
    """Rule 8 / R7: the runtime's unpack casts the packed form back and lets it go before the op that reads the
    tensor allocates its outputs. Both simulators held it through that op: max_pool2d's backward, reading the
    compressed relu output, was planned 561,376 bytes against 544,992 measured (3.0% over), 549,664 against
    516,896 with every candidate compressed (6.3%). The packed form is now held at the unpack only, as a
    replay's temporaries are: to the byte."""
    from tests.fixtures_models import ThreePoolCNN

    build = classifier(ThreePoolCNN, (4, 3, 32, 32), 10)
    w = capture(build, name="three-pool", batch_size=4, fake=False)
    vec = np.array([COMPRESS if compressed is None or c.key in compressed else KEEP for c in w.candidates], np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(lossy=True))
    planned, measured, _ = planned_and_measured(build, w, policy, 4)
    assert measured == [planned] * 2, (planned, measured)


def test_a_compressed_tensor_that_a_replay_reads_is_kept() -> None:
    """Plan P12 / Rule 8: with ``lossy``, a policy compressed ``s`` and recomputed the mask ``s > 0.1`` that
    ``s[mask]`` saves; the mask's replay read the rounded ``s``, selected another number of elements, and
    backward failed ("shape mismatch: value tensor of shape [195] cannot be broadcast to indexing result of
    shape [196]"). ``s`` is now kept: the policy says so, both simulators plan it and the runtime's peak is the
    plan. Compressed alone, with no replay reading it, it stays compressed."""
    from tests.fixtures_models import MaskedSum

    build = classifier(MaskedSum, (16, 16), 10)
    w = capture(build, name="masked", batch_size=16, fake=False)
    s, mask = "<root>#0.0:Tanh", "<root>#0.1:nograd"
    assert {s, mask} <= {c.key for c in w.candidates}
    opts = PolicyOptions(lossy=True)
    alone = Policy.from_vector(
        w, [COMPRESS if c.key == s else KEEP for c in w.candidates], hardware="cpu", options=opts
    )
    assert alone.actions[s] == Action.COMPRESS
    acts = {s: COMPRESS, mask: RECOMPUTE}
    vec = np.array([acts.get(c.key, KEEP) for c in w.candidates], np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu", options=opts)
    assert policy.actions[s] == Action.KEEP and policy.actions[mask] == Action.RECOMPUTE
    _planned_to_the_byte(build, w, vec, 16, lossy=True)


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_a_tensor_held_by_a_ctx_attribute_is_kept_where_the_policy_recomputes_it(fake: bool) -> None:
    """Plan P11: a custom Function that keeps its input as a ``ctx`` attribute holds it until backward, so a
    policy that recomputes it frees nothing; the replay finds it alive and re-runs nothing. The runtime learns
    it as kept (R11): before, every second step found a pack its recorder had not seen made, warned and kept
    everything (and relearnt). The simulator plans it kept (Rule 7): it had held a regenerated copy beside the
    original, 7.3% over the measured peak. Gradients stay plain training's, bit for bit."""
    from runtime.plan import held_outside
    from tests.fixtures_models import CtxHeldMLP

    build = classifier(CtxHeldMLP, (32, 64), 10)
    w = capture(build, name="ctx-held", batch_size=32, fake=fake)
    held = held_outside(w)
    assert [c.key for c, h in zip(w.candidates, held, strict=True) if h] == [f"<root>#0.{i}:Tanh" for i in range(4)]
    vec = uniform_actions(w, Action.RECOMPUTE)
    assert all(vec[held] == RECOMPUTE)
    policy = Policy.from_vector(w, vec, hardware="cpu")
    planned = Simulator(w, get_profile("cpu")).run(policy).peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = train_steps(build, policy, steps=4)
    assert same_bits(got, train_steps(build, None, steps=4))
    if not fake:  # the peak measured on the CPU, where the real trace is this machine's
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model)
        opt = make_optimizer("sgd", model.parameters())
        measured = run_iterations(model, batch, loss_fn, opt, steps=3, batch_size=32, around_step=rt.step)
        assert [m.peak_bytes for m in measured] == [planned] * 3


def test_a_tensor_is_materialized_where_its_node_unpacks_it_and_a_cpu_swap_copied_after_its_op() -> None:
    """Two twins of the runtime, each of which put the simulator 131,072 bytes (10%) off the measured peak on
    a GELU MLP, now equal to the byte under every policy tried: (1) a backward node unpacks all it saved when it
    starts, so a recomputed factor of a product is made before the node's first op, not at the op that reads it
    (the trace records the unpack: ``Candidate.unpack_op``; a keep and recompute mix on a tiny GPT-2 had been
    planned 3.0% over its measured peak so); (2) on the CPU a swapped tensor that its reader packs as an input is
    copied before that op's kernel, once the op before it has ended, so it is not there during the op before (Rule
    4)."""
    from envs.simulator_reference import simulate_reference
    from tests.fixtures_models import GeluMLP

    build = classifier(GeluMLP, (256, 32), 10)
    w = capture(build, name="gelu-mlp", batch_size=256, fake=False)
    # The product 0.5 * h * (...) : its node unpacks both factors before its first op.
    assert any(c.unpack_op >= 0 and c.unpack_op < c.bwd_uses[0] for c in w.candidates)
    hw = get_profile("cpu")
    sim = Simulator(w, hw)
    names = [w.ops[c.producer].name for c in w.candidates]
    rng = np.random.default_rng(0)
    policies = {
        "tanh and 1 + tanh recomputed": np.array(
            [RECOMPUTE if n in ("aten.tanh.default", "aten.add.Tensor") else KEEP for n in names], dtype=np.int8
        ),
        "swap": uniform_actions(w, Action.SWAP),
        **{f"mix {i}": rng.choice([KEEP, SWAP, RECOMPUTE], size=len(names)).astype(np.int8) for i in range(6)},
    }
    for label, vec in policies.items():
        policy = Policy.from_vector(w, vec, hardware="cpu")
        planned = sim.run(policy).peak_bytes
        assert simulate_reference(w, hw, vec).peak_bytes == planned, label
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model)
        opt = make_optimizer("sgd", model.parameters())
        measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=256, around_step=rt.step)
        assert [m.peak_bytes for m in measured] == [planned] * 2, label


def test_replays_let_go_of_their_random_states() -> None:
    """R6: the random-number states of the replayed dropouts (5,056 bytes each on the CPU, which the
    simulator does not count) are let go once the last replayed storage is unpacked. GPT-2's peak lies at
    the end of backward (the tied embedding's gradient), after the replays: the allocator's own high-water
    mark (the profiler's memory events) is then exactly the simulator's peak, with every candidate
    replayed, and on a later step (the runtime's steady state) too."""
    from runtime.measure import held_bytes, profiler_peak_bytes, training_state

    name, kwargs = GPT2_SMALL_VOCAB
    build = _build(name, kwargs)
    w = capture(build, name=name, batch_size=kwargs["batch_size"], fake=False)
    vec = np.full(len(w.candidates), RECOMPUTE, dtype=np.int8)
    assert any(w.ops[i].seeded for c in w.candidates for i in c.recompute_ops)  # dropout among the replayed
    policy = Policy.from_vector(w, vec, hardware="cpu")
    predicted = Simulator(w, get_profile("cpu")).run(policy)
    assert w.ops[predicted.peak_op].phase.value == "backward"
    model, batch, loss_fn = build()
    opt = make_optimizer("sgd", model.parameters())
    rt = PolicyRuntime(policy, model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with rt.step():
            loss_fn(model, batch).backward()
        opt.step()

    step()  # the first step learns (R11); the next ones are measured
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        state = held_bytes(training_state(model, batch, opt))
        assert profiler_peak_bytes(step, state, scratch=True) == predicted.peak_bytes
    assert rt.stats.recomputed_ops > 0


def test_a_second_backward_replays_attention_without_dropout() -> None:
    """R6: SDPA on the CPU is a random op by its schema (it takes ``dropout_p``), but at 0 it draws nothing
    that matters, so a second backward through the same graph (``retain_graph=True``) replays it after the
    random states are let go, where it was refused. Gradients are plain training's, bit for bit, and the
    replays fork the random state (the step leaves it as plain training does)."""
    name, kwargs = GPT2_SMALL_VOCAB
    overrides = {**kwargs["config_overrides"], "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    build = _build(name, {**kwargs, "config_overrides": overrides})
    w = capture(build, name=name, batch_size=kwargs["batch_size"])
    sdpa = [i for i, op in enumerate(w.ops) if op.seeded]
    assert sdpa and all("attention" in w.ops[i].name for i in sdpa)  # the only random ops
    policy = Policy.from_vector(w, np.full(len(w.candidates), RECOMPUTE, dtype=np.int8), hardware="cpu")

    def run(with_policy: bool) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model) if with_policy else None
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with rt.step() if rt is not None else contextlib.nullcontext():
                loss = loss_fn(model, batch)
                loss.backward(retain_graph=True)
                loss.backward()
            grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return grads, torch.get_rng_state(), rt.stats.recomputed_ops if rt is not None else 0

    plain, plain_rng, _ = run(False)
    ours, rng, replayed = run(True)
    assert replayed > 0
    assert len(plain) == len(ours) and all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert torch.equal(plain_rng, rng)


def test_a_replayed_op_that_always_draws_gets_its_random_state() -> None:
    """R6: a dropout written by hand (``torch.rand_like(x) > p``): ``rand_like`` has no argument that can make
    its draws irrelevant, so a replay re-draws it from the state it drew in forward. Gradients are plain
    training's, bit for bit, with every saved tensor recomputed."""

    class HandDropout(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (torch.rand_like(x) > 0.3) / 0.7

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), HandDropout(), torch.nn.Linear(32, 4))

    build = classifier(make, (8, 16), 4)
    w = capture(build, name="hand-dropout", batch_size=8)
    assert any(op.seeded and "rand_like" in op.name for op in w.ops)
    policy = Policy.from_vector(w, np.full(len(w.candidates), RECOMPUTE, dtype=np.int8), hardware="cpu")
    assert same_bits(train_steps(build, None, steps=2), train_steps(build, policy, steps=2))


def test_action_codes_match_the_policy_enum() -> None:
    assert [a.code for a in Action] == [KEEP, SWAP, RECOMPUTE, COMPRESS]


# -- later steps (R11): what the first step learned, applied --------------------------------------------------
def _steps(  # type: ignore[no-untyped-def]
    name: str,
    kwargs: dict,  # type: ignore[type-arg]
    policy: Policy | None,
    steps: int = 3,
    device: str = "cpu",
    modes_in_backward: list[int] | None = None,
):
    """``steps`` SGD steps on one model under one runtime: per step the loss, gradients, buffers and stats;
    ``modes_in_backward`` gets, per step, how many dispatch modes backward's ops pass through (seen by a hook
    on the first parameter's gradient, the last one backward makes)."""
    model, batch, loss_fn = _build(name, kwargs, device)()
    if modes_in_backward is not None:
        first = next(iter(model.parameters()))
        first.register_hook(lambda g: modes_in_backward.append(len(_get_current_dispatch_mode_stack())))
    opt = make_optimizer("sgd", model.parameters())
    rt = PolicyRuntime(policy, model) if policy is not None else None
    out = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        with rt.step() if rt is not None else contextlib.nullcontext() as stats:
            loss = loss_fn(model, batch)
            loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]))
        out[-1] += (stats,)  # type: ignore[assignment]
        # Nothing of the runtime's stays behind: a dispatch mode left on the stack would run every later op of
        # the process through Python (one recorder a step was left behind when backward popped it, R11).
        assert not _get_current_dispatch_mode_stack(), (i, _get_current_dispatch_mode_stack())
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, i
        opt.step()
    return out


@pytest.mark.parametrize(("name", "kwargs"), [RESNET, GPT2_SMALL_VOCAB], ids=["resnet18", "gpt2-2layer-dropout"])
def test_later_steps_are_bit_identical_too(name: str, kwargs: dict) -> None:  # type: ignore[type-arg]
    """Three SGD steps under one runtime: the first learns (R11), the others look packs up in its tables,
    enter hooks only where needed and recompute blocks through checkpoint (R10); every step's loss,
    gradients and BatchNorm statistics equal plain training's, and each step does the same work."""
    w = capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"])
    ref = _steps(name, kwargs, None)
    for label, vec in _policies(w).items():
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(prefetch_lookahead=2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no unknown key, no mismatch
            got = _steps(name, kwargs, policy)
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert torch.equal(a[0], b[0]), (label, step)
            assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)), (label, step)
            assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True)), (label, step)
        first, later = got[0][3], got[-1][3]
        for field in ("swapped_bytes", "compressed_bytes", "recomputed_ops", "regions"):
            assert getattr(first, field) == getattr(later, field), (label, field)
        assert later.packs <= first.packs  # later steps observe only what they must


def test_block_recompute_runs_as_region_nodes_and_all_keep_installs_nothing() -> None:
    """The uniform recompute policy on resnet18: every block is a region (runtime/plan.py), under checkpoint in
    the first step and as one node each after it (R10); from the second step on the only saved-tensor hooks
    are the loss's (its log-softmax output is replayed, from the
    classifier's output: the recorder runs in the classifier's call and in the loss up to the log-softmax,
    and backward's ops do not pass through it), and an all-keep policy sees no pack and hooks no module call
    at all."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    blocks = [r.module for r in policy.schedule.regions]  # type: ignore[union-attr]
    assert {f"layer{i}.{j}" for i in range(1, 5) for j in range(2)} <= set(blocks)
    modes: list[int] = []
    steps = _steps(name, kwargs, policy, steps=2, modes_in_backward=modes)
    first, later = steps[0][3], steps[-1][3]
    assert modes == [0, 0]  # backward's ops pass through no recorder, in the first step either (R6)
    assert later.regions == len(blocks) == first.checkpointed and later.checkpointed == 0
    checkpointed = Policy.from_vector(w, policy.to_vector(w), hardware="cpu", options=PolicyOptions(region_nodes=False))
    again = _steps(name, kwargs, checkpointed, steps=2)[-1][3]
    assert again.regions == again.checkpointed == len(blocks)  # region_nodes off: checkpoint every step
    assert later.recomputed_ops == 3  # the loss's chain, back to the classifier's kept input
    assert later.packs == 4 and later.hooked_calls == 2  # <loss>, and fc's call for the recorder
    assert later.recorded_ops == 5  # fc's ops and the loss's up to its log-softmax: not the whole forward
    keep = _steps(name, kwargs, Policy.uniform(w, Action.KEEP, hardware="cpu"), steps=2)[-1][3]
    assert (keep.packs, keep.hooked_calls, keep.regions) == (0, 0, 0)


def _beside_plain(rt: PolicyRuntime, model: torch.nn.Module, plain: torch.nn.Module, loss_fn, batch) -> RuntimeStats:  # type: ignore[no-untyped-def]
    """One step of ``model`` under ``rt`` and one of ``plain`` without: the same gradients (or None in both)."""
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    with rt.step() as stats:
        loss_fn(model, batch).backward()
    loss_fn(plain, batch).backward()
    grads = zip(model.parameters(), plain.parameters(), strict=True)
    assert all(p.grad is q.grad is None or torch.equal(p.grad, q.grad) for p, q in grads)  # type: ignore[arg-type]
    return stats


def test_a_batch_of_another_shape_learns_once_then_runs_as_planned() -> None:
    """The last, smaller batch of an epoch (R11): the tables of the full batch do not fit its shapes. It
    learns its own at its first step, from inside the model's call, and from then on full and small batches
    alternate with no step learning again: every one swaps and replays what the policy says, gradients plain
    training's, and no warning. (It kept every tensor, above the plan, and the next full step learnt again.)"""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    plain, _, _ = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    small = tuple(t[:1] for t in batch)
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in (batch, batch, small, batch, small, small, batch):
            stats = _beside_plain(rt, model, plain, loss_fn, b)
            got.append((len(b[0]), stats.packs, stats.swaps, stats.recomputed_ops))
    learning, steady = got[0][1], got[1][1]  # a learning step hooks every pack, a later one only its tables'
    assert learning > steady and got[1][2] > 0 and got[1][3] > 0
    assert [g[1] for g in got] == [learning, steady, learning, steady, steady, steady, steady]
    assert {g[2:] for g in got} == {got[1][2:]}  # the same swaps and replays at either size
    assert small[0].shape[0] == 1 and len(rt._learned) == 2


def test_a_step_that_saves_other_tensors_for_the_same_inputs_keeps_them_and_learns_again() -> None:
    """Control flow that depends on the data: with the same input shapes a step saves other tensors than
    the step that learnt them. From the first pack that differs it keeps them (gradients still right), one
    warning says so, and the next step learns again."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
        model = torch.nn.ModuleDict({"a": a, "b": b})
        model.use_b = True  # type: ignore[assignment]

        def forward(x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(a(x))
            return torch.sigmoid(b(h)) if model.use_b else h

        model.forward = forward  # type: ignore[method-assign,assignment]
        return model, (torch.randn(4, 8),), lambda m, batch: m(batch[0]).pow(2).sum()

    w = capture(build, name="branchy", batch_size=4)
    policy = Policy.uniform(w, Action.SWAP, hardware="cpu")
    model, batch, loss_fn = build()
    plain, _, _ = build()
    rt = PolicyRuntime(policy, model)
    seen = []
    for use_b in (True, True, False, False, True):
        model.use_b = plain.use_b = use_b  # type: ignore[assignment]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = _beside_plain(rt, model, plain, loss_fn, batch)
        seen.append((stats.swaps, [str(c.message) for c in caught]))
    assert [s for s, _ in seen] == [2, 2, 1, 1, 1]  # tanh's and sigmoid's outputs; then tanh's alone
    assert [len(m) for _, m in seen] == [0, 0, 1, 0, 1]  # the step that learns again says nothing
    assert [len(m) for _, m in seen] == [0, 0, 1, 0, 1]
    assert "differ from those of the step that learnt its inputs" in seen[2][1][0]


def test_regions_that_no_longer_match_the_actions_are_replayed_instead() -> None:
    """A hand-edited policy keeps a tensor its schedule's region recomputes: the region is dropped with a
    warning, its other tensors are replayed (R6), and the gradients are still plain training's."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    region = policy.schedule.regions[3]  # type: ignore[union-attr]
    policy.actions[region.keys[0]] = Action.KEEP
    _, ref, _ = _step(name, kwargs, None)
    with pytest.warns(UserWarning, match=f"region {region.module}#0"):
        rt = PolicyRuntime(policy, _build(name, kwargs)()[0])
    assert (region.module, 0) not in rt.regions and len(rt.regions) == len(policy.schedule.regions) - 1  # type: ignore[union-attr]
    with pytest.warns(UserWarning, match=f"region {region.module}#0"):
        _, got, _ = _step(name, kwargs, policy)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_step_without_backward_or_grad_teaches_nothing() -> None:
    """What users run under ``policy.applied`` before their first training step: a validation pass under
    ``torch.no_grad()`` (nothing packed), then a forward whose loss they skip (no backward). Neither is
    learnt from (R11): the next full step learns, and every later step applies the policy as it would
    have, gradients plain training's. (A no-grad step learnt an empty table and left the policy off for
    good; a step without backward learnt no replay, and every later backward failed an assertion.)"""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    acts = _policies(w)["mixed-1"]
    policy = Policy.from_vector(w, acts, hardware="cpu")
    reference = _steps(name, kwargs, policy, steps=2)[-1][3]
    assert reference.recomputed_ops > 0 and reference.swaps > 0
    model, batch, loss_fn = _build(name, kwargs)()
    plain, _, _ = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    model.eval()
    with torch.no_grad(), rt.step():
        loss_fn(model, batch)
    model.train()
    with pytest.warns(UserWarning, match="no backward"), rt.step():
        loss_fn(model, batch)  # skipped: no backward
    for step in range(3):
        stats = _beside_plain(rt, model, plain, loss_fn, batch)
        if step:
            assert (stats.recomputed_ops, stats.swaps, stats.packs) == (
                reference.recomputed_ops, reference.swaps, reference.packs), step  # fmt: skip


def test_a_step_that_learns_again_keys_what_regions_make_as_the_first_did() -> None:
    """A step that learns again (after a smaller batch) runs its regions under checkpoint, as the first
    step: as nodes, a region's output saved by the next module got a key naming the node's op (``_Region``),
    not in the policy, and was kept."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["recompute"], hardware="cpu")
    assert policy.schedule is not None and policy.schedule.regions
    model, batch, loss_fn = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    small = tuple(t[:1] for t in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown key
        for b in (batch, batch):
            with rt.step():
                loss_fn(model, b).backward()
        with rt.step() as again:  # learns for the small batch, from inside the model's call
            loss_fn(model, small).backward()
    assert not again.unknown_keys and again.checkpointed == again.regions > 0


def test_a_model_that_ran_under_a_policy_saves_and_copies_without_its_runtime() -> None:
    """``torch.save(model)`` (whole-module checkpoints) and pickling failed once ``policy.applied(model)``
    had run (the runtime kept on the model holds weak references); now they save the model alone, and a
    deep copy (an EMA model) trains under the policy with a runtime of its own, gradients as plain."""
    import copy
    import io
    import pickle

    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    with policy.applied(model):
        loss_fn(model, batch).backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True))
    assert not pickle.loads(pickle.dumps(model)).__dict__.get("_autotune_runtimes")
    twin = copy.deepcopy(model)
    assert not twin.__dict__["_autotune_runtimes"]
    for m in (twin, loaded):
        m.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with policy.applied(m):
            loss_fn(m, batch).backward()
        loss_fn(model, batch).backward()  # plain, outside the policy
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), model.parameters(), strict=True))


def test_a_policy_loaded_again_each_step_reuses_its_runtime_and_the_model_keeps_a_few(tmp_path: Path) -> None:
    """A loop that loads its policy file again each step (each epoch, in a helper) kept one runtime per load on
    the model, each with its policy and tables (30 after 30 steps, a QA run). An equal policy now takes the
    runtime learnt (no step learns again: the same packs as before), and a model keeps its MAX_RUNTIMES most
    recent runtimes; gradients stay plain training's."""
    from runtime.apply import MAX_RUNTIMES
    from runtime.policy import load_policy

    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu").save(tmp_path / "p.json")
    model, batch, loss_fn = _build(name, kwargs)()
    plain, _, _ = _build(name, kwargs)()
    runtimes, packs = [], []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        with load_policy(tmp_path / "p.json").applied(model) as stats:
            loss_fn(model, batch).backward()
        loss_fn(plain, batch).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True))
        runtimes.append(list(model.__dict__["_autotune_runtimes"].values()))
        packs.append(stats.packs)
    assert [len(r) for r in runtimes] == [1, 1, 1] and runtimes[0][0] is runtimes[2][0]
    assert packs[0] > packs[1] == packs[2]  # the first step learns (every pack seen), the others apply (R11)
    rng = np.random.default_rng(3)
    for _ in range(MAX_RUNTIMES + 2):  # other policies: the oldest runtimes go
        other = Policy.from_vector(w, rng.integers(0, 3, len(w.candidates)).astype(np.int8), hardware="cpu")
        with other.applied(model):
            loss_fn(model, batch).backward()
    assert len(model.__dict__["_autotune_runtimes"]) == MAX_RUNTIMES


def test_a_copy_made_inside_a_step_is_the_models_own_and_pickling_there_is_refused() -> None:
    """R18: an EMA model made inside the step (``copy.deepcopy``) kept the step's forward hooks and regions'
    forwards, bound to the original model: it computed with the original's weights, and its own steps were
    refused (a QA run). Now the copy is as a copy made outside: its output is its own weights', and it trains
    under the policy with gradients as plain. ``torch.save(model)`` inside the step is one clear error."""
    import copy
    import io

    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    for _ in range(2):  # the first step learns (module hooks of its own), the second applies (R11)
        model.zero_grad(set_to_none=True)
        with policy.applied(model):
            loss = loss_fn(model, batch)
            assert any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # the step's
            twin = copy.deepcopy(model)
            with pytest.raises(AutotuneError, match="save it after the step"):
                torch.save(model, io.BytesIO())
            loss.backward()
        for m in twin.modules():  # what the step installed is left as its own forward and hooks that do nothing
            own = m.__dict__.get("forward")
            assert own is None or (own.__self__ is m and own.__func__ is type(m).forward)
            assert all(h is _left_behind for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()])
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)  # the copy's weights alone change: its output follows them, the model's does not
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.5)
        twin.eval(), reference.eval()
        assert torch.equal(twin(batch[0]), reference(batch[0]))
        twin.train(), reference.train()
        for m in (twin, reference):
            m.zero_grad(set_to_none=True)
        with policy.applied(twin):
            loss_fn(twin, batch).backward()
        loss_fn(reference, batch).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(twin.parameters(), reference.parameters(), strict=True))


def test_a_policy_applied_to_a_wrapper_of_its_model_names_the_wrapped_model() -> None:
    """R12: a policy applied to ``DistributedDataParallel(model)`` (or ``DataParallel``) met parameter names with
    the wrapper's ``module.`` prefix, and the refusal said to search a policy for this model; it now says to
    apply it to ``wrapper.module``, where it runs."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    wrapper = torch.nn.DataParallel(model)
    with pytest.raises(AutotuneError, match=r"policy.applied\(wrapper.module\)"), policy.applied(wrapper):
        pass
    with policy.applied(wrapper.module):
        loss_fn(wrapper, batch).backward()

    # torch.compile's wrapper (parameters ``_orig_mod.*``), policy.compiled's model (``model.*``) and a module
    # holding the model (a LightningModule's ``net``) were each "a model with other parameters", to search a
    # policy for; strict=False then applied nothing (a QA run). Each says what to apply it to.
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

    for wrapped, said in (
        (torch.compile(model, backend="eager"), r"holding it as ._orig_mod.*policy.compiled\(model\)"),
        (policy.compiled(model, backend="eager"), r"holding it as .model.*call it as it is"),
        (Holder(), r"holds that model as 'net'.*module='net'"),
    ):
        with pytest.raises(AutotuneError, match=said), policy.applied(wrapped):
            pass


def test_a_policy_applied_again_inside_its_step_is_the_same_step() -> None:
    """R19: a ``train_step`` helper that applies the policy, called inside a loop that applies it too: the
    inner ``applied`` was a second step inside the first, and backward failed ("no recorded producer", an
    internal error). Now the outer step is the step: gradients as plain, over steps. Another policy inside
    a step is refused."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    other = Policy.from_vector(w, uniform_actions(w, Action.SWAP), hardware="cpu")
    plain = train_steps(_build(name, kwargs), None, steps=2)
    model, batch, loss_fn = _build(name, kwargs)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for _ in range(2):  # the first step learns, the second applies (R11)
        opt.zero_grad()
        with policy.applied(model) as outer, policy.applied(model) as inner:
            loss_fn(model, batch).backward()
        assert inner is outer and outer.recomputed_ops + outer.regions > 0
        got.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    assert same_bits(plain, got)
    with policy.applied(model), pytest.raises(AutotuneError, match="another policy"), other.applied(model):
        pass
    with other.applied(model):  # the refusal left nothing behind
        loss_fn(model, batch).backward()


def test_two_models_each_under_its_own_policy_in_one_step_are_refused() -> None:
    """R19: saved-tensor hooks are the thread's, so a step of a second model inside another model's step saw
    that model's packs as its own (``<loss>`` tensors): part of each plan was not applied, and on a tiny Llama
    the third step failed inside the runtime (``IndexError``). It is refused at once, naming the way out;
    each model in a step of its own trains as plain training does, and a step in another thread is its own."""
    import threading

    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    recompute = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    swap = Policy.from_vector(w, uniform_actions(w, Action.SWAP), hardware="cpu")
    (m1, batch, loss_fn), (m2, _, _) = _build(name, kwargs)(), _build(name, kwargs)()
    with recompute.applied(m1), pytest.raises(AutotuneError, match="another model in this step"), swap.applied(m2):
        pass
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in [*m1.modules(), *m2.modules()])
    plain = train_steps(_build(name, kwargs), None, steps=1)
    for model, policy in ((m1, recompute), (m2, swap)):
        model.zero_grad()
        with policy.applied(model):
            loss_fn(model, batch).backward()
        assert same_bits(plain, [[p.grad for p in model.parameters() if p.grad is not None]])
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            with swap.applied(m2):
                loss_fn(m2, batch).backward()
        except BaseException as e:  # reported below
            errors.append(e)

    with recompute.applied(m1):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        loss_fn(m1, batch).backward()
    assert errors == []


def test_a_validation_pass_of_another_shape_does_not_make_the_next_step_learn() -> None:
    """A validation pass under ``torch.no_grad()`` with its own batch size, inside ``policy.applied``,
    between training steps: it packs nothing and learns nothing, and the next training step applies the
    tables learnt for its inputs, as a step after a training step does (R11)."""
    name, kwargs = RESNET
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    rt = PolicyRuntime(policy, model)
    packs = []
    for b in (batch, batch, "val", batch):
        if b == "val":
            with torch.no_grad(), rt.step():
                model(batch[0][:1])
            continue
        with rt.step() as stats:
            loss_fn(model, b).backward()
        packs.append(stats.packs)
    assert packs[0] > packs[1] == packs[2] > 0


class _SavesInItsOwnForward(torch.nn.Module):
    """``tanh``'s output is saved in the model's own call, not a submodule's (as GPT-2 computing its loss
    from ``labels=`` inside its forward): the model's own call is a hooked frame."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("action", [Action.RECOMPUTE, Action.SWAP])
def test_a_new_shape_goes_on_from_inside_a_model_call_that_is_hooked_itself(action: Action) -> None:
    """R11 when the model's own call holds handled packs: at a new shape the step leaves the old tables inside
    that call, whose hooks PyTorch had gathered already. They ran anyway, pushed the old tables' hooks and
    recorder and nothing popped them: every later step of the process ran through them, and the new shape
    never learnt (a warning every step). Now each shape learns once, nothing stays behind, and a step that
    switches to the training mode's other tables does so too (eval-mode steps with backward)."""

    def build(batch: int = 8):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        data = (torch.randn(batch, 16), torch.randint(0, 4, (batch,)))
        return _SavesInItsOwnForward(), data, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    policy = Policy.uniform(capture(build, name="net", batch_size=8), action, hardware="cpu")
    model, batch, loss_fn = build()
    plain, _, _ = build()
    rt = PolicyRuntime(policy, model)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for size, training in ((8, True), (8, True), (5, True), (5, True), (8, True), (8, False), (8, True)):
            model.train(training)
            plain.train(training)
            stats = _beside_plain(rt, model, plain, loss_fn, tuple(t[:size] for t in batch))
            assert not _get_current_dispatch_mode_stack()  # nothing of the runtime stays behind a step
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            seen.append((stats.swaps, stats.recomputed_ops))
    assert len(set(seen)) == 1 and seen[0] != (0, 0)
    assert len(rt._learned) == 3  # 8 and 5 training, 8 in eval mode


def test_a_model_that_checkpoints_its_own_layers_is_refused_in_one_line() -> None:
    """R16: Hugging Face's gradient checkpointing under a policy with regions or hooks failed in backward with
    torch's "Recomputed values ... have different metadata" (its recompute re-ran the policy's regions).
    Now the first step says what to do, and nothing of the runtime stays installed."""
    name, kwargs = GPT2
    w = capture(_build(name, kwargs), name=name, batch_size=2)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu")
    model, batch, loss_fn = _build(name, kwargs)()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rt = PolicyRuntime(policy, model)
    with pytest.raises(AutotuneError, match="checkpoints its own layers"), rt.step():
        loss_fn(model, batch).backward()
    assert not _get_current_dispatch_mode_stack()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _OwnCheckpointCNN(torch.nn.Module):
    """A CNN whose forward checkpoints its block itself (``torch.utils.checkpoint`` in the model's code)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_model_that_calls_checkpoint_itself_is_refused_at_its_first_step(reentrant: bool) -> None:
    """R16: ``torch.utils.checkpoint`` in the model's own code under a policy that recomputes. Reentrant, the
    step ran without a word and left BatchNorm's running statistics other than plain training's (the
    runtime's guard for its own recomputes took the second update back); non-reentrant, backward failed in
    torch ("Recomputed values ... have different metadata"). The first step now says what to do, with
    nothing of the runtime left installed; an all-keep policy installs nothing and trains as plain."""
    build = classifier(lambda: _OwnCheckpointCNN(reentrant), (4, 3, 16, 16), 5)
    w = capture(build, name="own-checkpoint", batch_size=4, fake=False)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    model, batch, loss_fn = build()
    with (
        pytest.raises(AutotuneError, match="checkpoints part of its own forward: module 'block"),
        policy.applied(model),
    ):
        loss_fn(model, batch).backward()
    assert not _get_current_dispatch_mode_stack()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    keep = Policy.from_vector(w, uniform_actions(w, Action.KEEP), hardware="cpu")
    assert same_bits(train_steps(build, keep, steps=2, buffers=True), train_steps(build, None, steps=2, buffers=True))


class _Recurrent(torch.nn.Module):
    """A recurrent layer (``rnn``), then a linear head (``h``) on its last time step."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn, self.h = rnn, torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(self.rnn(x)[0][:, -1])


def _recurrent(make_rnn: Callable[[], torch.nn.Module]):  # type: ignore[no-untyped-def]
    """``build`` for a :class:`_Recurrent` around ``make_rnn()`` (16 features in, 32 hidden) at batch 4 x 5 steps."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(4, 5, 16), torch.randint(0, 10, (4,))
        return _Recurrent(make_rnn()), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    return build


def test_the_cpu_gru_cell_trains_as_plain_under_any_policy() -> None:
    """R3: the CPU's GRU cell runs ``sigmoid_`` on one ``unsafe_chunk`` of its gates, packs it, then writes
    the other chunks (siblings that count their writes apart, no view) and packs them. The swap's copy was
    taken at the first pack alone, so backward read stale chunks: swapping the first step's reset gate gave
    gradients off by up to 0.0175, every tensor swapped by 0.13 (a QA run's GRU). Now they are plain
    training's bits."""

    build = _recurrent(lambda: torch.nn.GRU(16, 32, batch_first=True))

    def grads(policy: Policy | None) -> list[torch.Tensor]:
        model, batch, loss_fn = build()
        with policy.applied(model) if policy is not None else contextlib.nullcontext():
            loss_fn(model, batch).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    w = capture(build, name="gru", batch_size=4)
    one = np.zeros(len(w.candidates), dtype=np.int8)
    one[[c.key for c in w.candidates].index("rnn#0.2:Sigmoid")] = SWAP
    plain = grads(None)
    clones = np.array([RECOMPUTE if c.key.endswith(":Clone") else KEEP for c in w.candidates], dtype=np.int8)
    mixes = [np.random.default_rng(seed).integers(0, 3, len(w.candidates)).astype(np.int8) for seed in range(4)]
    # R6: the cell clones one chunk of its gates, then multiplies that chunk in place; replaying the clone read
    # the chunk as it is now (gradients off). R9: a mix replays a tensor whose chain reads a swapped gate after
    # that gate's last unpack, whose only copy the CPU had let go ("needed after its release").
    for acts in (one, uniform_actions(w, Action.SWAP), clones, *mixes):
        got = grads(Policy.from_vector(w, acts, hardware="cpu"))
        assert len(got) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    # Rule 7 re-runs what the replay re-runs: both simulators agree on the GRU's random policies.
    from envs.simulator_reference import simulate_reference

    for profile in ("cpu", "a100-40gb"):
        hw = get_profile(profile)
        sim = Simulator(w, hw)
        for acts in mixes:
            fast, ref = sim.run(acts), simulate_reference(w, hw, acts)
            assert fast.peak_bytes == ref.peak_bytes and fast.iter_s == pytest.approx(ref.iter_s, rel=1e-9)


def test_the_cpu_lstm_trains_as_plain_under_random_mixes() -> None:
    """R6: a replay runs each op in the grad mode it ran in. The CPU's oneDNN LSTM layer
    (``aten.mkldnn_rnn_layer``) returns its workspace only with grad mode on, and rounds otherwise without it;
    backward, where replays run, turns grad mode off. Before, replaying its workspace failed in backward (an
    internal assertion: 34 of 80 random mixes of this model, regions as nodes or checkpointed) and replaying its
    output gave gradients off by up to 9.3e-9 (20 more); now every mix gives plain training's bits. The LSTM's
    call is no region either (P8 of runtime/plan.py): a node ran its forward without grad, and recomputing
    everything differed by 9.3e-9."""

    build = _recurrent(lambda: torch.nn.LSTM(16, 32, num_layers=2, batch_first=True))

    w = capture(build, name="lstm", batch_size=4, fake=False)
    plain = train_steps(build, None, 2)  # the learning step, then the steady state
    mixes = [
        (np.random.default_rng(seed).integers(0, 3, len(w.candidates)).astype(np.int8), nodes)
        for seed, nodes in ((0, False), (1, False), (8, False), (37, True), (37, False))
    ]  # off or failed before
    for acts, nodes in [*mixes, (uniform_actions(w, Action.RECOMPUTE), True)]:
        policy = Policy.from_vector(w, acts, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
        assert same_bits(plain, train_steps(build, policy, 2)), nodes


def test_a_swapped_tensor_that_a_later_replay_reads_is_re_made_on_the_cpu() -> None:
    """R9 on the CPU: ``x`` is swapped and read last (in backward) by ``x * w``'s backward; the sigmoid made
    from it is replayed later, in ``l2``'s backward. The swap's only copy goes at its last unpack, and the
    replay re-makes ``x`` from its producer (R6; it had failed: "swapped tensor ... was needed after its
    release")."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.w = torch.nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.l1(x)
            return (self.l2(torch.sigmoid(x)) + x * self.w).sum()

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return Net(), (torch.randn(4, 8),), lambda m, b: m(b[0])

    def grads(policy: Policy | None) -> list[torch.Tensor]:
        model, batch, loss_fn = build()
        with policy.applied(model) if policy is not None else contextlib.nullcontext():
            loss_fn(model, batch).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    w = capture(build, name="held", batch_size=4, fake=False)
    acts = {"<root>#0.0:Sigmoid": RECOMPUTE, "<root>#0.1:Addmm": SWAP}
    policy = Policy.from_vector(w, np.array([acts[c.key] for c in w.candidates], dtype=np.int8), hardware="cpu")
    plain = grads(None)
    got = grads(policy)
    assert len(got) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))


class _Blk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class _Branchy(torch.nn.Module):
    """A block used every other step (``step`` set by the loop), and a stem that may be frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b1, self.extra, self.b2 = torch.nn.Linear(8, 16), _Blk(), _Blk(), _Blk()
        self.out = torch.nn.Linear(16, 4)
        self.step = 0
        self.branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b1(torch.tanh(self.inp(x)))
        if self.branch and self.step % 2 == 1:
            x = self.extra(x)
        return self.out(self.b2(x))


@pytest.mark.parametrize("change", ["freeze", "branch"])
def test_a_step_whose_saved_tensors_change_under_equal_shapes_trains_as_plain(change: str) -> None:
    """R11 with the tables of a step that saved other tensors for the same shapes: layers frozen after the
    first step (a fine-tuning schedule), or a block used every other step. Replaying b2's input failed in
    backward ("cannot recompute a saved tensor: storage 0 has no recorded producer", QA runs): a frozen stem
    no longer keeps what the replay reads, and a pack matched the replayed entry by shape alone. Now the step
    learns again (frozen) or keeps what it cannot replay (branch, with a warning), and trains as plain."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _Branchy()
        model.branch = change == "branch"
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        return model, (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    def train(policy: Policy | None) -> list[list[torch.Tensor | None]]:
        model, batch, loss_fn = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for step in range(4):
            model.step = step
            if change == "freeze":
                for p in [*model.inp.parameters(), *model.b1.parameters()]:
                    p.requires_grad_(step == 0)
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the branch's tensors: keys not in the policy, kept
                with policy.applied(model) if policy is not None else contextlib.nullcontext():
                    loss_fn(model, batch).backward()
            out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        return out

    w = capture(build, name="branchy", batch_size=4, fake=False)
    acts = np.array([RECOMPUTE if c.key == "b2.ln#0.0:Add" else KEEP for c in w.candidates], dtype=np.int8)
    assert (acts == RECOMPUTE).sum() == 1
    plain, got = train(None), train(Policy.from_vector(w, acts, hardware="cpu"))
    for a, b in zip(plain, got, strict=True):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_second_forward_after_the_backward_inside_one_step_is_refused() -> None:
    """Gradient accumulation written with every micro-batch inside one ``applied``: the second micro-batch's
    backward failed with "cannot recompute a saved tensor: storage 18 has no recorded producer" (a QA run).
    Refused in one line at the second call; a forward under no_grad in the same step is fine."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 5))  # fmt: skip
        return (
            m,
            (torch.randn(6, 12), torch.randint(0, 5, (6,))),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        )

    w = capture(build, name="acc", batch_size=6, fake=False)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    model, batch, loss_fn = build()
    with policy.applied(model):
        loss_fn(model, batch).backward()
        with torch.no_grad():
            model(batch[0])
    with pytest.raises(AutotuneError, match="covers one forward and its backward"), policy.applied(model):
        loss_fn(model, batch).backward()
        loss_fn(model, batch).backward()


@pytest.mark.parametrize("mode", ["freeze_later", "unfreeze_later", "eval_inside"])
def test_batchnorm_whose_mode_changes_keeps_plain_statistics_in_regions(mode: str) -> None:
    """R10: a region's recompute takes back the step count of the BatchNorm calls that counted one in it, and
    only those: it took one back from a frozen (eval-mode) BatchNorm at every step (the count went 1, 0, -1, -2
    where plain training holds 1), and one unfrozen after the first step had its running statistics updated
    twice (its momentum was not zeroed in the recompute). Both region mechanisms."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            block = lambda: torch.nn.Sequential(  # noqa: E731
                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Tanh(),
            )  # fmt: skip
            self.stem, self.blocks, self.fc = (
                torch.nn.Conv2d(3, 8, 3, padding=1),
                torch.nn.Sequential(block(), block()),
                torch.nn.Linear(8, 10),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if mode == "eval_inside":
                self.blocks[1][1].eval()
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return (
            Net(),
            (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        )

    def run(policy: Policy | None) -> list[list[torch.Tensor]]:
        model, batch, loss_fn = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        bn = model.blocks[1][1]
        out = []
        for step in range(4):
            if mode == "freeze_later":
                bn.train(step == 0)
            if mode == "unfreeze_later":
                bn.train(step >= 2)
            opt.zero_grad()
            with policy.applied(model) if policy is not None else contextlib.nullcontext():
                loss_fn(model, batch).backward()
            opt.step()
            out.append([p.grad.clone() for p in model.parameters()] + [b.clone() for b in model.buffers()])
        return out

    w = capture(build, name="bn-mode", batch_size=2, fake=False)
    plain = run(None)
    for nodes in (True, False):
        policy = Policy.from_vector(
            w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu", options=PolicyOptions(region_nodes=nodes)
        )
        assert policy.schedule is not None and len(policy.schedule.regions) == 2
        got = run(policy)
        for a, b in zip(plain, got, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (mode, nodes)


class _UseThenUpdate(torch.nn.Module):
    """Reads its buffer, then updates it in place (an EMA), in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + self.shift)
        with torch.no_grad():
            self.shift.mul_(0.5).add_(h.mean(0), alpha=0.5)
        return h


class _Shifted(torch.nn.Module):
    """Reads a buffer that its caller updates after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.shift) * 3.0


class _LaterWrites(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ema, self.lin, self.shifted, self.head = (
            _UseThenUpdate(),
            torch.nn.Linear(16, 16),
            _Shifted(),
            torch.nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.ema(x))
        y = self.shifted(h)
        with torch.no_grad():
            self.shifted.shift.add_(y.mean(0))  # the buffer it read, updated after the call
        h.add_(1.0)  # and its argument, written in place after the call (nothing inside saves it)
        return self.head(y + h)


def test_what_a_recompute_reads_is_what_the_forward_read_when_written_in_place_later() -> None:
    """R6, P9 of runtime/plan.py: a buffer updated in place after a recomputed tensor's producer read it (an EMA)
    was read by the replay as updated: gradients off by up to 0.30 under a recompute of everything, silently (a QA
    pass); the recorder now keeps the buffer as it was read until the step's replays are done. A call that reads a
    buffer its caller updates afterwards, or whose argument a later op writes into, is no region: the region's
    recompute read the buffer as updated (wrong gradients), and autograd refused the argument it held ('modified
    by an inplace operation'). Plain training's gradients and buffers at every step, both region mechanisms."""

    build = classifier(_LaterWrites, (2, 16), 4)

    w = capture(build, name="later-writes", batch_size=2, fake=False)
    plain = train_steps(build, None, 3, buffers=True)
    keys = [c.key for c in w.candidates]
    only = [np.array([RECOMPUTE if k.startswith(p) else KEEP for k in keys], dtype=np.int8) for p in ("ema", "shift")]
    vectors = [uniform_actions(w, Action.RECOMPUTE), *only]
    for vec in vectors:
        for nodes in (True, False):
            policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(region_nodes=nodes))
            assert policy.schedule is None or not any(r.module == "shifted" for r in policy.schedule.regions)
            assert same_bits(plain, train_steps(build, policy, 3, buffers=True)), (vec.tolist(), nodes)


class _Constants(torch.nn.Module):
    """Tensor constants made from Python data in forward, read by recomputed chains: ``torch.tensor(0.1)``
    in a ``where``, and T5's ``_shift_right`` (a slice set to 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.emb, self.l2 = torch.nn.Linear(8, 16), torch.nn.Embedding(32, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = torch.where(h > 0, h, torch.tensor(0.1)) * 2.0
        ids = (x.abs() * 10).long() % 32
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 0
        return self.l2(torch.tanh(h) + torch.tanh(self.emb(shifted)).mean(1, keepdim=True).squeeze(1))


def test_constants_made_in_forward_are_there_for_the_replay() -> None:
    """R6: a constant lifted from Python data in forward (``aten.lift_fresh``) has no producer a replay could
    run and was gone by backward: recomputing what reads it failed ('storage N has no recorded producer'), as in
    torchvision's swin_t (its shifted-window mask), T5 and BART (their shifted decoder inputs), found by a QA
    pass. The recorder holds such constants for the step; gradients are plain training's."""

    build = classifier(_Constants, (2, 8), 4)

    w = capture(build, name="constants", batch_size=2, fake=False)
    plain = train_steps(build, None, 2)
    for nodes in (True, False):
        options = PolicyOptions(region_nodes=nodes)
        policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu", options=options)
        assert same_bits(plain, train_steps(build, policy, 2)), nodes


def test_a_swap_only_step_names_reshaped_tensors_as_the_trace_does() -> None:
    """NOTE [ Key format ]: a CPU reshape dispatches ``_reshape_alias`` where no dispatch mode is on and a
    ``view`` under one (the trace's): a policy that swaps and replays nothing ran without a mode and met three of
    ``nn.TransformerEncoderLayer``'s saved tensors as unknown keys, kept (a QA pass). Now none is unknown."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
        model = torch.nn.Sequential(layer, torch.nn.Flatten(), torch.nn.Linear(32 * 6, 4))
        return (
            model,
            (torch.randn(2, 6, 32), torch.randint(0, 4, (2,))),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        )

    w = capture(build, name="mha", batch_size=2, fake=False)
    policy = Policy.from_vector(w, uniform_actions(w, Action.SWAP), hardware="cpu")
    model, batch, loss_fn = build()
    for _ in range(2):
        with policy.applied(model) as stats:
            loss_fn(model, batch).backward()
        assert stats.unknown_keys == [] and stats.swaps == len(w.candidates)


class _TupleOut(torch.nn.Module):
    """Returns a tuple whose second element the loss does not use: its branch's backward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
        self.aux, self.fc, self.fc2 = torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(8, 10), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.fc(h.mean((2, 3))), self.fc2(torch.relu(self.aux(h)).mean((2, 3)))


def test_a_recomputed_tensor_whose_backward_never_comes_lets_the_steps_settle() -> None:
    """R11: a tensor the policy recomputes in a branch the loss does not use is never unpacked, so no replay
    re-ran its producers and later steps did not record them; every such step met it as unknown, kept everything
    after it with a warning and learnt again, every other step (a QA pass). It is learnt as kept: no warning after
    the first step, and plain training's gradients."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
        return _TupleOut(), batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0])[0], b[1])

    w = capture(build, name="tuple", batch_size=2, fake=False)
    # fc2's input, and a tensor of the body that is replayed (so that later steps run the recorder).
    acts = np.array([RECOMPUTE if c.key.startswith(("fc2#", "body.1#")) else KEEP for c in w.candidates], dtype=np.int8)
    assert (acts == RECOMPUTE).sum() == 2
    policy = Policy.from_vector(w, acts, hardware="cpu")
    grads = []
    for p in (None, policy):
        model, batch, loss_fn = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(4):
                opt.zero_grad()
                with p.applied(model) if p is not None else contextlib.nullcontext():
                    loss_fn(model, batch).backward()
                out.append([q.grad.clone() for q in model.parameters() if q.grad is not None])
                opt.step()
        grads.append(out)
    for a, b in zip(*grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_recorder_copies_only_buffers_a_model_reads_before_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """R6's copies are for a buffer a model op read before an in-place write (the EMA above), not for what the
    runtime's own packs alias: its detach of BatchNorm's running statistics, saved before the op updates them,
    made the recorder copy BatchNorm's statistics at every step (72 copies, 150 KB, a step on the ResNet-50 proxy
    under a random mix; 4 here)."""
    from runtime.replay import Recorder

    copies: list[int] = []
    release = Recorder.release_rng

    def counted(self: Recorder) -> None:
        copies.append(len(self.before_write))
        release(self)

    monkeypatch.setattr(Recorder, "release_rng", counted)
    for build, expect_copies in ((_resnet_like_build, False), (classifier(_LaterWrites, (2, 16), 4), True)):
        w = capture(build, name="copies", batch_size=2, fake=False)
        # The ReLUs' outputs (BatchNorm's, written in place), BatchNorm's saved mean (so that its call is hooked)
        # and the EMA's tensors replayed, the rest kept.
        replayed = (":Relu", "0.1:nograd")
        acts = np.array([RECOMPUTE if c.key.endswith(replayed) or c.key.startswith("ema#") else KEEP
                         for c in w.candidates], dtype=np.int8)  # fmt: skip
        copies.clear()
        train_steps(build, Policy.from_vector(w, acts, hardware="cpu"), 2)
        assert copies and (all(copies) if expect_copies else not any(copies)), copies


def _resnet_like_build():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    layers = [
        [torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU(inplace=True)] for _ in range(2)
    ]
    model = torch.nn.Sequential(*layers[0], *layers[1], torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,)))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("action", [Action.RECOMPUTE, Action.SWAP])
def test_a_forward_without_grad_inside_the_step_leaves_the_policy_as_it_is(action: Action) -> None:
    """R11: a forward of the model under ``torch.no_grad`` inside ``policy.applied``, before the training
    forward (pseudo-labels, FixMatch-style): its module calls were counted as the step's, so the regions'
    calls (``blocks.0`` call 1, not 0) and the hooked calls of later steps matched no table: regions never ran,
    and every other step kept every tensor after a warning (a QA run). Every step now applies the policy as a
    step without that forward does, with plain training's gradients."""
    from experiments.user_models import groupnorm_cnn

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return groupnorm_cnn(batch_size=4)

    w = capture(build, name="groupnorm_cnn", batch_size=4)
    policy = Policy.from_vector(w, uniform_actions(w, action), hardware="cpu")

    def run(pseudo: bool) -> list[tuple[int, int, int, list[torch.Tensor]]]:
        model, batch, loss_fn = build()
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "saved tensors of this step differ"
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                with policy.applied(model) as stats:
                    if pseudo:
                        with torch.no_grad():
                            loss_fn(model, batch)
                    loss_fn(model, batch).backward()
                out.append((stats.regions, stats.swaps, stats.recomputed_ops, [p.grad for p in model.parameters()]))
        return out

    with_pseudo, without = run(True), run(False)
    assert [s[:3] for s in with_pseudo] == [s[:3] for s in without]
    assert with_pseudo[-1][0] + with_pseudo[-1][1] > 0  # the policy acted
    assert all(
        torch.equal(a, b) for x, y in zip(with_pseudo, without, strict=True) for a, b in zip(x[3], y[3], strict=True)
    )


@pytest.mark.parametrize("pseudo_labels", [False, True])
def test_a_model_called_twice_before_backward_has_keys_of_its_own_for_each_call(pseudo_labels: bool) -> None:
    """A contrastive loss calls the encoder on two views before backward. Each call counted its module calls
    from 0 again, so both views' tensors had one key (23 saved, 14 keys: one action for two tensors), and the
    steps after the first looked the second call's packs up in the first call's tables: every other step
    warned, kept everything and learnt again. A call without grad (pseudo-labels) first is not counted."""
    import functools

    from tests.fixtures_models import make_siamese

    build = functools.partial(make_siamese, 4, pseudo_labels)
    w = capture(build, name="siamese", batch_size=4)
    keys = [c.key for c in w.candidates]
    assert len(keys) == len(set(keys)) == 23 + pseudo_labels  # (the pseudo-labels' weight, saved by the product)
    assert {"1#0.0:Convolution", "1#1.0:Convolution"} <= set(keys)  # the first conv's output, in each call
    policy = Policy.uniform(w, Action.RECOMPUTE, hardware="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step keeps what the policy drops
        got = train_steps(build, policy, 4, buffers=True)
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model)
        replayed = []
        for _ in range(4):
            with rt.step() as stats:
                loss_fn(model, batch).backward()
            replayed.append(stats.recomputed_ops)
    assert same_bits(got, train_steps(build, None, 4, buffers=True))
    assert replayed[0] > 0 and len(set(replayed)) == 1  # every step replays what the first did


def test_functional_call_with_tensors_of_its_own_trains_as_plain_training_under_regions() -> None:
    """A functional loop (torch.func.functional_call with parameter tensors held outside the module, new each
    step): a region's recompute runs in backward, after functional_call has put the module's own parameters
    back, and recomputed with those: gradients wrong from the second step (PyTorch's own checkpoint does the
    same). Nor may a region run as a node on the leaves it learnt in a plain step."""
    from torch.func import functional_call

    from tests.fixtures_models import ResidualMLP

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), ResidualMLP(16), ResidualMLP(16), torch.nn.Linear(16, 3))
        return model, (torch.randn(4, 8),), lambda m, b: m(*b).square().mean()

    w = capture(build, name="blocks", batch_size=4)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")  # each block a region

    def run(use: bool, plain_first: bool) -> list[tuple[torch.Tensor, ...]]:
        model, batch, loss_fn = build()  # a runtime of its own: what its regions learnt is the model's
        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        got, regions = [], 0
        for step in range(4):
            with policy.applied(model) if use else contextlib.nullcontext() as stats:
                if plain_first and step < 2:  # the model's own: the regions learn them as leaves, then run as nodes
                    loss = loss_fn(model, batch)
                    grads = torch.autograd.grad(loss, list(model.parameters()))
                else:
                    loss = functional_call(model, params, batch).square().mean()
                    grads = torch.autograd.grad(loss, list(params.values()))
            regions += stats.regions if use else 0
            got.append(grads)
            params = {
                n: (p - 0.1 * g).detach().requires_grad_() for (n, p), g in zip(params.items(), grads, strict=True)
            }
        assert regions > 0 or not use
        return got

    for plain_first in (False, True):  # (a node on the leaves it learnt failed: "not used in the graph")
        plain, under = run(False, plain_first), run(True, plain_first)
        assert all(torch.equal(a, b) for x, y in zip(plain, under, strict=True) for a, b in zip(x, y, strict=True))


def test_a_region_that_returns_a_view_modified_in_place_after_it_trains_as_plain() -> None:
    """Conv, InstanceNorm2d (its output a view it made), ReLU(inplace=True): the pattern of torchvision's
    raft_small. Each InstanceNorm a region, run as a node from the second step, failed there: "Output 0 of
    _Region is a view and is being modified inplace". Such a call is planned (P10) and run (N4) under
    checkpoint."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.InstanceNorm2d(8), torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.InstanceNorm2d(8), torch.nn.ReLU(inplace=True),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
        )  # fmt: skip
        return model, (torch.randn(2, 3, 16, 16),), lambda m, b: m(*b).square().mean()

    w = capture(build, name="instancenorm", batch_size=2)
    assert {f.path for f in w.frames if f.view_out} >= {"1", "4"}  # the InstanceNorms' outputs
    vector, plain = uniform_actions(w, Action.RECOMPUTE), train_steps(build, None, 3)
    planned = Policy.from_vector(w, vector, hardware="cpu", options=PolicyOptions(region_nodes=True))
    assert planned.schedule is not None and not {r.module for r in planned.schedule.regions} & {"1", "4"}  # P10
    # A policy whose schedule has them as regions (checkpointed when planned), run with nodes: N4 keeps them
    # under checkpoint.
    ran = Policy.from_vector(w, vector, hardware="cpu", options=PolicyOptions(region_nodes=False))
    assert ran.schedule is not None and {r.module for r in ran.schedule.regions} >= {"1", "4"}
    ran.options = dataclasses.replace(ran.options, region_nodes=True)
    for policy in (planned, ran):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = train_steps(build, policy, 3)
        assert same_bits(got, plain)


def test_backward_after_the_block_under_a_recomputing_policy_says_what_to_do() -> None:
    """``loss.backward()`` after ``with policy.applied(model):`` has ended: the recording a recompute replays
    went with the step, and the unpack failed on a bare ``AssertionError`` (a QA run: Lightning's automatic
    optimization calls backward after ``training_step`` returns). One line that says to call backward inside
    the block; a swap-only policy still trains so, with plain training's gradients."""
    name, kwargs = RESNET
    build = _build(name, kwargs)
    w = capture(build, name=name, batch_size=kwargs["batch_size"])
    for action in (Action.RECOMPUTE, Action.SWAP):
        policy = Policy.uniform(w, action, hardware="cpu")
        model, batch, loss_fn = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step's own "no backward inside it"
            with policy.applied(model):
                loss = loss_fn(model, batch)
            if action == Action.RECOMPUTE:
                with pytest.raises(AutotuneError, match=r"after `with policy.applied\(model\):` ended.*inside the"):
                    loss.backward()
                continue
            loss.backward()
        plain, pbatch, ploss = build()
        ploss(plain, pbatch).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True))
