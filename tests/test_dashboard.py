"""`autotune dashboard` serves optuna-dashboard on a sweep's storage, on loopback: its HTTP API lists the
sweep's studies."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import SweepRun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dashboard_serves_the_sweep_studies(sweep_run: SweepRun) -> None:
    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "autotune.cli", "dashboard", "--storage", sweep_run.storage, "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    names = [s["study_name"] for s in json.load(r)["study_summaries"]]
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                time.sleep(0.5)
        assert {c["study"] for c in sweep_run.out["cells"]} <= set(names)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/" in err  # the address, printed for the user


def test_a_busy_port_or_an_unknown_host_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The dashboard said "Listening on http://127.0.0.1:PORT/" and then failed with an internal error (exit 1)
    when the port was taken or the host did not resolve (a QA run). Now each is one line, exit 2, before it
    starts."""
    import optuna

    from tests.test_cli import user_error

    storage = f"sqlite:///{tmp_path / 'd.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=storage, study_name="s")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = user_error(capsys, "dashboard", "--storage", storage, "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line
    line = user_error(capsys, "dashboard", "--storage", storage, "--host", "nosuchhost.invalid", "--port", "18999")
    assert "cannot listen on nosuchhost.invalid:18999" in line
    # A storage URL with %20 for a space names the file SQLAlchemy opens (the sweep wrote "d x/d.db"): it was
    # "no such file"; here it passes that check and meets the busy port.
    (tmp_path / "d x").mkdir()
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'd x' / 'd.db'}", study_name="s")
    encoded = f"sqlite:///{tmp_path}/d%20x/d.db"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = user_error(capsys, "dashboard", "--storage", encoded, "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_the_dashboard_stops_on_sigterm_while_it_serves_requests(tmp_path: Path) -> None:
    """A SIGTERM that arrived while the dashboard answered a request became a KeyboardInterrupt inside
    wsgiref's handler, which printed it as a failed request and went on serving: the process did not end
    (a CI run waited 30 s for it). The dashboard has nothing to save, so it now ends at once on SIGTERM
    (exit 143) and Ctrl-C (130), whatever it is doing."""
    import signal
    import threading

    import optuna

    storage = f"sqlite:///{tmp_path / 'd.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=storage, study_name="s").optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "autotune", "dashboard", "--storage", storage, "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served = [0]
    stop = threading.Event()

    def hammer() -> None:  # requests back to back, so the signal most likely lands inside one
        while not stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    r.read()
                served[0] += 1
            except (OSError, http.client.HTTPException):  # (the server ends mid-answer: IncompleteRead)
                time.sleep(0.05)

    clients = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
    try:
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while served[0] < 20 and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.1)
        assert served[0] >= 20, server.stderr.read() if server.poll() is not None and server.stderr else served
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=15)
    finally:
        stop.set()
        if server.poll() is None:
            server.kill()
            server.communicate()
        for c in clients:  # not left running into the next test
            c.join(timeout=10)
    assert server.returncode == 143, err
    assert "Traceback" not in err, err


def test_the_best_trial_shown_is_the_best_that_fits(tmp_path: Path) -> None:
    """optuna-dashboard shows the storage's best trial, which it picked by value alone: a keep-everything trial
    27 MiB over a sweep cell's budget was shown as its best (a QA run). Served now: the fastest that fits, or the
    one nearest the budget where none fits; a study without the budget constraint as before."""
    import optuna

    from agents.optuna_search import best_fitting_first

    url = f"sqlite:///{tmp_path / 'b.db'}"
    for name, trials in {
        "cell": [(100.0, 0.3), (50.0, -0.1), (60.0, -0.2), (70.0, 0.05)],  # (samples/s, budget excess)
        "none-fits": [(100.0, 0.3), (90.0, 0.1)],
    }.items():
        study = optuna.create_study(study_name=name, storage=url, direction="maximize")
        for value, excess in trials:
            t = study.ask()
            t.set_user_attr("constraint", [excess])
            study.tell(t, value)
    plain = optuna.create_study(study_name="plain", storage=url, direction="maximize")
    plain.add_trial(optuna.trial.create_trial(value=3.0))
    plain.add_trial(optuna.trial.create_trial(value=4.0))
    storage = best_fitting_first(optuna.storages.get_storage(url))
    ids = {s.study_name: s._study_id for s in storage.get_all_studies()}
    assert storage.get_best_trial(ids["cell"]).number == 2  # 60 samples/s, the fastest that fits
    assert storage.get_best_trial(ids["none-fits"]).number == 1  # nearest the budget
    assert storage.get_best_trial(ids["plain"]).number == 1

    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "autotune.cli", "dashboard", "--storage", url, "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/studies/{ids['cell']}?after=0"
    try:
        best: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(api, timeout=5) as r:
                    best = [t["number"] for t in json.load(r)["best_trials"]]
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                time.sleep(0.5)
        assert best == [2]
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_a_file_that_holds_no_optuna_storage_is_refused_and_left_as_it_was(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An empty file, or another program's SQLite database, given as --storage was made an Optuna storage (its
    tables written into the file, 114,688 bytes) and an empty dashboard served (a QA run). The dashboard only
    reads: such a file is refused in one line and left as it was."""
    import contextlib
    import sqlite3

    from tests.test_cli import user_error

    empty, other = tmp_path / "afile", tmp_path / "other.db"
    empty.touch()
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    for path in (empty, other):
        before = path.read_bytes()
        line = user_error(capsys, "dashboard", "--storage", f"sqlite:///{path}", "--port", str(_free_port()))
        assert "the file holds no Optuna storage (no studies table)" in line, line
        assert path.read_bytes() == before
