"""Byte sizes as people write them (``6GB``, ``512MiB``) and as we print them (``5.59 GiB``).

Decimal units (KB, MB, GB, TB: powers of 1000) and binary units (KiB, MiB, GiB, TiB: powers of 1024) are
both accepted and never confused: ``6GB`` is 6,000,000,000 bytes, ``6GiB`` is 6,442,450,944. A bare ``G``
or ``M`` is rejected, since users mean either one (``nvidia-smi`` prints MiB, vendors sell GB): a
budget 7% off is a plan that does not fit. Units are case-insensitive (``6gb`` = ``6GB``); ``Gb`` is read
as gigabytes too, as nobody budgets memory in bits. Output is always binary, like ``nvidia-smi`` and
``torch.cuda.memory_summary``.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from runtime.errors import AutotuneError

_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMBIGUOUS_UNITS = frozenset({"k", "m", "g", "t"})
# A plain decimal number ("6", "1.5", ".5", "6.") then an optional unit; no sign, exponent or separators.
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)", re.IGNORECASE)
_EXPECTED = (
    "expected a number with an optional unit B, KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary), "
    "e.g. 6GB or 6GiB"
)
_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(text: str) -> int:
    """The number of bytes ``text`` names, e.g. ``parse_size("1.5GB") == 1_500_000_000``.

    Without a unit the number is bytes. Fractions are allowed with a unit and rounded down to whole bytes
    (``1.1MiB`` = 1,153,433 bytes); sizes must be at least one byte. Raises :class:`AutotuneError` with
    the offending text and the accepted forms otherwise.
    """
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        if text.strip().startswith("-"):
            raise AutotuneError(f"invalid size '{text}': a size must be greater than zero, e.g. 6GB or 6GiB")
        raise AutotuneError(f"invalid size '{text}': {_EXPECTED}")
    number, unit = match["number"], match["unit"].lower()
    if unit in _AMBIGUOUS_UNITS:
        step = "kmgt".index(unit) + 1  # K = 10^3 or 2^10, M = 10^6 or 2^20, ...
        raise AutotuneError(
            f"invalid size '{text}': the unit '{match['unit']}' is ambiguous, write "
            f"{number}{unit.upper()}B for {number} x 10^{3 * step} bytes or "
            f"{number}{unit.upper()}iB for {number} x 2^{10 * step} bytes"
        )
    if unit not in _UNIT_BYTES and unit != "":
        raise AutotuneError(f"invalid size '{text}': unknown unit '{match['unit']}', {_EXPECTED}")
    # Decimal, not float: 1.1 * 10**9 must be exactly 1,100,000,000, and huge sizes must not lose bytes.
    exact = Decimal(number) * _UNIT_BYTES.get(unit, 1)
    if unit in ("", "b") and exact != exact.to_integral_value():
        raise AutotuneError(f"invalid size '{text}': a number of bytes must be whole, e.g. 6442450944B or 6GiB")
    if exact == 0:
        raise AutotuneError(f"invalid size '{text}': a size must be greater than zero, e.g. 6GB or 6GiB")
    size = int(exact)  # rounds down: a fraction of a byte is no memory
    if size == 0:
        raise AutotuneError(f"invalid size '{text}': that is less than one byte, e.g. write 6GB or 6GiB")
    return size


def format_bytes(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number below 1024, with 2 decimals:
    ``format_bytes(8_160_000_000) == "7.60 GiB"``; whole bytes below 1 KiB: ``"512 B"``, ``"0 B"``.
    Negative values (a change in memory) keep their sign."""
    if not math.isfinite(n):
        raise ValueError(f"cannot format {n!r} bytes")
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    if round(value) < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _BINARY_UNITS:
        value /= 1024
        # Compare the rounded value, so 1023.999 MiB prints as 1.00 GiB rather than 1024.00 MiB.
        if round(value, 2) < 1024 or unit == _BINARY_UNITS[-1]:
            break
    return f"{sign}{value:.2f} {unit}"


def format_size_echo(text: str, n: int) -> str:
    """Echo a parsed size so the user sees how it was read: ``6GB = 6,000,000,000 bytes (5.59 GiB)``."""
    return f"{text.strip()} = {n:,} bytes ({format_bytes(n)})"


def file_stem(model: str) -> str:
    """A model name as the start of a file name: a factory's ``pkg.mod:fn`` or ``path/to/f.py:fn`` holds
    characters that are path separators, or not allowed, on some systems."""
    return model.replace(":", "_").replace("/", "_")
