"""The headline experiments' shared arithmetic (budgets as a share of the activations, Pareto fronts) on
hand-checked inputs, and their plots written as PNG files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.plots import pareto_front
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
