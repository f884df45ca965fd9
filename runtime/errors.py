"""User-facing errors.

Every error that a user can cause (a bad model name, an unparseable size, a corrupted file) is raised as an
:class:`AutotuneError` whose message names the offending value, says what was expected and how to fix it.
The CLI prints the message on one line and exits with code 2; a traceback is shown only with ``--debug``.
``assert`` is kept for internal invariants.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """An error caused by the user's input, with a message fit to print as is."""
