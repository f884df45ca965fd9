"""Shared fixtures: one small sweep (a subprocess, as users run it), reused by the sweep, report and
dashboard tests; the switch that turns skips for missing services into failures in CI; under pytest-xdist,
each worker's share of the cores; and plans without cuBLAS's workspaces unless a test asks for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def _share_the_cores() -> None:
    """Under ``pytest -n N`` each worker gets its share of the cores for intra-op threads (at least one), here
    and in the subprocesses it starts (``OMP_NUM_THREADS``). Left alone, every worker's torch takes all the
    cores: N workers on as many cores spin against each other in OpenMP's barriers, and a training step takes
    four times as long as on one thread. What the tests assert (peaks, gradients, policies) does not depend on
    the thread count; the calibrated cpu profile is measured in the same worker, on the same threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:  # a count set by hand stands
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


_share_the_cores()

# Every plan for a GPU holds cuBLAS's two workspaces (runtime/target.py G6: 2 x 32 MiB on Hopper, 2 x 8.125 MiB
# before), a constant that shifts every policy's peak alike. The flow tests' budgets on tiny models (resnet18 at
# batch 4 within 200 MB on a100-40gb) were chosen without it, and mean what they test only without it: the
# suite plans as a process with CUBLAS_WORKSPACE_CONFIG=:0:0 would (no workspaces, on the GPU too). The tests
# of G6 itself (tests/test_target.py, tests/test_allocator.py) take the default back with monkeypatch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")

# .ci/run installs Chromium and PostgreSQL and sets this: there, a missing service is a failure, not a skip.
REQUIRE_SERVICES = os.environ.get("AUTOTUNE_REQUIRE_SERVICES") == "1"

SWEEP_ARGS = [
    "sweep", "--models", "resnet18", "--batch-size", "8", "--budgets", "150MB,235MB,260MB", "--gpu", "a100-40gb",
    "--trials", "15", "--timeout", "60", "--methods", "baselines,optuna", "--reserve", "0",
]  # fmt: skip


def autotune(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``autotune ARGS`` in a subprocess, from the repository root."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args], cwd=root, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def skip_or_fail(reason: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{reason} (AUTOTUNE_REQUIRE_SERVICES=1: .ci/run should have provided it)")
    pytest.skip(reason)


@dataclass
class SweepRun:
    storage: str
    report: Path
    out: dict[str, Any]
    folder: Path


@pytest.fixture(scope="session")
def sweep_run(tmp_path_factory: pytest.TempPathFactory) -> SweepRun:
    folder = tmp_path_factory.mktemp("sweep")
    storage = f"sqlite:///{folder / 'sweep.db'}"
    report = folder / "sweep.html"
    proc = autotune(*SWEEP_ARGS, "--storage", storage, "--report", str(report), "--out-dir", str(folder), "--json")
    return SweepRun(storage, report, json.loads(proc.stdout), folder)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cases marked slow first, each group in its own order: pytest-xdist hands tests out in this order,
    so the longest ones start at once on every worker and the short ones fill in behind them, rather than a
    long case starting last and leaving the other workers idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
