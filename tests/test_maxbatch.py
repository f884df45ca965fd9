"""`autotune maxbatch`: doubling then bisection, and the command's answer checked against its own sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.maxbatch import MAX_BATCH, _largest
from tests.test_cli import run


@pytest.mark.parametrize(("limit", "start", "expected", "calls"), [(37, 4, 37, 10), (3, 4, 0, 1), (64, 64, 64, 8)])
def test_largest_doubles_then_bisects(limit: int, start: int, expected: int, calls: int) -> None:
    seen: list[int] = []

    def fits(b: int) -> bool:
        seen.append(b)
        return b <= limit

    assert _largest(start, fits) == expected
    assert len(seen) == calls == len(set(seen))  # 4 8 16 32 64, then 48 40 36 38 37: each size once
    assert _largest(1, lambda b: True) == MAX_BATCH


def test_largest_relative_tolerance() -> None:
    seen: list[int] = []

    def fits(b: int) -> bool:
        seen.append(b)
        return b <= 1000

    assert _largest(16, fits, rel_tol=0.05) == 992  # 16..512, 1024, then 768 896 960 992: 1024 - 992 <= 5% of 992
    assert len(seen) == 11 and _largest(16, lambda b: b <= 1000) == 1000


def test_maxbatch_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["maxbatch", "--model", "resnet18", "--budget", "300MB", "--gpu", "a100-40gb", "--start-batch", "4"]
    code, stdout, err = run(capsys, *args, "--per-size", "1", "--reserve", "0", "--out", str(out), "--json")
    assert code == 0, err
    got = json.loads(stdout)
    sizes = {s["batch_size"]: s for s in got["sizes"]}
    b, b0 = got["max_batch"], got["max_batch_no_policy"]
    assert b >= b0 > 0 and got["ratio"] == pytest.approx(b / b0)
    assert sizes[b]["fits"] and sizes[b + 1]["fits"] is False  # bisection ended between them
    assert sizes[b0]["no_policy_peak_bytes"] <= 300_000_000 < sizes[b0 + 1]["no_policy_peak_bytes"]
    bh = got["max_batch_baseline"]  # the heuristics seed each size's search: never ahead of it
    assert b0 <= bh <= b and got["baseline"] == sizes[bh]["baseline"] is not None
    assert sizes[bh]["baseline_fits"] and sizes[bh + 1]["baseline_fits"] is False
    assert sizes[bh]["baseline_samples_per_s"] <= sizes[bh]["samples_per_s"]
    policy = json.loads(out.read_text())
    assert policy["batch_size"] == b and policy["budget_bytes"] == 300_000_000
    assert got["samples_per_s"] == sizes[b]["samples_per_s"] and got["policy_path"] == str(out)
