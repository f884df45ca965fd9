"""User-facing errors.

Every error that a user can cause (a bad model name, an unparseable size, a corrupted file) is raised as an
:class:`AutotuneError` whose message names the offending value, says what was expected and how to fix it.
The CLI prints the message on one line and exits with code 2; a traceback is shown only with ``--debug``.
``assert`` is kept for internal invariants.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """An error caused by the user's input, with a message fit to print as is."""


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
