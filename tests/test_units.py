"""autotune.units: every accepted size form with its exact byte count, every rejection with its reason."""

from __future__ import annotations

import pytest

from autotune.units import format_bytes, format_size_echo, parse_size
from runtime.errors import AutotuneError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GB", 6_000_000_000),
        ("6 GB", 6_000_000_000),
        ("6gb", 6_000_000_000),
        ("6Gb", 6_000_000_000),  # read as gigabytes: nobody budgets memory in bits
        ("  6GB  ", 6_000_000_000),
        ("6GiB", 6 * 2**30),
        ("6 gib", 6_442_450_944),
        ("6000MB", 6_000_000_000),
        ("512MiB", 536_870_912),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 1_610_612_736),
        ("1.1GB", 1_100_000_000),  # exact: a float product would give 1,100,000,000.0000002
        ("1.1MiB", 1_153_433),  # 1,153,433.6 rounded down to whole bytes
        (".5GiB", 2**29),
        ("6.GB", 6_000_000_000),
        ("6442450944", 6_442_450_944),
        ("6442450944B", 6_442_450_944),
        ("6442450944 b", 6_442_450_944),
        ("1", 1),
        ("100KB", 100_000),
        ("100KiB", 102_400),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("2.0B", 2),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected a number with an optional unit"),
        ("   ", "expected a number with an optional unit"),
        ("six GB", "expected a number with an optional unit"),
        ("GB", "expected a number with an optional unit"),
        ("6XB", "unknown unit 'XB'"),
        ("6 bytes", "unknown unit 'bytes'"),
        ("6PB", "unknown unit 'PB'"),
        ("6 G", "the unit 'G' is ambiguous, write 6GB for 6 x 10^9 bytes or 6GiB for 6 x 2^30 bytes"),
        ("6g", "the unit 'g' is ambiguous"),
        ("512M", "write 512MB for 512 x 10^6 bytes or 512MiB for 512 x 2^20 bytes"),
        ("100k", "100KB for 100 x 10^3 bytes"),
        ("1T", "1TiB for 1 x 2^40 bytes"),
        ("0", "must be greater than zero"),
        ("0GB", "must be greater than zero"),
        ("0.0GiB", "must be greater than zero"),
        ("-6GB", "must be greater than zero"),
        ("-1", "must be greater than zero"),
        ("+6GB", "expected a number with an optional unit"),
        ("1e9", "expected a number with an optional unit"),
        ("6,000MB", "expected a number with an optional unit"),
        ("6 GB 2", "expected a number with an optional unit"),
        ("1.5", "a number of bytes must be whole"),
        ("0.5B", "a number of bytes must be whole"),
        ("0.0001KB", "less than one byte"),
    ],
)
def test_parse_size_rejects(text: str, reason: str) -> None:
    with pytest.raises(AutotuneError) as info:
        parse_size(text)
    message = str(info.value)
    assert message.startswith(f"invalid size '{text}': ")  # names the offending value
    assert reason in message
    assert "\n" not in message


def test_parse_size_generic_message_lists_every_unit() -> None:
    with pytest.raises(AutotuneError) as info:
        parse_size("6XB")
    assert str(info.value) == (
        "invalid size '6XB': unknown unit 'XB', expected a number with an optional unit B, KB, MB, GB, TB "
        "(decimal) or KiB, MiB, GiB, TiB (binary), e.g. 6GB or 6GiB"
    )


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (512 * 2**20, "512.00 MiB"),
        (8_160_000_000, "7.60 GiB"),
        (6_000_000_000, "5.59 GiB"),
        (2**30 - 1, "1.00 GiB"),  # 1023.999999 MiB rounds to 1024.00 MiB, so it moves up a unit
        (1023.4, "1023 B"),
        (1023.6, "1.00 KiB"),
        (3 * 2**40, "3.00 TiB"),
        (2**50, "1.00 PiB"),
        (2**60, "1024.00 PiB"),  # the largest unit keeps counting
        (-1.5 * 2**30, "-1.50 GiB"),
        (-0.0, "0 B"),
    ],
)
def test_format_bytes(n: float, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [float("nan"), float("inf")])
def test_format_bytes_rejects_non_finite(n: float) -> None:
    with pytest.raises(ValueError):
        format_bytes(n)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GB", "6GB = 6,000,000,000 bytes (5.59 GiB)"),
        (" 6GiB ", "6GiB = 6,442,450,944 bytes (6.00 GiB)"),
        ("512MiB", "512MiB = 536,870,912 bytes (512.00 MiB)"),
    ],
)
def test_format_size_echo(text: str, expected: str) -> None:
    assert format_size_echo(text, parse_size(text)) == expected


@pytest.mark.parametrize("text", ["0", "0B", "0MiB", "0 GB", "0.0GiB"])
def test_a_reserve_of_zero_takes_any_unit(text: str) -> None:
    """`--reserve 0MiB` was refused with "a size must be greater than zero ... (or 0 for none)"."""
    from autotune.budget import reserve_bytes
    from runtime.hardware import get_profile

    assert reserve_bytes(text, "1GB", 10**9, get_profile("a100-40gb")) == 0


def test_a_reserve_of_zero_with_an_unknown_unit_is_refused_as_typed() -> None:
    from autotune.budget import reserve_bytes
    from runtime.hardware import get_profile

    with pytest.raises(AutotuneError, match=r"--reserve: invalid size '0XB': unknown unit 'XB'"):
        reserve_bytes("0XB", "1GB", 10**9, get_profile("a100-40gb"))
