"""`autotune search --measure K`: the search's best distinct policies trained for real, the answer measured.

NOTE [ Measured search ]
    The simulator ranks policies; real iterations decide. After the simulated search, the ``K`` fastest distinct
    policies that fit (NOTE [ Finalists ] in agents/finalists.py) run a few steady-state training iterations
    each on the device the plan is for, through the environment's real backend
    (autotune.real_backend.RealBackend: the CUDA allocator's peak, or the CPU storage tracker's). On CUDA the
    device is capped at the user's budget as ``autotune train`` caps it, so that what the caching allocator
    reserves (cached blocks, split ends) counts as it does when the policy is applied: a finalist that runs out
    of memory there does not fit, nor one whose steady iterations run only by the allocator freeing its cached
    segments to make room (``alloc_retries``, ``segments_freed`` of runtime.measure: each cudaFree synchronises
    the device, and a policy that close to the cap can run out in another process: on an H200 the one finalist
    of six that ran within 3 GB for ResNet-50 b64 in the search's process, its five neighbours out of memory,
    ran out in `autotune train`'s; whether it made the allocator free its cache is not known). The answer is the
    fastest that runs within the budget with its *measured* peak there. When none is, the largest ratio of
    measured to planned peak says how much room the plan lacked: up to ``K`` more policies are drawn from the
    finalists planned with at least that much of the budget free (the next tier of MARGINS at least), and
    measured, tier after tier until one fits. When none of those fits either, there is no answer, and the
    command says so. The measured times also recalibrate the plan: the median ratio of measured to predicted
    time is the simulator's time scale on this device, and the errors before and after it is applied say how far
    the plan was off and how much of that a single scale explains (what it does not is the simulator ranking
    policies wrongly). A search for torch.compile (``--compile``) trains each finalist under ``policy.compiled``
    with the search's backend, a compile per finalist (``DEFAULT_COMPILED_MEASURE`` of them by default on the
    GPU): the compiled graph's memory is not the simulator's (on the CPU, inductor keeps channels-last copies
    of the convolutions' weights and input from forward to backward; docs/results.md), so its answer is one
    that ran compiled within the budget. On ResNet-18 b8 within 240 MiB under inductor on the CPU the
    simulated answer (239.93 MiB planned) held 253.00 MiB; a finalist planned at 215.43 MiB held 234.88 MiB
    and is the answer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.base import Problem, SearchResult
from agents.finalists import MARGINS, Finalist
from autotune.budget import record_budget
from autotune.real_backend import RealBackend
from runtime.policy import Policy, PolicyOptions, Prediction


@dataclass(eq=False)
class Measured:
    """One finalist, planned and measured (``peak_bytes`` and ``iter_s`` of real iterations; an
    out-of-memory run has an infinite time)."""

    finalist: Finalist
    label: str
    peak_bytes: int
    iter_s: float
    samples: int  # samples per iteration (batch size x accumulation)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iter_s if self.iter_s > 0 else 0.0

    def fits(self, budget_bytes: int) -> bool:
        return math.isfinite(self.iter_s) and self.peak_bytes <= budget_bytes

    def to_dict(self, budget_bytes: int) -> dict[str, Any]:
        r = self.finalist.result
        return {
            "label": self.label,
            "predicted": {"peak_bytes": r.peak_bytes, "iter_s": r.iter_s, "samples_per_s": r.samples_per_s},
            "measured": {
                "peak_bytes": self.peak_bytes,
                "iter_s": self.iter_s if math.isfinite(self.iter_s) else None,
                "samples_per_s": self.samples_per_s,
            },
            "fits": self.fits(budget_bytes),
            "options": {
                "prefetch_lookahead": self.finalist.options.prefetch_lookahead,
                "release_after": self.finalist.options.release_after,
            },
        }


@dataclass
class MeasuredSearch:
    """The finalists as measured, the answer (None: nothing fits when measured) and the plan's time scale."""

    budget_bytes: int  # the user's budget: what a measured peak must stay within
    rows: list[Measured] = field(default_factory=list)
    chosen: Measured | None = None
    note: str = ""

    def _scale(self, leave_out: Measured | None = None) -> float | None:
        """Median measured / planned iteration time over the finalists that ran, ``leave_out`` aside."""
        ratios = [
            m.iter_s / m.finalist.result.iter_s for m in self.rows if m is not leave_out and math.isfinite(m.iter_s)
        ]
        return statistics.median(ratios) if ratios else None

    @property
    def time_scale(self) -> float | None:
        """Median measured / predicted iteration time over the finalists that ran (None: none did)."""
        return self._scale()

    def calibrated_iter_s(self, row: Measured) -> float | None:
        """``row``'s planned time scaled by the median measured / planned ratio of the *other* finalists that
        ran (None: no other did): a prediction this device's measurements corrected, not fitted to ``row``."""
        scale = self._scale(leave_out=row)
        return row.finalist.result.iter_s * scale if scale is not None else None

    def errors(self) -> tuple[float, float | None] | None:
        """(largest relative time error of the plan; the same once each finalist's prediction is scaled by
        the median measured / predicted ratio of the *other* finalists, None with one finalist): how far
        the plan was off, and how much of that a time scale learnt on this device takes away."""
        ran = [m for m in self.rows if math.isfinite(m.iter_s)]
        if not ran:
            return None
        before = max(abs(m.finalist.result.iter_s / m.iter_s - 1) for m in ran)
        if len(ran) < 2:
            return before, None
        after = max(abs((self.calibrated_iter_s(m) or m.iter_s) / m.iter_s - 1) for m in ran)
        return before, after

    def lowest_peak(self) -> int | None:
        return min((m.peak_bytes for m in self.rows), default=None)

    def to_dict(self) -> dict[str, Any]:
        err = self.errors()
        return {
            "budget_bytes": self.budget_bytes,
            "finalists": [m.to_dict(self.budget_bytes) for m in self.rows],
            "chosen": self.rows.index(self.chosen) if self.chosen is not None else None,
            "time_scale": self.time_scale,
            "plan_time_error": err[0] if err else None,
            "plan_time_error_scaled": err[1] if err else None,  # leave-one-out: see errors()
            "note": self.note,
        }


def min_distance(problem: Problem) -> int:
    """Finalists differ in at least 2% of the candidates (at least one): see NOTE [ Finalists ]."""
    return max(1, problem.n // 50)


ANSWER = "the search's answer"  # the label of the finalist that is the simulated search's own answer


def proposers(
    problem: Problem, found: SearchResult, baselines: list[SearchResult]
) -> list[tuple[str, PolicyOptions, np.ndarray]]:
    """(label, options, action vector) of the search's answer and of each baseline, for :func:`label_of`."""
    return [
        (ANSWER if r is found else f"baseline {r.searcher}", r.policy.options, r.policy.to_vector(problem.workload))
        for r in (found, *baselines)
    ]


def label_of(f: Finalist, known: list[tuple[str, PolicyOptions, np.ndarray]]) -> str:
    """Who proposed ``f`` (:func:`proposers`), where a searcher's answer is the very same policy."""
    for label, options, actions in known:
        if options == f.options and np.array_equal(actions, f.actions):
            return label
    return "a finalist of the search"


def measure(
    problem: Problem,
    backend: RealBackend,
    k: int,
    *,
    budget_bytes: int,
    found: SearchResult,
    baselines: list[SearchResult],
    progress: Callable[[str], None] | None = None,
) -> MeasuredSearch:
    """Measure up to ``k`` finalists, then up to ``k`` more planned with room to spare if none fits (see
    NOTE [ Measured search ]). ``problem.finalists`` holds the pool; ``budget_bytes`` is the user's budget."""
    pool = problem.finalists
    if pool is None:
        raise ValueError("measure() needs a problem searched with finalists (Problem.finalists)")
    out = MeasuredSearch(budget_bytes)
    samples = problem.workload.batch_size * problem.workload.grad_accum
    distance = min_distance(problem)
    known = proposers(problem, found, baselines)

    def run(picks: list[Finalist]) -> None:
        for f in picks:
            if progress is not None:
                progress(f"measuring finalist {len(out.rows) + 1} on {backend.device}")
            peak, iter_s = backend(f.actions, f.options, cap_bytes=budget_bytes)
            out.rows.append(Measured(f, label_of(f, known), int(peak), float(iter_s), samples))

    run(pool.pick(k, 0.0, min_distance=distance))
    if not out.rows:
        out.note = "no policy fits the budget on the simulator: nothing to measure"
        return out
    tried = 0.0  # the largest share of the budget kept free by the finalists measured so far
    notes = []
    if len(out.rows) < k:  # --measure K asked for more than the search found apart from each other
        notes.append(
            f"{len(out.rows)} of the {k} finalists asked for: the search found no more fitting policies that differ "
            f"from these in at least {distance} decision{'s' if distance != 1 else ''}"
        )
    while not any(m.fits(budget_bytes) for m in out.rows):
        higher = [m for m in MARGINS if m > tried]
        if not higher:
            break
        over = max(m.peak_bytes / m.finalist.result.peak_bytes for m in out.rows)
        room = 1 - budget_bytes / (over * problem.budget_bytes)  # the share of the planned budget to keep free
        margin = next((m for m in higher if m >= room), higher[-1])
        seen = {m.finalist.key for m in out.rows}
        more = pool.pick(k, margin, min_distance=distance, exclude=seen)
        oom = sum(not math.isfinite(m.iter_s) for m in out.rows)
        why = f"; {oom} ran out of memory, or of room, within it" if oom else ""
        notes.append(
            f"no finalist fit when measured (up to {over - 1:+.2%} over its plan{why}): measuring {len(more)} "
            f"planned with {margin:.0%} of the budget free"
        )
        run(more)
        tried = margin
    out.note = "; ".join(notes)
    fitting = [m for m in out.rows if m.fits(budget_bytes)]
    out.chosen = max(fitting, key=lambda m: m.samples_per_s) if fitting else None
    return out


def finalist_policy(
    problem: Problem, f: Finalist, found: SearchResult, budget_bytes: int | None, searcher: str
) -> Policy:
    """A finalist as a policy file in place of the search's answer: its planned figures, the search's
    provenance under ``searcher``; ``budget_bytes`` the budget as typed, of which the problem planned for all
    but the reserve (recorded with it, NOTE [ Budget and reserve ])."""
    r = f.result
    policy = Policy.from_vector(
        problem.workload,
        f.actions,
        hardware=problem.hardware.name,
        options=f.options,
        searcher=searcher,
        trials=problem.evaluations,
        predicted=Prediction(r.peak_bytes, r.iter_s, r.samples_per_s),
        wall_s=found.wall_s,
    )
    reserve = None if budget_bytes is None else max(0, budget_bytes - problem.budget_bytes)
    return record_budget(policy, budget_bytes, reserve)


def answer_policy(problem: Problem, chosen: Measured, found: SearchResult, budget_bytes: int) -> Policy:
    """The chosen finalist as a policy file: planned figures, the measurement, the search's provenance."""
    searcher = found.searcher if chosen.label == ANSWER else f"{found.searcher} (measured)"
    policy = finalist_policy(problem, chosen.finalist, found, budget_bytes, searcher)
    policy.measured = Prediction(chosen.peak_bytes, chosen.iter_s, chosen.samples_per_s)
    return policy
