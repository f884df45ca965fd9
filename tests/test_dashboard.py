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
