"""Tensor partition (runtime/partition.py, NOTE [ Partition ]; simulator Rule 14, runtime R13): a submodule
run on slices of the batch. Gradients bit-identical to plain training with the same partition under every
policy; off by rounding only from unpartitioned training, within the bound NOTE Q4 derives; the simulators
agree exactly on partitioned workloads; the measured CPU peak matches the plan; the floor goes down; and the
main flow from the CLI (search --allow-partition, simulate, train, policy.applied in a plain loop)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agents.base import Problem, SearchContext, get_searcher
from autotune.maxbatch import MaxBatch
from autotune.models import build_model
from autotune.partitions import choose
from envs.simulator import Simulator, peak_floor
from envs.simulator_reference import simulate_reference
from runtime.apply import PolicyRuntime
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.measure import run_iterations
from runtime.partition import Partition, partitioned
from runtime.policy import Policy, PolicyOptions, load_policy
from runtime.trace import capture, make_optimizer
from runtime.workload import Workload
from tests.test_apply import _check_done, _policies
from tests.test_cli import run, user_error
from tests.test_simulator import _assert_same

CNN = "experiments.user_models:groupnorm_cnn"  # GroupNorm: per sample, so its blocks can be partitioned


def _cnn(batch_size: int = 4, image_size: int = 32, norm: bool = False):  # type: ignore[no-untyped-def]
    """A VGG-like stack (``features``, no BatchNorm unless ``norm``) and a linear head."""

    def build():  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16) if norm else nn.Identity(),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        model = nn.Sequential()
        model.add_module("features", features)
        model.add_module("pool", nn.AdaptiveAvgPool2d(1))
        model.add_module("flat", nn.Flatten())
        model.add_module("head", nn.Linear(32, 10))
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        return model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1])

    return build


def _step(build, policy: Policy | None, parts: tuple[Partition, ...]):  # type: ignore[no-untyped-def]
    """One forward and backward: with the policy, or with the partition alone (no policy)."""
    model, batch, loss_fn = build()
    ctx = policy.applied(model) if policy is not None else partitioned(model, parts)
    with ctx as stats:
        loss = loss_fn(model, batch)
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], stats


@pytest.mark.parametrize("chunks", [2, 3])  # 3 slices of a batch of 4: 2, 1 and 1 samples
def test_gradients_bit_identical_to_the_same_partition_without_a_policy(chunks: int) -> None:
    build = _cnn()
    parts = (Partition("features", chunks),)
    w = capture(build, name="cnn", batch_size=4, partitions=parts)
    plain = capture(build, name="cnn", batch_size=4)
    # Each slice's saved tensors are candidates of their own, named by the slice's submodule calls.
    assert len(w.candidates) > len(plain.candidates)
    assert any(c.key.startswith("features.2#1.") for c in w.candidates)  # the second slice's first ReLU
    assert w.fingerprint != plain.fingerprint and w.meta["partitions"] == [{"module": "features", "chunks": chunks}]
    ref_loss, ref_grads, _ = _step(build, None, parts)
    for label, vec in _policies(w).items():
        policy = Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(allow_partition=True))
        assert policy.partitions == parts
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every saved tensor known by key
            loss, grads, stats = _step(build, policy, ())
        assert torch.equal(loss, ref_loss), label
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), label
        _check_done(w, vec, stats, label)


def _products(build) -> dict[str, tuple[torch.Tensor, int]]:  # type: ignore[no-untyped-def]
    """For each convolution's weight: sum over the batch (and positions) of |input| x |output gradient|,
    in float64, and how many products that is: NOTE [ Partition ] Q4's sum of |x_b|."""
    model, (x, y), loss_fn = build()
    model = model.double()
    for m in model.modules():  # the same values; the backward hooks below refuse in-place ops on outputs
        if isinstance(m, nn.ReLU):
            m.inplace = False
    seen: dict[str, list[torch.Tensor]] = {}
    convs = {name: m for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    for name, m in convs.items():
        m.register_forward_hook(lambda mod, i, o, name=name: seen.setdefault(name, []).append(i[0].detach()))
        m.register_full_backward_hook(lambda mod, gi, go, name=name: seen[name].append(go[0].detach()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first convolution's input needs no gradient: said, and fine here
        loss_fn(model, (x.double(), y)).backward()
    out = {}
    for name, m in convs.items():
        inp, grad_out = seen[name]
        sums = torch.nn.grad.conv2d_weight(inp.abs(), m.weight.shape, grad_out.abs(), padding=m.padding)
        out[name] = (sums, grad_out.shape[0] * grad_out.shape[2] * grad_out.shape[3])  # batch x positions
    return out


def test_gradients_differ_from_unpartitioned_training_by_rounding_only() -> None:
    """Q4: per convolution weight, |g_partitioned - g| <= 2 gamma(n) sum |x_b| with n the products summed
    (batch x positions), u = 2^-24 (float32). A partition that changed what is computed (a slice dropped,
    statistics over a slice) would be off by the gradient's own size."""
    build = _cnn(batch_size=8)
    parts = (Partition("features", 4),)
    _, plain_grads, _ = _step(build, None, ())
    _, part_grads, _ = _step(build, None, parts)
    model, _, _ = build()
    grads = dict(zip([n for n, _ in model.named_parameters()], zip(plain_grads, part_grads, strict=True), strict=True))
    u = 2.0**-24
    differs = 0
    for name, (sums, n) in _products(build).items():
        a, b = grads[f"{name}.weight"]
        gamma = n * u / (1 - n * u)
        diff = (a.double() - b.double()).abs()
        assert torch.all(diff <= 2 * gamma * sums), (name, float((diff / (2 * gamma * sums)).max()))
        differs += int(not torch.equal(a, b))
    assert differs > 0  # the summation order did change: this is not bit-identity by accident
    # And the samples are the samples: the loss (a mean over per-sample losses of identical logits) agrees.
    model, batch, _ = build()
    with torch.no_grad(), partitioned(model, parts):
        sliced = model(batch[0])
    assert torch.allclose(sliced, model(batch[0]).detach(), rtol=0, atol=1e-5)


def test_batch_norm_and_bad_partitions_are_refused() -> None:
    model, _, _ = _cnn(norm=True)()
    refused = {
        r"features.*BatchNorm in training mode": (Partition("features", 2),),
        r"no such submodule; name one as in `model.named_modules\(\)` \(its own with submodules: 'features'": (
            Partition("stem", 2),
        ),
        r"cannot nest": (Partition("features", 2), Partition("features.0", 2)),
        r"partition a submodule": (Partition("", 2),),
    }
    for match, parts in refused.items():
        with pytest.raises(AutotuneError, match=match), partitioned(model, parts):
            pass
    with pytest.raises(AutotuneError, match=r"at least 2"):
        Partition("features", 1)
    model, (x, _), _ = _cnn(batch_size=2, norm=False)()
    with (
        pytest.raises(AutotuneError, match=r"batch has 2 samples; use at most 2"),
        partitioned(model, (Partition("features", 4),)),
    ):
        model(x)
    assert "forward" not in model.features.__dict__  # restored on the way out


def test_policy_file_needs_consent_and_a_matching_trace(tmp_path: Path) -> None:
    build = _cnn()
    parts = (Partition("features", 2),)
    w = capture(build, name="cnn", batch_size=4, partitions=parts)
    policy = Policy.from_vector(w, _policies(w)["mixed-1"], hardware="cpu", options=PolicyOptions(allow_partition=True))
    policy.save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["partitions"] == [{"module": "features", "chunks": 2}] and d["options"]["allow_partition"] is True
    assert load_policy(tmp_path / "p.json").partitions == parts
    d["options"]["allow_partition"] = False
    (tmp_path / "q.json").write_text(json.dumps(d))
    with pytest.raises(AutotuneError, match=r"allow_partition is false but the policy partitions features/2"):
        load_policy(tmp_path / "q.json")
    with pytest.raises(AutotuneError, match=r"with partitions features/2 but the workload was traced with no part"):
        policy.check_against(capture(build, name="cnn", batch_size=4))
    plain = capture(build, name="cnn", batch_size=4)
    assert "partitions" not in Policy.from_vector(plain, _policies(plain)["keep"], hardware="cpu").to_dict()


@pytest.mark.parametrize("profile", ["a100-40gb", "cpu"])
def test_simulators_agree_on_a_partitioned_workload(profile: str) -> None:
    """Rule 14: nothing new to simulate, so the vectorised simulator equals the op-by-op reference."""
    w = capture(_cnn(batch_size=6), name="cnn", batch_size=6, partitions=(Partition("features", 3),))
    hw = get_profile(profile)
    sim = Simulator(w, hw)
    rng = np.random.default_rng(1)
    for _ in range(25):
        acts = rng.integers(0, 3, len(w.candidates)).astype(np.int8)
        opts = PolicyOptions(prefetch_lookahead=int(rng.integers(0, 4)), release_after=int(rng.integers(1, 6)))
        _assert_same(sim.run(acts, options=opts), simulate_reference(w, hw, acts, options=opts))


@pytest.mark.slow
def test_floor_drops_and_a_searched_policy_runs_at_its_plan() -> None:
    """On this CPU (real-mode traces, the calibrated cpu profile): slicing the features in 4 lowers the floor
    below the unpartitioned one; a policy searched for a budget between the two fits there, and training
    under it measures the planned peak within 3% (the storage tracker, swapped bytes counted: on the CPU the
    host store is the same memory)."""
    batch, build, hw = 8, _cnn(batch_size=8, image_size=64), get_profile("cpu")
    parts = (Partition("features", 4),)
    plain = capture(build, name="cnn", batch_size=batch, fake=False)
    w = capture(build, name="cnn", batch_size=batch, fake=False, partitions=parts)
    base, floor = peak_floor(plain, hw).bytes, peak_floor(w, hw).bytes
    assert floor < 0.6 * base, (floor, base)
    budget = (floor + base) // 2  # below anything the unpartitioned model can reach
    problem = Problem(w, hw, budget, options=PolicyOptions(allow_partition=True))
    found = get_searcher("portfolio").search(problem, SearchContext(time_limit_s=6))
    assert found.feasible and found.result.peak_bytes <= budget
    policy = found.policy
    assert policy.partitions == parts
    model, data, loss_fn = build()
    opt = make_optimizer("sgd", model.parameters())
    rt = PolicyRuntime(policy, model)
    measured = run_iterations(model, data, loss_fn, opt, steps=1, batch_size=batch, around_step=rt.step)[0].peak_bytes
    planned = Simulator(w, hw).run(policy).peak_bytes
    assert abs(measured - planned) <= 0.03 * planned, (measured, planned)
    assert measured < base


@pytest.mark.slow
def test_search_simulate_train_applied_with_partition_from_the_cli(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The main flow, as a user types it, at a budget below the unpartitioned floor: refused (exit 2, with the
    hint) without --allow-partition; with it the search partitions a stage, and simulate, train and a plain
    loop under policy.applied follow the file."""
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "cpu", "--json")
    assert code == 0, err
    budget = str(int(json.loads(out)["peak_bytes"] * 0.5))
    path, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    line = user_error(capsys, "search", "--model", CNN, "--budget", budget, "--gpu", "cpu", "--out", str(path))
    assert "--allow-partition" in line
    code, stdout, err = run(capsys, "search", "--model", CNN, "--budget", budget, "--gpu", "cpu", "--timeout", "8",
                            "--allow-partition", "--out", str(path), "--storage", store, "--json")  # fmt: skip
    assert code == 0, err
    assert "partition: blocks/" in err
    found = json.loads(stdout)
    assert found["feasible"] and found["written"] and found["peak_bytes"] <= int(budget)
    policy = load_policy(path)
    assert policy.partitions and policy.options.allow_partition
    code, stdout, err = run(capsys, "simulate", "--policy", str(path), "--json")
    assert code == 0, err
    simulated = json.loads(stdout)
    assert simulated["peak_bytes"] == found["peak_bytes"]  # traced again with the file's partition
    # No policy is the model without slices in both (simulate's had been the sliced one's, all kept).
    assert simulated["no_policy"]["peak_bytes"] == found["no_policy_peak_bytes"]
    code, stdout, err = run(capsys, "train", "--policy", str(path), "--steps", "1", "--json")
    assert code == 0, err
    trained = json.loads(stdout)
    assert trained["unknown_keys"] == [] and trained["out_of_memory"] is None
    peak, planned = trained["measured"]["peak_bytes"], trained["predicted"]["peak_bytes"]
    assert abs(peak - planned) <= 0.03 * planned, (peak, planned)
    # A plain loop: the losses of two SGD steps under policy.applied equal those of the same partition alone.
    losses: dict[bool, list[float]] = {False: [], True: []}
    for use in (False, True):
        entry = build_model(CNN)
        opt = torch.optim.SGD(entry.module.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            ctx = policy.applied(entry.module) if use else partitioned(entry.module, policy.partitions)
            with ctx:
                loss = entry.loss_fn(entry.module, entry.batch)
                loss.backward()
            opt.step()
            losses[use].append(loss.item())
    assert losses[True] == losses[False]


@pytest.mark.slow
def test_measured_search_trains_the_chosen_partition(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """search --allow-partition --measure on the CPU, below the unpartitioned floor: the partition is chosen
    on real-mode traces of the backend that trains the finalists, so they train with the slices searched;
    the answer is a measured one that fits, and its file partitions."""
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "cpu", "--json")
    assert code == 0, err
    budget = int(json.loads(out)["peak_bytes"] * 0.5)
    path, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    code, stdout, err = run(capsys, "search", "--model", CNN, "--budget", str(budget), "--gpu", "cpu", "--timeout",
                            "3", "--allow-partition", "--measure", "1", "--out", str(path), "--storage", store,
                            "--json")  # fmt: skip
    assert code == 0, err
    assert "partition: blocks/" in err
    got = json.loads(stdout)
    rows = got["finalists"]["finalists"]
    assert rows and got["finalists"]["chosen"] is not None
    chosen = rows[got["finalists"]["chosen"]]
    assert chosen["fits"] and chosen["measured"]["peak_bytes"] <= budget
    assert got["measured"]["peak_bytes"] == chosen["measured"]["peak_bytes"]
    policy = load_policy(path)
    assert policy.partitions and policy.options.allow_partition
    assert json.loads(path.read_text())["measured"]["peak_bytes"] == got["measured"]["peak_bytes"]


def test_the_search_chooses_which_call_to_slice(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """NOTE [ Choosing a partition ] C4: the rule's choice (the outermost call, the fewest slices a frugal
    policy fits in: ``blocks/2``) and the inner candidate's (``blocks.0/4``, the first block alone) are both
    searched, and the faster answer is the search's. From the command line the rule alone answered 7,421.4
    samples/s here, the first block on 4 slices 9,073.4 (a 20 s search; the simulator's figures on a fake
    trace); in 6 s as the tests plan, without cuBLAS's workspaces (tests/conftest.py), 9,113.4 and 10,020.5."""
    path, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    code, out, err = run(capsys, "search", "--model", CNN, "--batch-size", "64", "--gpu", "a100-40gb", "--budget",
                         "350MiB", "--allow-partition", "--timeout", "6", "--out", str(path), "--storage", store,
                         "--json", "--budget-kind", "allocated")  # fmt: skip
    assert code == 0, err
    assert "partition: blocks/2 " in err and "searching 2 partitions in turn (blocks/2, blocks.0/4)" in err
    found = json.loads(out)
    answers = {tuple((p["module"], p["chunks"]) for p in s["partitions"]): s for s in found["partitions_searched"]}
    assert list(answers) == [(("blocks", 2),), (("blocks.0", 4),)]
    rule, inner = answers[(("blocks", 2),)], answers[(("blocks.0", 4),)]
    assert rule["feasible"] and inner["feasible"] and rule["study_name"] != inner["study_name"]
    assert inner["samples_per_s"] > rule["samples_per_s"], answers
    assert f"blocks.0/4: {inner['samples_per_s']:,.1f} samples/s (fits)" in err
    assert found["feasible"] and found["samples_per_s"] == inner["samples_per_s"]
    assert load_policy(path).partitions == (Partition("blocks.0", 4),)


@pytest.mark.slow
def test_sweep_partitions_the_cells_below_the_floor(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """sweep --allow-partition: the cell below the unpartitioned floor gets slices and a study of its own, its
    no-policy row the unpartitioned model's; the cell above it is searched as before; one just above the floor,
    where C1 chooses slices, is searched with and without them, each in a study of its own, and answers the
    faster, as search does (the sweep searched the slices alone: slower than search's answer without them, a
    QA run); the partitioned cell's policy file partitions with consent, and the report draws both."""
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "cpu", "--json")
    assert code == 0, err
    peak, floor = json.loads(out)["peak_bytes"], json.loads(out)["floor"]["bytes"]
    low, high = int(peak * 0.5), int(peak * 0.95)
    near = int(floor * 1.05)
    assert low < floor < near < high
    store, folder, report = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "sweep", tmp_path / "r.html"
    args = ["sweep", "--models", CNN, "--gpu", "cpu", "--budgets", f"{low},{high}", "--methods", "baselines,optuna",
            "--trials", "4", "--timeout", "5", "--storage", store, "--out-dir", str(folder), "--json"]  # fmt: skip
    code, out, err = run(capsys, *args)
    assert code == 0, err
    below, above = json.loads(out)["cells"]
    assert below["below_floor"] and below["samples_per_s"] is None and not below["partitions"]
    code, out, err = run(capsys, *args, "--allow-partition", "--report", str(report))
    assert code == 0, err
    below, above2 = json.loads(out)["cells"]
    assert below["partitions"] and below["partitions"][0]["module"].startswith("blocks")
    code, out, err = run(capsys, *args[:6], str(near), *args[7:], "--allow-partition")
    assert code == 0, err
    (just_above,) = json.loads(out)["cells"]
    import optuna

    names = [n for n in optuna.get_all_study_names(store) if n.endswith(f".{near}")]
    assert len(names) == 2 and f"sweep.{CNN}.b8.cpu.{near}" in names
    best = [optuna.load_study(study_name=n, storage=store).user_attrs.get("best") for n in names]
    assert just_above["samples_per_s"] == max(b["samples_per_s"] for b in best if b is not None)
    assert not below["below_floor"] and below["samples_per_s"] and below["peak_bytes"] <= low
    assert below["study"] != f"sweep.{CNN}.b8.cpu.{low}" and below["no_policy_peak_bytes"] == peak
    assert not above2["partitions"] and above2["study"] == above["study"]  # resumed, as before
    (sliced,) = [p for p in folder.glob("*.policy.json") if f".{low}." in p.name]
    policy = load_policy(sliced)
    assert policy.partitions and policy.options.allow_partition
    assert "no policy" in report.read_text()
    sliced_as = f"{below['partitions'][0]['module']}/{below['partitions'][0]['chunks']}"
    assert f"on {sliced_as}" in report.read_text()  # the summary says which cell ran on slices (it did not)


@pytest.mark.slow
def test_maxbatch_with_partition_trains_larger_batches() -> None:
    """maxbatch --allow-partition's search (autotune/maxbatch.py with autotune/partitions.py) on the small CNN
    within 8 MiB on a100-40gb: without partition the floor stops it, with it each size is traced sliced where
    its budget is below that floor, and the largest batch grows; no policy is the unpartitioned model's."""
    hw, planned = get_profile("a100-40gb"), 8 << 20

    def trace(b: int, parts: tuple[Partition, ...] = ()) -> Workload:
        return capture(_cnn(batch_size=b, image_size=32), name="cnn", batch_size=b, partitions=parts)

    def partition(w: Workload) -> Workload:
        return choose(w, hw, planned, lambda ps: trace(w.batch_size, ps), others=False).workload

    plain = MaxBatch(trace, hw, planned, per_size_s=0.5, max_slowdown=None).run(8)
    sliced = MaxBatch(trace, hw, planned, per_size_s=0.5, max_slowdown=None, partition=partition).run(8)
    assert sliced.max_batch_no_policy == plain.max_batch_no_policy
    assert sliced.max_batch > 2 * plain.max_batch, (sliced.max_batch, plain.max_batch)
    best = {r.batch_size: r for r in sliced.tried}[sliced.max_batch]
    assert best.found is not None and best.found.policy.partitions and best.found.result.peak_bytes <= planned
    assert peak_floor(trace(plain.max_batch + 1), hw).bytes > planned  # the floor, not the search, stopped it


def test_baselines_compare_on_the_chosen_partition(capsys: pytest.CaptureFixture[str]) -> None:
    """autotune baselines --allow-partition: below the unpartitioned floor the methods run on the chosen slices
    (said on stderr); the same budget without it is refused before any method runs (exit 2)."""
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "a100-40gb", "--json")
    assert code == 0, err
    budget = str(int(json.loads(out)["peak_bytes"] * 0.5) + (128 << 20))  # half the peak, planned
    args = ("baselines", "--model", CNN, "--gpu", "a100-40gb", "--budget", budget, "--only", "megtaichi,dtr")
    assert "--allow-partition" in user_error(capsys, *args)
    code, out, err = run(capsys, *args, "--allow-partition", "--json")
    assert code == 0, err
    assert "partition: blocks/" in err
    answer = json.loads(out)
    assert {row["method"] for row in answer["methods"]} == {"megtaichi", "dtr"}
    assert [p["module"] for p in answer["partitions"]] == ["blocks"]


def test_the_floor_error_suggests_partition_only_where_it_was_not_asked_for() -> None:
    """Below the floor, the error suggests --allow-partition where a partitionable submodule runs the floor's
    op; with --allow-partition given (and no slices that lower the floor: the unpartitioned model planned)
    it said the same, suggesting what the user had just passed (a QA run)."""
    from autotune.budget import budget_of
    from autotune.search import planned_problem
    from autotune.workloads import TraceRequest, trace_model

    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model=CNN, batch_size=8, target=hw))
    plan = budget_of(2_000_000, "0", hw)
    with pytest.raises(AutotuneError, match=r"\(--allow-partition\)"):
        planned_problem(w, hw, plan, allow_compress=False)
    with pytest.raises(AutotuneError) as e:
        planned_problem(w, hw, plan, allow_compress=False, partitioning=True)
    assert "no policy can meet it" in str(e.value) and "--allow-partition" not in str(e.value)


def test_baselines_on_slices_count_their_slowdown_from_the_model_without_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``baselines --partition``: every method runs on the sliced model, and its slowdown is against no policy
    on the model without slices, as search's is; it was against keeping everything on slices, so the slices'
    own cost showed nowhere ("none" +0.0%, a QA run)."""
    from autotune.workloads import TraceRequest, trace_model

    hw = get_profile("a100-40gb")
    code, stdout, err = run(capsys, "baselines", "--model", CNN, "--budget", "10GB", "--gpu", "a100-40gb",
                            "--partition", "blocks/4", "--only", "none", "--json")  # fmt: skip
    assert code == 0, err
    answer = json.loads(stdout)
    (none,) = answer["methods"]
    plain = trace_model(TraceRequest(model=CNN, target=hw))[0]
    sliced = trace_model(TraceRequest(model=CNN, target=hw, partitions=(Partition("blocks", 4),)))[0]
    keep_sliced, no_policy = Simulator(sliced, hw).no_policy(), Simulator(plain, hw).no_policy()
    assert none["samples_per_s"] == pytest.approx(keep_sliced.samples_per_s, rel=1e-12)
    assert none["slowdown"] == pytest.approx(no_policy.samples_per_s / keep_sliced.samples_per_s - 1, rel=1e-9)
    assert none["slowdown"] > 0.01  # four slices of each block cost time on the GPU's profile
    assert answer["no_policy_samples_per_s"] == pytest.approx(no_policy.samples_per_s, rel=1e-12)  # no slices


@pytest.mark.slow
def test_a_search_on_slices_timed_apart_from_no_policy_says_so_where_it_plans_faster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On this CPU the model with slices and without them are two real-mode traces, timed apart: on a busy
    machine the answer printed a slowdown of -90% against no policy, without a word (a QA run). A policy only
    adds work to its model, so an answer on slices more than 5% faster than no policy says the times varied."""
    import dataclasses

    import autotune.workloads as wl

    trace_model = wl.trace_model

    def busy_without_slices(req):  # type: ignore[no-untyped-def]
        w, s = trace_model(req)
        if req.partitions or w.mode != "real":
            return w, s
        # Op times add up to the plain iterations timed beside them (NOTE [ Op time calibration ]).
        return dataclasses.replace(w, meta={**w.meta, "plain_iter_s": 20 * w.meta["plain_iter_s"]}), s

    monkeypatch.setattr(wl, "trace_model", busy_without_slices)
    code, out, err = run(capsys, "profile", "--model", CNN, "--gpu", "cpu", "--json")
    assert code == 0, err
    budget = str(int(json.loads(out)["peak_bytes"] * 0.5))
    code, out, err = run(capsys, "search", "--model", CNN, "--budget", budget, "--gpu", "cpu", "--timeout", "4",
                         "--allow-partition", "--out", str(tmp_path / "p.json"),
                         "--storage", f"sqlite:///{tmp_path / 's.db'}")  # fmt: skip
    assert code == 0, err
    assert "faster than no policy without them: the two models were traced apart" in err


# -- NOTE [ Choosing a partition ] C5: searchers that choose the partition among their own decisions -------------
@pytest.fixture(scope="module")
def family() -> list[Problem]:
    """The GroupNorm CNN at batch 64 on a100-40gb within 222 MiB (what `search --budget 350MiB` plans for there),
    unpartitioned and on the two partitions C3 finds (``blocks/2``, ``blocks.0/4``), fake traces. The
    unpartitioned floor (282.75 MiB) is above the budget, the partitions' (186.95 and 194.82) below it."""
    from autotune.workloads import TraceRequest, trace_model

    hw = get_profile("a100-40gb")
    req = TraceRequest(model=CNN, batch_size=64, target=hw)
    parts = [(), (Partition("blocks", 2),), (Partition("blocks.0", 4),)]
    budget = 222 * 2**20
    return [Problem(trace_model(dataclasses.replace(req, partitions=p))[0], hw, budget) for p in parts]


def _with_rivals(members: list[Problem]) -> Problem:
    return dataclasses.replace(members[0], rivals=tuple(members[1:]))


def test_the_rl_environments_first_action_chooses_the_partition(family: list[Problem]) -> None:
    """PartitionChoiceEnv: the first action's mask holds the partitions whose floor is within the budget (not the
    unpartitioned model's: nothing of it fits), an illegal choice takes the first legal one, and the episode
    then decides that partition's candidates; its reward is relative to the fastest keep-all of the three."""
    from gymnasium.utils.env_checker import check_env

    from envs.memory_env import PartitionChoiceEnv

    assert [peak_floor(p.workload, p.hardware).bytes <= p.budget_bytes for p in family] == [False, True, True]
    env = PartitionChoiceEnv(family)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert not obs.any() and info["action_mask"].tolist() == [False, True, True, False]
    obs, reward, done, _, info = env.step(0)  # the unpartitioned model: not legal
    assert (info["applied_action"], info["rival"], reward, done) == (1, 0, 0.0, False)
    env.reset()
    obs, reward, done, _, info = env.step(2)  # blocks.0/4
    assert (info["applied_action"], info["rival"], done) == (2, 1, False)
    steps = 0
    while not done:
        obs, reward, done, _, info = env.step(1)  # swap everything: 218.96 MiB there
        steps += 1
    assert steps == family[2].n and info["rival"] == 1 and info["feasible"]
    fastest = max(Simulator(p.workload, p.hardware).no_policy().samples_per_s for p in family)
    assert reward == pytest.approx(info["samples_per_s"] / fastest) and reward < 1
    assert env.best is not None and env.best_rival == 1


@pytest.mark.parametrize("name", ["optuna-tpe", "ppo", "refine"])
def test_a_searcher_that_chooses_the_partition_answers_for_one_that_fits(family: list[Problem], name: str) -> None:
    """Optuna's ``partition`` parameter, the RL agent's first action and refinement's move to another partition:
    the answer is for a partition (the unpartitioned model cannot fit), its policy names it, and simulated again
    on that partition's model it gives the searcher's result (the contract)."""
    main = _with_rivals(family)
    r = get_searcher(name).search(main, SearchContext(time_limit_s=20, trials=30 if name != "ppo" else 4, seed=0))
    assert r.rival in (0, 1) and r.feasible, (r.rival, r.result)
    member = main.member(r.rival)
    assert r.policy.partitions == tuple(Partition.from_dict(p) for p in member.workload.meta["partitions"])
    assert member.evaluate(r.policy.to_vector(member.workload), r.policy.options) == r.result


def test_optuna_chooses_the_partition_as_one_of_its_parameters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """C5 from the command line: `--searcher optuna-tpe` searches both partitions in one study whose trials draw a
    ``partition`` parameter (before: each partition in turn, a study each, the fastest answer taken); the answer
    names the partition chosen, and its policy file slices that call."""
    import optuna

    path, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    code, out, err = run(capsys, "search", "--model", CNN, "--batch-size", "64", "--gpu", "a100-40gb", "--budget",
                         "350MiB", "--allow-partition", "--searcher", "optuna-tpe", "--trials", "40", "--timeout", "60",
                         "--out", str(path), "--storage", store, "--json", "--budget-kind", "allocated")  # fmt: skip
    assert code == 0, err
    assert "searching 2 partitions together (blocks/2, blocks.0/4): optuna-tpe chooses the partition among its" in err
    found = json.loads(out)
    (entry,) = found["partitions_searched"]
    assert entry["chosen_among"] == [[{"module": "blocks", "chunks": 2}], [{"module": "blocks.0", "chunks": 4}]]
    trials = optuna.load_study(study_name=entry["study_name"], storage=store).trials
    assert len(trials) == 40 and {t.params["partition"] for t in trials} == {"blocks/2", "blocks.0/4"}
    chosen = tuple(Partition.from_dict(p) for p in entry["partitions"])
    assert found["feasible"] and load_policy(path).partitions == chosen
    assert f"(optuna-tpe's choice of 2): {found['samples_per_s']:,.1f} samples/s (fits)" in err


def test_a_studys_name_resumes_the_search_that_chose_among_partitions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The name a C5 search's study got (what an interrupted search says to resume with) resumes it when passed
    as --study (before, it was suffixed again, ``.partitions.partitions``: a new study, nothing resumed)."""
    path, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    args = ["search", "--model", CNN, "--batch-size", "64", "--gpu", "a100-40gb", "--budget", "350MiB",
            "--allow-partition", "--searcher", "optuna-tpe", "--timeout", "60", "--out", str(path), "--storage", store,
            "--json", "--budget-kind", "allocated"]  # fmt: skip
    code, out, err = run(capsys, *args, "--trials", "6")
    assert code == 0, err
    name = json.loads(out)["study_name"]
    assert name.endswith(".optuna-tpe.partitions")
    code, out, err = run(capsys, *args, "--trials", "10", "--study", name)
    assert code == 0, err
    assert f"resuming study {name} in {store}: 6 trials found, running up to 4 more" in err
    assert json.loads(out)["study_name"] == name
