"""`autotune maxbatch`: doubling then bisection, and the command's answer checked against its own sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.maxbatch import MAX_BATCH, _largest
from tests.test_cli import run


@pytest.mark.parametrize(
    ("limit", "start", "expected", "calls"),
    [(37, 4, 37, 10), (3, 4, 3, 3), (64, 64, 64, 8), (5, 64, 5, 7), (0, 4, 0, 3)],
)
def test_largest_doubles_then_bisects(limit: int, start: int, expected: int, calls: int) -> None:
    """Doubling from the start, or halving from it where it does not fit (64 32 16 8 4, then 6 5), then
    bisection; 0 where not even batch 1 fits (4 2 1)."""
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


def test_a_start_batch_that_does_not_fit_halves_and_nothing_fitting_exits_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A --start-batch above the answer halves down to it (it answered 0 and exited 0, trying the start only);
    a budget that not even batch 1 meets is an error that writes nothing."""
    out = tmp_path / "p.json"
    args = ["maxbatch", "--model", "resnet18", "--gpu", "a100-40gb", "--per-size", "0.5", "--reserve", "0"]
    code, stdout, err = run(capsys, *args, "--budget", "300MB", "--start-batch", "256", "--out", str(out), "--json")
    assert code == 0, err
    got = json.loads(stdout)
    sizes = {s["batch_size"]: s for s in got["sizes"]}
    b = got["max_batch"]
    assert 0 < b < 256 and not sizes[256]["fits"] and sizes[b]["fits"] and sizes[b + 1]["fits"] is False
    assert json.loads(out.read_text())["batch_size"] == b
    out.unlink()
    code, _, err = run(capsys, *args, "--budget", "40MB", "--start-batch", "2", "--out", str(out), "--json")
    assert code == 1 and "no batch size trains within" in err and "not even 1" in err, err
    assert not out.exists()
    # At 32 px resnet18's BatchNorm sees one value per channel at batch 1, where its training step raises: that
    # size does not train, so it does not fit (it was an input error blaming --image-size, exit 2, a QA run).
    code, _, err = run(capsys, *args, "--budget", "50MB", "--image-size", "32", "--start-batch", "2", "--json")
    assert code == 1 and "not even 1" in err and "at batch size 1 resnet18 does not train: " in err, err
    assert "Expected more than 1 value per channel" in err and "--image-size" not in err


def test_ctrl_c_in_a_sizes_search_stops_maxbatch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The portfolio takes a Ctrl-C and returns its best so far; maxbatch went on to the next size and answered
    (exit 0). A size searched in part gives no answer: exit 130, nothing written. (The Ctrl-C lands in the
    portfolio's first refinement, which every size's search that keeping everything does not answer runs; at an
    Optuna trial's third tell, as before, it did not come at all where 2 s per size ran fewer trials.)"""
    import agents.portfolio as portfolio

    real, calls = portfolio.refine, [0]

    def interrupted(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(portfolio, "refine", interrupted)
    out = tmp_path / "p.json"
    code, _, err = run(capsys, "maxbatch", "--model", "resnet18", "--gpu", "a100-40gb", "--budget", "300MB",
                       "--start-batch", "4", "--per-size", "2", "--reserve", "0", "--out", str(out))  # fmt: skip
    assert code == 130 and "interrupted" in err and "internal error" not in err, err
    assert calls[0] == 1 and not out.exists()


def test_ctrl_c_says_the_sizes_searched_so_far(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after minutes of searching left the user one word, "interrupted": it now also says the sizes
    searched so far and what each gave, and that nothing was written. With --json stdout had only the error; it
    now holds the same as an object, as search's and sweep's outcomes do."""
    import json
    import re

    from autotune import maxbatch as mb

    real = mb.MaxBatch.evaluate

    def evaluate(self: mb.MaxBatch, b: int) -> mb.SizeResult:
        if self.results and b not in self.results:  # Ctrl-C in the second size's search
            raise KeyboardInterrupt
        return real(self, b)

    monkeypatch.setattr(mb.MaxBatch, "evaluate", evaluate)
    out = tmp_path / "p.json"
    code, _, err = run(capsys, "maxbatch", "--model", "resnet18", "--gpu", "a100-40gb", "--budget", "300MB",
                       "--start-batch", "4", "--per-size", "1", "--reserve", "0", "--out", str(out))  # fmt: skip
    assert code == 130 and "interrupted" in err, err
    assert re.search(r"maxbatch: searched 4 fits \([\d,.]+ samples/s\); nothing written", err), err
    assert not out.exists()
    args = ["--model", "resnet18", "--gpu", "a100-40gb", "--budget", "300MB", "--start-batch", "4", "--per-size", "1"]
    code, stdout, err = run(capsys, "maxbatch", *args, "--reserve", "0", "--out", str(out), "--json")
    got = json.loads(stdout)
    assert code == got["exit_code"] == 130 and got["error"] == "interrupted" and got["policy"] is None, stdout
    [four] = got["searched"]
    assert four["batch_size"] == 4 and four["fits"] and four["samples_per_s"] > 0
    assert "searched 4 fits" in err and not out.exists()


def test_a_size_that_fits_but_runs_too_slow_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """With --max-slowdown, a size whose policy is within the budget but slower than allowed read "no" in the
    fits column, as a size whose policy is over the budget does (a QA run): it reads "too slow"."""
    code, out, err = run(capsys, "maxbatch", "--model", "resnet18", "--gpu", "a100-40gb", "--budget", "1GB",
                         "--per-size", "0.5", "--max-slowdown", "0.05", "--start-batch", "32",
                         "--out", str(tmp_path / "p.json"))  # fmt: skip
    assert code == 0, err
    rows = [cells for cells in (line.split("│") for line in out.splitlines()) if len(cells) > 6]
    rows = [cells for cells in rows if cells[2].strip() == "too slow"]  # (the heuristic's column says it too)
    assert rows, out
    for cells in rows:  # each such row has a policy (its samples/s) and a slowdown above the 5% allowed
        assert cells[5].strip() != "—" and float(cells[6].strip().rstrip("%")) > 5.0, cells


def test_maxbatch_says_its_times_are_simulated_on_fake_traces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Every size is traced in fake mode, so on --gpu cpu its samples/s are the cpu profile's estimates while
    `simulate --policy` on the file times real ops (a QA run: 258.4 samples/s here, 161.9 there), and with
    --measure the answer's row, timed on a real-mode trace, sat unlabelled in the same column. Each row and the
    JSON now say what it was timed on, a caption says what that means, and on the CPU one line says so."""
    out = tmp_path / "p.json"
    args = ["maxbatch", "--model", "experiments.user_models:groupnorm_cnn", "--gpu", "cpu", "--budget", "60MB",
            "--start-batch", "16", "--per-size", "0.2", "--out", str(out)]  # fmt: skip
    code, stdout, err = run(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(stdout)
    searched = [s for s in got["sizes"] if s["samples_per_s"] is not None]
    assert searched and all(s["timed_on"] == "fake-mode trace" for s in searched)
    assert got["timed_on"] == "fake-mode trace"
    code, stdout, err = run(capsys, *args)
    assert code == 0, err
    said = " ".join(stdout.split())  # (rich wraps at the console's width: 80 columns in a log)
    assert "simulated on fake traces: the cpu profile's modelled op times" in said, stdout
    assert "*" not in said.split("simulated on fake traces")[0], stdout  # no row marked as on a real trace
    assert f"estimates of its ops, not timings: `autotune simulate --policy {out}`" in said


def test_maxbatch_checks_its_answer_on_the_caching_allocators_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """maxbatch fills the planned budget to the edge (a QA run: batch 10 at 158.02 MiB of 158.10) and never
    checked its answer on the caching allocator's model, on which that policy runs out (as `simulate --policy`
    said): it now warns as `search` does, and its JSON carries the verdict as search's does."""
    out = tmp_path / "p.json"
    args = ["maxbatch", "--model", "resnet18", "--image-size", "64", "--budget", "300MB", "--gpu", "a100-40gb",
            "--start-batch", "8", "--per-size", "0.5", "--out", str(out)]  # fmt: skip
    code, stdout, err = run(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(stdout)
    rf = got["reserved"]
    assert rf is not None and rf["fits"] is False and rf["enforced"] is False
    assert rf["planned_bytes"] == [got["planned_budget_bytes"]] and got["peak_bytes"] <= got["planned_budget_bytes"]
    code, stdout, err = run(capsys, *args)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "warning: on a model of PyTorch's CUDA caching allocator" in said and "runs out of memory within" in said
    assert f"autotune search --batch-size {got['max_batch']}` (its default --budget-kind reserved)" in said, stdout


def test_maxbatch_json_names_the_batch_of_each_no_policy_figure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The JSON's "slowdown" is against no policy at the answer's batch, but the only no-policy samples/s beside
    it was at max_batch_no_policy (a QA run: unlike figures side by side): both are given, each named by its
    batch, and the slowdown is the one at the answer's."""
    code, stdout, err = run(capsys, "maxbatch", "--model", "resnet18", "--image-size", "64", "--budget", "300MB",
                            "--gpu", "a100-40gb", "--start-batch", "8", "--per-size", "0.5",
                            "--out", str(tmp_path / "p.json"), "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(stdout)
    sizes = {s["batch_size"]: s for s in got["sizes"]}
    b, b0 = got["max_batch"], got["max_batch_no_policy"]
    assert b > b0 and "no_policy_samples_per_s" not in got
    at_b = got["no_policy_samples_per_s_at_max_batch"]
    assert at_b == sizes[b]["no_policy_samples_per_s"] and got["slowdown"] == pytest.approx(
        at_b / got["samples_per_s"] - 1
    )
    assert got["no_policy_samples_per_s_at_max_batch_no_policy"] == sizes[b0]["no_policy_samples_per_s"] != at_b
