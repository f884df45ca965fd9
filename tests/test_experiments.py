"""The headline experiments' shared arithmetic (budgets as a share of the activations, Pareto fronts) on
hand-checked inputs, and their plots written as PNG files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.plots import memory_timeline_figure, memory_unit, pareto_front
from tests.synthetic import chain_workload, fixed_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import exp_maxbatch
import exp_memory_saved
import exp_overhead
import exp_swap_vs_recompute
import headline_common

PNG = b"\x89PNG\r\n\x1a\n"


def test_activation_budget_on_the_chain() -> None:
    # 16 layers of 1000 B: the no-policy peak (18 tensors: the input, c_0..c_15, g_0) holds 16 saved
    # activations; keeping half of them leaves 18000 - 8000 bytes.
    w = chain_workload(16, 1000, 1e-3)
    assert headline_common.activation_bytes_at_peak(w, fixed_profile()) == (18_000, 16_000)
    assert headline_common.activation_budget(w, fixed_profile(), 0.5) == 10_000
    assert headline_common.activation_budget(w, fixed_profile(), 1.0) == 18_000


def test_front_keeps_the_points_no_other_point_beats() -> None:
    points = [(0.1, 0.01), (0.3, 0.05), (0.2, 0.08), (0.5, 0.2), (0.5, 0.3), (0.4, 0.25)]
    assert pareto_front(points) == [(0.1, 0.01), (0.3, 0.05), (0.5, 0.2)]


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        {"model": m, "profile": p, "max_batch_no_policy": 100, "max_batch_heuristic": 200, "max_batch": 300,
         "ratio": 3.0, "heuristic_ratio": 2.0}
        for p in ("v100-16gb", "a100-40gb") for m in ("resnet50", "bert-base")
    ]  # fmt: skip
    exp_maxbatch.plot(rows, tmp_path / "mb.png", 0.2)
    _png(tmp_path / "mb.png")
    rows = [
        {"model": m, "batch": 8, "profile": "a100-40gb", "share": s, "slowdown": 0.04, "heuristic_slowdown": None}
        for m in ("resnet50", "gpt2") for s in (0.5, 0.25)
    ]  # fmt: skip
    exp_overhead.plot(rows, tmp_path / "ov.png")
    _png(tmp_path / "ov.png")
    fronts = {"resnet50": {m: [(0.2, 0.01), (0.5, 0.1)] for m in exp_memory_saved.METHODS}}
    exp_memory_saved.plot(fronts, [{"model": "resnet50", "no_policy_peak_bytes": 2**30}], tmp_path / "ms.png", "x")
    _png(tmp_path / "ms.png")
    rows = [
        {"model": "resnet50", "batch": 64, "profile": "h100-80gb", "share": 0.5, "link": link, "keep": 0.5,
         "swap": 0.1, "recompute": 0.4, "compress": 0.0, "slowdown": 0.05}
        for link in exp_swap_vs_recompute.LINKS
    ]  # fmt: skip
    exp_swap_vs_recompute.plot(rows, tmp_path / "sr.png")
    _png(tmp_path / "sr.png")


# -- the pretrained agent's training script ------------------------------------------------------------------------
def test_agent_split_holds_out_whole_models() -> None:
    import train_agent

    train = {s.model for s in train_agent.TRAIN}
    assert not train & {s.model for s in train_agent.HELDOUT}
    assert train_agent.VALIDATION in train


def test_expert_labels_turn_to_keep_once_the_policy_fits() -> None:
    import numpy as np
    import train_agent

    from envs.memory_env import OBS_FIELDS, OBS_SIZE

    label = train_agent.Label(train_agent.TRAIN[0], "a100-40gb", 0.5, np.array([2, 1, 3]), 0.9, 0.8, "capuchin")
    obs = np.zeros(OBS_SIZE, dtype=np.float32)
    legal = np.array([True, True, True, False])
    assert train_agent.expert_action(label, 0, obs, legal) == 0  # need_ratio 0: it fits already
    obs[OBS_FIELDS.index("need_ratio")] = 0.2
    assert [train_agent.expert_action(label, t, obs, legal) for t in range(3)] == [2, 1, 0]  # 3 is masked


@pytest.mark.slow
def test_train_agent_end_to_end_writes_a_loadable_agent(tmp_path: Path) -> None:
    """The whole script on one small training workload, a fraction of a second of search per cell."""
    import subprocess

    from agents.pretrained import load_agent

    script = Path(__file__).resolve().parents[1] / "experiments" / "train_agent.py"
    args = ["--models", "resnet18-b64", "--expert-s", "0.3", "--epochs", "2", "--dagger", "1", "--dagger-epochs", "1"]
    args += ["--jobs", "1", "--out", str(tmp_path / "a.pt"), "--cache", str(tmp_path / "cache")]
    args += ["--results", str(tmp_path / "res")]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    agent = load_agent(tmp_path / "a.pt")
    assert agent.meta["train"] == ["resnet18-b64"] and "resnet101-b64" in agent.meta["heldout"]
    _png(tmp_path / "res" / "agent_curves.png")
    assert "second_choice" in (tmp_path / "res" / "agent_train.csv").read_text().splitlines()[0]
    assert "one pass >= best heuristic" in done.stdout


def test_gpu_check_expandable_child_dry_run_on_the_cpu() -> None:
    """experiments/gpu_check.py's step 6 runs its code on the CPU (nothing recorded): keep and the mix, each with
    the allocator's model of expandable_segments:True (A8-A11) beside the simulator's peak."""
    import gpu_check

    row = gpu_check.expandable_child("tests.fixtures_models:make_wide", 4, None, device="cpu")
    assert set(row["policies"]) == {"keep", "mixed"} and row["in_effect"] is None
    for r in row["policies"].values():
        assert r["model_reserved_peak_bytes"] >= r["model_allocated_peak_bytes"] >= r["planned_peak_bytes"] > 0
        assert r["allocator_reserved_peak_bytes"] == r["replayed_reserved_peak_bytes"] == 0 and r["requests"] == []


def test_gpu_check_conv_workspaces_dry_run_on_the_cpu() -> None:
    """experiments/gpu_check.py's convolution recorder (step 5, for cuDNN's workspaces) on the CPU: ResNet-18's
    20 convolutions, each once forward and once backward in a step, keyed by what chooses cuDNN's algorithm;
    nothing allocated beyond the outputs on the CPU."""
    import gpu_check

    rows = gpu_check.conv_workspaces("resnet18", 2, None, device="cpu")
    calls = {op: sum(r["calls"] for r in rows if r["op"] == op) for op in ("forward", "backward")}
    assert calls == {"forward": 20, "backward": 20}
    first = next(r for r in rows if r["op"] == "forward" and r["weight"] == (64, 3, 7, 7))
    assert (first["input"], first["stride"], first["padding"], first["groups"]) == ((2, 3, 224, 224), (2, 2), (3, 3), 1)
    assert all(r["workspace_bytes"] == 0 for r in rows)


def test_memory_axes_take_the_unit_of_their_values() -> None:
    """A small model's plots read 0.00 GiB everywhere (its 4 and 5 MiB budgets could not be told apart)."""
    assert memory_unit(5 * 2**20) == ("MiB", 2**20) and memory_unit(3 * 2**30) == ("GiB", 2**30)
    assert memory_unit(100) == ("KiB", 2**10)
    fig = memory_timeline_figure([("plan", [0.0, 0.001], [4 * 2**20, 5 * 2**20])], title="t", budget_bytes=6 * 2**20)
    assert fig.layout.yaxis.title.text == "device memory (MiB)"
    assert fig.data[1].text == ("peak 5.00 MiB",)
