"""What the four headline experiments share: the models, tracing, budgets as a share of the saved
activations, one searched cell (every heuristic, then the portfolio seeded with them), CSV and PNG output.

Not a command; imported by experiments/exp_*.py (run from the repository root, e.g.
``python experiments/exp_maxbatch.py``).
"""

from __future__ import annotations

import argparse
import csv
import io
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.base import Problem, SearchContext, SearchResult, Status, baseline_names, best_of, get_searcher
from autotune.search import budget_floor
from autotune.workloads import TraceRequest, trace_model
from envs.simulator import SimResult
from runtime.fileio import atomic_write
from runtime.hardware import HardwareProfile
from runtime.policy import Policy
from runtime.workload import Workload, peak_report

RESULTS = Path("experiments/results")

# The models of the headline table: trace options, the batch for fixed-batch experiments, and the first
# batch `maxbatch` tries (transformers at full sequence length need gigabytes per sample).
MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {"kw": {}, "batch": 64, "start": 16},
    "resnet101": {"kw": {}, "batch": 64, "start": 16},
    "vgg16": {"kw": {}, "batch": 64, "start": 16},
    "densenet121": {"kw": {}, "batch": 64, "start": 16},
    "bert-base": {"kw": {"seq_len": 512}, "batch": 8, "start": 2},
    "gpt2-medium": {"kw": {"seq_len": 1024}, "batch": 4, "start": 1},
}


def experiment_parser(doc: str | None, out: str, replot_from: str = "<out>.csv") -> argparse.ArgumentParser:
    """The options every headline experiment has: --models, --out (results/<out>.csv and .png), --replot."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=models_arg, default=list(MODELS))
    ap.add_argument("--out", type=Path, default=RESULTS / out)
    ap.add_argument("--replot", action="store_true", help=f"redraw the table and PNG from {replot_from}, no search")
    return ap


def show(
    rows: list[dict[str, Any]],
    table: Callable[[list[dict[str, Any]]], str],
    plot: Callable[[list[dict[str, Any]], Path], None],
    out: Path,
) -> None:
    """Print an experiment's table and draw its PNG beside the CSV."""
    print()
    print(table(rows))
    plot(rows, out.with_suffix(".png"))


def trace(model: str, target: HardwareProfile, batch: int | None = None, partitions: tuple[Any, ...] = ()) -> Workload:
    """``model``'s fake trace for ``target``, as `autotune search` traces it (a GPU profile's kernels:
    runtime/target.py), with ``partitions`` (runtime/partition.py) if any."""
    spec = MODELS.get(model, {"kw": {}, "batch": None})
    b = batch or spec["batch"]
    w, _ = trace_model(TraceRequest(model=model, batch_size=b, target=target, partitions=partitions, **spec["kw"]))
    return w


def models_arg(value: str) -> list[str]:
    names = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}: expected some of {', '.join(MODELS)}")
    return names


def activation_bytes_at_peak(w: Workload, hw: HardwareProfile) -> tuple[int, int]:
    """(no-policy peak, bytes of saved activations live at that peak), both rounded as the allocator does."""
    r = peak_report(w, hw.alloc_granularity_bytes)
    return r.peak_bytes, r.by_kind_bytes["activation"]


def activation_budget(w: Workload, hw: HardwareProfile, share: float) -> int:
    """The budget that leaves the saved activations ``share`` of their bytes at the no-policy peak
    (everything else at the peak unchanged): peak - (1 - share) x activations."""
    peak, act = activation_bytes_at_peak(w, hw)
    return int(peak - (1.0 - share) * act)


@dataclass
class Cell:
    """One (workload, profile, budget) searched: no policy, every heuristic, the portfolio."""

    budget: int
    floor: int  # autotune.search.budget_floor: no policy can go below it
    no_policy: SimResult
    heuristics: list[SearchResult]
    found: SearchResult | None  # the portfolio's answer (None: the budget is below the floor)
    wall_s: float

    def best_heuristic(self) -> SearchResult | None:
        return best_of(r for r in self.heuristics if r.feasible)

    def heuristic(self, name: str) -> SearchResult | None:
        return next((r for r in self.heuristics if r.searcher == name and r.feasible), None)

    def slowdown(self, r: SearchResult | None) -> float | None:
        """no-policy samples/s over the policy's, less one (same batch); None if it does not fit."""
        if r is None or not r.feasible:
            return None
        return self.no_policy.samples_per_s / r.result.samples_per_s - 1


def search_cell(
    w: Workload,
    hw: HardwareProfile,
    budget: int,
    seconds: float,
    seed: int = 0,
    extra_seeds: Sequence[Policy | None] = (),
) -> Cell:
    """``extra_seeds``: policies for this workload found elsewhere (another link, say), scored here and added to
    the portfolio's warm start."""
    started = time.perf_counter()
    p = Problem(w, hw, budget)
    no_policy = p.simulator.no_policy(budget_bytes=budget)
    floor = budget_floor(p)
    if floor > budget:
        return Cell(budget, floor, no_policy, [], None, time.perf_counter() - started)
    heuristics = [get_searcher(n).search(p) for n in baseline_names()]
    seeds = list(heuristics)
    for i, policy in enumerate(q for q in extra_seeds if q is not None):
        result = p.evaluate(policy.to_vector(w), policy.options)
        status = Status.FEASIBLE if result.feasible else Status.INFEASIBLE
        seeds.append(SearchResult(f"seed-{i}", policy, result, status, 0.0, 1))
    ctx = SearchContext(time_limit_s=seconds, seed=seed, trials=0, seeds=tuple(seeds))
    found = get_searcher("portfolio").search(p, ctx)
    return Cell(budget, floor, no_policy, heuristics, found, time.perf_counter() - started)


def write_csv(path: Path, header: Sequence[str], rows: Iterable[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(header), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in header})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buf.getvalue())


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows written by ``write_csv``: numbers back to int or float, empty cells to None (for --replot)."""

    def value(v: str) -> Any:
        if v == "":
            return None
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    with path.open(newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _csv_value(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def save_png(fig: Any, path: Path) -> None:
    """Write a matplotlib figure atomically (a temporary name, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=130, bbox_inches="tight", format="png")
    tmp.replace(path)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "—"
    if kind == "pct":
        return f"{v:+.1%}"
    if kind == "share":
        return f"{v:.0%}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "gib":
        return f"{v / 2**30:.2f} GiB"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
