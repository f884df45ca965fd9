"""`autotune baselines`: every published heuristic and exact solver on one problem, side by side."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agents.base import Problem, SearchContext, SearchResult, Status, baseline_names, get_searcher, list_searchers
from autotune.budget import Budget, record_budget
from autotune.reserved import OVER, result_stats
from autotune.units import file_stem, format_bytes
from envs.simulator import SimResult
from runtime.errors import AutotuneError


def select_methods(only: str | None) -> list[str]:
    """The published methods (heuristics and exact solvers), or the comma-separated subset ``only``: each name
    one of them, each once, at least one."""
    published = baseline_names() + baseline_names(exact=True)
    if only is None:
        return published
    names = list(dict.fromkeys(n.strip() for n in only.split(",") if n.strip()))  # a name twice: one row, one file
    if not names:
        raise AutotuneError(f"--only {only!r} names no method: expected some of {', '.join(published)}")
    for n in names:
        if n not in published:
            close = difflib.get_close_matches(n, published, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            what = "a search, not a published method (run it with autotune search --searcher)"
            why = what if n in list_searchers() else "unknown"
            raise AutotuneError(f"--only: '{n}' is {why}: {hint}expected some of {', '.join(published)}")
    return names


def run_baselines(problem: Problem, ctx: SearchContext, methods: list[str], err: Console) -> list[SearchResult]:
    results = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # a transient bar that never drew left an empty line in a log or pipe
    ) as progress:
        task = progress.add_task("baselines", total=len(methods))
        for name in methods:
            progress.update(task, description=f"running {name}")
            results.append(get_searcher(name).search(problem, ctx))
            progress.advance(task)
    return results


@dataclass
class Held:
    """Each method's policy held to the bytes the caching allocator reserves (NOTE [ Reserved budget ]): its
    reserved peak on the allocator's model with the device capped at the planned budget, by the method's
    position; None where it runs out there; absent where it was not checked (over the budget in tensors)."""

    reserved_bytes: dict[int, int | None]
    expandable_segments: bool = False


def held_to_reserved(
    problem: Problem, results: list[SearchResult], expandable_segments: bool = False
) -> tuple[list[SearchResult], Held]:
    """Every feasible method's policy run on the caching allocator's model, the device capped at the planned
    budget, as `autotune search` holds its answer and its best baseline (step 4 of NOTE [ Reserved budget ]);
    one that runs out there is infeasible, with that note."""
    held, out = Held({}, expandable_segments), []
    for i, r in enumerate(results):
        if r.feasible:
            st = result_stats(problem, r, problem.budget_bytes, expandable_segments)
            held.reserved_bytes[i] = None if st is None else st.peak_reserved
            r = r if st is not None else dataclasses.replace(r, status=Status.INFEASIBLE, note=OVER)
        out.append(r)
    return out, held


def rows(
    problem: Problem, results: list[SearchResult], plain: SimResult | None = None, held: Held | None = None
) -> list[dict[str, Any]]:
    """One JSON-able row per method; ``slowdown`` is against keeping everything, on the model without slices
    (``plain``: its no policy) where the problem's is partitioned; ``held``: each policy's reserved peak on
    the caching allocator's model (``reserved_peak_bytes``, None where it runs out or was not checked)."""
    base = plain if plain is not None else problem.evaluate(problem.keep_all())
    out = []
    for i, r in enumerate(results):
        checked = held is not None and i in held.reserved_bytes
        reserved = held.reserved_bytes[i] if held is not None and checked else None
        out.append(
            {
                "method": r.searcher,
                "exact": get_searcher(r.searcher).exact,
                "status": r.status.value,
                "feasible": r.feasible,
                "peak_bytes": r.result.peak_bytes,
                "iter_s": r.result.iter_s,
                "samples_per_s": r.result.samples_per_s,
                "slowdown": base.samples_per_s / r.result.samples_per_s - 1,
                "wall_s": r.wall_s,
                "evaluations": r.evaluations,
                "gap": r.gap,
                "note": r.note,
                "reserved_peak_bytes": reserved,
                "runs_on_allocator_model": (reserved is not None) if checked else None,
            }
        )
    return out


def best_heuristic(table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest feasible row among heuristics (exact solvers excluded)."""
    feasible = [r for r in table if r["feasible"] and not r["exact"]]
    return max(feasible, key=lambda r: r["samples_per_s"]) if feasible else None


def render(
    out: Console, problem: Problem, table: list[dict[str, Any]], budget: Budget | None = None, held: Held | None = None
) -> None:
    w = problem.workload
    best = best_heuristic(table)
    shown = format_bytes(problem.budget_bytes if budget is None else budget.given_bytes)
    if budget is not None and budget.given_bytes != problem.budget_bytes:
        shown += f" (planned for {format_bytes(problem.budget_bytes)})"
    t = Table(title=f"{w.model}, batch {w.batch_size}, {problem.hardware.name}, budget {shown}")
    cols = ("method", "status", "peak", *(("reserved",) if held is not None else ()), "iteration", "samples/s",
            "slowdown", "solve")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "status") else "right")
    for r in table:
        shown_reserved = () if held is None else (_reserved_cell(r),)
        style = "bold green" if best is not None and r is best else ("dim" if not r["feasible"] else "")
        status = r["status"] + (f" (gap {r['gap']:.1%})" if r["gap"] else "")
        t.add_row(
            r["method"] + (" *" if r["exact"] else ""),
            status,
            format_bytes(r["peak_bytes"]),
            *shown_reserved,
            f"{r['iter_s'] * 1e3:.1f} ms",
            f"{r['samples_per_s']:,.1f}",
            f"{r['slowdown']:+.1%}",
            f"{r['wall_s']:.2f} s",
            style=style,
        )
    out.print(t)
    out.print("* exact solver (optimal for its own model of the problem). Green: the fastest feasible heuristic.")
    if held is not None:
        es = " with expandable_segments:True" if held.expandable_segments else ""
        over = sum(r["runs_on_allocator_model"] is False for r in table)
        none = " none runs there: `autotune search` plans the heuristics again for fewer tensor bytes;" * (
            best is None and over > 0
        )
        out.print(
            f"reserved: what PyTorch's CUDA caching allocator reserves for the policy (a model{es}, three iterations, "
            f"the device capped at the planned budget, as `autotune search` holds its answer); {over} of the "
            f"policies that fit in tensors run out there, shown infeasible;{none} --budget-kind allocated counts "
            "tensors alone",
            highlight=False,
        )


def _reserved_cell(row: dict[str, Any]) -> str:
    if row["runs_on_allocator_model"] is None:
        return ""
    return format_bytes(row["reserved_peak_bytes"]) if row["runs_on_allocator_model"] else "runs out"


def save(directory: Path, problem: Problem, results: list[SearchResult], budget: Budget | None = None) -> list[Path]:
    """Each method's policy file, recording the budget as typed (the planned one without ``budget``); one that
    does not fit the budget is named ``<model>.<method>.infeasible.policy.json`` (nothing told them apart). A
    method's file of the other kind, from an earlier run at another budget, goes: the folder said both fitting
    and not fitting for one method."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        stem = f"{file_stem(problem.workload.model)}.{r.searcher}"
        path, other = (directory / f"{stem}{kind}.policy.json" for kind in ("", ".infeasible"))
        if not r.feasible:
            path, other = other, path
        record_budget(r.policy, budget if budget is not None else problem.budget_bytes).save(path)
        other.unlink(missing_ok=True)
        paths.append(path)
    return paths


def to_json(
    problem: Problem,
    table: list[dict[str, Any]],
    budget: Budget | None = None,
    plain: SimResult | None = None,
    saved: Path | None = None,
    held: Held | None = None,
) -> str:
    """The problem (as `search --json` names it), no policy (``plain``: on the model without slices, as in
    :func:`rows`), the fastest feasible heuristic and one row per method (``methods``); ``budget_kind``
    reserved where ``held``."""
    w = problem.workload
    base = plain if plain is not None else problem.evaluate(problem.keep_all())
    top = best_heuristic(table)
    return json.dumps(
        {
            "model": w.model,
            "batch_size": w.batch_size,
            "precision": w.precision,
            "grad_accum": w.grad_accum,
            "gpu": problem.hardware.name,
            "budget_bytes": problem.budget_bytes if budget is None else budget.given_bytes,
            "planned_budget_bytes": problem.budget_bytes,
            "partitions": list(w.meta.get("partitions", ())),
            "budget_kind": "reserved" if held is not None else "allocated",
            "expandable_segments": held is not None and held.expandable_segments,
            "no_policy_samples_per_s": base.samples_per_s,
            "no_policy_peak_bytes": base.peak_bytes,
            "best_heuristic": top["method"] if top else None,
            "saved_to": str(saved) if saved is not None else None,
            "methods": table,
        }
    )


__all__ = [
    "Held",
    "Status",
    "best_heuristic",
    "held_to_reserved",
    "render",
    "rows",
    "run_baselines",
    "save",
    "select_methods",
]
