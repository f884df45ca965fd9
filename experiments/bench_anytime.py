"""Anytime search: how soon the default searcher's answer is as good as its long-run answer.

    python experiments/bench_anytime.py [--models resnet50,resnet101,gpt2,bert-base] [--profiles a100-40gb]
        [--fractions 0.8,0.6,0.45,0.3] [--short 10] [--long 60] [--csv FILE]

Each model is traced for each profile, as ``autotune search`` traces it (the GPU's kernels). Per cell (budget
= fraction of the no-policy peak), the portfolio runs as ``autotune search`` runs it (baselines first, then
the search, in one time limit), three times from scratch:

- ``long``: ``--long`` seconds with the early stop off: the reference answer, and the time at which the best
  policy found came within 1% and within 0.1% of it (the run's history of improvements);
- ``short``: ``--short`` seconds (early stop on): its answer against the long one (target >= 0.99 in every
  cell);
- ``default``: ``--long`` seconds with the early stop on (what ``autotune search`` does by default): its
  wall time and its answer against the long one.

Targets (issue: the search's frontier, item 4): short / long >= 0.99 in every cell; the default run stops
early once converged. Searches are time-limited, so a busy machine finds less: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

from agents import portfolio
from agents.base import Problem, SearchContext, SearchResult, baseline_names, get_searcher
from autotune.models import default_batch_size
from autotune.workloads import TraceRequest, trace_model
from envs.simulator import SimResult
from runtime.hardware import get_profile
from runtime.workload import peak_report

MODELS = {"resnet50": {}, "resnet101": {}, "gpt2": {"seq_len": 1024}, "bert-base": {}}


class _History:
    """The best feasible samples/s seen over the problem's evaluations, with when it was reached."""

    def __init__(self, problem: Problem) -> None:
        self.start = time.perf_counter()
        self.best = 0.0
        self.points: list[tuple[float, float]] = []  # (seconds since start, samples/s), at each improvement
        evaluate = problem.evaluate

        def recorded(*args, **kwargs) -> SimResult:  # type: ignore[no-untyped-def]
            result = evaluate(*args, **kwargs)
            if result.feasible and result.samples_per_s > self.best:
                self.best = result.samples_per_s
                self.points.append((time.perf_counter() - self.start, self.best))
            return result

        problem.evaluate = recorded  # type: ignore[method-assign]

    def reached(self, target: float) -> float | None:
        """Seconds until the best was at least ``target``."""
        return next((t for t, v in self.points if v >= target), None)


def run(w, hw, budget: int, limit_s: float, early_stop: bool) -> tuple[SearchResult, float, _History]:  # type: ignore[no-untyped-def]
    """The portfolio as ``autotune search`` runs it: baselines, then the search, within ``limit_s``."""
    problem = Problem(w, hw, budget)
    history = _History(problem)
    started = time.perf_counter()
    seeds = tuple(get_searcher(n).search(problem) for n in baseline_names())
    ctx = SearchContext(time_limit_s=max(1.0, limit_s - (time.perf_counter() - started)), trials=0, seeds=seeds)
    saved = portfolio.EARLY_STOP
    portfolio.EARLY_STOP = early_stop
    try:
        found = get_searcher("portfolio").search(problem, ctx)
    finally:
        portfolio.EARLY_STOP = saved
    return found, time.perf_counter() - started, history


def _speed(r: SearchResult) -> float | None:
    return r.result.samples_per_s if r.feasible else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profiles", default="a100-40gb")
    ap.add_argument("--fractions", default="0.8,0.6,0.45,0.3")
    ap.add_argument("--short", type=float, default=10.0)
    ap.add_argument("--long", type=float, default=60.0)
    ap.add_argument("--runs", default="long,short,default", help="which of the three runs per cell")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args()
    header = ["model", "profile", "budget", "long", "at_1pct_s", "at_0.1pct_s", "short", "short_vs_long",
              "default", "default_vs_long", "default_s"]  # fmt: skip
    rows: list[dict[str, object]] = []
    print(" | ".join(header), flush=True)
    for model in args.models.split(","):
        for profile in args.profiles.split(","):
            hw = get_profile(profile)
            req = TraceRequest(model=model, batch_size=default_batch_size(model), target=hw, **MODELS.get(model, {}))  # type: ignore[arg-type]
            w, _ = trace_model(req)
            peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
            for fraction in (float(f) for f in args.fractions.split(",")):
                budget = int(peak * fraction)
                runs = args.runs.split(",")
                row: dict[str, object] = {"model": model, "profile": profile, "budget": f"{fraction:.0%}"}
                ref = None
                if "long" in runs:
                    long, _, hist = run(w, hw, budget, args.long, early_stop=False)
                    row["long"] = ref = _speed(long)
                    if ref:
                        row["at_1pct_s"] = hist.reached(0.99 * ref)
                        row["at_0.1pct_s"] = hist.reached(0.999 * ref)
                        print("   history: " + ", ".join(f"{t:.1f} s {v:,.1f}" for t, v in hist.points[-8:]))
                if "short" in runs:
                    row["short"] = _speed(run(w, hw, budget, args.short, early_stop=True)[0])
                if "default" in runs:
                    default, row["default_s"], _ = run(w, hw, budget, args.long, early_stop=True)
                    row["default"] = _speed(default)
                for k in ("short", "default"):
                    v = row.get(k)
                    row[f"{k}_vs_long"] = v / ref if isinstance(v, float) and ref else None
                rows.append(row)
                print(" | ".join(_fmt(row.get(h)) for h in header), flush=True)
                if args.csv:
                    with args.csv.open("w", newline="") as f:
                        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
                        writer.writeheader()
                        writer.writerows(rows)
    short = [r["short_vs_long"] for r in rows if isinstance(r.get("short_vs_long"), float)]
    default = [r["default_vs_long"] for r in rows if isinstance(r.get("default_vs_long"), float)]
    walls = [r["default_s"] for r in rows if isinstance(r.get("default_s"), float)]
    if short:
        low = sum(1 for s in short if s < 0.99)
        print(f"\n{args.short:g} s against {args.long:g} s: min {min(short):.4f}, median "
              f"{statistics.median(short):.4f}; below 0.99 in {low} of {len(short)} cells (target: none)")  # fmt: skip
    if default:
        print(f"default (early stop, at most {args.long:g} s): min {min(default):.4f} of the long answer; wall "
              f"median {statistics.median(walls):.1f} s, max {max(walls):.1f} s")  # fmt: skip


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    return "—" if v is None else str(v)


if __name__ == "__main__":
    main()
