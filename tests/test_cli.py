"""The command line: JSON outputs, and one-line errors with exit code 2 for every bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autotune.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def user_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if not line.startswith(("budget:", "planning for", "no "))]
    assert len(lines) == 1 and lines[0].startswith("error:"), err  # one line, no traceback
    assert "Traceback" not in err
    return lines[0]


def test_profile_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(
        capsys,
        "profile",
        "--model",
        "resnet18",
        "--batch-size",
        "2",
        "--gpu",
        "a100-40gb",
        "--json",
        "--out",
        str(tmp_path / "w.json"),
    )
    assert code == 0
    d = json.loads(out)
    for key in ("candidates", "activation_bytes", "parameter_bytes", "peak_bytes", "fingerprint"):
        assert key in d
    assert d["parameter_bytes"] == 11_689_512 * 4  # resnet18's parameters, float32
    # A fake trace is deterministic: resnet18 at batch 2 saves 82 distinct storages for backward, and its
    # no-policy peak (parameters, gradients, momentum, the batch, activations, during the first backward
    # convolutions) is exactly this many bytes on torch 2.14.1.
    assert d["candidates"] == 82 and d["activation_bytes"] == 43_201_860 and d["peak_bytes"] == 178_955_776
    # What no policy goes below: at bn1's backward, as for every batch size of resnet18 (envs.simulator).
    assert d["floor"]["name"] == "aten.native_batch_norm_backward.default" and d["floor"]["module"] == "bn1"
    assert d["floor"]["bytes"] < d["peak_bytes"]
    # The caching allocator's model (envs/allocator.py) on a GPU profile: it holds at least what is allocated,
    # which counts whole blocks (>= the peak of the bytes asked for).
    assert d["reserved_peak_bytes"] >= d["allocated_peak_bytes"] >= d["peak_bytes"]
    assert d["expandable_reserved_peak_bytes"] >= d["peak_bytes"]  # expandable_segments:True (A8-A11)
    assert d["planned_pool_bytes"] >= d["peak_bytes"]  # one arena planned from the lifetimes (seed 003)
    assert (tmp_path / "w.json").exists()
    saved = ["--workload", str(tmp_path / "w.json"), "--gpu", "a100-40gb", "--json"]
    for same in ([], ["--model", "resnet18", "--batch-size", "2"], ["--image-size", "224"]):  # its own, or none
        code, out2, _ = run(capsys, "profile", *same, *saved)
        assert code == 0 and json.loads(out2)["peak_bytes"] == d["peak_bytes"]
    # Settings beside --workload that are not the trace's were ignored: the report was resnet18 at batch 2's
    # (a QA run asked for resnet34 at batch 8 in bf16, and --model nosuchmodel passed). Refused, naming both.
    for other, said in ((["--model", "resnet34"], "--model resnet34"), (["-b", "8"], "--batch-size 8"),
                        (["--precision", "bf16"], "--precision bf16"),
                        (["--image-size", "32"], "--image-size 32"),
                        # how a new trace runs: ignored with rc 0 (a QA run)
                        (["--mode", "real"], "--mode real"), (["--device", "cuda"], "--device cuda")):  # fmt: skip
        assert f"{said} with --workload" in user_error(capsys, "profile", *other, *saved)
    # A fake trace takes its profile's kernels: another GPU's plan from it was accepted (a QA run). Refused where
    # their choices differ; without --gpu the trace's own profile is taken.
    said = user_error(capsys, "profile", "--workload", str(tmp_path / "w.json"), "--gpu", "h200")
    assert "--gpu h200 with --workload" in said and "taken with a100-40gb's kernels" in said
    code, out2, _ = run(capsys, "profile", "--workload", str(tmp_path / "w.json"), "--json")
    assert code == 0 and json.loads(out2)["peak_bytes"] == d["peak_bytes"]
    # The first line said "fake trace on cpu in 0.00 s" for a trace read from a file, and "on cpu" for one taken
    # with a GPU's kernels.
    code, text, _ = run(capsys, "profile", "--workload", str(tmp_path / "w.json"))
    assert code == 0 and f"fake trace read from {tmp_path / 'w.json'}: " in text.splitlines()[0]
    assert d["traced_for"] == "a100-40gb" and d["workload_file"] is None


def test_a_real_trace_profiled_for_another_device_says_its_times_are_estimates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real trace on this CPU profiled for a t4: the times shown are the t4's roofline estimates, the
    measured ones the CPU's (they were dropped without a word, a QA run); for the CPU itself nothing is said."""
    args = ["profile", "--model", "resnet18", "--batch-size", "2", "--image-size", "32", "--mode", "real"]
    code, _, err = run(capsys, *args, "--gpu", "t4")
    assert code == 0 and "note: the times below are t4's roofline estimates" in err, err
    assert "(plan with --gpu cpu to use them)" in err
    code, _, err = run(capsys, *args)
    assert code == 0 and "roofline" not in err, err


def test_profile_for_a_gpu_counts_cublas_workspaces_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user runs it (CUBLAS_WORKSPACE_CONFIG unset): the plan for an a100-40gb holds cuBLAS's two
    workspaces of 4096 KiB x 2 + 16 KiB x 8 each (runtime/target.py G6), the peak above by exactly those;
    the h200's are 32 MiB each; the cpu profile has none."""
    args = ["profile", "--model", "resnet18", "--batch-size", "2", "--json"]
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    peaks = {}
    for gpu in ("a100-40gb", "h200", "cpu"):
        code, out, _ = run(capsys, *args, "--gpu", gpu)
        assert code == 0
        peaks[gpu] = json.loads(out)["peak_bytes"]
    assert peaks["a100-40gb"] == 178_955_776 + 2 * (8 * 2**20 + 128 * 2**10)
    assert peaks["h200"] == 178_955_776 + 2 * 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    code, out, _ = run(capsys, *args, "--gpu", "cpu")
    assert code == 0 and json.loads(out)["peak_bytes"] == peaks["cpu"]


def test_profile_table_and_budget_echo(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "profile", "--model", "resnet18", "--batch-size", "2", "--budget", "6GiB")
    assert code == 0
    assert "6GiB = 6,442,450,944 bytes (6.00 GiB)" in err
    assert "fits" in out and "Largest" in out and "no policy can go below" in out
    text = " ".join(out.split())
    assert "caching allocator would reserve" in text and "with expandable_segments:True" in text  # a100-40gb
    code, out, _ = run(capsys, "profile", "--model", "resnet18", "--batch-size", "2", "--budget", "50MB")
    assert code == 0 and "below what any policy can reach" in " ".join(out.split())


def test_profile_in_real_mode_reports_the_op_times_it_measured(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`profile --mode real` on the CPU without --gpu: the op times measured there, on the cpu profile (as
    search plans --gpu cpu), from a trace and from the trace saved. It showed an a100-40gb's roofline times
    where no GPU was detected (a QA run)."""
    saved = tmp_path / "w.json"
    args = ["--model", "resnet18", "--batch-size", "2", "--image-size", "32", "--mode", "real", "--out", str(saved)]
    for given in (args, ["--workload", str(saved)]):
        code, out, err = run(capsys, "profile", *given, "--json")
        assert code == 0, err
        d = json.loads(out)
        assert (d["mode"], d["device"], d["gpu"], d["op_times"]) == ("real", "cpu", "cpu", "measured")


def test_with_grad_accum_the_times_say_they_are_one_micro_batchs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--grad-accum 4: compute, recompute, compress and stall are one micro-batch's, the optimizer step once in
    compute, where the iteration beside them runs four (Rule 10); simulate's table, search's line and profile's
    showed them as the iteration's (a QA run)."""
    import numpy as np

    from autotune.workloads import TraceRequest, trace_model
    from envs.simulator import Simulator, optimizer_s
    from runtime.hardware import get_profile, op_times_s

    model = ["--model", "tests.test_env:deep_mlp", "--batch-size", "8", "--gpu", "a100-40gb"]
    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="tests.test_env:deep_mlp", batch_size=8, grad_accum=4, target=hw))
    r = Simulator(w, hw).no_policy()
    opt_s = optimizer_s(w, np.array(op_times_s(w, hw)))
    assert r.compute_s == pytest.approx(sum(op_times_s(w, hw)))  # one micro-batch's ops and the step's
    assert r.iter_s >= 4 * (r.compute_s - opt_s) + opt_s > 2 * r.compute_s  # the iteration runs four
    said = {
        "simulate": "compute, recompute, compress and stall: one of 4 micro-batches (the optimizer step in compute)",
        "search": "time of one of 4 micro-batches (the optimizer step in compute): compute",
        "profile": "the ops' compute for one of 4 micro-batches and the optimizer step: forward",
    }
    more = {"simulate": ["--action", "keep"], "profile": [],
            "search": ["--budget", "10GB", "--trials", "1", "--out", str(tmp_path / "p.json"),
                       "--storage", f"sqlite:///{tmp_path / 's.db'}"]}  # fmt: skip
    for command, line in said.items():
        for accum in ("4", "1"):
            code, out, err = run(capsys, command, *model, "--grad-accum", accum, *more[command])
            assert code == 0, err
            assert (line in " ".join(out.split())) == (accum == "4"), out


def test_hardware_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "hardware", "--json")
    assert code == 0
    d = json.loads(out)
    names = {p["name"] for p in d["profiles"]}
    assert {"v100-16gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "t4", "rtx3090", "rtx4090"} <= names
    assert "message" in d["detected"]
    code, out, _ = run(capsys, "hardware")  # the table names the cpu profile too, which --gpu takes (a QA run)
    assert code == 0 and "cpu: this machine's CPU" in out
    # FP16: the V100's and T4's tensor cores, which have no TF32 or BF16 ("-" in every other column; a QA run).
    v100 = next(line for line in out.splitlines() if "v100-16gb" in line)
    assert "FP16" in out and "125.0" in v100, v100


def test_simulate_actions_and_policy_roundtrip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["simulate", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--json"]
    keep = json.loads(run(capsys, *base, "--action", "keep")[1])
    rec = json.loads(run(capsys, *base, "--action", "recompute")[1])
    assert keep["peak_bytes"] == keep["no_policy"]["peak_bytes"] and keep["recompute_s"] == 0
    assert rec["peak_bytes"] < keep["peak_bytes"] and rec["iter_s"] > keep["iter_s"]
    # The table's parts add up to the iteration: the host's share was left out (1.7 ms shown as 1.5 of parts).
    parts = ("compute_s", "recompute_s", "compress_s", "stall_s", "host_wait_s")
    assert sum(rec[p] for p in parts) == pytest.approx(rec["iter_s"]) and rec["host_wait_s"] > 0
    policy, html = tmp_path / "p.json", tmp_path / "t.html"
    code, out, _ = run(
        capsys, *base, "--action", "swap", "--budget", "1GB", "--save-policy", str(policy), "--timeline", str(html)
    )
    swap = json.loads(out)
    assert code == 0 and swap["d2h_bytes"] > 0
    again = json.loads(run(capsys, "simulate", "--policy", str(policy), "--json")[1])
    for key in ("peak_bytes", "iter_s", "stall_s", "budget_bytes", "gpu", "batch_size"):
        assert again[key] == swap[key], key
    # a model name the file holds that is unknown: said as the file's (it read as a --model typed, a QA run)
    edited = tmp_path / "edited.json"
    edited.write_text(policy.read_text().replace('"model": "resnet18"', '"model": "resnet19"'))
    line = user_error(capsys, "simulate", "--policy", str(edited))
    assert line.startswith(f"error: the policy file {edited} names its model: unknown model 'resnet19'"), line
    text = html.read_text()
    assert "plotly" in text and "cdn.plot.ly" not in text.split("<body>")[0]  # self-contained
    assert "<title>resnet18, batch 4, on a100-40gb: device memory</title>" in text  # the browser tab's name
    # The caching allocator's model: keeping everything reserves what the no-policy iteration does; capped at
    # that the policy runs, capped one byte under its allocated peak it runs out (A7).
    from autotune.workloads import TraceRequest, trace_model
    from envs.allocator import no_policy_stats
    from runtime.hardware import get_profile

    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=4, target=get_profile("a100-40gb")))
    alone = no_policy_stats(w)
    assert (keep["reserved_peak_bytes"], keep["allocated_peak_bytes"]) == (alone.peak_reserved, alone.peak_allocated)
    assert keep["runs_within_budget"] is None and rec["reserved_peak_bytes"] >= rec["peak_bytes"]
    assert keep["planned_pool_bytes"] >= keep["peak_bytes"] and rec["planned_pool_bytes"] >= rec["peak_bytes"]
    from autotune.budget import DEFAULT_GPU_RESERVE

    for budget, runs in ((keep["reserved_peak_bytes"], True), (keep["allocated_peak_bytes"] - 1, False)):
        # A budget given to simulate is planned as search plans it: less the default reserve on a GPU profile.
        d = json.loads(run(capsys, *base, "--action", "keep", "--budget", str(budget + DEFAULT_GPU_RESERVE))[1])
        assert d["runs_within_budget"] is runs and d["planned_budget_bytes"] == budget, budget
    # ... and with expandable_segments:True (A8-A11): the same requests, so the same no-policy replay
    grown = no_policy_stats(w, expandable_segments=True)
    assert (keep["expandable_reserved_peak_bytes"], keep["expandable_allocated_peak_bytes"]) == (
        grown.peak_reserved,
        grown.peak_allocated,
    )
    d = json.loads(run(capsys, *base, "--action", "keep", "--budget", str(grown.peak_allocated - 1))[1])
    assert d["expandable_runs_within_budget"] is False and d["runs_within_budget"] is False


BAD_INPUTS = [
    (["profile", "--model", "resnet100"], "did you mean"),
    # --only "," traced the model and printed an empty table; a search ran as a baseline
    (["baselines", "--model", "resnet18", "--budget", "1GB", "--only", ","], "names no method"),
    (["baselines", "--model", "resnet18", "--budget", "1GB", "--only", "portfolio"], "a search, not a published"),
    (["baselines", "--model", "resnet18", "--budget", "1GB", "--only", "capuchn"], "did you mean capuchin"),
    (["profile", "--model", "no_such_pkg.mod:make"], "no_such_pkg"),
    (["profile", "--model", "tests.fixtures_models"], "package.module:factory"),
    (["profile", "--model", "tests.fixtures_models:make_raises"], "raised"),
    # .item() in the constructor under the fake trace blamed the factory (a QA run): the way out is a real trace
    (["profile", "--model", "tests.fixtures_models:make_item_in_init", "--gpu", "a100-40gb"], "reads tensor values"),
    # an op whose fake kernel refuses fp32 (Mixtral's experts) was an internal error with a logged traceback
    (["profile", "--model", "tests.fixtures_models:make_grouped_mm", "--gpu", "a100-40gb"], "_grouped_mm.default"),
    (["profile", "--model", "resnet18", "--batch-size", "0"], "batch size"),
    # a batch this machine cannot make was an internal error (exit 1) in a real trace
    (
        ["profile", "--model", "resnet18", "-b", "2", "--image-size", "1000000000", "--gpu", "cpu", "--mode", "real"],
        "could not be built with its batch at --batch-size 2 --image-size 1000000000 on cpu",
    ),
    (["profile", "--model", "resnet18", "--batch-size", "-3"], "-3"),
    (["profile", "--model", "resnet18", "--budget", "6XB"], "6XB"),
    (["profile", "--model", "resnet18", "--gpu", "a100"], "a100"),
    (["simulate", "--model", "resnet18", "--action", "swapp"], "swapp"),
    (["simulate", "--model", "resnet18"], "--policy"),
    # refused after the trace, as "prefetch_lookahead=-2 is negative" (a QA run): now before it, with the way out
    (["simulate", "--model", "resnet18", "--action", "swap", "--lookahead", "-2"], "invalid --lookahead -2"),
    # ignored with exit 0 (a QA run)
    (["simulate", "--model", "resnet18", "--action", "keep", "--lossy"], "--lossy applies with --action compress"),
    (
        ["simulate", "-m", "resnet18", "--action", "recompute", "--lookahead", "3"],
        "--lookahead applies with --action swap",
    ),
    (["search", "--model", "resnet18", "--budget", "6"], "e.g. 6GB or 6GiB"),  # a unit left out: refused at once
    # ... where the number is thousands, not with that unit on it ("1048575GB", a QA run)
    (["search", "--model", "resnet18", "--budget", "1048575"], "write the unit, e.g. 6GB or 6GiB, or 1048575B"),
    (["profile", "--model", "gpt2", "--seq-len", "0"], "invalid --seq-len 0"),
    (["profile", "--model", "resnet18", "--image-size", "0"], "invalid --image-size 0"),
    (["profile", "--model", "gpt2", "--image-size", "32"], "--image-size 32 given for language model 'gpt2'"),
    (
        ["search", "--model", "experiments.user_models:tiny_llama", "--budget", "1GB", "--image-size", "32"],
        "image_size=32 given for experiments.user_models:tiny_llama, but the factory has no image_size parameter",
    ),
    # a model whose forward raises was an internal error, to report as autotune's bug
    (
        ["profile", "--model", "tests.fixtures_models:make_mismatched", "--gpu", "cpu"],
        "raised in its first training step, run before any of autotune's hooks: RuntimeError: mat1 and mat2 shapes",
    ),
    # ... and on a fake trace (a GPU profile) a loss backward cannot take was one too (a QA run)
    (
        ["profile", "--model", "tests.fixtures_models:make_per_sample_loss", "--gpu", "a100-40gb"],
        "raised in its first training step, run before any of autotune's hooks: RuntimeError: grad can be implicitly",
    ),
    (
        ["profile", "--model", "tests.fixtures_models:make_detached_loss", "--gpu", "a100-40gb"],
        "its first training step, run before any of autotune's hooks: RuntimeError: element 0 of tensors does not",
    ),
    (["search", "--model", "resnet18", "--budget", "1GB", "--reserve", "-1"], "--reserve: invalid size '-1'"),
    # 6 bytes of reserve, searched for (a QA run): a unit left out, as --budget 6
    (["search", "--model", "resnet18", "--budget", "1GB", "--reserve", "6"], "invalid --reserve '6'"),
    # an internal error from Optuna's sampler after the trace and the baselines (a QA run)
    (["search", "--model", "resnet18", "--budget", "1GB", "--seed", "-1"], "invalid --seed -1"),
    (["maxbatch", "--model", "resnet18", "--budget", "1GB", "--seed", "4294967296"], "invalid --seed 4294967296"),
    (["sweep", "--models", "resnet18", "--budgets", "1GB", "--seed", "-1"], "invalid --seed -1"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_INPUTS, ids=[" ".join(a[1:]) for a, _ in BAD_INPUTS])
def test_bad_inputs(capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    assert expected in user_error(capsys, *args)


@pytest.mark.parametrize("command", [["simulate", "--action", "recompute"], ["profile"]])
def test_a_plan_for_this_cpu_traces_for_real_what_a_fake_trace_cannot_run(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """A model that reads tensor values while it runs cannot be traced with fake tensors; for a GPU profile
    that is an error naming the way out (above), but a plan for this CPU (--gpu cpu) said the same, and
    simulate and profile trace fake there too, so the way out it named did nothing (a QA run). profile traces
    it for real on this CPU instead, with a warning that says so; simulate traces a plan for this machine for
    real from the start, as search does."""
    code, out, err = run(capsys, *command, "--model", "tests.fixtures_models:make_item_in_init", "--gpu", "cpu",
                         "--json")  # fmt: skip
    assert code == 0, err
    if command[0] == "profile":
        assert "reads tensor values" in err and "traced for real on this CPU instead" in err
    else:
        assert "reads tensor values" not in err
    json.loads(out)


def test_bad_workload_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"format": "autotune.workload/v1", "ops": [')
    assert "not a workload file" in user_error(
        capsys, "profile", "-m", "x", "--workload", str(tmp_path / "broken.json")
    )
    (tmp_path / "old.json").write_text('{"format": "autotune.workload/v0"}')
    assert "v0" in user_error(capsys, "profile", "-m", "x", "--workload", str(tmp_path / "old.json"))


def test_debug_shows_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """--debug adds the traceback and changes nothing else: exit code 2 and, with --json, the error object (it
    exited 1 with nothing on stdout, a QA run)."""
    for args in (
        ["profile", "--model", "resnet100", "--debug"],
        ["--debug", "profile", "--model", "resnet100", "--json"],
    ):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert "Traceback (most recent call last)" in err and "AutotuneError: unknown model 'resnet100'" in err
        assert err.strip().splitlines()[-1].startswith("error: unknown model 'resnet100'")
        if "--json" in args:
            assert json.loads(out)["exit_code"] == 2 and "resnet100" in json.loads(out)["error"]
        else:
            assert out == ""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["baselines", "--bogus"], "No such option: --bogus"),
        (["profile", "--model", "resnet18", "--batch-size", "x"], "valid integer"),
        (
            ["search", "--model", "resnet18", "--budget", "1GB", "--trials=x2"],
            "(given: 'x2'); see autotune search --help",
        ),
        (["profile", "--model", "resnet18", "-b", "abc"], "(given: 'abc')"),
    ],
)
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    """A value of the wrong type or an unknown option: one line naming it and where to look, exit 2, as
    every other input error (click's usage block was four lines: a QA run)."""
    code, _, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], err


@pytest.mark.parametrize("command", ["search", "profile"])
def test_ctrl_c_while_tracing_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    """typer turns a Ctrl-C outside the search's own handling into an exit code that it returns, not raises,
    when not standalone: the process ended with 0 and no word, as if it had finished."""
    import autotune.workloads

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(autotune.workloads, "trace_model", interrupted)
    extra = ["--budget", "200MB", "--out", str(tmp_path / "p.json")] if command == "search" else []
    code, out, err = run(capsys, command, "--model", "resnet18", "--batch-size", "2", *extra)
    assert code == 130 and "interrupted" in err and not (tmp_path / "p.json").exists(), (code, out, err)


JSON_FAILURES = [
    ["profile", "--model", "resnet18", "--batch-size", "0"],
    ["simulate", "--model", "resnet18"],
    ["baselines", "--model", "resnet18", "--budget", "1GB", "--only", ","],
    ["search", "--model", "resnet18", "--budget", "6"],
    ["search", "--model", "resnet18", "--budget", "1GB", "--trials", "many"],  # click's usage error
    ["maxbatch", "--model", "resnet18", "--budget", "1GB", "--seed", "-1"],
    ["sweep", "--models", "resnet18", "--budgets", "1GB", "--seed", "-1"],
    ["train", "--policy", "no-such.policy.json"],
]


@pytest.mark.parametrize("args", JSON_FAILURES, ids=[" ".join(a) for a in JSON_FAILURES])
def test_a_failure_with_json_prints_one_object(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    """--json and an input error: stdout was empty, and a script reading it had nothing to parse (a QA run).
    One object now, with the message on stderr and the exit code."""
    code, out, err = run(capsys, *args, "--json")
    assert code == 2 and "Traceback" not in err, (code, out, err)
    line = err.strip().splitlines()[-1]
    assert json.loads(out) == {"error": line.removeprefix("error: "), "exit_code": 2}


def test_an_interrupt_with_json_prints_one_object(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C before a command printed its object: that one says so. (Where it printed its own first, as search
    does where nothing fits, it stays the only one: tests/test_main_flow.py reads search's and maxbatch's.)"""
    import autotune.workloads

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(autotune.workloads, "trace_model", interrupted)
    code, out, err = run(capsys, "profile", "--model", "resnet18", "--batch-size", "2", "--json")
    assert code == 130 and "interrupted" in err
    assert json.loads(out) == {"error": "interrupted", "exit_code": 130}


def test_every_planning_command_keeps_the_same_reserve(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """On a GPU profile `baselines` planned for the whole budget and `search` for the budget less the 128 MiB
    reserve (NOTE [ Budget and reserve ] in autotune.budget): the same heuristics, two answers. Now both plan
    for the same bytes, and a saved policy records the budget as typed."""
    from runtime.policy import load_policy

    # In tensor bytes (--budget-kind allocated): the default, reserved, holds the policies to the caching
    # allocator's model, where none of these runs at this size; the reserve is the same either way.
    common = ["--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--budget", "330MB", "--budget-kind",
              "allocated"]  # fmt: skip
    code, out, err = run(capsys, "baselines", *common, "--only", "capuchin", "--save", str(tmp_path))
    assert code == 0 and "budget 314.71 MiB (planned for 186.71 MiB)" in out, (out, err)
    saved = load_policy(tmp_path / "resnet18.capuchin.policy.json")
    code, out, err2 = run(capsys, "search", *common, "--searcher", "capuchin", "--out", str(tmp_path / "s.json"),
                          "--storage", f"sqlite:///{tmp_path / 's.db'}", "--json")  # fmt: skip
    assert code == 0, err2
    found = json.loads(out)
    planned = 330_000_000 - 128 * 2**20
    line = "planning for 186.71 MiB: the budget less a 128.00 MiB reserve for workspaces (--reserve)"
    assert line in err and line in err2
    assert found["planned_budget_bytes"] == planned and found["budget_bytes"] == 330_000_000
    assert saved.predicted is not None and saved.predicted.peak_bytes == found["peak_bytes"] <= planned
    assert saved.budget_bytes == 330_000_000
    assert load_policy(tmp_path / "s.json").budget_bytes == 330_000_000
    code, out, err = run(capsys, "sweep", "--models", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb",
                         "--budgets", "330MB", "--methods", "baselines", "--storage", f"sqlite:///{tmp_path / 'w.db'}",
                         "--out-dir", str(tmp_path / "sweep"), "--json")  # fmt: skip
    assert code == 0, err
    cell = json.loads(out)["cells"][0]
    assert (cell["budget_bytes"], cell["planned_budget_bytes"], cell["reserve_bytes"]) == (
        330_000_000,
        planned,
        128 * 2**20,
    )
    assert cell["peak_bytes"] == found["peak_bytes"]  # Capuchin: the fastest baseline at this budget
    (written,) = (tmp_path / "sweep").glob("*.policy.json")
    assert load_policy(written).budget_bytes == 330_000_000


def test_train_expandable_segments_is_set_before_cuda_initialises(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`autotune train --expandable-segments` appends expandable_segments:True to PYTORCH_CUDA_ALLOC_CONF (one
    already there replaced; PYTORCH_ALLOC_CONF, which newer torch reads first, too where it is set); refused on
    the CPU, and once CUDA is initialised in the process (the allocator has read its configuration then)."""
    import torch

    from autotune import train as tr

    env = {tr.ALLOC_CONF: "max_split_size_mb:128,expandable_segments:False"}
    tr.enable_expandable_segments("cuda", env)
    assert env == {tr.ALLOC_CONF: "max_split_size_mb:128,expandable_segments:True"}
    env = {tr.ALLOC_CONF_NEW: "garbage_collection_threshold:0.6"}
    tr.enable_expandable_segments("cuda:0", env)
    assert env == {
        tr.ALLOC_CONF: "expandable_segments:True",
        tr.ALLOC_CONF_NEW: "garbage_collection_threshold:0.6,expandable_segments:True",
    }
    for settings, effect in (("expandable_segments:True", True), ("max_split_size_mb:64", False), ("", False)):
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda s=settings: s, raising=False)
        assert tr.expandable_in_effect() is effect
    args = ["train", "--policy", "missing.policy.json", "--expandable-segments"]
    assert "use --device cuda" in user_error(capsys, *args, "--device", "cpu")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA is already initialised" in user_error(capsys, *args, "--device", "cuda")
    # --backend is torch.compile's: alone it was ignored (trained eagerly, exit 0); now refused before any work.
    line = user_error(capsys, "train", "--policy", "missing.policy.json", "--backend", "aot_eager")
    assert line.startswith("error: --backend aot_eager without --compile")


def test_host_memory_option(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--host-memory is checked before any work (exit 2, one line), and echoed where it bounds a GPU plan."""
    line = user_error(capsys, "search", "--model", "resnet18", "--budget", "1GB", "--gpu", "a100-40gb",
                      "--host-memory", "0", "--out", str(tmp_path / "p.json"))  # fmt: skip
    assert line.startswith("error: --host-memory: invalid size '0'")
    code, _, err = run(capsys, "search", "--model", "resnet18", "--batch-size", "2", "--budget", "10GB", "--gpu",
                       "a100-40gb", "--host-memory", "8GB", "--timeout", "2", "--out", str(tmp_path / "p.json"),
                       "--storage", f"sqlite:///{tmp_path / 's.db'}")  # fmt: skip
    assert code == 0, err
    assert "swapped tensors may pin up to 8GB = 8,000,000,000 bytes" in err


def test_a_ctrl_c_that_a_finalizer_swallowed_while_tracing_stops_the_search(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands in a ``__del__`` while the model is traced (regex's ``Group.__del__``, 1 of 40 tries
    of `search` in a QA run) is dropped by Python ("Exception ignored in ..."), and the search ran to its end,
    wrote its policy and exited 0. The command notes every Ctrl-C; the search raises a noted one at its first
    report and stops as a Ctrl-C stops it (exit 130, the best policy so far written). The stand-in notes it as
    the handler does, after the trace, and drops it."""
    import autotune.workloads
    from runtime.errors import note_sigint

    traced = autotune.workloads.trace_model

    def trace_then_swallowed_ctrl_c(*args: object, **kwargs: object) -> object:
        out = traced(*args, **kwargs)
        note_sigint()  # the handler's note; its KeyboardInterrupt went to a finalizer
        return out

    monkeypatch.setattr(autotune.workloads, "trace_model", trace_then_swallowed_ctrl_c)
    out = tmp_path / "p.json"
    args = ["--model", "resnet18", "-b", "2", "--budget", "180MB", "--reserve", "8MiB", "--gpu", "a100-40gb"]
    code, _, err = run(capsys, "search", *args, "--timeout", "30", "--out", str(out),
                       "--storage", f"sqlite:///{tmp_path / 's.db'}")  # fmt: skip
    assert code == 130 and "interrupted: the best policy so far is in" in err, err


def test_a_message_line_stays_whole_when_stdout_is_redirected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Piped or redirected, stdout is 200 columns wide (COLUMNS where set) so that tables keep every value, and
    rich cut message lines there too: the command to check a policy written to a long path came out in two."""
    out = tmp_path / ("d" * 120) / ("e" * 120) / "p.json"
    out.parent.mkdir(parents=True)
    args = ["--model", "resnet18", "--batch-size", "2", "--budget", "1GB", "--gpu", "a100-40gb", "--timeout", "2"]
    code, stdout, err = run(capsys, "search", *args, "--out", str(out), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert code == 0, err
    said = f"check it with `autotune simulate --policy {out}`"
    assert any(line.endswith(said) for line in stdout.splitlines()), stdout


def test_train_says_in_which_iteration_it_ran_out_of_memory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-memory error at the policy's budget is a result of `autotune train`, with the iteration it
    came in (1: the warm-up), in the JSON and the table's line. The error is raised by a stand-in for the
    training loop, after the second iteration's forward has begun (what a CPU cannot produce)."""
    import numpy as np
    import torch

    from autotune import train as tr
    from autotune.workloads import TraceRequest, trace_model
    from runtime.policy import Policy

    w, _ = trace_model(TraceRequest(model="tests.test_env:deep_mlp", batch_size=64))
    path = tmp_path / "mlp.policy.json"
    Policy.from_vector(w, np.zeros(len(w.candidates), dtype=np.int8), hardware="cpu").save(path)

    def run_out(model, batch, loss_fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        for _ in range(2):
            loss_fn(model, batch)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 196.00 MiB.\nmore")

    monkeypatch.setattr(tr, "run_iterations", run_out)
    code, out, err = run(capsys, "train", "--policy", str(path), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert (got["out_of_memory"], got["out_of_memory_iteration"]) == (
        "CUDA out of memory. Tried to allocate 196.00 MiB.",
        2,
    )
    code, out, err = run(capsys, "train", "--policy", str(path))
    assert code == 0, err
    assert "out of memory at the policy's budget in iteration 2 (the first is the warm-up)" in " ".join(out.split())
    # 0 is a value, not "take the file's" (a QA run: it trained at the file's batch and accumulation)
    assert "batch size" in user_error(capsys, "train", "--policy", str(path), "--batch-size", "0")
    assert "grad" in user_error(capsys, "train", "--policy", str(path), "--grad-accum", "0")


def test_train_says_which_profile_the_policy_was_planned_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A GPU's plan trained on the CPU: the run said "cpu profile" and the CPU's prediction, not that the file was
    planned for another device nor what it planned there (a QA run)."""
    import numpy as np

    from autotune.workloads import TraceRequest, trace_model
    from runtime.policy import Policy, Prediction

    w, _ = trace_model(TraceRequest(model="tests.test_env:deep_mlp", batch_size=64))
    path = tmp_path / "mlp.policy.json"
    there = Prediction(peak_bytes=12_345_678, iter_s=0.002, samples_per_s=32_000.0)
    vec = np.zeros(len(w.candidates), dtype=np.int8)
    Policy.from_vector(w, vec, hardware="a100-40gb", predicted=there).save(path)
    code, out, err = run(capsys, "train", "--policy", str(path), "--steps", "1", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["profile"] == "cpu" and got["planned_for"] == "a100-40gb"
    assert got["planned"] == {"peak_bytes": 12_345_678, "iter_s": 0.002, "samples_per_s": 32_000.0}
    code, out, err = run(capsys, "train", "--policy", str(path), "--steps", "1")
    assert code == 0, err
    assert "the policy was planned for a100-40gb (11.77 MiB at 32,000.0 samples/s there); this run is on cpu" in (
        " ".join(out.split())
    )
    # A profile's name that no profile has (edited by hand) is refused, as simulate refuses it; train ran it.
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "hardware": "h900"}))
    line = user_error(capsys, "train", "--policy", str(path), "--steps", "1")
    assert "hardware: unknown hardware profile 'h900'" in line


def test_a_plan_for_this_machines_gpu_takes_this_hosts_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the plan is for this machine's GPU (the planned device a CUDA one), the runtime's host costs are
    measured here (runtime/host_costs.py) in place of the profile's, which one H200 host measured, and so in
    `autotune train`'s prediction on a GPU; a plan for another machine's GPU, or for the CPU, keeps its
    profile's (the CPU profile measures its own already)."""
    import runtime.host_costs
    from autotune import search as sr
    from runtime.hardware import HostCosts, get_profile

    h200, cpu = get_profile("h200"), get_profile("cpu")  # the cpu profile measures its own host
    here_costs = HostCosts(op_s=9.5e-6, region_s=114e-6, replay_op_s=187e-6, source="measured here")
    asked: list[str] = []
    monkeypatch.setattr(runtime.host_costs, "calibrate", lambda device, seconds: asked.append(device) or here_costs)
    hw, line = sr.with_local_host_costs(h200, "cuda:0")
    assert hw.host == here_costs and asked == ["cuda:0"]
    assert dataclasses.replace(hw, host=h200.host) == h200  # nothing else changes
    assert line == (
        "the runtime's host costs measured on this machine: an op 9.5 us, a region 114 us, a replayed op 187 us "
        "(the h200 profile's: 5.9, 92, 127)"
    )
    assert sr.with_local_host_costs(h200, None) == (h200, "")  # planned for a GPU that is not here
    assert sr.with_local_host_costs(cpu, "cpu") == (cpu, "") and asked == ["cuda:0"]
    from autotune import train as tr
    from runtime.hardware import Detection

    monkeypatch.setattr(tr, "detect", lambda: Detection(h200, "NVIDIA H200", None, "detected"))
    assert tr._profile_for("cuda") == hw and asked == ["cuda:0", "cuda"]  # autotune train's prediction too


def test_train_warns_where_the_allocator_freed_segments_to_make_room(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`autotune train` warns where the caching allocator freed cached segments within the budget's cap, as the
    measured search counts a finalist that did so as no fit: segments freed without a full retry count too."""
    import numpy as np

    from autotune import train as tr
    from autotune.workloads import TraceRequest, trace_model
    from runtime.measure import IterationMeasurement
    from runtime.policy import Policy

    w, _ = trace_model(TraceRequest(model="tests.test_env:deep_mlp", batch_size=64))
    path = tmp_path / "mlp.policy.json"
    Policy.from_vector(w, np.zeros(len(w.candidates), dtype=np.int8), hardware="cpu").save(path)
    for retries, freed, warned in ((0, 0, False), (0, 3, True), (1, 4, True)):
        steps = [IterationMeasurement(1000, 0.01, 6400.0, 2048, retries, freed)]
        monkeypatch.setattr(tr, "run_iterations", lambda *a, s=steps, **k: s)
        code, out, err = run(capsys, "train", "--policy", str(path))
        assert code == 0, err
        line = " ".join(out.split())
        assert ("the caching allocator ran out of room within the budget" in line) is warned, (retries, freed)
        assert not warned or f"freed {freed} cached segments to go on ({retries} times all it held" in line


def test_a_policy_searched_with_adamw_trains_with_adamw(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The policy file records the optimizer it was traced with: `autotune simulate --policy` and `autotune
    train` take it by default (both refused it before: sgd's state has other sizes, reported as "other tensor
    sizes" at the same batch size), and another one is refused naming both."""
    path = tmp_path / "adamw.policy.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "--batch-size", "2", "--gpu", "cpu", "--optimizer",
                       "adamw", "--action", "recompute", "--save-policy", str(path), "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(path.read_text())["optimizer"] == "adamw"
    code, out, err = run(capsys, "simulate", "--policy", str(path), "--json")
    assert code == 0, err
    code, out, err = run(capsys, "train", "--policy", str(path), "--steps", "2", "--json")
    assert code == 0, err
    trained = json.loads(out)
    assert trained["iterations"] and isinstance(trained["measured"]["peak_bytes"], int)  # one step's, in bytes
    line = user_error(capsys, "simulate", "--policy", str(path), "--optimizer", "sgd")
    assert "made for training with adamw" in line and "drop --optimizer" in line


@pytest.mark.parametrize("where", ["missing/x.json", "file.txt/x.json", "folder"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    """--out under a folder that does not exist or under a file, or naming a folder: one line, exit 2, before
    the trace (it said "internal error" after the whole search)."""
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "folder").mkdir()
    out = str(tmp_path / where)
    line = user_error(capsys, "search", "--model", "resnet18", "--budget", "1GB", "--out", out)
    assert "--out" in line and out in line
    assert "--save-policy" in user_error(capsys, "simulate", "--model", "resnet18", "--action", "keep",
                                         "--save-policy", out)  # fmt: skip
    if where == "folder":  # the file suggested in it is of the output's kind (an HTML report was "out.json")
        line = user_error(capsys, "simulate", "--model", "resnet18", "--action", "keep", "--timeline", out)
        assert line.endswith(f"expected a file name in it, e.g. {Path(out).resolve() / 'timeline.html'}"), line
    assert not list(tmp_path.glob("**/*.tmp"))


def test_outputs_where_nothing_can_be_made_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder where permissions say yes but no file can be made (/proc), a file named as an output folder,
    a storage the dashboard cannot open: one line, exit 2, before the work (each was an "internal error"
    after it, the finished search lost)."""
    import autotune.workloads

    def no_trace(*_: object, **__: object) -> None:
        raise AssertionError("traced before the inputs were checked")

    monkeypatch.setattr(autotune.workloads, "trace_model", no_trace)
    (tmp_path / "file.json").write_text("{}")
    line = user_error(capsys, "search", "--model", "resnet18", "--budget", "1GB", "--out", "/proc/autotune.json")
    assert "--out '/proc/autotune.json': cannot write in the folder '/proc'" in line
    line = user_error(
        capsys, "baselines", "--model", "resnet18", "--budget", "1GB", "--save", str(tmp_path / "file.json")
    )
    assert "--save" in line and "is a file" in line
    line = user_error(
        capsys, "sweep", "--models", "resnet18", "--budgets", "1GB", "--out-dir", str(tmp_path / "file.json")
    )
    assert "--out-dir" in line and "is a file" in line
    assert "cannot open it" in user_error(capsys, "dashboard", "--storage", "bogus://")
    assert "no such file" in user_error(capsys, "dashboard", "--storage", f"sqlite:///{tmp_path / 'none.db'}")
    # an in-memory database passed the checks and failed inside the server (a QA run)
    assert "in-memory database" in user_error(capsys, "dashboard", "--storage", "sqlite://")
    assert not (tmp_path / "none.db").exists()


def test_inputs_are_checked_before_the_cpu_is_calibrated(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--gpu cpu`` calibrates this CPU (seconds, tens of seconds on a busy machine): an unknown model, a bad
    budget, batch, optimizer, precision, device or partition is said before it."""
    import runtime.hardware

    def no_calibration(*_: object, **__: object) -> None:
        raise AssertionError("calibrated before the inputs were checked")

    monkeypatch.setattr(runtime.hardware, "calibrate_cpu", no_calibration)
    monkeypatch.setattr(runtime.hardware, "_calibrate_cpu", no_calibration)
    base = ["--model", "resnet18", "--budget", "1GB", "--gpu", "cpu"]
    cases = [
        (["--model", "resnet999"], "unknown model 'resnet999'"),
        (["--budget", "0"], "invalid size '0'"),
        (["-b", "0"], "invalid batch size 0"),
        (["--optimizer", "adamm"], "unknown optimizer 'adamm'"),
        (["--precision", "fp8"], "unknown precision 'fp8'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--partition", "layer1"], "invalid --partition 'layer1'"),
        (["--partition", "layer1/2", "--allow-partition"], "--partition layer1/2 with --allow-partition"),
        (["--heartbeat", "0"], "invalid --heartbeat 0"),
        # click reads "nan" and "inf" as floats, and nan passed every range check: an internal error (heartbeat),
        # or a search with no time limit (timeout).
        (["--heartbeat", "nan"], "invalid --heartbeat nan"),
        (["--heartbeat", "inf"], "invalid --heartbeat inf"),
        (["--timeout", "nan"], "invalid --timeout nan"),
        # Options that torch.compile cannot serve: said after 54 s of calibration and tracing on a busy machine.
        (["--compile", "--allow-partition"], "--compile with --partition/--allow-partition"),
        (["--compile", "--allow-compress"], "--compile with --allow-compress"),
        # Said after about 10 s of calibration (a QA run), or not at all: the CPU has no caching allocator.
        (["--host-memory", "lots"], "--host-memory: invalid size 'lots'"),
        # A number alone was taken as bytes: "--host-memory 64" planned with 64 bytes of host memory.
        (["--host-memory", "64"], "invalid --host-memory '64': without a unit that is 64 bytes"),
        (["--seq-len", "16"], "--seq-len 16 given for image model 'resnet18'"),
        (["--budget-kind", "reserved"], "--budget-kind reserved with --gpu cpu"),
        (["--expandable-segments"], "--expandable-segments with --gpu cpu"),
    ]
    for extra, said in cases:
        assert said in user_error(capsys, "search", *base, *extra), extra
    mb = ["maxbatch", *base]
    assert "invalid --max-slowdown nan" in user_error(capsys, *mb, "--max-slowdown", "nan")
    assert "invalid --per-size nan" in user_error(capsys, *mb, "--per-size", "nan")
    sweep = ["sweep", "--models", "resnet18", "--budgets", "1GB"]
    assert "invalid --timeout nan" in user_error(capsys, *sweep, "--trials", "15", "--timeout", "nan")
    assert "invalid --time-limit inf" in user_error(capsys, "baselines", *base, "--time-limit", "inf")
    both = ["--partition", "layer1/2", "--allow-partition"]
    assert "pass one of the two" in user_error(capsys, "baselines", *base, *both)
    assert "unknown model 'nosuch'" in user_error(capsys, "sweep", "--models", "resnet18,nosuch", "--budgets", "1GB",
                                                  "--gpu", "cpu")  # fmt: skip
    assert "unknown model" in user_error(capsys, "simulate", "--model", "resnet999", "--gpu", "cpu", "--action", "keep")
    assert "invalid --top -1" in user_error(capsys, "profile", "--model", "resnet18", "--gpu", "cpu", "--top", "-1")


def test_an_error_message_is_printed_as_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A key in a schema error, ``block.0#0.0:Cat``, printed as a cat emoji (rich's ``:cat:`` code); ``[x]``
    would have been read as markup."""
    policy = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "--batch-size", "2", "--gpu", "cpu", "--action",
                       "keep", "--save-policy", str(policy), "--json")  # fmt: skip
    assert code == 0, err
    data = json.loads(policy.read_text())
    data["actions"]["d1.0#0.0:Cat"] = "teleport [x]"
    policy.write_text(json.dumps(data))
    line = user_error(capsys, "simulate", "--policy", str(policy))
    assert "d1.0#0.0:Cat" in line and "teleport [x]" in line


def test_settings_a_policy_file_refuses_are_refused_before_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another batch size, precision, accumulation or optimizer than the policy file's: refused at once with
    the flag to drop (they were refused after a real trace of the model, 20-40 s)."""
    import autotune.train
    import autotune.workloads

    path = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "--batch-size", "2", "--gpu", "cpu", "--action",
                       "keep", "--save-policy", str(path), "--json")  # fmt: skip
    assert code == 0, err

    def no_trace(*_: object, **__: object) -> None:
        raise AssertionError("traced")

    monkeypatch.setattr(autotune.workloads, "trace_model", no_trace)
    monkeypatch.setattr(autotune.train, "trace_model", no_trace)
    for cmd in ("simulate", "train"):
        for flag, value in (("--batch-size", "4"), ("--precision", "bf16"), ("--grad-accum", "2"),
                            ("--optimizer", "adam")):  # fmt: skip
            line = user_error(capsys, cmd, "--policy", str(path), flag, value)
            assert flag in line and "drop" in line, line
        # Another model's name: its parameters are compared on a fake build, before any trace.
        assert "other parameters" in user_error(capsys, cmd, "--policy", str(path), "--model", "resnet34")


def test_a_portfolio_search_run_again_says_it_resumes_its_studies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The portfolio's Optuna phases run in NAME.explore and NAME.seeded: a second run with the same --study
    said nothing of them (it looked for NAME alone). (A budget below the no-policy peak: above it keeping
    everything is the answer, with no search; in tensor bytes: at this size no policy below that peak runs on
    the caching allocator's model.)"""
    args = ["search", "--model", "resnet18", "--batch-size", "2", "--gpu", "a100-40gb", "--budget", "180MB",
            "--budget-kind", "allocated",
            "--reserve", "8MiB", "--timeout", "4", "--study", "again", "--storage", f"sqlite:///{tmp_path / 's.db'}",
            "--out", str(tmp_path / "p.json")]  # fmt: skip
    code, _, err = run(capsys, *args)
    assert code == 0 and "resuming" not in err, err
    code, _, err = run(capsys, *args)
    # Which of its phases the first run's 4 s reached depends on the machine's load: one of them is named.
    said = "again.seeded (" in err or "again.explore (" in err
    assert code == 0 and "resuming the search's Optuna studies" in err and said, err


def test_an_unknown_hardware_profile_in_a_policy_file_names_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "--batch-size", "2", "--gpu", "a100-40gb",
                       "--action", "keep", "--save-policy", str(path), "--json")  # fmt: skip
    assert code == 0, err
    path.write_text(path.read_text().replace('"hardware": "a100-40gb"', '"hardware": "h900"'))
    line = user_error(capsys, "simulate", "--policy", str(path))
    assert line.startswith(f"error: {path}: hardware: unknown hardware profile 'h900'") and "--gpu" in line


def test_a_policy_files_reserve_that_leaves_nothing_of_its_budget_is_refused_before_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose reserve_bytes is not below its budget (edited by hand): simulate traced, planned for 0 B and
    exited 0 with "exceeds it" (a QA run); refused at once, as --reserve is (Budget.check_left)."""
    import autotune.workloads

    path = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "--batch-size", "2", "--gpu", "a100-40gb",
                       "--action", "keep", "--budget", "1GB", "--save-policy", str(path), "--json")  # fmt: skip
    assert code == 0, err
    d = json.loads(path.read_text())
    d["reserve_bytes"] = 2 * d["budget_bytes"]
    path.write_text(json.dumps(d))

    def no_trace(*_: object, **__: object) -> None:
        raise AssertionError("traced")

    monkeypatch.setattr(autotune.workloads, "trace_model", no_trace)
    for more in ([], ["--budget", "2GB"]):  # the file's budget, or one given that the reserve still leaves nothing of
        line = user_error(capsys, "simulate", "--policy", str(path), *more)
        assert line.startswith(f"error: {path}: budget ") and "leaves nothing after the file's 1.86 GiB reserve" in line
        assert "expected a reserve below the budget; pass a --budget well above it" in line


def test_the_profilers_own_log_lines_stay_out_of_the_output() -> None:
    """`train --compile` measures the compiled peak with torch's profiler, whose log lines ("USDT ...
    profiler_start", "ERROR ... gpuGetDeviceCount failed" without a GPU) came out among the command's."""
    import os
    import subprocess
    import sys

    code = (
        "import autotune.cli, torch\n"
        "from runtime.measure import profiler_peak_bytes\n"
        "print(profiler_peak_bytes(lambda: torch.ones(8) * 2, 0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "profiler_start" not in done.stdout + done.stderr and "gpuGetDeviceCount" not in done.stderr


def test_python_dash_m_autotune_is_the_command_line() -> None:
    """``python -m autotune`` said "'autotune' is a package and cannot be directly executed" (a QA run)."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "autotune", "search", "--model", "resnet18", "--budget", "6"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "e.g. 6GB or 6GiB" in done.stderr, done.stderr


def test_profile_says_what_search_plans_for_at_the_same_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU profile `profile --budget 300MiB` said the no-policy peak fits with 9.86 MiB to spare, and
    `search --budget 300MiB` refused the budget as below what any policy needs: search plans for the budget
    less its reserve (a QA run). Profile now says that too, and the two agree."""
    args = ["--model", "resnet18", "--batch-size", "8", "--gpu", "a100-40gb", "--budget", "300MiB"]
    code, out, err = run(capsys, "profile", *args, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["fits"] and not r["fits_planned"] and r["planned_below_floor"]
    assert r["planned_budget_bytes"] == 300 * 2**20 - r["reserve_bytes"] and r["reserve_bytes"] == 128 * 2**20
    code, out, _ = run(capsys, "profile", *args)
    assert code == 0 and "plans for the budget less a 128.00 MiB reserve" in " ".join(out.split())
    # The no-policy speed as simulate (and search, sweep) say it: the host's clock included, not compute alone.
    code, out, err = run(capsys, "simulate", *args[:6], "--action", "keep", "--json")
    assert code == 0, err
    assert json.loads(out)["no_policy"]["samples_per_s"] == r["samples_per_s"]
    assert r["iter_s"] > r["compute_s"]
    assert "that any policy needs" in user_error(capsys, "search", *args)


def test_simulate_plans_a_saved_policy_as_its_search_did(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """baselines plans for the budget less the reserve kept back for workspaces (128 MiB on a GPU profile) and
    found Capuchin's policy over that; simulate checked the saved file against the whole budget and said it
    fits (a QA run: resnet18 b16 at 484MB on a100-40gb). The file records the reserve, and simulate plans as
    the search did, with the default reserve where a budget is given on its command line."""
    from autotune.budget import DEFAULT_GPU_RESERVE
    from runtime.policy import load_policy

    # in tensor bytes, as simulate's "feasible" counts them (the caching allocator's model: the test below)
    args = ["--model", "resnet18", "--batch-size", "16", "--gpu", "a100-40gb", "--budget", "484MB", "--budget-kind",
            "allocated"]  # fmt: skip
    methods = "capuchin,megtaichi,delta"
    code, out, err = run(capsys, "baselines", *args, "--only", methods, "--save", str(tmp_path), "--json")
    assert code == 0 and err == "", err  # --json writes nothing else, not even the bar's empty line
    answer = json.loads(out)
    rows = answer["methods"]
    planned = 484_000_000 - DEFAULT_GPU_RESERVE
    assert (answer["model"], answer["batch_size"], answer["gpu"]) == ("resnet18", 16, "a100-40gb")
    assert (answer["budget_bytes"], answer["planned_budget_bytes"]) == (484_000_000, planned)
    assert answer["saved_to"] == str(tmp_path) and answer["partitions"] == []
    fastest = max((r for r in rows if r["feasible"] and not r["exact"]), key=lambda r: r["samples_per_s"])
    assert answer["best_heuristic"] == fastest["method"]
    # Capuchin's policy (megtaichi's with CUBLAS_WORKSPACE_CONFIG=:0:0, which sizes the traced workspaces) is
    # over the planned budget and within the whole one: the case that was told otherwise.
    assert any(planned < r["peak_bytes"] <= 484_000_000 for r in rows), rows
    for row in rows:  # one that does not fit says so in its name (nothing told them apart)
        fits = "" if row["status"] == "FEASIBLE" else ".infeasible"
        path = tmp_path / f"resnet18.{row['method']}{fits}.policy.json"
        policy = load_policy(path)
        assert (policy.budget_bytes, policy.reserve_bytes) == (484_000_000, DEFAULT_GPU_RESERVE)
        code, out, err = run(capsys, "simulate", "--policy", str(path), "--json")
        assert code == 0, err
        got = json.loads(out)
        assert got["feasible"] == (row["status"] == "FEASIBLE") and got["peak_bytes"] == row["peak_bytes"]
        assert (got["budget_bytes"], got["planned_budget_bytes"]) == (484_000_000, planned)
    over = next(r for r in rows if planned < r["peak_bytes"] <= 484_000_000)
    path = tmp_path / f"resnet18.{over['method']}.infeasible.policy.json"
    code, out, err = run(capsys, "simulate", "--policy", str(path))
    assert "(planned): exceeds it by" in out and "less the file's 128.00 MiB reserve" in err, (out, err)
    # A uniform action's options beside a file were ignored, the file's own scored (a QA run): refused.
    for flag in (["--lookahead", "0"], ["--lossy"], ["--checkpoint-regions"]):
        assert "applies with --action" in user_error(capsys, "simulate", "--policy", str(path), *flag)
    code, out, err = run(capsys, "simulate", "--policy", str(path), "--budget", "600MB", "--json")
    assert json.loads(out)["feasible"] and json.loads(out)["planned_budget_bytes"] == 600_000_000 - DEFAULT_GPU_RESERVE


def test_baselines_save_names_files_without_the_factorys_colon(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A factory model (``pkg.mod:fn``) saved as ``pkg.mod:fn.delta.policy.json``: a colon is not allowed in a
    Windows file name. Named as search, maxbatch and sweep name theirs (``_`` for ``:`` and ``/``)."""
    args = ["--model", "experiments.user_models:groupnorm_cnn", "--batch-size", "2", "--gpu", "a100-40gb"]
    code, _, err = run(capsys, "baselines", *args, "--budget", "1GB", "--only", "delta", "--save", str(tmp_path))
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["experiments.user_models_groupnorm_cnn.delta.policy.json"]
    # Saved again where it does not fit (MegTaiChi plans 19.58 MiB there, without cuBLAS workspaces: conftest),
    # then where it does: each run leaves one file for the method, of its own kind (the fitting one stayed beside
    # the over-budget one, a QA run).
    for budget, name in (("20MB", "megtaichi.infeasible"), ("1GB", "megtaichi")):
        code, _, err = run(capsys, "baselines", *args, "--reserve", "0", "--budget", budget, "--only", "megtaichi",
                           "--save", str(tmp_path))  # fmt: skip
        assert code == 0, err
        assert sorted(p.name for p in tmp_path.glob("*megtaichi*")) == [
            f"experiments.user_models_groupnorm_cnn.{name}.policy.json"
        ]


def test_a_study_made_for_another_problem_is_not_resumed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--study NAME`` given again for another budget resumed the first search's study: its 3 trials counted
    toward --trials (nothing new ran) and TPE would learn from values scored on the other problem (a QA run).
    It is refused before the baselines, naming both problems; the same problem resumes as before. (Budgets below
    the no-policy peak, 220,300,800 bytes: above it keeping everything is the answer, with no search; in tensor
    bytes, as no policy below that peak runs on the caching allocator's model at this size.)"""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    base = ["search", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--reserve", "0",
            "--searcher", "optuna-tpe", "--trials", "3", "--study", "mine", "--storage", storage, "--budget-kind",
            "allocated"]  # fmt: skip
    code, _, err = run(capsys, *base, "--budget", "210MB", "--out", str(tmp_path / "a.json"))
    assert code == 0, err
    said = user_error(capsys, *base, "--budget", "200MB", "--out", str(tmp_path / "b.json"))
    assert "study 'mine'" in said and "within 210000000 bytes, not for" in said and "within 200000000" in said
    assert not (tmp_path / "b.json").exists()
    code, _, err = run(capsys, *base, "--budget", "210MB", "--out", str(tmp_path / "a.json"))
    assert code == 0 and "resuming study mine" in err, err


@pytest.mark.parametrize("command", [["profile"], ["simulate", "--action", "keep"]])
def test_a_budget_above_the_gpus_memory_is_flagged_where_it_is_checked(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """search, baselines and maxbatch warned of a budget above the card's memory; profile and simulate said
    "fits" without a word."""
    code, _, err = run(capsys, *command, "--model", "resnet18", "-b", "2", "--gpu", "a100-40gb", "--budget", "50GB")
    assert code == 0 and "warning: the budget is more than the 40.00 GiB of memory the a100-40gb has" in err, err


def test_a_files_sequence_length_for_an_image_model_names_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A resnet18 policy with a seq_len (edited, or another model's): train and simulate blamed a --seq-len flag
    the user never gave ("leave it unset")."""
    path = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", "--model", "resnet18", "-b", "2", "--gpu", "a100-40gb", "--action", "keep",
                       "--save-policy", str(path))  # fmt: skip
    assert code == 0, err
    d = json.loads(path.read_text())
    d["seq_len"] = 64
    path.write_text(json.dumps(d))
    for command in (["train", "--policy", str(path)], ["simulate", "--policy", str(path)]):
        message = user_error(capsys, *command)
        assert f"{path}: seq_len 64 does not apply to 'resnet18': the policy was made for another model" in message


def test_a_fake_build_says_nothing_of_data_pointers(capsys: pytest.CaptureFixture[str]) -> None:
    """nn.TransformerEncoder deep-copies its layer: built with fake tensors, PyTorch warned "Accessing the data
    pointer of FakeTensor is deprecated ... almost definitely a bug in your code" on every command."""
    code, _, err = run(capsys, "profile", "--model", "tests.fixtures_models:make_transformer_encoder", "--gpu",
                       "a100-40gb")  # fmt: skip
    assert code == 0 and "FakeTensor" not in err, err


def test_simulate_and_baselines_trace_a_plan_for_this_cpu_as_search_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``search --gpu cpu`` traces in real mode (the ops timed on this CPU); ``simulate`` and ``baselines``
    traced the same plan in fake mode, the cpu profile's roofline times, another workload: simulate said a
    searched policy was 754% slower than no policy where its search had said 203% (a QA run, a reused block at
    batch 64). They trace as search does; a plan for a GPU profile stays fake."""
    import autotune.workloads as wl

    traced: list[tuple[str, str]] = []
    trace_model = wl.trace_model

    def spy(req):  # type: ignore[no-untyped-def]
        traced.append((req.mode, req.device))
        return trace_model(req)

    monkeypatch.setattr(wl, "trace_model", spy)
    model = ["--model", "tests.fixtures_models:make_wide", "--batch-size", "4"]
    path = tmp_path / "p.json"
    code, _, err = run(capsys, "simulate", *model, "--gpu", "cpu", "--action", "recompute", "--save-policy", str(path))
    assert code == 0, err
    code, _, err = run(capsys, "simulate", "--policy", str(path), "--json")
    assert code == 0, err
    code, _, err = run(capsys, "baselines", *model, "--gpu", "cpu", "--budget", "1GB", "--only", "checkpoint-sqrt")
    assert code == 0, err
    assert traced == [("real", "cpu")] * 3
    code, _, err = run(capsys, "simulate", *model, "--gpu", "a100-40gb", "--action", "keep", "--json")
    assert code == 0, err
    assert traced[-1] == ("fake", "cpu")


def test_a_budget_without_a_unit_is_refused_below_a_mebibyte_and_650000B_is_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--budget 6`` is a unit left out, not 6 bytes: refused, naming the ways to write it; ``650000B`` is
    650,000 bytes (the message had said such a budget was "not enough to train anything", true of no model)."""
    said = user_error(capsys, "simulate", "--model", "resnet18", "--action", "keep", "--budget", "650000")
    assert "'650000'" in said and "e.g. 6GB or 6GiB" in said and "650000B if you mean bytes" in said
    assert "650000GB" not in said  # a unit on thousands (650 TB) is no likely meaning
    code, out, err = run(capsys, "simulate", "--model", "tests.fixtures_models:make_wide", "--gpu", "cpu",
                         "--action", "keep", "--budget", "650000B", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["budget_bytes"] == 650_000
