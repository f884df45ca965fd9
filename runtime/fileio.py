"""Atomic file writes: nothing half-written on failure."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from runtime.errors import AutotuneError


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so readers see
    the old file or the new one, never a part. A new file gets the usual permissions (0666 less the umask),
    not mkstemp's private 0600; a file that exists keeps its own. A symbolic link is written through (the file
    it names is replaced, the link stays), and a file that is not a regular one (``/dev/null``, a named pipe)
    is written into, not replaced."""
    path = Path(os.path.realpath(path))
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = path.stat().st_mode
    except OSError:  # a new file
        umask = os.umask(0)
        os.umask(umask)
        mode = stat.S_IFREG | (0o666 & ~umask)
    if not stat.S_ISREG(mode):
        with open(path, "wb") as f:
            f.write(raw)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike[str] | None, option: str, example: str = "out.json") -> None:
    """Refuse, before any long work, an output path that cannot be written: a folder (``example``: a file name
    to suggest in it), a file under a folder that does not exist or under a file, a folder this process may not
    write in."""
    if path is None:
        return
    p = Path(os.path.realpath(path))  # a symbolic link is written through (atomic_write)
    parent = p.parent
    how = f"choose another {option}"
    if p.exists() and not p.is_dir() and not p.is_file():  # /dev/null, a named pipe: written into
        if not os.access(p, os.W_OK):
            raise AutotuneError(f"{option} {str(path)!r}: cannot write to it; {how}")
        return
    if p.is_dir():
        raise AutotuneError(f"{option} {str(path)!r} is a folder: expected a file name in it, e.g. {p / example}")
    if not parent.exists():
        raise AutotuneError(f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist: create it or {how}")
    if not parent.is_dir():
        raise AutotuneError(f"{option} {str(path)!r}: {str(parent)!r} is not a folder; {how}")
    _writable_in(parent, f"{option} {str(path)!r}", how)


def check_folder(path: str | os.PathLike[str] | None, option: str) -> None:
    """Refuse, before any long work, an output folder that cannot be made or written in: a file of that name,
    a folder under a file, a folder this process may not write in."""
    if path is None:
        return
    p = Path(path)
    how = f"choose another {option}"
    if p.exists() and not p.is_dir():
        raise AutotuneError(f"{option} {str(path)!r} is a file: expected a folder (made if missing); {how}")
    existing = next((q for q in (p, *p.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise AutotuneError(f"{option} {str(path)!r}: {str(existing)!r} is not a folder; {how}")
    _writable_in(existing, f"{option} {str(path)!r}", how)


def _writable_in(folder: Path, what: str, how: str) -> None:
    """Refuse a folder this process may not write in (:func:`write_problem`)."""
    problem = write_problem(folder)
    if problem is not None:
        raise AutotuneError(f"{what}: {problem}; {how}")


def write_problem(folder: Path) -> str | None:
    """Why this process cannot make a file in ``folder`` (None: it can): by its permissions, then by making and
    removing a file in it, as the write will (permissions say yes where a read-only or special file system,
    ``/proc``, says no)."""
    if not folder.is_dir():
        return f"the folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in the folder {str(folder)!r}"
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".autotune-", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"cannot write in the folder {str(folder)!r} ({e.strerror})"
    return None
