"""The budget as every planning command reads it: parse it once, keep the reserve back the same way.

NOTE [ Budget and reserve ]
The budget a user types is what a policy file records and what ``autotune train`` checks a measured peak
against. A trace cannot see what the GPU's libraries allocate (cuDNN and cuBLAS workspaces and handles), so
on a GPU profile the search plans for the budget less a reserve (``--reserve``; ``DEFAULT_GPU_RESERVE`` on GPU
profiles, 0 on ``cpu``). ``search``, ``maxbatch``, ``baselines`` and ``sweep`` take their budgets through
:func:`plan_budget`, so that ``autotune baselines --budget 6GB`` and ``autotune search --budget 6GB`` plan for
the same bytes, and :func:`record_budget` is where a policy's recorded budget is set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.console import Console

from autotune.units import format_bytes, format_size_echo, parse_size
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile
from runtime.policy import Policy

# What the CUDA allocator holds that no trace sees: cuBLAS/cuDNN workspaces and library handles. Measured on
# an H200 (README, runtime on a GPU): resnet50 batch 64 allocated 89 MiB over its traced peak, GPT-2 67 MiB.
DEFAULT_GPU_RESERVE = 128 * 2**20


def warn_over_device(err: Console, budget_bytes: int, hw: HardwareProfile) -> None:
    """A budget above the profile's memory: a policy that fits it does not fit the GPU (profile and simulate
    said "fits" there without a word)."""
    if budget_bytes > hw.memory_bytes:
        err.print(
            f"[yellow]warning:[/] the budget is more than the {format_bytes(hw.memory_bytes)} of memory the "
            f"{hw.name} has: a policy planned for it will not fit there",
            highlight=False,
        )


@dataclass(frozen=True)
class Budget:
    """One budget as typed (``text``, ``given_bytes``: what a policy records) and what is planned for."""

    text: str
    given_bytes: int
    reserve_bytes: int

    @property
    def planned_bytes(self) -> int:
        return max(0, self.given_bytes - self.reserve_bytes)

    def echo(self, err: Console, hw: HardwareProfile) -> None:
        """The budget as read, a warning where the GPU has less memory, and what is planned for."""
        err.print(f"budget: {format_size_echo(self.text, self.given_bytes)}")
        warn_over_device(err, self.given_bytes, hw)
        if self.reserve_bytes and self.reserve_bytes < self.given_bytes:
            planned, kept = format_bytes(self.planned_bytes), format_bytes(self.reserve_bytes)
            err.print(f"planning for {planned}: the budget less a {kept} reserve for workspaces (--reserve)")

    def check_left(self, source: str | None = None) -> None:
        """Refuse a budget that the reserve leaves nothing of (it would be planned for 0 B). ``source``: the
        policy file whose recorded reserve it is (``autotune simulate --policy``), else --reserve's."""
        if self.planned_bytes:
            return
        if source is not None:
            raise AutotuneError(
                f"{source}: budget {self.text} leaves nothing after the file's {format_bytes(self.reserve_bytes)} "
                "reserve for workspaces (reserve_bytes): expected a reserve below the budget; pass a --budget well "
                "above it, or plan the policy again with `autotune search` (the file edited by hand?)"
            )
        raise AutotuneError(
            f"budget {self.text} leaves nothing after the {format_bytes(self.reserve_bytes)} kept back on GPU "
            "profiles for workspaces (--reserve): raise the budget well above it"
        )


def reserve_bytes(reserve: str | None, budget: str, budget_bytes: int, hw: HardwareProfile) -> int:
    """The ``--reserve`` in bytes: as given ("0" allowed), or DEFAULT_GPU_RESERVE on GPU profiles and 0 on
    the CPU; an error when one given leaves nothing of the budget (the default one is left to
    :func:`autotune.search.check_budget`, which names the smallest budget that works)."""
    if reserve is None:
        n = DEFAULT_GPU_RESERVE if hw.is_gpu else 0
    else:
        zero = re.fullmatch(r"\s*0+(?:\.0*)?\s*([A-Za-z]*)\s*", reserve)  # 0, 0B, 0MiB, 0.0 GB: none
        try:
            n = parse_size(reserve if zero is None else f"1{zero.group(1)}") * (zero is None)  # a zero's unit checked
        except AutotuneError as e:
            if zero is not None:
                raise AutotuneError(
                    f"--reserve: invalid size {reserve!r}: unknown unit {zero.group(1)!r}; e.g. 0 or 128MiB"
                ) from None
            raise AutotuneError(f"--reserve: {e} (or 0 for none)") from None
        if zero is None and n < 2**20 and reserve.strip().isdigit():  # as --budget: a number alone is bytes
            raise AutotuneError(
                f"invalid --reserve '{reserve}': without a unit that is {n} bytes, most likely a unit left out; "
                f"write the unit, e.g. {reserve.strip()}MiB, or {reserve.strip()}B if you mean bytes (0: none)"
            )
    if n >= budget_bytes and reserve is not None:
        raise AutotuneError(
            f"--reserve {reserve} is not below the budget ({budget}): nothing would be left to plan for; pass "
            "a smaller one, e.g. --reserve 0"
        )
    return n


def plan_budget(text: str, reserve: str | None, hw: HardwareProfile) -> Budget:
    """``--budget`` and ``--reserve`` as planned for on ``hw`` (NOTE [ Budget and reserve ])."""
    return budget_of(parse_budget(text), reserve, hw, text)


def parse_budget(text: str, option: str = "--budget") -> int:
    """``--budget`` (or ``option``: sweep's ``--budgets``) in bytes; a plain number below 1 MiB is refused as a
    unit left out."""
    try:
        given = parse_size(text)
    except AutotuneError as e:  # which option it was: sweep's list said "invalid size 'abc'" alone (a QA run)
        raise AutotuneError(f"{option}: {e}") from None
    refuse_unit_left_out(option, text, given)
    return given


def refuse_unit_left_out(option: str, text: str, n: int) -> None:
    """A size of ``option`` given as a number alone (bytes) below 1 MiB: a unit left out, surely."""
    if n < 2**20 and text.strip().isdigit():
        t = text.strip()
        # a unit on a number of thousands (1048575GB: a petabyte) was no likely meaning (a QA run)
        unit = f"e.g. {t}GB or {t}GiB" if n < 1000 else "e.g. 6GB or 6GiB"
        raise AutotuneError(
            f"invalid {option} '{text}': without a unit that is {n} bytes, most likely a unit left out; write "
            f"the unit, {unit}, or {t}B if you mean bytes"
        )


def budget_of(given_bytes: int, reserve: str | None, hw: HardwareProfile, text: str | None = None) -> Budget:
    """A budget already parsed (``autotune sweep``'s list), with ``--reserve`` as planned for on ``hw``."""
    text = text if text is not None else format_bytes(given_bytes)
    return Budget(text, given_bytes, reserve_bytes(reserve, text, given_bytes, hw))


def record_budget(policy: Policy, budget: Budget | int | None, reserve_bytes: int | None = None) -> Policy:
    """The one place a policy's recorded budget is set: the budget as typed, not the planned one, and the reserve
    kept back of it (None: no budget, as ``autotune simulate`` without one records; an int: a budget in bytes,
    with ``reserve_bytes`` where one was kept back)."""
    if isinstance(budget, Budget):
        policy.budget_bytes, policy.reserve_bytes = budget.given_bytes, budget.reserve_bytes
    else:
        policy.budget_bytes = None if budget is None else int(budget)
        policy.reserve_bytes = None if budget is None else reserve_bytes
    return policy


__all__ = ["DEFAULT_GPU_RESERVE", "Budget", "budget_of", "plan_budget", "record_budget", "reserve_bytes"]
