"""`autotune sweep`: one study per cell in one storage, resumed without recomputing, a killed worker's trial
retried (heartbeats), and a self-contained report (NOTE [ Sweep storage ] in autotune/sweep.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agents.optuna_search import retried_trial_number
from autotune.workloads import TraceRequest, trace_model
from tests.conftest import SWEEP_ARGS, SweepRun, autotune


def _study(storage: str, name: str):  # type: ignore[no-untyped-def]
    import optuna

    return optuna.load_study(study_name=name, storage=storage)


def test_one_study_per_cell_with_the_baselines_beside_it(sweep_run: SweepRun) -> None:
    import optuna

    cells = sweep_run.out["cells"]
    budgets = [150_000_000, 235_000_000, 260_000_000]
    assert [c["budget_bytes"] for c in cells] == budgets
    assert {f"sweep.resnet18.b8.a100-40gb.{b}" for b in budgets} <= set(optuna.get_all_study_names(sweep_run.storage))
    # 150 MB is below what any policy needs (parameters, gradients, momentum and the largest op): no search.
    low = _study(sweep_run.storage, cells[0]["study"])
    assert cells[0]["below_floor"] and low.user_attrs["below_floor"] and not low.trials
    # ... and says what the floor is, as search does (it said "below the floor" alone).
    from agents.base import Problem
    from autotune.search import budget_floor
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile

    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=8, target=hw))
    floor = budget_floor(Problem(w, hw, 1 << 40))
    assert cells[0]["floor_bytes"] == floor > cells[0]["planned_budget_bytes"]
    # The floor as a budget to type, as the table says it (the reserve added back) and as budget_bytes is typed.
    assert cells[0]["floor_budget_bytes"] == floor + cells[0]["reserve_bytes"] > cells[0]["budget_bytes"]
    assert [c["floor_bytes"] for c in cells[1:]] == [None, None]
    for c in cells[1:]:
        study = _study(sweep_run.storage, c["study"])
        attrs = study.user_attrs
        assert set(attrs["baselines"]) >= {"capuchin", "dtr", "checkpoint-sqrt"}
        assert attrs["done"] == ["baselines"] and c["resumed"] == []
        assert Counter(t.state.name for t in study.trials) == {"COMPLETE": 15}
        # Fits; never faster than no policy, never slower than the best heuristic (a seed of the search).
        assert c["peak_bytes"] <= c["planned_budget_bytes"]
        assert c["best_heuristic_samples_per_s"] <= c["samples_per_s"] <= c["no_policy_samples_per_s"]
    policies = sorted(p.name for p in sweep_run.folder.glob("*.policy.json"))
    assert len(policies) == sum(c["samples_per_s"] is not None for c in cells)


def test_the_policies_written_are_the_ones_scored(sweep_run: SweepRun) -> None:
    """--out-dir wrote each cell's best with only three of its options (release_after and region_nodes fell
    back to their defaults: a QA run's mobilenet_v2 cell said 302.89 samples/s for capuchin's policy, whose
    file simulated at 288.73), no prediction and 0 trials. Each file now carries every option it was scored
    with, and simulates to the sweep's figures."""
    from autotune.workloads import TraceRequest, trace_model
    from envs.simulator import Simulator
    from runtime.hardware import get_profile
    from runtime.policy import load_policy

    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=8, target=hw))
    sim = Simulator(w, hw)
    for c in sweep_run.out["cells"]:
        if c["samples_per_s"] is None:
            continue
        best = _study(sweep_run.storage, c["study"]).user_attrs["best"]
        (path,) = sweep_run.folder.glob(f"*{c['budget_bytes']}*.policy.json") or [None]
        assert path is not None, c["budget_bytes"]
        policy = load_policy(path, w)
        assert {k: getattr(policy.options, k) for k in best["options"]} == best["options"]
        assert set(best["options"]) >= {"release_after", "region_nodes", "prefetch_lookahead"}
        r = sim.run(policy)
        assert r.samples_per_s == c["samples_per_s"] and r.peak_bytes == c["peak_bytes"]
        assert policy.predicted is not None and policy.predicted.samples_per_s == c["samples_per_s"]
        assert policy.provenance.trials > 0


def test_a_cell_of_another_optimizer_or_sequence_length_is_a_study_of_its_own() -> None:
    """A sweep again with --optimizer adam (or another --seq-len) on the same storage resumed the first one's
    studies, whose names left both out, and answered with their policies (a QA run: an SGD plan labelled adam,
    38.27 MiB over its budget)."""
    import dataclasses

    from autotune.sweep import cell_study_name
    from runtime.hardware import get_profile
    from tests.synthetic import chain_workload

    w, hw = chain_workload(4, 2**20, 1e-3), get_profile("a100-40gb")
    names = {
        cell_study_name(w, hw, 10**9),
        cell_study_name(dataclasses.replace(w, optimizer="adam"), hw, 10**9),
        cell_study_name(dataclasses.replace(w, seq_len=128), hw, 10**9),
        cell_study_name(dataclasses.replace(w, seq_len=256), hw, 10**9),
    }
    assert len(names) == 4


def test_running_again_recomputes_nothing(sweep_run: SweepRun) -> None:
    """Nor the no-policy row: the one stored with the cell's figures stands (on the cpu profile, calibrated
    again by each run, a row simulated again could be slower than the stored heuristics it is the ceiling
    of). Marked here by a stored value no simulation gives."""
    study = _study(sweep_run.storage, sweep_run.out["cells"][1]["study"])
    stored = study.user_attrs["no_policy"]
    study.set_user_attr("no_policy", {**stored, "samples_per_s": 12345.5})
    try:
        proc = autotune(*SWEEP_ARGS, "--storage", sweep_run.storage, "--json")
    finally:
        study.set_user_attr("no_policy", stored)
    again = json.loads(proc.stdout)["cells"]
    assert again[1]["no_policy_samples_per_s"] == 12345.5
    for first, second in zip(sweep_run.out["cells"], again, strict=True):
        assert second["resumed"] == ["baselines", "optuna"]
        assert second["samples_per_s"] == first["samples_per_s"]
        assert len(_study(sweep_run.storage, second["study"]).trials) == (0 if second["below_floor"] else 15)
    # The table's footer names the studies as they are (it gave a pattern without the image size, of typed bytes).
    shown = autotune(*SWEEP_ARGS, "--storage", sweep_run.storage)
    table = "".join(shown.stdout.split())
    assert again[0]["study"] in table
    # A run that found every cell done says so (it said "0 s" alone), and no bar is drawn where stderr is no
    # terminal (cut to the width, "━━ 4… 0:…", in a log).
    assert "(3of3resumedfromthestorage)" in table and "━" not in shown.stderr


def test_a_cell_its_timeout_stopped_is_not_searched_again(tmp_path: Path) -> None:
    """A cell whose Optuna search ended on --timeout before --trials was searched again, for another --timeout, on
    every run of the same command (its trials 12 -> 23 -> 34, and one answer changed: 1,870.2 -> 1,884.5 samples/s,
    its file rewritten). Now the same command recomputes nothing; a larger --trials goes on."""
    storage = f"sqlite:///{tmp_path / 't.db'}"
    args = [*SWEEP_ARGS[:5], "--budgets", "235MB", "--gpu", "a100-40gb", "--timeout", "2", "--reserve", "0",
            "--methods", "optuna", "--storage", storage, "--json"]  # fmt: skip
    first = json.loads(autotune(*args, "--trials", "100000").stdout)["cells"][0]
    n = len(_study(storage, first["study"]).trials)
    assert 0 < n < 100000 and first["resumed"] == []
    again = json.loads(autotune(*args, "--trials", "100000").stdout)["cells"][0]
    assert again["resumed"] == ["optuna"] and again["samples_per_s"] == first["samples_per_s"]
    assert len(_study(storage, first["study"]).trials) == n
    json.loads(autotune(*args, "--trials", "200000").stdout)
    assert len(_study(storage, first["study"]).trials) > n


def test_a_cell_no_method_fits_says_so() -> None:
    """Above the floor, with no method of the sweep's finding a policy that fits (a QA run: the GroupNorm CNN with
    Adam at 65 MiB on a100-40gb, where `autotune search` answers 4,047.5 samples/s), the row read "—" in every
    column, as if the cell had not run, and no line said why. A cell below its floor and one that fits are as
    before."""
    from io import StringIO

    from rich.console import Console

    from autotune.sweep import CellResult, SweepOutcome, render

    def cell(budget: int, **kw: object) -> CellResult:
        return CellResult(model="m", batch_size=8, profile="p", budget_bytes=budget, study_name=f"s{budget}",
                          no_policy={"peak_bytes": 1000, "samples_per_s": 100.0}, **kw)  # type: ignore[arg-type]  # fmt: skip

    cells = [cell(500), cell(100, below_floor=True, floor_bytes=300),
             cell(900, best={"method": "optuna", "samples_per_s": 90.0, "peak_bytes": 600})]  # fmt: skip
    buf = StringIO()
    render(Console(file=buf, width=300), SweepOutcome(cells, {}, {}, 1.0), "sqlite:///x.db", None)
    rows = [line for line in buf.getvalue().splitlines() if line.startswith("│ m")]
    assert [r.split("│")[-2].strip() for r in rows] == [
        "none fits",
        "below the floor: no policy under 300 B",
        "90.0 optuna",
    ]
    assert "1 cell found no fitting policy (m p 500 B), above what no policy can go below: `autotune search`" in (
        buf.getvalue()
    )
    # The dashboard's command as printed runs as pasted: a storage path with a space is quoted.
    buf = StringIO()
    render(Console(file=buf, width=300), SweepOutcome(cells, {}, {}, 1.0), "sqlite:///a b/x.db", None)
    assert "`autotune dashboard --storage 'sqlite:///a b/x.db'` opens them" in buf.getvalue()


@pytest.mark.slow
def test_a_killed_worker_loses_no_trial(tmp_path: Path) -> None:
    """SIGKILL mid-search (after 10 of 50 trials); the next run fails the dead trial (its heartbeat stopped),
    retries it and completes the study."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'k.db'}"
    args = [*SWEEP_ARGS[:5], "--budgets", "235MB", "--gpu", "a100-40gb", "--trials", "50", "--timeout", "300",
            "--reserve", "0"]  # fmt: skip
    args += ["--storage", storage, "--heartbeat", "1", "--json"]
    root = Path(__file__).resolve().parents[1]
    worker = subprocess.Popen([sys.executable, "-m", "autotune.cli", *args], cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    name = "sweep.resnet18.b8.a100-40gb.235000000"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the search is well under way
        time.sleep(0.5)
        try:
            if len(_study(storage, name).get_trials(states=(optuna.trial.TrialState.COMPLETE,))) >= 10:
                break
        except Exception:
            continue
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    time.sleep(3)  # past the grace period (two heartbeats)
    out = json.loads(autotune(*args).stdout)
    study = _study(storage, name)
    states = Counter(t.state.name for t in study.trials)
    assert states["COMPLETE"] >= 50 and states["RUNNING"] == 0 and states["WAITING"] == 0, states
    failed = {t.number for t in study.trials if t.state.name == "FAIL"}
    retried = {retried_trial_number(t) for t in study.trials} - {None}
    assert failed == retried  # each dead trial ran again (at most one was in flight when it died)
    assert len(failed) <= 1
    assert out["cells"][0]["resumed"] == ["baselines"]


def test_report_is_self_contained(sweep_run: SweepRun) -> None:
    text = sweep_run.report.read_text()
    # plotly.js inline, nothing fetched: works offline (no script or stylesheet from elsewhere).
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=[\"']http", text)
    for i in range(5):
        assert f'id="plot-{i}"' in text
    assert "resnet18" in text and "Pareto front" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "baselines,magic"], "unknown method 'magic' in --methods 'baselines,magic'"),
        (["--budgets", "lots"], "lots"),
        (["--budgets", "300MiB,6"], "invalid --budgets '6': without a unit"),  # it named --budget
    ],
)
def test_bad_input_is_a_one_line_error(args: list[str], message: str) -> None:
    base = ["sweep", "--models", "resnet18", "--budgets", "200MB", "--gpu", "a100-40gb"]
    proc = autotune(*base, *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_each_profile_plans_on_a_trace_taken_for_it(tmp_path: Path) -> None:
    """Two GPUs of other compute capabilities (V100 7.0, A100 8.0): each model is traced once per kind of
    target (runtime/target.py) and each cell planned, reported and written on its own profile's trace."""
    storage, report, folder = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "report.html", tmp_path / "policies"
    args = ["sweep", "--models", "resnet18", "--batch-size", "8", "--budgets", "235MB", "--gpu",
            "v100-16gb,a100-40gb", "--trials", "5", "--timeout", "30", "--methods", "baselines,optuna", "--reserve",
            "0"]  # fmt: skip
    out = json.loads(autotune(*args, "--storage", storage, "--report", str(report), "--out-dir", str(folder),
                              "--json").stdout)  # fmt: skip
    assert [c["gpu"] for c in out["cells"]] == ["v100-16gb", "a100-40gb"]
    assert all(c["peak_bytes"] <= c["budget_bytes"] for c in out["cells"])
    written = sorted(p.name for p in folder.glob("*.policy.json"))
    # The file names say the problem (batch size and the rest, as the studies do): two sweeps of one model at
    # two batch sizes wrote one file, the last one's (a QA run).
    assert written == [f"resnet18.b8.{gpu}.235000000.policy.json" for gpu in ("a100-40gb", "v100-16gb")]
    assert report.exists()


def test_a_report_without_optuna_says_why_its_trial_figures_are_empty(tmp_path: Path) -> None:
    """With --methods baselines a cell fits, and the report's trial figures (every trial, search history) said
    "no fitting policy in any cell" (a QA run): they have no Optuna trials to draw, and say that."""
    report = tmp_path / "r.html"
    args = ["sweep", "--models", "resnet18", "--batch-size", "8", "--budgets", "235MB", "--gpu", "a100-40gb",
            "--methods", "baselines", "--reserve", "0", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--report",
            str(report), "--json"]  # fmt: skip
    (cell,) = json.loads(autotune(*args).stdout)["cells"]
    assert cell["samples_per_s"] is not None
    text = report.read_text()
    assert text.count("nothing to show (no Optuna trials: the sweep ran without optuna)") == 2
    assert "no fitting policy in any cell" not in text


def test_budgets_read_as_typed_and_one_below_the_reserve_is_refused(tmp_path: Path) -> None:
    """On a GPU profile the default reserve (128 MiB) is more than a budget of 100 MiB: such a cell planned for
    0 B, and every such budget of a model and profile shared one study (40MB and 80MB: the second cell said it
    had resumed the first's). It is refused before any work, as search and maxbatch refuse it. The JSON's
    ``budget_bytes`` is the budget as typed, as search's and maxbatch's are (it was the planned bytes), beside
    ``planned_budget_bytes``; the reserve said is the one kept back, and only where one is."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    base = ["sweep", "--batch-size", "8", "--trials", "2", "--timeout", "5", "--storage", storage, "--json"]
    proc = autotune(*base, "--models", "resnet18", "--gpu", "a100-40gb", "--budgets", "40MB,80MB", check=False)
    assert proc.returncode == 2 and "leaves nothing after the 128.00 MiB kept back" in proc.stderr, proc.stderr
    assert not (tmp_path / "s.db").exists()
    proc = autotune(*base, "--models", "resnet18", "--gpu", "a100-40gb,cpu", "--budgets", "150MB")
    cells = json.loads(proc.stdout)["cells"]
    assert [(c["gpu"], c["budget_bytes"], c["planned_budget_bytes"]) for c in cells] == [
        ("a100-40gb", 150_000_000, 150_000_000 - 128 * 2**20),
        ("cpu", 150_000_000, 150_000_000),
    ]
    assert "less a 128.00 MiB reserve for workspaces on a100-40gb" in proc.stderr, proc.stderr
    # A model, budget or profile given twice is one cell (resnet18,resnet18 x 100MiB,104857600 made four).
    proc = autotune("sweep", "--models", "resnet18,resnet18", "--batch-size", "8", "--gpu", "a100-40gb,a100-40gb",
                    "--budgets", "100MiB,104857600", "--reserve", "0", "--trials", "2", "--timeout", "5",
                    "--storage", storage, "--json")  # fmt: skip
    assert len(json.loads(proc.stdout)["cells"]) == 1


def test_a_resumed_agent_does_not_replace_a_better_stored_episode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``ppo`` column is the agent's best episode: an interrupted agent trains again when the sweep resumes,
    and its answer replaced the stored one even where slower (a QA sweep showed ppo 4,001.7 beside "chosen
    4,023.4 ppo"). Here the first run's agent answers Capuchin's policy and is interrupted, the resumed one
    answers checkpoint-sqrt's, slower."""
    import autotune.sweep as sw
    from agents.base import Problem, get_searcher
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile

    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=8, target=hw))
    budget = 235_000_000
    fast, slow = (get_searcher(n).search(Problem(w, hw, budget)) for n in ("capuchin", "checkpoint-sqrt"))
    assert fast.feasible and slow.feasible and fast.result.samples_per_s > slow.result.samples_per_s
    answers = [fast, slow]

    class Agent:
        def search(self, problem, ctx):  # type: ignore[no-untyped-def]
            if len(answers) == 2:
                ctx.interrupt()  # the first run is stopped in the agent: ppo is not done
            return answers.pop(0)

    real = sw.get_searcher
    monkeypatch.setattr(sw, "get_searcher", lambda name: Agent() if name == "ppo" else real(name))
    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = sw.run_cell(w, hw, budget, methods=["ppo"], storage=storage, trials=1, timeout_s=1)
    assert first.interrupted and first.ppo is not None
    second = sw.run_cell(w, hw, budget, methods=["ppo"], storage=storage, trials=1, timeout_s=1)
    assert not answers and not second.interrupted
    got = second.to_json()
    assert got["ppo_samples_per_s"] == fast.result.samples_per_s == got["samples_per_s"]


def test_a_method_that_ties_to_rounding_does_not_become_the_chosen_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's "chosen" column named ppo for an answer 1e-13 faster than the best heuristic's (the same
    policy's time, summed in another order): a tie keeps the method found first."""
    import autotune.sweep as sw
    from agents.base import Problem, baseline_names, get_searcher
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile

    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=8, target=hw))
    budget = 235_000_000
    found = [get_searcher(n).search(Problem(w, hw, budget)) for n in baseline_names()]
    top = max((r for r in found if r.feasible), key=lambda r: r.result.samples_per_s)
    tied = dataclasses.replace(
        top, result=dataclasses.replace(top.result, samples_per_s=top.result.samples_per_s * (1 + 1e-13))
    )

    class Agent:
        def search(self, problem, ctx):  # type: ignore[no-untyped-def]
            return tied

    real = sw.get_searcher
    monkeypatch.setattr(sw, "get_searcher", lambda name: Agent() if name == "ppo" else real(name))
    cell = sw.run_cell(w, hw, budget, methods=["baselines", "ppo"], storage=f"sqlite:///{tmp_path / 's.db'}",
                       trials=1, timeout_s=1)  # fmt: skip
    got = cell.to_json()
    assert got["ppo_samples_per_s"] > got["best_heuristic_samples_per_s"] == top.result.samples_per_s
    assert got["best_method"] == "baselines" and got["samples_per_s"] == top.result.samples_per_s


def test_the_report_marks_each_cells_answer_beside_its_trials() -> None:
    """The answer is refined after the Optuna trials (or is a baseline's), so it is no trial: the "every trial"
    chart had no point for it and the search history ended below the table's samples/s (2,368.09 against
    2,474.3 in a QA run). Both now mark it: no policy 1,000 bytes at 100 samples/s; trials at 80 and 85 samples/s
    (700 and 650 bytes); the answer 90 samples/s at 600 bytes: 40% saved, 11.1% slower."""
    from autotune.sweep import CellResult
    from autotune.sweep_report import _history, _pareto

    cell = CellResult(model="m", batch_size=8, profile="p", budget_bytes=800, study_name="s",
                      no_policy={"peak_bytes": 1000, "samples_per_s": 100.0},
                      best={"method": "optuna", "samples_per_s": 90.0, "peak_bytes": 600})  # fmt: skip
    trials = {"s": [{"number": 0, "samples_per_s": 80.0, "peak_bytes": 700, "feasible": True},
                    {"number": 1, "samples_per_s": 85.0, "peak_bytes": 650, "feasible": True}]}  # fmt: skip
    history = {t.name: t for t in _history([cell], trials).data}
    line, answer = history["m p 800 B"], history["m p 800 B: answer (optuna)"]
    assert list(line.y) == [80.0, 85.0] and list(answer.x) == [1] and list(answer.y) == [90.0]
    pareto = {t.name: t for t in _pareto([cell], trials).data}
    (x,), (y,) = pareto["each cell's answer"].x, pareto["each cell's answer"].y
    assert x == pytest.approx(40.0) and y == pytest.approx(100 * (100 / 90 - 1))
    assert sorted(pareto["trials"].x) == pytest.approx([30.0, 35.0])


def test_two_workers_racing_on_a_new_sqlite_storage_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sweeps started at once on a new SQLite file: one failed in 6 of 8 pairs (a QA run), where the other
    had made the file's tables between Optuna's check and its own ("table studies already exists"), or had
    taken the same queued trial (SQLite has no row lock) and stored it first ("Cannot tell a COMPLETE trial",
    as an internal error). Both now go on: the study is made again, the search goes on for its time left."""
    import optuna

    from agents.base import Problem, SearchContext, get_searcher
    from agents.optuna_search import create_study
    from runtime.hardware import get_profile
    from runtime.trace import capture
    from tests.test_trace import tiny_cnn_build

    real_create, real_optimize = optuna.create_study, optuna.study.Study.optimize
    raised = {"create": 0, "tell": 0}

    def racing_create(**kw):  # type: ignore[no-untyped-def]
        if not raised["create"]:
            raised["create"] += 1
            raise RuntimeError("(sqlite3.OperationalError) table studies already exists")
        return real_create(**kw)

    def racing_optimize(self, *a, **kw):  # type: ignore[no-untyped-def]
        if not raised["tell"]:
            raised["tell"] += 1
            real_optimize(self, *a, **{**kw, "n_trials": 1})
            raise ValueError("Cannot tell a COMPLETE trial.")
        return real_optimize(self, *a, **kw)

    monkeypatch.setattr(optuna, "create_study", racing_create)
    monkeypatch.setattr(optuna.study.Study, "optimize", racing_optimize)
    assert create_study(study_name="s", direction="maximize").study_name == "s"
    w = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
    p = Problem(w, get_profile("v100-16gb"), budget_bytes=10**12)
    r = get_searcher("optuna-tpe").search(p, SearchContext(time_limit_s=30, seed=0, trials=5))
    assert raised == {"create": 1, "tell": 1} and r.feasible and r.evaluations >= 5


def test_a_cell_where_keeping_everything_fits_is_answered_without_a_search(tmp_path: Path) -> None:
    """A cell whose budget holds the whole step ran Optuna for its whole --timeout (233 trials in 20 s, a QA run)
    to find keeping everything again, the fastest policy there is; search answers at once there. Now so does the
    sweep (NOTE [ Sweep storage ]), and again when resumed. A sweep's log (stderr not a terminal) has a line per
    step of a cell (it had none until the end); the budgets are echoed as read, with a warning for one the GPU
    cannot hold, as search's."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    args = ["sweep", "--models", "resnet18", "--batch-size", "8", "--gpu", "a100-40gb", "--budgets", "1GB,50GB",
            "--methods", "baselines,optuna,ppo", "--trials", "500", "--timeout", "30", "--storage", storage,
            "--json"]  # fmt: skip
    for run in range(2):
        proc = autotune(*args)
        cells = json.loads(proc.stdout)["cells"]
        assert [(c["best_method"], c["optuna_samples_per_s"], c["ppo_samples_per_s"]) for c in cells] == [
            ("keep all", None, None)
        ] * 2, cells
        assert all(c["samples_per_s"] == c["no_policy_samples_per_s"] for c in cells)
        for c in cells:
            assert not _study(storage, c["study"]).trials  # no Optuna trial, now or resumed
        assert sorted(cells[0]["resumed"]) == ([] if run == 0 else ["baselines", "optuna", "ppo"]), cells[0]
    assert "budgets: 1GB = 1,000,000,000 bytes (953.67 MiB); 50GB = 50,000,000,000 bytes (46.57 GiB)" in proc.stderr
    assert "warning: the budget is more than the 40.00 GiB of memory the a100-40gb has" in proc.stderr
    assert re.search(r"\d+ s, 2 of 2 cells done: resnet18 a100-40gb 46\.57 GiB: [\d,.]+ samples/s \(keep all\)",
                     proc.stderr), proc.stderr  # fmt: skip


def test_a_ctrl_c_a_finalizer_swallowed_while_the_report_is_written_is_still_the_sweeps_stop(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands in a weakref callback while the report is built is dropped by Python: the sweep
    printed an "Exception ignored" traceback and exited 0 (2 of 9 tries, a QA run). The command notes every
    Ctrl-C; the sweep, with no search left to raise it, asks after the report and exits as stopped. The stand-in
    notes it as the handler does, and drops it."""
    from autotune import sweep_report
    from runtime.errors import note_sigint
    from tests.test_cli import run

    written = sweep_report.write_report

    def write_then_swallowed_ctrl_c(path: Path, text: str) -> None:
        written(path, text)
        note_sigint()

    monkeypatch.setattr(sweep_report, "write_report", write_then_swallowed_ctrl_c)
    report = tmp_path / "r.html"
    code, out, err = run(capsys, "sweep", "--models", "resnet18", "--batch-size", "8", "--budgets", "235MB", "--gpu",
                         "a100-40gb", "--methods", "baselines", "--reserve", "0", "--storage",
                         f"sqlite:///{tmp_path / 's.db'}", "--report", str(report))  # fmt: skip
    assert code == 130 and "interrupted after 1 of 1 cells; the same command resumes" in err, (code, err)
    assert report.exists() and "sweep: 1 cell in" in out


def test_each_cells_chosen_policy_is_checked_on_the_caching_allocators_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A sweep plans the tensors' bytes, where `autotune search` plans what PyTorch's caching allocator reserves
    by default: a cell's answer could run out on the allocator's model and the table said nothing. Now each
    chosen policy on a GPU profile runs there with the device capped at the planned budget (NOTE [ Sweep
    storage ]): resnet18 b4 keeps everything within both 250MB and 300MB (8 MiB reserve; its peak is 220,300,800
    bytes), which reserves more than the first's 241,611,392 planned bytes on the model and runs within the
    second's, reserving what ``policy_stats`` gives; the table and the report say which ran out; on the cpu
    profile nothing is checked."""
    from envs.allocator import OutOfMemory, policy_stats
    from runtime.hardware import get_profile
    from runtime.policy import load_policy
    from tests.test_cli import run

    report, files = tmp_path / "r.html", tmp_path / "p"
    args = ["sweep", "--models", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--budgets", "250MB,300MB",
            "--reserve", "8MiB", "--methods", "baselines", "--storage", f"sqlite:///{tmp_path / 's.db'}",
            "--out-dir", str(files)]  # fmt: skip
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    runs = [c["runs_on_allocator_model"] for c in cells]
    assert [c["best_method"] for c in cells] == ["keep all"] * 2 and runs == [False, True], cells
    hw = get_profile("a100-40gb")
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=4, target=hw))
    policies = sorted(files.glob("*.policy.json"))
    assert len(policies) == 2
    for c in cells:
        p = next(load_policy(f) for f in policies if load_policy(f).budget_bytes == c["budget_bytes"])
        try:
            st = policy_stats(w, hw, p.to_vector(w), p.options, capacity_bytes=c["planned_budget_bytes"])
            assert c["reserved_peak_bytes"] == st.peak_reserved and c["peak_bytes"] < st.peak_reserved, c
        except OutOfMemory:
            assert c["reserved_peak_bytes"] is None and c["planned_budget_bytes"] == 241_611_392, c
    code, out, err = run(capsys, *args, "--report", str(report))
    shown = " ".join(out.split())
    assert code == 0 and "1 of the chosen policies run out on a model of PyTorch's CUDA caching allocator" in shown
    assert "runs out on the caching allocator" in report.read_text()
    code, out, err = run(capsys, *args[:6], "cpu", "--budgets", "300MB", "--methods", "baselines", "--storage",
                         f"sqlite:///{tmp_path / 'c.db'}", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["cells"][0]["runs_on_allocator_model"] is None, err
