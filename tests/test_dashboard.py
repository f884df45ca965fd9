"""`autotune dashboard` serves optuna-dashboard on a sweep's storage, on loopback: its HTTP API lists the
sweep's studies."""

from __future__ import annotations

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
