"""User-facing errors.

Every error that a user can cause (a bad model name, an unparseable size, a corrupted file) is raised as an
:class:`AutotuneError` whose message names the offending value, says what was expected and how to fix it.
The CLI prints the message on one line and exits with code 2; a traceback is shown only with ``--debug``.
``assert`` is kept for internal invariants.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


class AutotuneError(Exception):
    """An error caused by the user's input, with a message fit to print as is."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters: for an error of ours that quotes it."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


class ModelError(AutotuneError):
    """The model's own training step raised, run before any of autotune's hooks (runtime.trace.capture's
    warm-up): the model, its loss or the settings it was built with, not autotune's tracing. ``reason``: what
    the model raised, without the advice a caller adds to the message (the message itself where none did)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


_SIGINT = [False]


def note_sigint(arrived: bool = True) -> None:
    """Say that a Ctrl-C has arrived in this process (agents.base's ``noting_sigint``), or forget it (a
    command's start)."""
    _SIGINT[0] = arrived


@contextlib.contextmanager
def noting_sigint() -> Iterator[None]:
    """While inside (a command's whole run, in the main thread where SIGINT has Python's default handler), a
    Ctrl-C is noted (:func:`note_sigint`) before its KeyboardInterrupt is raised: one that lands in a finalizer
    (a ``__del__`` while a model is built or traced, a weakref callback while a report is built) is dropped by
    Python, without its "Exception ignored" traceback here, and the search that follows raises it again
    (agents.base ``SearchContext.noting_sigint``) instead of running to its end; a command with no search after
    it asks :func:`sigint_arrived`."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def noted(signum: int, frame: Any) -> None:
        note_sigint()
        signal.default_int_handler(signum, frame)

    noted.notes_sigint = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, noted)
    try:
        with dropped_interrupts():
            yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def dropped_interrupts() -> Iterator[None]:
    """While inside, a KeyboardInterrupt that Python drops in a finalizer (noted by the handler that raised it)
    prints no "Exception ignored" traceback; a finalizer's other errors are shown as before."""
    hook = sys.unraisablehook

    def unraisable(info: Any) -> None:
        if not issubclass(info.exc_type, KeyboardInterrupt):
            hook(info)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = hook


def sigint_arrived() -> bool:
    """Whether a Ctrl-C has arrived in this process since :func:`note_sigint` was first called: an error that
    follows it (a storage whose connection the interrupt broke, failing in the bookkeeping after it) is the
    interrupt's, not a bug to report."""
    return _SIGINT[0]


def from_interrupt(e: BaseException) -> bool:
    """Whether ``e`` is a Ctrl-C that a library turned into another error while handling it: a
    KeyboardInterrupt in its chain of causes and contexts. (Optuna 5's trial bookkeeping, interrupted while it
    stores a trial, raises UnboundLocalError from its ``finally``.)"""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False
