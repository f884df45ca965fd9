"""Mixed precision (NOTE [ Precision ] in runtime.precision): what autocast saves, hand-counted on a tiny MLP;
a plan for one precision refused by another, in the policy check, the runtime and the CLI."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import pytest
import torch

from runtime.apply import PolicyRuntime
from runtime.errors import AutotuneError
from runtime.policy import Action, Policy
from runtime.precision import TrainStep, active_precision, check_precision
from runtime.trace import capture
from tests.test_cli import run


def _mlp():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))
    return model, (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _saved(precision: str) -> dict[str, tuple[int, str]]:
    w = capture(_mlp, name="mlp", batch_size=4, precision=precision)
    assert w.precision == precision
    return {c.key: (c.nbytes, w.tensors[c.tensor].dtype) for c in w.candidates}


def test_fp32_mlp_saves_relu_and_log_softmax() -> None:
    # ReLU's output (4 x 32 x 4 B) for its own backward and the second Linear's weight gradient; the loss's
    # log-softmax (4 x 10 x 4 B); nll_loss's total weight (one float). The batch and the weights are not
    # candidates.
    assert _saved("fp32") == {
        "1#0.0:Relu": (512, "float32"),
        "<loss>#0.0:LogSoftmax": (160, "float32"),
        "<loss>#0.2:nograd": (4, "float32"),
    }


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", "bfloat16"), ("fp16", "float16")])
def test_autocast_mlp_saves_half_activations_and_the_casts(precision: str, dtype: str) -> None:
    # Under autocast the ReLU output is half as large (4 x 32 x 2 B), and two casts autocast inserts are
    # saved too: the batch cast for the first Linear's weight gradient (4 x 64 x 2 B; the batch itself is
    # not a candidate, its cast is made in forward) and the second Linear's weight cast for its input
    # gradient (10 x 32 x 2 B; the first Linear's is not saved: nothing needs the batch's gradient).
    # log_softmax runs in fp32 under autocast (its fp32 list).
    assert _saved(precision) == {
        "0#0.0:nograd": (512, dtype),
        "1#0.0:Relu": (256, dtype),
        "2#0.0:T": (640, dtype),
        "<loss>#0.0:LogSoftmax": (160, "float32"),
        "<loss>#0.2:nograd": (4, "float32"),
    }


def test_fp16_trace_counts_the_grad_scaler() -> None:
    w = capture(_mlp, name="mlp", batch_size=4, precision="fp16")
    # The scale (one float) is saved by the loss scaling: a known, ignored key, not a candidate.
    assert "<loss>#0.3:nograd" in w.meta["ignored_keys"]
    assert any(op.name == "aten._amp_foreach_non_finite_check_and_unscale_.default" for op in w.ops)


def test_unknown_precision_is_a_clear_error() -> None:
    assert check_precision(" BF16 ") == "bf16"
    with pytest.raises(AutotuneError, match=r"unknown precision 'fp8': expected one of fp32, bf16, fp16"):
        check_precision("fp8")


def test_policy_for_fp32_refuses_a_bf16_workload() -> None:
    fp32 = capture(_mlp, name="mlp", batch_size=4)
    bf16 = capture(_mlp, name="mlp", batch_size=4, precision="bf16")
    policy = Policy.uniform(fp32, Action.SWAP, hardware="cpu")
    assert policy.precision == "fp32"
    wanted = r"made for fp32 training but the workload trains in bf16.*--precision bf16"
    with pytest.raises(AutotuneError, match=wanted):
        policy.check_against(bf16)


@pytest.mark.parametrize("action", [Action.KEEP, Action.SWAP])
def test_runtime_refuses_a_forward_in_another_precision(action: Action) -> None:
    """Even an all-keep policy (which installs no saved-tensor hooks) checks the precision of the forward."""
    policy = Policy.uniform(capture(_mlp, name="mlp", batch_size=4), action, hardware="cpu")
    model, batch, loss_fn = _mlp()
    rt = PolicyRuntime(policy, model)
    with pytest.raises(AutotuneError, match=r"made for fp32 training but this forward runs in bf16"), rt.step():
        TrainStep("bf16").loss(model, batch, loss_fn)
    with rt.step():  # the check left nothing behind: the same runtime trains in fp32
        TrainStep("fp32").backward(TrainStep("fp32").loss(model, batch, loss_fn))
    assert active_precision("cpu") == "fp32"


def test_cli_search_bf16_then_train_in_fp32_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["search", "--model", "resnet18", "--batch-size", "2", "--budget", "200MB", "--gpu", "a100-40gb"]
    args += ["--reserve", "0"]
    code, stdout, err = run(
        capsys,
        *args,
        "--precision",
        "bf16",
        "--trials",
        "5",
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        "--out",
        str(out),
        "--json",
    )
    assert code == 0, err
    assert json.loads(out.read_text())["precision"] == "bf16" == json.loads(stdout)["precision"]
    code, _, err = run(capsys, "train", "--policy", str(out), "--precision", "fp32", "--steps", "1")
    assert code == 2
    assert "made for bf16 training but the workload trains in fp32" in err


class _Fp32Inside(torch.nn.Module):
    """A block computed in fp32 with autocast turned off inside the forward (a numerically sensitive part):
    its matmul runs on fp32 tensors although autocast lists it for bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 8)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = torch.tanh(h.float() @ self.w)
        return self.b(h)


def _fp32_inside():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return _Fp32Inside(), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1])


def test_a_replay_runs_its_ops_as_the_forward_did_when_backward_runs_under_autocast() -> None:
    """R6: a replay re-runs the recorded aten ops, which autocast had already cast: run under an autocast
    still on in backward (``with torch.autocast(...): loss.backward()`` inside it, a common form), autocast
    cast the fp32 matmul's inputs to bf16 again, and the gradients differed (GPT-2 under a QA run: the CPU's
    math attention upcasts to fp32, by 0.047). Replays now run with autocast off: bit for bit plain
    training's, over steps."""
    w = capture(_fp32_inside, name="fp32-inside", batch_size=8, precision="bf16")
    policy = Policy.uniform(w, Action.RECOMPUTE, hardware="cpu")

    def run(with_policy: bool) -> list[torch.Tensor]:
        model, batch, loss_fn = _fp32_inside()
        rt = PolicyRuntime(policy, model) if with_policy else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16), rt.step() if rt else contextlib.nullcontext():
                loss_fn(model, batch).backward()
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
        if rt is not None:
            assert rt.stats.recomputed_ops > 0
        return grads

    plain, ours = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))


def test_steps_settle_with_backward_under_autocast() -> None:
    """R11 with ``torch.autocast`` around forward and backward: its cache of the weights' casts lived through
    backward, so a recomputed cast was still alive at its unpack and never replayed while a step learnt;
    later steps did not record where it is made, and every other step warned, kept its tensors (22 swaps of
    34 on resnet18 under a QA run) and learnt again. The runtime lets go of the cache when backward starts,
    as an autocast around the forward alone does: every step after the first applies the plan, with no
    warning, and gradients stay plain training's."""
    import warnings

    import numpy as np

    from autotune.models import build_model

    def build():  # type: ignore[no-untyped-def]
        e = build_model("resnet18", batch_size=2, image_size=32)
        return e.module, e.batch, e.loss_fn

    w = capture(build, name="resnet18", batch_size=2, precision="bf16")
    vec = np.random.default_rng(1).integers(0, 3, len(w.candidates)).astype(np.int8)
    policy = Policy.from_vector(w, vec, hardware="cpu", precision="bf16")

    def run(with_policy: bool) -> tuple[list[torch.Tensor], list[int]]:
        model, batch, loss_fn = build()
        rt = PolicyRuntime(policy, model) if with_policy else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, handled = [], []
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16), rt.step() if rt else contextlib.nullcontext() as st:
                loss_fn(model, batch).backward()
            grads += [p.grad.clone() for p in model.parameters()]
            handled.append(st.swaps + st.recomputed_ops if st is not None else 0)
            opt.step()
        return grads, handled

    plain, _ = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours, handled = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert handled[1] > 0 and handled[1] == handled[2] == handled[3]


class _MLPBlock(torch.nn.Module):
    """An embedding, an MLP (``mlp``: up, SiLU, down) and a wide head, as a decoder layer's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(16, 64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
        self.head = torch.nn.Linear(64, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.emb(x)))


def _mlp_region(make: type[_MLPBlock], name: str, precision: str = "bf16"):  # type: ignore[no-untyped-def]
    """``make``'s build (a batch of 32, 512 classes), its real-mode trace under ``precision`` and the action codes that
    recompute what its ``mlp`` call makes (a region)."""
    import numpy as np

    from runtime.vocab import KEEP, RECOMPUTE

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(32, 16), torch.randint(0, 512, (32,))
        return make(), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    w = capture(build, name=name, batch_size=32, precision=precision, fake=False)
    inside = [c.key.startswith("mlp") and w.ops[c.producer].module.startswith("mlp") for c in w.candidates]
    return build, w, np.array([RECOMPUTE if i else KEEP for i in inside], np.int8)


@pytest.mark.parametrize("nodes", [False, True], ids=["checkpoint", "node"])
def test_a_node_region_lets_its_weights_casts_go_as_the_runtime_does(nodes: bool) -> None:
    """Simulator Rule 11 as one node under autocast: the node runs the call's forward with autocast's cache off,
    so the casts of the MLP's weights go after their product, where the trace's cache held them to the end of
    forward. Both simulators held them (a QA run: 18,747,928 bytes planned against 18,419,736 measured on a tiny
    Llama in bf16, its MLP one node; under checkpoint exact). Now to the byte both ways."""
    from envs.simulator import Simulator
    from envs.simulator_reference import simulate_reference
    from runtime.hardware import get_profile
    from runtime.measure import run_iterations
    from runtime.policy import PolicyOptions
    from runtime.trace import make_optimizer

    build, w, vec = _mlp_region(_MLPBlock, "mlp-block")
    policy = Policy.from_vector(w, vec, hardware="cpu", precision="bf16", options=PolicyOptions(region_nodes=nodes))
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["mlp"]
    hw = get_profile("cpu")
    planned = Simulator(w, hw).run(policy).peak_bytes
    assert simulate_reference(w, hw, vec, options=policy.options).peak_bytes == planned
    model, batch, loss_fn = build()
    opt = make_optimizer("sgd", model.parameters())
    measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=32, precision="bf16",
                              around_step=PolicyRuntime(policy, model).step)  # fmt: skip
    assert [m.peak_bytes for m in measured] == [planned] * 2


class _MLPView(torch.nn.Module):
    """An MLP on a 3-D input (so its output is a view of the last product) whose output only a sum reads, which
    saves nothing: the view is gone before the forward ends; ``inplace`` writes it in place after the call."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.emb = torch.nn.Linear(16, 64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
        self.head = torch.nn.Linear(64, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        y = self.mlp(h)
        if self.inplace:
            y.mul_(0.5)
        return self.head(y + h)


@pytest.mark.parametrize("inplace", [False, True], ids=["read", "written"])
def test_a_node_whose_output_view_is_gone_runs_as_one(inplace: bool) -> None:
    """Runtime R10 (regions N4): a region's output view written in place after the call keeps the call under
    checkpoint. A view gone by the forward's end (a Linear's output on a 3-D input, read by a sum) counted as
    written, so such a call never ran as the node the plan had: under bf16 autocast the casts of its weights
    lived in autocast's cache to the end of the forward, 8,192 to 32,768 bytes over the plan on tiny BERT and
    Llama (a QA run). The graph now tells: the node runs from the second step, measured to the plan's byte; a
    view written in place stays under checkpoint (as a node, "Output 0 of _Region is a view and is being
    modified inplace"), and trains as plain training does."""
    import numpy as np

    from envs.simulator import Simulator
    from runtime.hardware import get_profile
    from runtime.measure import run_iterations
    from runtime.policy import PolicyOptions
    from runtime.trace import make_optimizer
    from runtime.vocab import KEEP, RECOMPUTE
    from tests.steps import same_bits, train_steps

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(4, 8, 16), torch.randint(0, 512, (4, 8))
        loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())  # noqa: E731
        return _MLPView(inplace), (x, y), loss

    w = capture(build, name="mlp-view", batch_size=4, precision="bf16", fake=False)
    assert [f.view_out for f in w.frames if f.path == "mlp"] == [True]
    inside = [c.key.startswith("mlp") and w.ops[c.producer].module.startswith("mlp") for c in w.candidates]
    vec = np.array([RECOMPUTE if i else KEEP for i in inside], np.int8)  # what the call makes: a region
    if not inplace:
        policy = Policy.from_vector(w, vec, hardware="cpu", precision="bf16", options=PolicyOptions(region_nodes=True))
        assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["mlp"]
        planned = Simulator(w, get_profile("cpu")).run(policy).peak_bytes
        model, batch, loss_fn = build()
        runtime = PolicyRuntime(policy, model)
        measured = run_iterations(model, batch, loss_fn, make_optimizer("sgd", model.parameters()), steps=2,
                                  batch_size=4, precision="bf16", around_step=runtime.step)  # fmt: skip
        assert runtime.stats.regions == 1 and runtime.stats.checkpointed == 0  # one node, in the last step
        assert [m.peak_bytes for m in measured] == [planned] * 2
        return
    # Written after the call: not a node region when planned (plan P10); one checkpointed, then run with nodes.
    assert Policy.from_vector(w, vec, hardware="cpu", precision="bf16").schedule.regions == []  # type: ignore[union-attr]
    policy = Policy.from_vector(w, vec, hardware="cpu", precision="bf16", options=PolicyOptions(region_nodes=False))
    assert [r.module for r in policy.schedule.regions] == ["mlp"]  # type: ignore[union-attr]
    policy.options = PolicyOptions(region_nodes=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = train_steps(build, policy, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = train_steps(build, None, 3)
    assert same_bits(got, plain)


def test_the_fp16_loss_lives_through_backward_beside_the_scaled_one() -> None:
    """The trace: under fp16 the loss as computed lives through backward, as the caller's ``loss`` does in
    ``scaler.scale(loss).backward()``; the trace had kept the scaled loss alone, and every fp16 plan was 4 bytes
    (one float32 scalar) under the measured peak where that peak is in backward (a QA run on tiny BERT and GPT-2)."""
    from envs.simulator import Simulator
    from runtime.hardware import get_profile
    from runtime.measure import run_iterations
    from runtime.trace import make_optimizer

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(32, 16), torch.randint(0, 512, (32,))
        return _MLPBlock(), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    w = capture(build, name="mlp-block", batch_size=32, precision="fp16", fake=False)
    policy = Policy.from_vector(w, [0] * len(w.candidates), hardware="cpu", precision="fp16")  # keep all
    planned = Simulator(w, get_profile("cpu")).run(policy)
    assert w.ops[planned.peak_op].phase.name == "BACKWARD"
    model, batch, loss_fn = build()
    opt = make_optimizer("sgd", model.parameters())
    step = PolicyRuntime(policy, model).step
    measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=32, precision="fp16", around_step=step)
    assert [m.peak_bytes for m in measured] == [planned.peak_bytes] * 2


class _WideProbe(_MLPBlock):
    """The MLP block with a statistic of a wide projection of the MLP's output, computed without grad: the peak is
    there, in the forward, after the MLP's call."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(64, 16384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(self.emb(x))
        with torch.no_grad():
            s = self.wide(y).float().abs().amax()
        return self.head(y) * (s / s)


def test_a_node_lets_the_casts_no_op_saves_go_after_their_product() -> None:
    """Simulator Rule 11 as one node under autocast: the node runs the call's forward with autocast's cache off, so
    the casts of its biases (which no op saves: a bias's gradient is a sum of the output's) go after their product
    too, where the trace's cache held them to the end of the forward. Both simulators held them: 640 bytes (two
    bf16 biases) over the measured peak here, 128 on a tiny BERT's attention output (a QA run). Now to the byte."""
    from envs.simulator import Simulator
    from envs.simulator_reference import simulate_reference
    from runtime.hardware import get_profile
    from runtime.measure import run_iterations
    from runtime.policy import PolicyOptions
    from runtime.trace import make_optimizer

    build, w, vec = _mlp_region(_WideProbe, "wide-probe")
    policy = Policy.from_vector(w, vec, hardware="cpu", precision="bf16", options=PolicyOptions(region_nodes=True))
    assert policy.schedule is not None and [r.module for r in policy.schedule.regions] == ["mlp"]
    hw = get_profile("cpu")
    planned = Simulator(w, hw).run(policy)
    (mlp,) = [f for f in w.frames if f.path == "mlp"]
    assert w.ops[planned.peak_op].phase.name == "FORWARD" and planned.peak_op > mlp.last_op  # after the call
    assert simulate_reference(w, hw, vec, options=policy.options).peak_bytes == planned.peak_bytes
    model, batch, loss_fn = build()
    opt = make_optimizer("sgd", model.parameters())
    step = PolicyRuntime(policy, model).step
    measured = run_iterations(model, batch, loss_fn, opt, steps=2, batch_size=32, precision="bf16", around_step=step)
    assert [m.peak_bytes for m in measured] == [planned.peak_bytes] * 2
