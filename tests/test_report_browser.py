"""The sweep report in headless Chromium: every plot rendered (plotly's SVG roots in the DOM after its
scripts ran), no JavaScript error, and a screenshot. Chromium comes from Debian's package (.ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.conftest import SweepRun, skip_or_fail

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--virtual-time-budget=20000",
]  # fmt: skip


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        skip_or_fail("needs Debian's chromium (apt-get install chromium)")
    assert found is not None
    return found


def test_report_renders_without_javascript_errors(sweep_run: SweepRun, tmp_path: Path) -> None:
    browser = _chromium()
    url = sweep_run.report.resolve().as_uri()
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([browser, *FLAGS, *profile, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # Five sections; the subplot figures draw one SVG root per figure plus its overlay layer.
    assert all(f'id="plot-{i}"' in html for i in range(5))
    assert html.count('class="main-svg"') >= 2 * 5
    errors = html.split('<pre id="js-errors"', 1)[1].split(">", 1)[1].split("</pre>", 1)[0]
    assert errors == "", errors
    shot = tmp_path / "sweep-report.png"
    run = subprocess.run(
        [browser, *FLAGS, *profile, "--window-size=1400,2600", f"--screenshot={shot}", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    keep = os.environ.get("AUTOTUNE_SCREENSHOT")  # where to keep it (the README's picture)
    if keep:
        shutil.copyfile(shot, keep)
