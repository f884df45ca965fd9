"""runtime.fileio: atomic writes replace a regular file whole, and leave alone what is not one (a QA run, as
root, turned /dev/null into a regular file with `search --out /dev/null`)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from runtime.errors import AutotuneError
from runtime.fileio import atomic_write, check_writable


def test_a_file_that_exists_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path: Path) -> None:
    private = tmp_path / "p.json"
    private.write_text("old")
    private.chmod(0o600)
    atomic_write(private, "new")
    assert private.read_text() == "new" and stat.S_IMODE(private.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "n.json", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "n.json").stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.json", "p.json"]  # no temporary file left


def test_a_symbolic_link_is_written_through(tmp_path: Path) -> None:
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    check_writable(tmp_path / "link.json", "--out")
    atomic_write(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    (tmp_path / "dangling.json").symlink_to("missing/x.json")  # its file's folder does not exist: refused early
    with pytest.raises(AutotuneError, match=r"the folder .*missing' does not exist"):
        check_writable(tmp_path / "dangling.json", "--out")


def test_a_named_pipe_and_dev_null_are_written_into_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    check_writable(fifo, "--out")
    atomic_write(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)
    check_writable("/dev/null", "--out")  # not refused for its folder, /dev, where a user may not write
    atomic_write("/dev/null", "nothing")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
