"""Distributed search (NOTE [ Distributed search ] in agents/optuna_search.py): two `autotune search`
workers on one PostgreSQL study, one killed mid-search; every trial is accounted for, the study finishes,
and the survivor's answer is the best over both workers' trials. The server comes from .ci/run
(AUTOTUNE_TEST_POSTGRES=postgresql://user:password@127.0.0.1:5432/db)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from agents.optuna_search import retried_trial_number
from tests.conftest import skip_or_fail

TRIALS = 120


@pytest.mark.slow
def test_two_workers_one_killed() -> None:
    url = os.environ.get("AUTOTUNE_TEST_POSTGRES")
    if not url:
        skip_or_fail("needs a PostgreSQL server: set AUTOTUNE_TEST_POSTGRES (.ci/run starts one)")
    import optuna

    study_name = f"dist-{uuid.uuid4().hex[:8]}"
    args = ["search", "--model", "resnet18", "--batch-size", "8", "--budget", "235MB", "--gpu", "a100-40gb"]
    args += ["--reserve", "0", "--searcher", "optuna-tpe", "--trials", str(TRIALS), "--timeout", "600"]
    args += ["--storage", url, "--study", study_name, "--heartbeat", "1", "--json"]
    # In tensor bytes, as the trials' constraints count them: at this size no policy below the no-policy peak runs on
    # the caching allocator's model (the default, --budget-kind reserved; tests/test_main_flow.py tests it).
    args += ["--budget-kind", "allocated"]
    root = Path(__file__).resolve().parents[1]

    def worker(i: int, folder: Path) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "autotune.cli", *args, "--out", str(folder / f"w{i}.policy.json")]
        return subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / study_name
    folder.mkdir(parents=True)
    first, second = worker(1, folder), worker(2, folder)
    try:
        complete = (optuna.trial.TrialState.COMPLETE,)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                if len(optuna.load_study(study_name=study_name, storage=url).get_trials(states=complete)) >= 20:
                    break
            except KeyError:  # not created yet
                continue
        first.send_signal(signal.SIGKILL)
        first.wait()
        out, err = second.communicate(timeout=600)
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
    assert second.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name=study_name, storage=url)
    states = Counter(t.state.name for t in study.trials)
    assert states["COMPLETE"] >= TRIALS and states["RUNNING"] == 0 and states["WAITING"] == 0, states
    failed = {t.number for t in study.trials if t.state.name == "FAIL"}
    retried = {retried_trial_number(t) for t in study.trials} - {None}
    assert failed == retried  # the killed worker's trial (if one was in flight) ran again
    best = max(
        t.user_attrs["samples_per_s"] for t in study.get_trials(states=complete) if t.user_attrs["constraint"][0] <= 0
    )
    got = json.loads(out)
    assert got["feasible"] and got["samples_per_s"] >= best  # the best over both workers' trials
    optuna.delete_study(study_name=study_name, storage=url)
