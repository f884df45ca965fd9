"""`autotune maxbatch`: the largest batch that trains within a memory budget, with and without a policy.

Sizes are tried by doubling from the start size until one does not fit (or is too slow), then by bisection
between the last that fits and the first that does not. Each size is traced once (fake mode) and searched
with the portfolio for ``per_size_s`` seconds, seeded with the policy found at the previous fitting size
(keys do not depend on the batch size, so the vector carries over). The no-policy batch comes from the
same traces (keep-all peak within the budget), extended by its own doubling and bisection, and so does the
largest batch of the best published heuristic (each size's baselines, which also seed the search there).

A size "fits" when the found policy is within the planned budget and, with ``max_slowdown``, runs at most
that much slower than the same batch with no policy (the price of the memory saved, the measure the
published systems report).

With ``--measure K`` (NOTE [ Measured search ] in autotune/measured.py), the sizes that fit on the simulator
are then taken from the largest down: each is traced in real mode on the planned device, searched again
there (``per_size_s``, seeded with the answer of its fake-mode search and the heuristics), and its K best
distinct policies are trained for real; the answer is the largest size whose fastest measured policy fits
the budget (at most ``MEASURED_SIZES`` sizes are measured). The doubling and bisection stay on fake-mode
traces: a real trace at a size that does not fit would take the memory it needs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from agents.base import Problem, SearchContext, SearchResult, Status, baseline_names, best_of, get_searcher
from agents.finalists import Finalists
from autotune.measured import MeasuredSearch, answer_policy
from autotune.reserved import ReservedFit
from autotune.search import budget_floor, check_reserved, plain_no_policy, warn_reserved
from envs.simulator import SimResult
from runtime.errors import AutotuneError, ModelError
from runtime.hardware import HardwareProfile
from runtime.policy import Policy
from runtime.workload import Workload, peak_report

if TYPE_CHECKING:
    from autotune.real_backend import RealBackend
    from runtime.partition import Partition

MAX_BATCH = 1 << 16
MEASURED_SIZES = 3  # --measure: sizes trained for real, from the largest that fits on the simulator down
FAKE_TRACE, REAL_TRACE = "fake-mode trace", "real-mode trace"  # what a size's simulated times are timed on


@dataclass
class SizeResult:
    batch_size: int
    fits: bool  # within the budget (and max_slowdown) with the best policy found
    fits_without_policy: bool
    no_policy: SimResult
    found: SearchResult | None  # None when the state alone exceeds the budget (nothing searched)
    slowdown: float | None  # no-policy samples/s / found samples/s - 1, same batch
    searched: bool = True  # False: traced for the no-policy search only (``fits`` is then unknown)
    baseline: SearchResult | None = None  # the best published heuristic at this size (None: not run)
    baseline_fits: bool | None = None  # within the budget (and max_slowdown); None: not run
    trained: bool | None = None  # --measure: None not trained; True the answer, as measured; False did not fit so

    @property
    def timed_on(self) -> str:
        """Where the simulator's times come from: a fake-mode trace (the profile's modelled op times; every size
        the search tries) or, for --measure's answer (the one size trained and fitting), its real-mode trace."""
        return REAL_TRACE if self.trained is True else FAKE_TRACE

    @property
    def baseline_slowdown(self) -> float | None:
        b = self.baseline
        return self.no_policy.samples_per_s / b.result.samples_per_s - 1 if b is not None and b.feasible else None

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "fits": self.fits if self.searched else None,
            "fits_without_policy": self.fits_without_policy,
            "peak_bytes": self.found.result.peak_bytes if self.found else None,
            "samples_per_s": self.found.result.samples_per_s if self.found and self.found.feasible else None,
            "no_policy_peak_bytes": self.no_policy.peak_bytes,
            "no_policy_samples_per_s": self.no_policy.samples_per_s,
            "slowdown": self.slowdown,
            "searcher": self.found.searcher if self.found else None,
            "baseline": self.baseline.searcher if self.baseline is not None and self.baseline.feasible else None,
            "baseline_fits": self.baseline_fits,
            "baseline_samples_per_s": (
                self.baseline.result.samples_per_s if self.baseline is not None and self.baseline.feasible else None
            ),
            "baseline_slowdown": self.baseline_slowdown,
            "trained": self.trained,
            "timed_on": self.timed_on,
        }


@dataclass
class MeasuredSize:
    """``--measure``: the size whose measured answer fits, searched again on its real-mode trace."""

    batch_size: int
    found: SearchResult  # the search on the real-mode trace, with the measured answer as its policy
    measured: MeasuredSearch


@dataclass
class MaxBatchOutcome:
    max_batch: int  # 0: not even batch 1 fits
    max_batch_no_policy: int
    best: SizeResult | None
    max_batch_baseline: int = 0  # the best published heuristic's largest batch, same criteria
    tried: list[SizeResult] = field(default_factory=list)
    policy_path: Path | None = None
    wall_s: float = 0.0
    measured: MeasuredSize | None = None  # --measure: the answer as trained
    measured_sizes: list[int] = field(default_factory=list)  # --measure: every size trained, largest first
    reserved: ReservedFit | None = None  # GPU profiles, answer not measured: on the caching allocator's model

    def to_json(self, hw: HardwareProfile, budget_bytes: int, planned_bytes: int) -> dict[str, Any]:
        b = self.best
        return {
            "max_batch": self.max_batch,
            "max_batch_no_policy": self.max_batch_no_policy,
            "ratio": self.max_batch / self.max_batch_no_policy if self.max_batch_no_policy else None,
            "max_batch_baseline": self.max_batch_baseline,
            "baseline": next(
                (t.baseline.searcher for t in self.tried if t.batch_size == self.max_batch_baseline and t.baseline),
                None,
            ),
            "baseline_ratio": (
                self.max_batch_baseline / self.max_batch_no_policy if self.max_batch_no_policy else None
            ),
            "samples_per_s": b.found.result.samples_per_s if b and b.found else None,
            "peak_bytes": b.found.result.peak_bytes if b and b.found else None,
            "slowdown": b.slowdown if b else None,  # against no policy at max_batch (the next figure)
            "timed_on": b.timed_on if b else None,
            # No policy's samples/s at the answer's batch (what "slowdown" compares with; it may not fit there)
            # and at its own largest batch: two batches, named so.
            "no_policy_samples_per_s_at_max_batch": b.no_policy.samples_per_s if b else None,
            "no_policy_samples_per_s_at_max_batch_no_policy": next(
                (t.no_policy.samples_per_s for t in self.tried if t.batch_size == self.max_batch_no_policy), None
            ),
            "policy_path": str(self.policy_path) if self.policy_path else None,
            "gpu": hw.name,
            "budget_bytes": budget_bytes,
            "planned_budget_bytes": planned_bytes,
            "sizes": [t.to_json() for t in sorted(self.tried, key=lambda t: t.batch_size)],
            "wall_s": self.wall_s,
            "measured": (
                {"batch_size": self.measured.batch_size, **self.measured.measured.to_dict()}
                if self.measured is not None
                else None
            ),
            "measured_sizes": self.measured_sizes,
            "reserved": self.reserved.to_dict() if self.reserved is not None else None,
        }


class MaxBatch:
    """The search over batch sizes; ``trace(b)`` gives the workload at batch ``b`` (cached here)."""

    def __init__(
        self,
        trace: Callable[[int], Workload],
        hw: HardwareProfile,
        planned_bytes: int,
        *,
        per_size_s: float,
        max_slowdown: float | None,
        seed: int = 0,
        progress: Callable[[str], None] | None = None,
        partition: Callable[[Workload], Workload] | None = None,
    ) -> None:
        """``partition``: the workload to plan a size on, from the unpartitioned one (--allow-partition:
        autotune/partitions.py); no policy is always the unpartitioned model's."""
        self.trace, self.hw, self.planned = trace, hw, planned_bytes
        self.partition = partition
        self.per_size_s, self.max_slowdown, self.seed = per_size_s, max_slowdown, seed
        self.progress = progress or (lambda _msg: None)
        self.results: dict[int, SizeResult] = {}
        self._workloads: dict[int, Workload] = {}  # what each size is planned on
        # sizes at which the model raised in its first training step, once another size had traced (BatchNorm
        # at batch 1: "expected more than 1 value per channel"): they do not fit; the first such error
        self.untrainable: dict[int, str] = {}
        self._plain: dict[int, Workload] = {}  # unpartitioned: what no policy runs
        self._no_policy: dict[int, SimResult] = {}
        self._problems: dict[int, Problem] = {}
        self._baselines: dict[int, tuple[SimResult, list[SearchResult]]] = {}  # per size: no policy, baselines
        self._last_fit: SizeResult | None = None

    def workload(self, b: int) -> Workload:
        if b in self.untrainable:
            raise _Untrainable(b)
        if b not in self._workloads:
            self.progress(f"tracing batch {b}")
            try:
                self._plain[b] = self._workloads[b] = self.trace(b)
            except ModelError as e:
                if not self._workloads:  # the first size: the model, or its settings, do not train at all
                    raise
                self.untrainable[b] = e.reason
                raise _Untrainable(b) from None
            if self.partition is not None:
                self._workloads[b] = self.partition(self._plain[b])
        return self._workloads[b]

    def no_policy(self, b: int) -> SimResult:
        """No policy at ``b``, on the unpartitioned model (simulated once per size)."""
        if b not in self._no_policy:
            self.workload(b)
            self._no_policy[b] = plain_no_policy(self._problem(b), self._plain[b])
        return self._no_policy[b]

    def searched(self) -> list[dict[str, Any]]:
        """The sizes searched so far, each with whether it fits and its samples/s (simulated) where it does."""
        done = [self.results[b] for b in sorted(self.results) if self.results[b].searched]
        return [
            {
                "batch_size": r.batch_size,
                "fits": bool(r.fits and r.found is not None),
                "samples_per_s": r.found.result.samples_per_s if r.fits and r.found is not None else None,
            }
            for r in done
        ]

    def reached(self) -> str:
        """The sizes searched so far and what each gave, in one line (what a Ctrl-C leaves the user)."""
        done = self.searched()
        if not done:
            return "no batch size searched yet"
        said = [
            f"{s['batch_size']} fits ({s['samples_per_s']:,.1f} samples/s)"
            if s["fits"]
            else f"{s['batch_size']} does not"
            for s in done
        ]
        return "searched " + ", ".join(said)

    def no_policy_fits(self, b: int) -> bool:
        self.workload(b)
        return peak_report(self._plain[b], self.hw.alloc_granularity_bytes).peak_bytes <= self.planned

    def _problem(self, b: int) -> Problem:
        if b not in self._problems:  # one per size, so its simulator is built once
            w = self.workload(b)
            self._problems[b] = Problem(w, self.hw, self.planned)
        return self._problems[b]

    @property
    def ctx(self) -> SearchContext:
        """How each size is searched: ``per_size_s`` seconds under the seed, stopping early once converged."""
        return SearchContext(time_limit_s=self.per_size_s, seed=self.seed, trials=0)

    def _search(self, name: str, problem: Problem, seeds: tuple[SearchResult, ...] = ()) -> SearchResult:
        """``name``'s search of ``problem`` in a context of its own (one size's convergence is not another's).
        A Ctrl-C that the search took (it returns its best so far) stops the whole run: an answer from a size
        searched only in part is no answer, so the KeyboardInterrupt goes on to the caller."""
        ctx = self.ctx.derive(seeds=seeds)
        with ctx.noting_sigint():
            found = get_searcher(name).search(problem, ctx)
        if ctx.interrupted or ctx.state.sigint_pending:  # (pending: a Ctrl-C that a finalizer swallowed)
            raise KeyboardInterrupt
        return found

    def baselines(self, b: int) -> tuple[SimResult, list[SearchResult]]:
        """The no-policy result at ``b`` and every published heuristic's (none run when no policy can meet
        the budget: ``autotune.search.budget_floor``)."""
        if b not in self._baselines:
            problem = self._problem(b)
            no_policy = self.no_policy(b)
            seeds: list[SearchResult] = []
            if budget_floor(problem) <= self.planned:
                self.progress(f"baselines at batch {b}")
                seeds = [self._search(n, problem) for n in baseline_names()]
            self._baselines[b] = (no_policy, seeds)
        return self._baselines[b]

    def _fits(self, no_policy: SimResult, found: SearchResult | None) -> bool:
        if found is None or not found.feasible:
            return False
        slowdown = no_policy.samples_per_s / found.result.samples_per_s - 1
        return self.max_slowdown is None or slowdown <= self.max_slowdown

    def _best_baseline(self, b: int) -> SearchResult | None:
        return best_of(self.baselines(b)[1])

    def baseline_fits(self, b: int) -> bool:
        no_policy, _ = self.baselines(b)
        return self._fits(no_policy, self._best_baseline(b))

    def evaluate(self, b: int) -> SizeResult:
        if b in self.results:
            return self.results[b]
        w = self.workload(b)
        problem = self._problem(b)
        no_policy, baselines = self.baselines(b)
        if not baselines:  # no policy can meet the budget (autotune.search.check_budget)
            r = SizeResult(b, False, False, no_policy, None, None, baseline_fits=False)
        else:
            self.progress(f"searching batch {b}")
            seeds = list(baselines)
            last = self._last_fit
            if last is not None and last.found is not None and _same_slicing(self.workload(last.batch_size), w):
                prev = last.found
                vec = prev.policy.to_vector(self.workload(last.batch_size))
                policy = Policy.from_vector(w, vec, hardware=self.hw.name, options=prev.policy.options)
                seeds.append(_as_seed(problem, policy, f"batch-{last.batch_size}"))
            found = self._search("portfolio", problem, tuple(seeds))
            slowdown = no_policy.samples_per_s / found.result.samples_per_s - 1 if found.feasible else None
            fits = self._fits(no_policy, found)
            r = SizeResult(b, fits, no_policy.peak_bytes <= self.planned, no_policy, found, slowdown)
            r.baseline, r.baseline_fits = self._best_baseline(b), self.baseline_fits(b)
        self.results[b] = r
        if r.fits and (self._last_fit is None or b > self._last_fit.batch_size):
            self._last_fit = r
        return r

    def run(self, start: int, rel_tol: float = 0.0) -> MaxBatchOutcome:
        """``rel_tol``: stop each bisection once its bounds are within that fraction (0: exact)."""
        started = time.perf_counter()
        best = _largest(start, _trainable(lambda b: self.evaluate(b).fits), rel_tol)
        baseline = _largest(start, _trainable(self.baseline_fits), rel_tol)
        no_policy = _largest(start, _trainable(self.no_policy_fits), rel_tol)
        for b in self._workloads:  # sizes not searched (baselines or no policy only): record them too
            if b not in self.results:
                r = self.no_policy(b)
                s = SizeResult(b, False, r.feasible, r, None, None, searched=False)
                if b in self._baselines:
                    s.baseline, s.baseline_fits = self._best_baseline(b), self.baseline_fits(b)
                self.results[b] = s
        out = MaxBatchOutcome(
            best, no_policy, self.results.get(best), tried=list(self.results.values()), max_batch_baseline=baseline
        )
        out.wall_s = time.perf_counter() - started
        return out

    def measure(
        self,
        outcome: MaxBatchOutcome,
        backend_at: Callable[[int, tuple[Partition, ...]], RealBackend],
        k: int,
        budget_bytes: int,
    ) -> MaxBatchOutcome:
        """``--measure k`` (see the module's docstring): from the largest size that fits on the simulator
        down, at most MEASURED_SIZES of them, the first whose measured answer fits ``budget_bytes`` (the
        user's budget) becomes the outcome's answer; with none, ``max_batch`` is 0. ``backend_at(b, parts)``
        traces and trains size b with the partitions its simulated answer chose; no policy is the
        unpartitioned model's, traced so too."""
        from autotune.measured import measure

        started = time.perf_counter()
        sizes = sorted((r.batch_size for r in self.results.values() if r.fits and r.found), reverse=True)
        outcome.max_batch, outcome.best = 0, None
        for b in sizes[:MEASURED_SIZES]:
            outcome.measured_sizes.append(b)
            self.results[b].trained = False  # until its measured answer fits
            simulated = self.results[b].found
            assert simulated is not None
            parts = simulated.policy.partitions
            self.progress(f"tracing batch {b} in real mode")
            # The unpartitioned trace first, its model let go at once: a device's measured peak counts all.
            plain_w = backend_at(b, ()).workload if parts else None
            backend = backend_at(b, parts)
            problem = Problem(
                backend.workload, self.hw, self.planned, finalists=Finalists(self.planned, capacity=4 * k)
            )
            no_policy = plain_no_policy(problem, plain_w)
            self.progress(f"searching batch {b} on its real-mode trace")
            baselines = [self._search(n, problem) for n in baseline_names()]
            seeds = (*baselines, _as_seed(problem, simulated.policy, f"batch-{b}-fake-trace"))
            found = self._search("portfolio", problem, seeds)
            if not self._fits(no_policy, found):
                continue
            self.progress(f"measuring batch {b}")
            m = measure(problem, backend, k, budget_bytes=budget_bytes, found=found, baselines=baselines,
                        progress=self.progress)  # fmt: skip
            if m.chosen is None:
                continue
            f = m.chosen.finalist
            policy = answer_policy(problem, m.chosen, found, budget_bytes)
            answer = dataclasses.replace(found, policy=policy, result=f.result)
            slowdown = no_policy.samples_per_s / f.result.samples_per_s - 1
            outcome.max_batch = b
            outcome.best = SizeResult(b, True, no_policy.feasible, no_policy, answer, slowdown, trained=True)
            best_baseline = best_of(baselines)
            outcome.best.baseline, outcome.best.baseline_fits = best_baseline, self._fits(no_policy, best_baseline)
            outcome.measured = MeasuredSize(b, answer, m)
            # The answer's row as trained, on its real-mode trace: the figures the file and the answer give.
            outcome.tried = [outcome.best if t.batch_size == b else t for t in outcome.tried]
            break
        outcome.wall_s += time.perf_counter() - started
        return outcome

    def check_allocator(self, outcome: MaxBatchOutcome) -> MaxBatchOutcome:
        """On a GPU profile, whether the answer (planned to the edge of the budget) also runs within it on the
        caching allocator's model, as `autotune search` checks its answer (NOTE [ Reserved budget ]): checked,
        not enforced. A measured answer ran on the device itself, capped at the budget: not checked."""
        b = outcome.best
        if self.hw.is_gpu and outcome.measured is None and b is not None and b.found and b.found.feasible:
            outcome.reserved = check_reserved(self._problem(b.batch_size), b.found)
        return outcome


def _same_slicing(a: Workload, b: Workload) -> bool:
    """A policy for one size seeds another only where both were traced with the same partitions: other
    slices are other candidates."""
    return a.meta.get("partitions") == b.meta.get("partitions") and len(a.candidates) == len(b.candidates)


def _as_seed(problem: Problem, policy: Policy, name: str) -> SearchResult:
    """A policy carried over from another batch size, scored here, as a warm-start seed."""
    actions = policy.to_vector(problem.workload)
    result = problem.evaluate(actions, policy.options)
    status = Status.FEASIBLE if result.feasible else Status.INFEASIBLE
    return SearchResult(name, policy, result, status, 0.0, 1)


class _Untrainable(Exception):
    """A batch size at which the model does not train (``MaxBatch.untrainable``)."""


def _trainable(fits: Callable[[int], bool]) -> Callable[[int], bool]:
    """``fits``, False at a size where the model does not train."""

    def fits_or_not(b: int) -> bool:
        try:
            return fits(b)
        except _Untrainable:
            return False

    return fits_or_not


def _largest(start: int, fits: Callable[[int], bool], rel_tol: float = 0.0) -> int:
    """The largest b with fits(b) (0 if not even 1), assuming fits is monotone: doubling from ``start``, or
    halving from it where it does not fit, then bisection between the last size that fits and the first that
    does not, until they are 1 apart or, with ``rel_tol``, within that fraction of the one that fits (the
    answer is then at most that far below)."""
    if fits(start):
        lo, hi = start, start * 2
        while hi <= MAX_BATCH and fits(hi):
            lo, hi = hi, hi * 2
        if hi > MAX_BATCH:
            return lo
    else:
        lo, hi = start // 2, start
        while lo >= 1 and not fits(lo):
            lo, hi = lo // 2, lo
        if lo < 1:
            return 0
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def check_start(start: int) -> None:
    if start <= 0 or start > MAX_BATCH:
        raise AutotuneError(f"invalid --start-batch {start}: expected 1 to {MAX_BATCH}, e.g. --start-batch 32")


def render(
    out: Console, model: str, hw: HardwareProfile, budget_bytes: int, outcome: MaxBatchOutcome, result: dict[str, Any]
) -> None:
    """`autotune maxbatch`'s table: every batch size tried, the answer in green, and the measurement."""
    from autotune import search as sr

    timed = {r["timed_on"] for r in result["sizes"] if r["samples_per_s"] is not None}
    t = Table(title=f"{model} on {hw.name}, budget {sr.format_bytes(budget_bytes)}", caption=_caption(hw, timed))
    # A row simulated on a real-mode trace is marked (*) rather than given a column: a narrower table (80
    # columns in a log) wrapped "too slow" and the heuristic's cells.
    for col in ("batch", "fits", "no policy fits", "peak", "samples/s", "slowdown", "best heuristic"):
        t.add_column(col, justify="right")
    for r in result["sizes"]:
        t.add_row(
            str(r["batch_size"]),
            # A policy within the budget that is more than --max-slowdown slower does not count: say why.
            "no, as trained"
            if r["trained"] is False
            else "too slow"
            if r["fits"] is False and r["samples_per_s"] is not None
            else _FITS[r["fits"]],
            "yes" if r["fits_without_policy"] else "no",
            sr.format_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "—",
            f"{r['samples_per_s']:,.1f}" + ("*" if r["timed_on"] == REAL_TRACE else "")
            if r["samples_per_s"] is not None
            else "—",
            f"{r['slowdown']:+.1%}" if r["slowdown"] is not None else "—",
            _heuristic_cell(r),
            style="bold green" if r["batch_size"] == outcome.max_batch else "",
        )
    out.print(t)
    ratio = f" ({result['ratio']:.2f}x)" if result["ratio"] else ""
    out.print(
        f"largest batch: {outcome.max_batch} with a policy{ratio}, {outcome.max_batch_no_policy} without, "
        f"{outcome.max_batch_baseline} with the best heuristic ({result['baseline'] or 'none fits'}); "
        f"{outcome.wall_s:.0f} s" + (f"; policy written to {outcome.policy_path}" if outcome.policy_path else "")
    )
    if hw.name == "cpu" and FAKE_TRACE in timed:  # `search` and `simulate` trace this machine in real mode
        f = outcome.policy_path or "FILE"
        out.print(
            "on this machine's CPU the fake traces' times are the cpu profile's estimates of its ops, not timings: "
            f"`autotune simulate --policy {f}` and `autotune train --policy {f}` time its real ops",
            highlight=False,
        )
    warn_reserved(
        out, outcome.reserved, f"`autotune search --batch-size {outcome.max_batch}` (its default --budget-kind "
        "reserved) plans for that, at this batch or a smaller one",
    )  # fmt: skip
    if outcome.measured is not None:
        sr.render_measured(out, outcome.measured.measured)
        out.print(
            f"measured at batch {outcome.measured.batch_size} (sizes trained: "
            f"{', '.join(str(b) for b in outcome.measured_sizes)}), on its real-mode trace"
        )


_FITS = {True: "yes", False: "no", None: "not searched"}


def _caption(hw: HardwareProfile, timed: set[str]) -> str:
    """What the samples/s and slowdowns are: the simulator's, on which trace's op times (one kind or two)."""
    kinds = []
    if FAKE_TRACE in timed:
        kinds.append(f"on fake traces: the {hw.name} profile's modelled op times")
    if REAL_TRACE in timed:
        kinds.append("* on a real trace: op times measured on this machine (--measure; trained figures below)")
    return "samples/s and slowdowns simulated " + "; ".join(kinds) if kinds else ""


def _heuristic_cell(size: dict[str, Any]) -> str:
    """The best published heuristic at one size of `maxbatch`: its name, samples/s and slowdown."""
    if size["baseline_fits"] is None:
        return "not run"
    if size["baseline"] is None:
        return "none fits"
    mark = "" if size["baseline_fits"] else " (too slow)"
    return f"{size['baseline']} {size['baseline_samples_per_s']:,.1f} {size['baseline_slowdown']:+.1%}{mark}"
