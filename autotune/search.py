"""`autotune search`: the main job. Baselines, then the chosen searcher (the portfolio by default), a policy
file, and a table of the found policy against the best baseline and no policy."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agents.base import Problem, SearchResult, baseline_names, best_of, better, get_searcher
from autotune.units import format_bytes, parse_size
from envs.simulator import RECOMPUTE, SimResult, uniform_actions
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile
from runtime.policy import Action, Policy, PolicyOptions
from runtime.workload import Phase, peak_report, rounded

# What the CUDA allocator holds that no trace sees: cuBLAS/cuDNN workspaces and library handles. Measured on
# an H200 (README, runtime on a GPU): resnet50 batch 64 allocated 89 MiB over its traced peak, GPT-2 67 MiB.
DEFAULT_GPU_RESERVE = 128 * 2**20


@dataclass
class SearchOutcome:
    problem: Problem
    found: SearchResult
    baselines: list[SearchResult]
    milp: SearchResult | None
    no_policy: SimResult
    policy_path: Path
    wall_s: float
    interrupted: bool = False  # the study's name is problem.study_name
    notes: list[str] = field(default_factory=list)


def reserve_bytes(reserve: str | None, budget: str, budget_bytes: int, hw: HardwareProfile) -> int:
    """The ``--reserve`` in bytes: as given ("0" allowed), or DEFAULT_GPU_RESERVE on GPU profiles and 0 on
    the CPU; an error when it leaves nothing of the budget."""
    if reserve is None:
        n = DEFAULT_GPU_RESERVE if hw.is_gpu else 0
    else:
        n = 0 if reserve.strip().upper() in ("0", "0B") else parse_size(reserve)
    if n >= budget_bytes:
        what = f"--reserve {reserve}" if reserve is not None else f"the default reserve ({format_bytes(n)})"
        raise AutotuneError(
            f"{what} is not below the budget ({budget}): nothing would be left to plan for; pass a smaller "
            "one, e.g. --reserve 0"
        )
    return n


# -- impossible budgets ----------------------------------------------------------------------------------------
def budget_floor(problem: Problem) -> int:
    """A lower bound on any policy's peak: the state that lives through the whole iteration plus, for the op
    that needs the most, every non-persistent tensor it reads or writes (they must be on the device while
    it runs) and its workspace."""
    w = problem.workload
    g = problem.hardware.alloc_granularity_bytes
    persistent = peak_report(w, g).persistent_bytes
    needs = 0
    for op in w.ops:
        touched = {*op.inputs, *op.outputs}
        b = sum(rounded(w.tensors[t].nbytes, g) for t in touched if not w.tensors[t].persistent)
        needs = max(needs, b + op.workspace_bytes)
    return persistent + needs


def smallest_known_budget(problem: Problem) -> tuple[int, str]:
    """The lowest peak among the most memory-frugal uniform policies: a budget autotune can certainly meet."""
    w = problem.workload
    tries = {
        "recompute everything": np.full(problem.n, RECOMPUTE, dtype=np.int8),
        "recompute every block's inside": uniform_actions(w, Action.RECOMPUTE),
        "swap everything": uniform_actions(w, Action.SWAP),
    }
    opts = PolicyOptions(prefetch_lookahead=1)
    return min((problem.simulator.run(a, options=opts).peak_bytes, k) for k, a in tries.items())


def check_budget(problem: Problem) -> None:
    """Fail at once, with the smallest budget that works, when no policy can meet the budget."""
    floor = budget_floor(problem)
    if problem.budget_bytes < floor:
        smallest, how = smallest_known_budget(problem)
        raise AutotuneError(
            f"budget {format_bytes(problem.budget_bytes)} is below the {format_bytes(floor)} that any policy "
            f"needs (parameters, optimizer state and the batch, plus the largest op's own tensors): no policy "
            f"can meet it; autotune can meet {format_bytes(smallest)} ({how}): raise --budget to at least "
            f"that, or lower --batch-size"
        )


# -- the search ------------------------------------------------------------------------------------------------
def run_search(
    problem: Problem,
    searcher: str,
    *,
    out: Path,
    milp: bool,
    milp_time_s: float,
    err: Console,
    quiet: bool,
    user_budget_bytes: int | None = None,
) -> SearchOutcome:
    """Baselines, then ``searcher``; the best policy is written to ``out``. ``problem.budget_bytes`` is what
    the search plans for; ``user_budget_bytes`` (the budget before the reserve) is what the policy file
    records, and what `autotune train` caps the device at."""
    started = time.perf_counter()
    get_searcher(searcher)  # an unknown name fails before any work
    no_policy = problem.simulator.run(problem.keep_all(), budget_bytes=problem.budget_bytes)
    limit = problem.time_limit_s
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[best]}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=quiet,
    ) as progress:
        task = progress.add_task("baselines", total=limit or 1.0, best="")
        trials = [0]

        def report(phase: str, best: SimResult | None) -> None:
            if not phase.startswith("baseline"):
                trials[0] += 1
                phase = f"{phase}: trial {trials[0]}"
            shown = ""
            if best is not None:
                fits = "fits" if best.feasible else "over budget"
                shown = f"best {best.samples_per_s:,.1f} samples/s, peak {format_bytes(best.peak_bytes)} ({fits})"
            progress.update(task, description=phase, completed=time.perf_counter() - started, best=shown)

        problem.progress = report
        baselines: list[SearchResult] = []
        try:
            for name in baseline_names():
                report(f"baseline {name}", None)
                baselines.append(get_searcher(name).search(problem))
        except KeyboardInterrupt:
            problem.interrupted = True
        problem.seeds = list(baselines)
        milp_result = None
        if milp and not problem.interrupted:
            report("milp (exact, coarsened)", None)
            saved_limit, problem.time_limit_s = problem.time_limit_s, milp_time_s
            try:
                milp_result = get_searcher("milp").search(problem)
            except KeyboardInterrupt:
                problem.interrupted = True
            finally:
                problem.time_limit_s = saved_limit
        if limit is not None:
            problem.time_limit_s = max(1.0, limit - (time.perf_counter() - started))
        found = best_of(baselines) if problem.interrupted else None
        if found is None:
            try:
                found = get_searcher(searcher).search(problem)
            except KeyboardInterrupt:  # outside the searchers' own handling: keep what the baselines found
                problem.interrupted = True
                found = best_of(baselines)
        if found is None:
            raise KeyboardInterrupt
        top = best_of(baselines)
        # A searcher alone (not the portfolio) can lose to a seed.
        if top is not None and better(top.result, found.result):
            found = top
    if user_budget_bytes is not None:
        found.policy.budget_bytes = user_budget_bytes
    found.policy.save(out)
    return SearchOutcome(
        problem,
        found,
        baselines,
        milp_result,
        no_policy,
        out,
        time.perf_counter() - started,
        problem.interrupted,
    )


def best_heuristic(outcome: SearchOutcome) -> SearchResult | None:
    feasible = [r for r in outcome.baselines if r.feasible]
    return max(feasible, key=lambda r: r.result.samples_per_s) if feasible else None


# -- reporting -------------------------------------------------------------------------------------------------
_DONE = {Action.KEEP: "kept", Action.SWAP: "swapped", Action.RECOMPUTE: "recomputed", Action.COMPRESS: "compressed"}


def memory_by_action(problem: Problem, policy: Policy) -> dict[str, int]:
    """Candidate bytes per action, named for the report ("kept", "swapped", ...)."""
    return {_DONE[a]: n for a, n in policy.bytes_by_action(problem.workload).items()}


def to_json(outcome: SearchOutcome) -> dict[str, Any]:
    p, f = outcome.problem, outcome.found
    top = best_heuristic(outcome)
    return {
        "model": p.workload.model,
        "batch_size": p.workload.batch_size,
        "precision": p.workload.precision,
        "grad_accum": p.workload.grad_accum,
        "gpu": p.hardware.name,
        "budget_bytes": f.policy.budget_bytes,
        "planned_budget_bytes": p.budget_bytes,
        "searcher": f.searcher,
        "note": f.note,
        "status": f.status.value,
        "feasible": f.feasible,
        "peak_bytes": f.result.peak_bytes,
        "iter_s": f.result.iter_s,
        "samples_per_s": f.result.samples_per_s,
        "slowdown": outcome.no_policy.samples_per_s / f.result.samples_per_s - 1,
        "best_heuristic": top.searcher if top else None,
        "best_heuristic_samples_per_s": top.result.samples_per_s if top else None,
        "best_heuristic_peak_bytes": top.result.peak_bytes if top else None,
        "milp_samples_per_s": outcome.milp.result.samples_per_s if outcome.milp and outcome.milp.feasible else None,
        "milp_status": outcome.milp.status.value if outcome.milp else None,
        "no_policy_samples_per_s": outcome.no_policy.samples_per_s,
        "no_policy_peak_bytes": outcome.no_policy.peak_bytes,
        "bytes_by_action": memory_by_action(p, f.policy),
        "policy_path": str(outcome.policy_path),
        "study_name": outcome.problem.study_name,
        "storage": p.storage,
        "evaluations": p.evaluations,
        "wall_s": outcome.wall_s,
        "interrupted": outcome.interrupted,
    }


def render(out: Console, outcome: SearchOutcome) -> None:
    p, f = outcome.problem, outcome.found
    w = p.workload
    top = best_heuristic(outcome)
    base = outcome.no_policy
    budget = format_bytes(f.policy.budget_bytes or p.budget_bytes)
    planned = f" (planned for {format_bytes(p.budget_bytes)})" if f.policy.budget_bytes != p.budget_bytes else ""
    t = Table(title=f"{w.model}, batch {w.batch_size}, {p.hardware.name}, budget {budget}{planned}")
    for col in ("policy", "peak", "fits", "iteration", "samples/s", "slowdown"):
        t.add_column(col, justify="left" if col == "policy" else "right")

    def row(label: str, r: SimResult, style: str = "") -> None:
        t.add_row(
            label,
            format_bytes(r.peak_bytes),
            "yes" if r.peak_bytes <= p.budget_bytes else "no",
            f"{r.iter_s * 1e3:.1f} ms",
            f"{r.samples_per_s:,.1f}",
            f"{base.samples_per_s / r.samples_per_s - 1:+.1%}",
            style=style,
        )

    row(f"found ({f.searcher}{', ' + f.note if f.note else ''})", f.result, "bold green" if f.feasible else "red")
    if top is not None:
        row(f"best baseline ({top.searcher})", top.result)
    else:
        t.add_row("best baseline", "none fits", "", "", "", "")
    if outcome.milp is not None:
        row(f"milp ({outcome.milp.status.value.lower()})", outcome.milp.result, "dim")
    row("no policy", base, "dim")
    out.print(t)
    moved = memory_by_action(p, f.policy)
    total = sum(moved.values()) or 1
    parts = ", ".join(f"{k} {format_bytes(v)} ({v / total:.0%})" for k, v in moved.items() if v)
    out.print(f"saved activations: {parts}")
    r = f.result
    where = w.ops[r.peak_op]
    phase = "forward" if where.phase == Phase.FORWARD else "backward"
    out.print(
        f"peak {format_bytes(r.peak_bytes)} during op {r.peak_op} ({where.name}, {where.module}, {phase}); "
        f"time: compute {r.compute_s * 1e3:.1f} ms, recompute {r.recompute_s * 1e3:.1f} ms, "
        f"stalls {r.stall_s * 1e3:.1f} ms, compress {r.compress_s * 1e3:.1f} ms"
    )
    if not f.feasible:
        out.print(f"[red]no policy found within the budget; the written one peaks at {format_bytes(r.peak_bytes)}[/]")
    out.print(
        f"policy written to {outcome.policy_path} ({p.evaluations:,} simulations, {outcome.wall_s:.1f} s); "
        f"check it with `autotune simulate --policy {outcome.policy_path}`"
    )


def dumps(outcome: SearchOutcome) -> str:
    return json.dumps(to_json(outcome))
