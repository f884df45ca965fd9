"""A policy under torch.compile (runtime/compiled.py, NOTE [ Compiled policies ]): keys mapped to the ops the
compiler traces; gradients and BatchNorm statistics bit-identical to the compiled run without a policy; the
compiled graph saves what the policy keeps; its measured peak equals the eager runtime's under the same
policy; swap, compression and partitions refused with a one-line reason (or kept and reported). The CPU runs
them with the ``aot_eager`` backend (AOTAutograd and the min-cut partitioner, the compiler's decisions on
what to save, without inductor's code generation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from autotune.models import build_model
from autotune.workloads import TraceRequest, trace_model
from runtime.apply import PolicyRuntime
from runtime.compiled import _fold, op_name
from runtime.errors import AutotuneError
from runtime.measure import profiler_peak_bytes, run_iterations, training_state
from runtime.partition import Partition
from runtime.policy import Policy, PolicyOptions, load_policy
from runtime.trace import capture, make_optimizer
from runtime.vocab import Action
from runtime.workload import Workload
from tests.test_cli import run, user_error

BACKEND = "aot_eager"


def _cnn(batch_size: int = 4):  # type: ignore[no-untyped-def]
    """Conv-BatchNorm-ReLU(in place) twice, dropout, a linear head: the renamed BatchNorm, the in-place
    ReLU and the CPU's four-op dropout of C4 in one small model."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(8 * 16 * 16, 10),
        )
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch_size, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        return model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    return build


def _policy(w: Workload, rule: str) -> Policy:
    recompute = {
        "keep": lambda k: False,
        "relu": lambda k: k.endswith(":Relu"),
        "all": lambda k: True,
    }[rule]
    vec = np.array([Action.RECOMPUTE.code if recompute(c.key) else 0 for c in w.candidates], dtype=np.int8)
    return Policy.from_vector(w, vec, hardware="cpu")


def _saved_bytes(model: nn.Module, run) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the distinct storages autograd saves while ``run`` runs (the compiled graph's saved
    tensors are saved through ctx.save_for_backward, so the hooks see them), parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def _step(build, policy: Policy | None, backend: str = BACKEND):  # type: ignore[no-untyped-def]
    """One compiled training step: gradients, BatchNorm statistics, the saved bytes and the report."""
    model, batch, loss_fn = build()
    torch.manual_seed(2)  # the dropout mask
    cm = policy.compiled(model, backend=backend) if policy is not None else torch.compile(model, backend=backend)
    loss_fn(cm, batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    stats = [b.clone() for b in model.buffers()]
    torch.manual_seed(2)
    saved = _saved_bytes(model, lambda: loss_fn(cm, batch))
    return grads, stats, saved, getattr(cm, "report", None)


def test_op_names_fold_what_the_compiler_names_otherwise() -> None:
    assert op_name(torch.ops.aten.relu_.default) == "aten.relu"
    assert op_name(torch.ops.aten._native_batch_norm_legit.default) == "aten.native_batch_norm"
    assert op_name(torch.ops.aten.native_batch_norm.default) == "aten.native_batch_norm"
    assert op_name(torch.ops.aten.convolution.default) == "aten.convolution"
    names = ["aten.addmm", "aten.empty_like", "aten.bernoulli", "aten.div", "aten.mul", "aten.relu"]
    s = torch.UntypedStorage(4)
    inputs = [[], [(0, s)], [(1, s)], [(2, s)], [(0, s), (3, s)], [(4, s)]]
    folded, folded_inputs, new_of = _fold(names, inputs)  # type: ignore[arg-type]
    assert folded == ["aten.addmm", "aten.native_dropout", "aten.relu"]
    assert new_of == [0, 1, 1, 1, 1, 2]
    # The folded dropout reads the addmm (twice: from empty_like and from mul), nothing of its own group.
    assert [w for w, _ in folded_inputs[1]] == [0, 0]
    assert [w for w, _ in folded_inputs[2]] == [1]


@pytest.fixture(scope="module")
def cnn_workload() -> Workload:
    return capture(_cnn(), name="cnn", batch_size=4)


@pytest.mark.parametrize("rule", ["keep", "relu", "all"])
def test_gradients_and_statistics_equal_the_compiled_run_without_policy(cnn_workload: Workload, rule: str) -> None:
    build = _cnn()
    g0, s0, saved0, _ = _step(build, None)
    policy = _policy(cnn_workload, rule)
    g, s, saved, report = _step(build, policy)
    assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(s, s0, strict=True))  # running statistics updated once
    assert report is not None and not report.dropped  # every key's op found in the compiled trace
    cand = {c.key: c.nbytes for c in cnn_workload.candidates}
    if rule == "keep":  # on this model the compiler, left alone, saves what autograd saves
        assert not report.changed
        assert saved == saved0
    elif rule == "relu":
        # The two ReLUs recomputed from their BatchNorm (C3): the BatchNorms' saved statistics with them, and
        # the compiled graph saves exactly those candidates' bytes less.
        stats = {k for k in cand if k.startswith(("1#", "4#")) and k.endswith("nograd")}
        assert set(report.changed) == stats
        recomputed = stats | {k for k in cand if k.endswith(":Relu")}
        assert saved0 - saved == sum(cand[k] for k in recomputed) == 2 * 4 * 8 * 16 * 16 * 4 + 4 * 8 * 4
    else:
        # Everything recomputed from what stays resident: the input batch, the BatchNorms' running
        # statistics (the recompute's inputs), dropout's output (4x2048 fp32) and mask (bool under compile),
        # which a random op keeps (C3), and, outside the model, cross_entropy's log-softmax (4x10 fp32),
        # targets (4 int64) and a scalar.
        assert set(report.changed) == {"7#0.0:nograd", "8#0.0:Mul"} | {k for k in cand if k.startswith("<loss>")}
        model, batch, _ = build()
        running = sum(b.untyped_storage().nbytes() for n, b in model.named_buffers() if "running" in n)
        dropout = 4 * 2048 * 4 + 4 * 2048
        assert saved == batch[0].untyped_storage().nbytes() + running + dropout + (160 + 32 + 4)


def test_peak_under_compile_equals_the_eager_runtimes_under_the_same_policy(cnn_workload: Workload) -> None:
    """Both measured the same way (the CPU allocator's events: the storage tracker is a dispatch mode, under
    which dynamo does not compile), after a warm-up step, with gradients and state held; between ops (what
    ``autotune train --compile`` measures) the eager step's is the storage tracker's to the byte."""
    policy = _policy(cnn_workload, "relu")

    def peak(compiled: bool, scratch: bool = True) -> int:
        model, batch, loss_fn = _cnn()()
        opt = make_optimizer("sgd", model.parameters())
        cm = policy.compiled(model, backend=BACKEND) if compiled else None
        rt = None if compiled else PolicyRuntime(policy, model)

        def step() -> None:
            torch.manual_seed(2)
            if cm is not None:
                loss_fn(cm, batch).backward()
            else:
                assert rt is not None
                with rt.step():
                    loss_fn(model, batch).backward()
            opt.step()

        step()
        opt.zero_grad(set_to_none=True)
        base = sum(t.untyped_storage().nbytes() for t in training_state(model, batch, opt))
        return profiler_peak_bytes(step, base, scratch=scratch)

    model, batch, loss_fn = _cnn()()
    opt = make_optimizer("sgd", model.parameters())
    rt = PolicyRuntime(policy, model)
    tracker = run_iterations(model, batch, loss_fn, opt, steps=1, batch_size=4, around_step=rt.step)[0].peak_bytes
    assert peak(compiled=False, scratch=False) == tracker
    # The compiled step between ops: 160 bytes under (the functional BatchNorm's statistics, as below).
    assert abs(peak(compiled=True, scratch=False) - tracker) <= 2 * 4 * 8 * 4
    # Equal but for a few bytes: the compiled BatchNorm is functional, its new running statistics exist
    # beside the buffers until they are copied back (64 bytes measured here; bounded by all four, 4 x 8 fp32).
    assert 0 <= peak(compiled=True) - peak(compiled=False) <= 4 * 8 * 4


def test_swap_is_refused_or_kept_and_reported(cnn_workload: Workload) -> None:
    vec = np.array([Action.SWAP.code if k.endswith(":Relu") else 0 for k in (c.key for c in cnn_workload.candidates)])
    policy = Policy.from_vector(cnn_workload, vec, hardware="cpu")
    model, batch, loss_fn = _cnn()()
    with pytest.raises(AutotuneError, match=r"only keep and recompute .* strict=False"):
        loss_fn(policy.compiled(model, backend=BACKEND), batch)
    cm = policy.compiled(model, backend=BACKEND, strict=False)
    loss_fn(cm, batch).backward()
    swapped = {k for k, a in policy.actions.items() if a == Action.SWAP}
    assert set(cm.report.changed) == swapped
    assert all(got == Action.KEEP for _, got, _ in cm.report.changed.values())


def test_partitions_and_other_models_are_refused_before_compiling(cnn_workload: Workload) -> None:
    policy = _policy(cnn_workload, "relu")
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(AutotuneError, match="other parameters"):
        policy.compiled(other, backend=BACKEND)
    parted = Policy.from_vector(
        cnn_workload,
        policy.to_vector(cnn_workload),
        hardware="cpu",
        options=PolicyOptions(allow_partition=True),
    )
    parted.partitions = (Partition("0", 2),)
    with pytest.raises(AutotuneError, match="cannot be compiled"):
        parted.compiled(_cnn()()[0], backend=BACKEND)


def test_gpt2_dropout_and_attention_align_and_recompute_bit_identically() -> None:
    kwargs: dict[str, Any] = {
        "batch_size": 2,
        "seq_len": 32,
        "config_overrides": {"n_layer": 1, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0},
    }

    def build():  # type: ignore[no-untyped-def]
        e = build_model("gpt2", **kwargs)
        return e.module, e.batch, e.loss_fn

    w = capture(build, name="gpt2", batch_size=2, seq_len=32)
    g0, _, saved0, _ = _step(build, None)
    g, _, saved, report = _step(build, _policy(w, "all"))
    assert report is not None and not report.dropped
    assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True))
    assert saved < saved0


def test_two_policies_for_one_model_class_compile_apart(cnn_workload: Workload) -> None:
    """Dynamo caches on the code object and guards on the model's structure, not on the policy: without a
    code object per CompiledModel the second policy ran the first one's graph."""
    build = _cnn()
    saved = [_step(build, _policy(cnn_workload, rule))[2] for rule in ("keep", "relu", "keep")]
    assert saved[0] == saved[2] > saved[1]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_recomputes_bit_identically(cnn_workload: Workload) -> None:
    """The backend users train with. Dropout recomputed by inductor drew another mask (C3): kept instead."""
    build = _cnn()
    g0, s0, _, _ = _step(build, None, backend="inductor")
    g, s, _, report = _step(build, _policy(cnn_workload, "all"), backend="inductor")
    assert report is not None and not report.dropped
    assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(s, s0, strict=True))


# -- from the CLI, as users run it ------------------------------------------------------------------------------
CNN = "experiments.user_models:groupnorm_cnn"


@pytest.mark.slow
def test_search_train_compiled_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`search --compile --measure 1` -> `simulate` -> `train --compile` -> ``policy.compiled`` in a plain loop:
    the search trains its finalists compiled (before, `--compile` refused `--measure`), the file says which
    backend it was planned for, which `simulate` scores it for and `train --compile` trains it under; its
    measured peak is `train --compile`'s, within the budget and the plan's, and the losses are bit-identical to
    the same compiled loop without a policy."""
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "cpu", "--json")
    assert code == 0, err
    budget = str(int(json.loads(out)["peak_bytes"] * 0.8))
    path = tmp_path / "p.json"
    code, out, err = run(capsys, "search", "--model", CNN, "--budget", budget, "--gpu", "cpu", "--timeout", "8",
                         "--compile", "--backend", BACKEND, "--measure", "1", "--out", str(path), "--json")  # fmt: skip
    assert code == 0, err
    found = json.loads(out)
    assert found["feasible"] and found["written"] and found["finalists"] is not None
    policy = load_policy(path)
    counts = policy.counts()
    assert counts[Action.SWAP] == counts[Action.COMPRESS] == 0 and counts[Action.RECOMPUTE] > 0
    assert policy.compile_backend == BACKEND and json.loads(path.read_text())["compile_backend"] == BACKEND
    code, out, err = run(capsys, "simulate", "--policy", str(path), "--json")
    assert code == 0, err
    simulated = json.loads(out)
    assert simulated["compile_backend"] == BACKEND and policy.predicted is not None
    assert simulated["peak_bytes"] == policy.predicted.peak_bytes  # the search's score, on the twin (Rule 16)
    code, out, err = run(capsys, "train", "--policy", str(path), "--steps", "1", "--compile", "--json")
    assert code == 0, err
    trained = json.loads(out)  # --compile alone: the backend the policy was planned for
    assert trained["compiled"] == BACKEND and trained["compile_report"]["dropped"] == 0
    # On the CPU a compiled step's peak comes from the allocator's events between ops (dynamo does not compile
    # under the storage tracker; NOTE [ Device memory on the CPU ]): the search measured what train measures,
    # and it is the plan's (within 0.1%; 1 KiB under on this model when written: the functional BatchNorm).
    peak = trained["measured"]["peak_bytes"]
    assert found["measured"]["peak_bytes"] == peak <= int(budget)
    assert abs(peak - trained["predicted"]["peak_bytes"]) <= 0.001 * peak, (peak, trained["predicted"])
    losses = {}
    for use in (False, True):
        torch.manual_seed(0)
        entry = build_model(CNN)
        opt = torch.optim.SGD(entry.module.parameters(), lr=0.1)
        model = policy.compiled(entry.module, backend=BACKEND) if use else torch.compile(entry.module, backend=BACKEND)
        losses[use] = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = entry.loss_fn(model, entry.batch)
            loss.backward()
            opt.step()
            losses[use].append(loss.item())
    assert losses[True] == losses[False]


def test_compile_refusals_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cnn_workload: Workload
) -> None:
    msg = user_error(capsys, "search", "--model", CNN, "--budget", "1GB", "--gpu", "cpu", "--compile",
                     "--allow-compress")  # fmt: skip
    assert "--compile with --allow-compress" in msg
    search = ("search", "--model", CNN, "--budget", "1GB", "--gpu", "cpu")
    assert "--backend aot_eager without --compile" in user_error(capsys, *search, "--backend", "aot_eager")
    assert "unknown torch.compile backend 'nope'" in user_error(capsys, *search, "--compile", "--backend", "nope")
    assert "--backend eager without --measure" in user_error(capsys, *search, "--compile", "--backend", "eager")
    swapping = tmp_path / "swap.json"
    w, _ = trace_model(TraceRequest(model=CNN))
    Policy.uniform(w, Action.SWAP, hardware="a100-40gb").save(swapping)
    assert "torch.compile cannot apply" in user_error(capsys, "train", "--policy", str(swapping), "--compile")
    assert "unknown torch.compile backend 'nope'" in user_error(
        capsys, "train", "--policy", str(swapping), "--compile", "--backend", "nope"
    )


def test_a_graph_break_is_refused_in_one_line(cnn_workload: Workload) -> None:
    class Breaks(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            print("a print breaks the graph")
            return super().forward(x)

    model, batch, loss_fn = _cnn()()
    broken = Breaks(*model)
    policy = _policy(cnn_workload, "relu")
    with pytest.raises(AutotuneError, match=r"does not compile as one graph .* policy.applied"):
        loss_fn(policy.compiled(broken, backend=BACKEND), batch)


def test_a_validation_first_leaves_the_plan_to_the_first_training_call(cnn_workload: Workload) -> None:
    """C7: a validation pass before training (eval and no_grad: Lightning's sanity check) saved nothing, the
    plan was made there, every decision was dropped and training ran without the policy (a QA run: 427,876
    bytes saved a step against 165,732). Planned at the first training call instead, and a later validation
    leaves the report as training made it."""
    build = _cnn()
    policy = _policy(cnn_workload, "relu")
    _, _, expected, report = _step(build, policy)
    model, batch, loss_fn = build()
    cm = policy.compiled(model, backend=BACKEND)
    model.eval()
    with torch.no_grad():
        cm(batch[0])
    assert not cm.report.applied  # no plan yet
    model.train()
    torch.manual_seed(2)
    assert _saved_bytes(model, lambda: loss_fn(cm, batch)) == expected
    assert cm.report.applied == report.applied and not cm.report.dropped
    model.eval()
    with torch.no_grad():
        cm(batch[0])
    assert cm.report.applied == report.applied and not cm.report.dropped


def test_a_model_trained_in_eval_mode_is_told_it_runs_without_the_policy(cnn_workload: Workload) -> None:
    """C7: a model trained in eval mode (gradients on) ran eagerly without the policy, its report "0 applied,
    0 dropped", with nothing said (a QA run). It warns once; a validation under no_grad says nothing."""
    import warnings

    model, batch, loss_fn = _cnn()()
    cm = _policy(cnn_workload, "relu").compiled(model, backend=BACKEND)
    model.eval()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with torch.no_grad():
            cm(batch[0])
        assert not said
        loss_fn(cm, batch).backward()
        loss_fn(cm, batch).backward()
    assert [str(w.message).split(",")[0] for w in said] == [
        f"policy.compiled: {type(model).__name__} is in eval mode with gradients on"
    ]
    assert not cm.report.applied


def test_a_policy_for_another_precision_is_refused_as_policy_applied_refuses_it(cnn_workload: Workload) -> None:
    """An fp32 policy compiled and trained under bf16 autocast reported its decisions applied and ran (a QA
    run), where ``policy.applied`` refuses it: refused in the same words."""
    build = _cnn()
    model, batch, loss_fn = build()
    cm = _policy(cnn_workload, "relu").compiled(model, backend=BACKEND)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AutotuneError, match="made for fp32 training"):
        loss_fn(cm, batch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cm(batch[0])  # inference saves nothing: any precision


def test_a_compiled_steps_peak_is_its_twins_plan() -> None:
    """The GroupNorm CNN of experiments/user_models.py with every tensor in the model recomputed, trained one
    step compiled under aot_eager (``autotune train --compile``'s path): its peak between ops is the plan of
    the simulator's twin of the compiled step (Rule 16: each replay's temporaries freed at their last reader;
    within 0.01%, 3 KB measured at batch 8), where the eager runtime's replays, which hold theirs until the
    outermost is done, hold about a quarter more (Rule 7)."""
    from autotune.train import run_policy
    from envs.simulator import Simulator
    from runtime.hardware import get_profile

    name = "experiments.user_models:groupnorm_cnn"
    w, _ = trace_model(TraceRequest(model=name, batch_size=8, image_size=64, mode="fake", device="cpu"))
    hw = get_profile("cpu")
    vec = np.full(len(w.candidates), Action.RECOMPUTE.code, dtype=np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu")
    r = run_policy(policy, w, hw, name=name, batch=8, steps=1, device="cpu", compile_backend=BACKEND)
    measured, planned = r.steps[0].peak_bytes, int(r.predicted["peak_bytes"])
    assert abs(measured - planned) <= 1e-4 * planned, (measured, planned)
    assert Simulator(w, hw).run(policy).peak_bytes > 1.2 * measured  # the eager runtime's plan


def test_a_simulated_search_for_inductor_says_its_memory_is_not_modelled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule 16 is aot_eager's memory; inductor's fusion and buffers are not modelled (the GroupNorm CNN's
    plans were off by -20% to +17% under inductor on the CPU): a search that checks nothing compiled says so,
    and how to check it."""
    monkeypatch.chdir(tmp_path)  # its policy file and study storage, by their defaults
    code, _, err = run(capsys, "search", "--model", CNN, "--batch-size", "2", "--gpu", "a100-40gb", "--budget",
                       "1GB", "--compile", "--timeout", "1")  # fmt: skip
    assert code == 0, err
    assert "inductor's fusion and buffers are not modelled" in err and "--measure on the GPU" in err
