"""`autotune search`: the main job. Baselines, then the chosen searcher (the portfolio by default), a policy
file, and a table of the found policy against the best baseline and no policy."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agents.base import Problem, SearchContext, SearchResult, Status, baseline_names, best_of, better, get_searcher
from agents.finalists import Finalist, Finalists
from autotune.budget import Budget, record_budget, refuse_unit_left_out
from autotune.measured import ANSWER, MeasuredSearch, answer_policy
from autotune.reserved import OVER as _OVER
from autotune.reserved import (
    ROUNDS,
    ReservedFit,
    as_result,
    fit_one,
    new_pool,
    next_planned,
    reserved_stats,
    result_stats,
    scaled_budget,
)
from autotune.units import format_bytes, format_size_echo, parse_size
from envs.allocator import AllocatorStats
from envs.simulator import Floor, SimResult, Simulator, frugal_starts, peak_floor
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile
from runtime.policy import Action, Policy, PolicyOptions
from runtime.workload import Workload

if TYPE_CHECKING:
    from autotune.workloads import TraceRequest


@dataclass
class SearchOutcome:
    problem: Problem
    ctx: SearchContext
    found: SearchResult
    baselines: list[SearchResult]
    milp: SearchResult | None
    no_policy: SimResult
    policy_path: Path
    wall_s: float
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    measured: MeasuredSearch | None = None  # --measure: the finalists as trained (NOTE [ Measured search ])
    written: bool = False  # the answer is in policy_path (write_answer)
    reserved: ReservedFit | None = None  # --budget-kind reserved on a GPU profile (NOTE [ Reserved budget ])
    # --budget-kind reserved: the best baseline's reserved peak on the allocator's model (step 4)
    baseline_reserved_bytes: int | None = None
    # step 4: the tensor bytes the best baseline was planned for again, where none planned for the budget ran
    baseline_planned_bytes: int | None = None
    # --allow-partition with more than one model searched (NOTE [ Choosing a partition ] C4): each one's answer
    searched: list[dict[str, Any]] = field(default_factory=list)


# -- the device the plan is for ------------------------------------------------------------------------------
DEFAULT_GPU_MEASURE = 5  # finalists measured by default where the planned profile is this machine's GPU
# Under --compile each finalist is a compile of its own (tens of seconds for a ResNet-18 on the CPU's inductor).
DEFAULT_COMPILED_MEASURE = 2


def check_device(device: str | None) -> None:
    """``--device``: cpu, cuda or cuda:N (whether it is here is :func:`plan_device`'s to say)."""
    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise AutotuneError(f"unknown device '{device}': expected cpu, cuda or cuda:N")


def traced_here(req: TraceRequest, hw: HardwareProfile) -> tuple[HardwareProfile, TraceRequest, str]:
    """``req`` traced as ``autotune search`` traces for ``hw``: in real mode on this machine's device where the
    plan is for this machine (``plan_device``: --gpu cpu, or the detected GPU's profile), with the runtime's host
    costs measured here for this machine's GPU (:func:`with_local_host_costs`: seconds, so after ``req`` is
    validated), else in fake mode; so that ``simulate`` and ``baselines`` score a plan on the workload its search
    scored it on. Returns the profile, the request and a line for stderr (empty: nothing to say)."""
    here = plan_device(hw, None)
    hw, note = with_local_host_costs(hw, here)
    mode = "real" if here is not None else "fake"
    return hw, dataclasses.replace(req, mode=mode, device=here or "cpu", target=hw), note


def check_measure(measure: int | None) -> None:
    if measure is not None and measure < 0:
        raise AutotuneError(f"invalid --measure {measure}: expected 0 or a number of policies to train, e.g. 3")


def plan_device(hw: HardwareProfile, device: str | None) -> str | None:
    """The device here that a plan for ``hw`` runs on: ``cpu`` for the cpu profile, ``cuda`` (or the
    ``device`` given, cuda:N) where the detected GPU is ``hw``; None where the plan is for another machine.
    A ``device`` that is not the planned one is an error."""
    if hw.name == "cpu":
        here: str | None = "cpu"
    else:
        from runtime.hardware import detect

        found = detect()
        here = "cuda" if found.profile is not None and found.profile.name == hw.name else None
    if device is None:
        return here
    check_device(device)
    if here is None or (device == "cpu") != (here == "cpu"):
        where = f"this machine's {here}" if here else "no device of this machine"
        raise AutotuneError(
            f"--device {device}: the plan is for the {hw.name} profile, which is {where}; measure where the plan "
            f"runs: --gpu cpu for this CPU, or the detected GPU's profile (see `autotune hardware`)"
        )
    return device


def parse_host_memory(text: str) -> int:
    """``--host-memory`` in bytes; a plain number below 1 MiB is refused as a unit left out (as ``--budget``)."""
    try:
        n = parse_size(text)
    except AutotuneError as e:
        raise AutotuneError(f"--host-memory: {e}") from None
    refuse_unit_left_out("--host-memory", text, n)
    return n


def with_host_memory(hw: HardwareProfile, text: str | None, here: str | None) -> tuple[HardwareProfile, str]:
    """``--host-memory``: the host memory a plan may pin for swapped tensors (simulator Rule 2, runtime R3),
    on GPU profiles. Default: this machine's physical memory where the plan is for its GPU, else unbounded
    (another machine's host is not known). Returns the profile and a line for stderr (empty: nothing to say)."""
    n = 0 if text is None else parse_host_memory(text)
    if not hw.is_gpu:
        return hw, "" if text is None else f"--host-memory {text} does not apply to the {hw.name} profile (no copies)"
    if text is None:
        if here is None or not here.startswith("cuda"):
            return hw, ""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return dataclasses.replace(hw, host_memory_bytes=total), (
            f"swapped tensors may pin up to this machine's {format_bytes(total)} of host memory (--host-memory)"
        )
    return dataclasses.replace(hw, host_memory_bytes=n), f"swapped tensors may pin up to {format_size_echo(text, n)}"


def with_local_host_costs(hw: HardwareProfile, here: str | None, seconds: float = 1.0) -> tuple[HardwareProfile, str]:
    """Where the plan is for this machine's GPU (``here`` a CUDA device), the runtime's host costs measured on
    this host (runtime/host_costs.py, in about four times ``seconds``) in place of the profile's: those are one
    H200 machine's, and hosts differ (one H200 machine's host issued an op in 5.9 us in one call and 9.5 in the
    next, and ResNet-50's host-bound recompute steps ran 13-31% slower than planned on the slower;
    docs/results.md). Returns the profile and a line for stderr (empty: nothing to say)."""
    if not hw.is_gpu or here is None or not here.startswith("cuda"):
        return hw, ""
    from runtime.host_costs import calibrate  # the runtime itself: imported where it is needed

    costs = calibrate(here, seconds)
    old = hw.host
    return dataclasses.replace(hw, host=costs), (
        f"the runtime's host costs measured on this machine: an op {costs.op_s * 1e6:.1f} us, a region "
        f"{costs.region_s * 1e6:.0f} us, a replayed op {costs.replay_op_s * 1e6:.0f} us (the {hw.name} profile's: "
        f"{old.op_s * 1e6:.1f}, {old.region_s * 1e6:.0f}, {old.replay_op_s * 1e6:.0f})"
    )


def measure_count(measure: int | None, device: str | None, hw: HardwareProfile, compiled: bool = False) -> int:
    """``--measure``: as given, else DEFAULT_GPU_MEASURE (DEFAULT_COMPILED_MEASURE for ``compiled``, a
    search for torch.compile) where the plan is for this machine's GPU, else 0; an error when asked for where
    the planned device is not here."""
    check_measure(measure)
    if measure and device is None:
        raise AutotuneError(
            f"--measure {measure}: the plan is for {hw.name}, which is not on this machine, so its policies cannot "
            "be trained here; plan for this machine (--gpu cpu, or the detected GPU: see `autotune hardware`), or "
            "pass --measure 0"
        )
    if measure is not None:
        return measure
    if device is None or not device.startswith("cuda"):
        return 0
    return DEFAULT_COMPILED_MEASURE if compiled else DEFAULT_GPU_MEASURE


# -- impossible budgets ----------------------------------------------------------------------------------------
def budget_floor(problem: Problem) -> int:
    """A lower bound on any policy's peak (envs.simulator.peak_floor)."""
    return peak_floor(problem.workload, problem.hardware).bytes


def floor_detail(problem: Problem, f: Floor) -> str:
    """Where the floor ``f`` lies and what makes it up, for the messages."""
    op = problem.workload.ops[f.op]
    where = f"op {f.op}, {op.name.removeprefix('aten.').removesuffix('.default')} in {op.phase.value} of `{op.module}`"
    parts = [
        f"parameters, optimizer state and the batch {format_bytes(f.state_bytes)}",
        f"gradients and other tensors the step holds there {format_bytes(f.held_bytes)}",
        f"activations needed there whatever the policy {format_bytes(f.activation_bytes)}",
    ]
    if f.workspace_bytes:
        parts.append(f"the op's workspace {format_bytes(f.workspace_bytes)}")
    return f"at {where}: {', '.join(parts)}"


DESCENT_S = 3.0  # seconds of descent on the peak for the budget an impossible-budget error suggests


FRUGAL_OPTIONS = PolicyOptions(prefetch_lookahead=1)


def smallest_known_budget(
    problem: Problem, reserved: bool = False, expandable_segments: bool = False
) -> tuple[int, str]:
    """A budget autotune can certainly meet: the lowest peak among the most memory-frugal uniform policies
    and the descents on the peak from each of them and from no policy (single moves, DESCENT_S seconds in
    all). ``reserved`` (NOTE [ Reserved budget ]): what that policy reserves on the caching allocator's model
    with nothing capping the device (it never gives a segment back: a budget it runs within)."""
    from agents.refine import _repair

    if reserved:  # what step 5 of NOTE [ Reserved budget ] then answers with: one error, not a chain
        least, name = least_frugal_reserved(problem, expandable_segments)
        return least, f"{name}, reserved on the caching allocator's model with nothing capping the device"
    tries = frugal_starts(problem.workload)
    opts = FRUGAL_OPTIONS
    best = min((problem.simulator.run(a, options=opts).peak_bytes, k) for k, a in tries.items())
    tries["no policy"] = problem.keep_all()
    for how, start in tries.items():  # a share of the time each
        deadline = time.perf_counter() + DESCENT_S / len(tries)
        result = problem.simulator.run(start, options=opts, budget_bytes=problem.budget_bytes)
        _, _, lowest = _repair(problem, start, opts, result, deadline)
        best = min(best, (lowest.peak_bytes, f"{how}, then a descent on the peak"))
    return best


def frugal_on_the_model(
    problem: Problem, budget_bytes: int | None, expandable_segments: bool = False
) -> list[tuple[str, Finalist, AllocatorStats | None]]:
    """Step 5 of NOTE [ Reserved budget ]: each most frugal uniform policy (``frugal_starts``) this problem
    allows, and its stats on the caching allocator's model with the device capped at ``budget_bytes`` (None:
    nothing caps it; None stats: it runs out)."""
    out = []
    for name, actions in frugal_starts(problem.workload).items():
        if not problem.allow_swap and (actions == Action.SWAP.code).any():
            continue
        result = problem.evaluate(actions, FRUGAL_OPTIONS)
        if result.host_over_bytes:
            continue
        st = reserved_stats(problem, actions, FRUGAL_OPTIONS, budget_bytes, expandable_segments)
        out.append((name, Finalist(actions, FRUGAL_OPTIONS, result), st))
    return out


def least_frugal_reserved(problem: Problem, expandable_segments: bool = False) -> tuple[int, str]:
    """The least a most frugal uniform policy reserves on the model with nothing capping the device, and which."""
    runs = [(st.peak_reserved, name) for name, _, st in frugal_on_the_model(problem, None, expandable_segments) if st]
    return min(runs)


def check_budget(
    problem: Problem,
    budget: Budget | None = None,
    *,
    partitioning: bool = False,
    reserved: bool = False,
    expandable_segments: bool = False,
) -> None:
    """Fail at once, with the smallest budget that works, when no policy can meet the budget.
    ``problem.budget_bytes`` is what is planned for: ``budget`` as typed less its reserve (NOTE [ Budget and
    reserve ] in autotune.budget), which the message adds back. ``partitioning``: --allow-partition was given
    (and chose no slices), so the message does not suggest it. ``reserved``: the budget is in reserved bytes
    (NOTE [ Reserved budget ]), and so is the one suggested."""
    f = peak_floor(problem.workload, problem.hardware)
    floor = f.bytes
    reserve = budget.reserve_bytes if budget is not None else 0
    if problem.budget_bytes < floor or (budget is not None and budget.given_bytes <= reserve):
        smallest, how = smallest_known_budget(problem, reserved, expandable_segments)
        given = problem.budget_bytes + reserve if budget is None else budget.given_bytes
        kept = f", the {format_bytes(reserve)} reserve for workspaces (--reserve) included" * (reserve > 0)
        raise AutotuneError(
            f"budget {format_bytes(given)} is below the {format_bytes(floor + reserve)} that any policy "
            f"needs ({floor_detail(problem, f)}{kept}): no policy can meet it; autotune can meet "
            f"{format_bytes(smallest + reserve)} ({how}): raise --budget to at least that, or lower "
            f"--batch-size{'' if partitioning else _partition_hint(problem.workload, f.op)}"
        )


def _partition_hint(w: Workload, op: int) -> str:
    """Where a partitionable submodule runs the floor's op (autotune/partitions.py, C2), say so."""
    from autotune.partitions import candidate_frames

    if w.meta.get("partitions") or not candidate_frames(w, op):
        return ""
    return ", or let the search run a submodule on slices of the batch (--allow-partition)"


def plain_no_policy(problem: Problem, plain: Workload | None = None) -> SimResult:
    """No policy (plain PyTorch: ``Simulator.no_policy``) within the problem's budget, on ``plain``: the model
    without the partitions the problem's workload was traced with (None: the problem's own workload)."""
    sim = problem.simulator if plain is None or plain is problem.workload else Simulator(plain, problem.hardware)
    return sim.no_policy(budget_bytes=problem.budget_bytes)


def planned_problem(
    w: Workload,
    hw: HardwareProfile,
    budget: Budget,
    *,
    allow_compress: bool,
    finalists: Finalists | None = None,
    allow_swap: bool = True,
    partitioning: bool = False,
    compiled: str | None = None,
    reserved: bool = False,
    expandable_segments: bool = False,
) -> Problem:
    """The problem a planning command solves: ``w`` on ``hw`` within ``budget`` as planned for (its reserve
    kept back, NOTE [ Budget and reserve ]), compression (lossy) only where allowed, under torch.compile with
    backend ``compiled`` (simulator Rule 16) where given; checked at once
    (:func:`check_budget`; ``partitioning``: --allow-partition given; ``reserved``: in the caching allocator's
    bytes, NOTE [ Reserved budget ]), before any search."""
    problem = Problem(
        w,
        hw,
        budget.planned_bytes,
        options=PolicyOptions(lossy=allow_compress),  # allow_partition follows the workload (envs.problem)
        allow_compress=allow_compress,
        allow_swap=allow_swap,
        finalists=finalists,
        compiled=compiled,
    )
    check_budget(problem, budget, partitioning=partitioning, reserved=reserved,
                 expandable_segments=expandable_segments)  # fmt: skip
    return problem


# -- the search ------------------------------------------------------------------------------------------------
PLAIN_EVERY_S = 10.0  # seconds between progress lines where stderr is not a terminal


def run_search(
    problem: Problem,
    ctx: SearchContext,
    searcher: str,
    *,
    out: Path,
    milp: bool,
    milp_time_s: float,
    err: Console,
    quiet: bool,
    user_budget_bytes: int | None = None,
    plain: Workload | None = None,
    keeping_runs: Callable[[Problem, SearchResult], bool] | None = None,
) -> SearchOutcome:
    """Baselines, then ``searcher``; ``out`` is where the answer goes (:func:`write_answer`, once the caller
    has it: nothing is written for a policy that does not fit). ``problem.budget_bytes`` is what the search
    plans for; ``user_budget_bytes`` (the budget before the reserve) is what the policy file records, and
    what `autotune train` caps the device at. ``plain``: the model without partitions, where the problem's
    workload has them (runtime/partition.py): no policy is that model's. ``keeping_runs``: whether keeping
    everything, where its tensors fit, also runs where the answer must (the caching allocator's model, NOTE
    [ Reserved budget ]); without it, a problem with finalists (--measure) is searched."""
    started = time.perf_counter()
    get_searcher(searcher)  # an unknown name fails before any work
    no_policy = plain_no_policy(problem, plain)
    limit = ctx.time_limit_s
    with (
        ctx.noting_sigint(),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[best]}"),
            TimeElapsedColumn(),
            console=err,
            transient=True,
            disable=quiet,
        ) as progress,
    ):
        task = progress.add_task("baselines", total=limit or 1.0, best="")
        trials = [0]
        # Where stderr is no terminal (a pipe, a log file) the bar does not draw: a line every PLAIN_EVERY_S.
        lines = not quiet and not err.is_terminal
        last_line = [started]

        def report(phase: str, best: SimResult | None) -> None:
            if not phase.startswith("baseline") and phase not in ("refine", "perturbation"):
                trials[0] += 1
                phase = f"{phase}: trial {trials[0]}"
            shown = ""
            if best is not None:
                fits = "fits" if best.feasible else "over budget"
                shown = f"best {best.samples_per_s:,.1f} samples/s, peak {format_bytes(best.peak_bytes)} ({fits})"
            now = time.perf_counter()
            progress.update(task, description=phase, completed=now - started, best=shown)
            if lines and now - last_line[0] >= PLAIN_EVERY_S:
                last_line[0] = now
                err.print(f"{now - started:.0f} s: {phase}" + (f"; {shown}" if shown else ""), highlight=False)

        ctx = ctx.derive(progress=report)
        baselines: list[SearchResult] = []
        try:
            for name in baseline_names():
                report(f"baseline {name}", None)
                baselines.append(get_searcher(name).search(problem, ctx))
                # NOTE [ Choosing a partition ] C5: each rival partition's too, seeds of the searcher choosing.
                for i, rival in enumerate(problem.rivals):
                    baselines.append(dataclasses.replace(get_searcher(name).search(rival, ctx), rival=i))
        except KeyboardInterrupt:
            ctx.interrupt()
        milp_result = None
        # Keeping everything fits (the model as it is, or with a shared parameter's gradients summed in place,
        # Rule 15): it is the fastest policy there is (every other action adds work, Rules 4-8), so a search
        # would spend its time to find it again; but for --measure, whose finalists come from the search (a
        # plan that fits can run out when trained). Among rival partitions only where the model as it is fits
        # (else keeping everything on slices can be slower than another policy without them).
        kept_all = None
        settles = problem.finalists is None or keeping_runs is not None
        if (no_policy.feasible or not problem.rivals) and settles and not ctx.interrupted:
            kept_all = best_of(
                b for b in baselines if b.feasible and not b.policy.to_vector(problem.member(b.rival).workload).any()
            )
            runs = keeping_runs is None or kept_all is None or keeping_runs(problem, kept_all)
            if not runs:
                kept_all = None  # its tensors fit, its segments do not: a search
        if milp and kept_all is None and not ctx.interrupted:
            report("milp (exact, coarsened)", None)
            try:
                milp_result = get_searcher("milp").search(problem, ctx.derive(time_limit_s=milp_time_s))
            except KeyboardInterrupt:
                ctx.interrupt()
        left_s = None if limit is None else max(1.0, limit - (time.perf_counter() - started))
        found = best_of(baselines) if ctx.interrupted else None
        if found is None and kept_all is not None:
            found = dataclasses.replace(kept_all, searcher=searcher)
        if found is None:
            try:
                found = get_searcher(searcher).search(problem, ctx.derive(seeds=tuple(baselines), time_limit_s=left_s))
            except KeyboardInterrupt:  # outside the searchers' own handling: keep what the baselines found
                ctx.interrupt()
                found = best_of(baselines)
        if found is None:
            raise KeyboardInterrupt
        top = best_of(baselines)
        # A searcher alone (not the portfolio) can lose to a seed: the answer is the seed's, said as the
        # portfolio says whose policy won (the searcher is the one run; the policy file's provenance the seed).
        if top is not None and better(top.result, found.result):
            found = dataclasses.replace(top, searcher=found.searcher, note=f"won by {top.searcher}")
        if found.feasible and not found.policy.to_vector(problem.member(found.rival).workload).any():
            # "won by capuchin" named a heuristic for keeping everything.
            found = dataclasses.replace(found, note=_keeping_everything(problem.member(found.rival), found, no_policy))
        if not found.feasible:  # the nearest miss won nothing: "won by delta" stood beside "fits: no" (a QA run)
            nearest = found.note.removeprefix("won by ")
            note = "does not fit the budget" + (f"; nearest: {nearest}" if nearest else "")
            found = dataclasses.replace(found, note=note)
        if ctx.state.sigint_pending:  # a Ctrl-C after the last report, that a finalizer swallowed
            ctx.interrupt()
    if user_budget_bytes is not None:  # the budget as typed, and the reserve kept back of it
        record_budget(found.policy, user_budget_bytes, user_budget_bytes - problem.budget_bytes)
    chosen = problem.member(found.rival)  # the partition the answer chose (C5), whose model the policy is for
    for other in (m for m in problem.members if m is not chosen):  # the run's evaluations are every partition's
        chosen.evaluations += other.evaluations
        chosen.cached += other.cached
    return SearchOutcome(
        chosen,
        ctx,
        found,
        baselines,
        milp_result,
        no_policy,
        out,
        time.perf_counter() - started,
        ctx.interrupted,
    )


def _keeping_everything(problem: Problem, found: SearchResult, no_policy: SimResult) -> str:
    """The note of an answer that keeps every saved tensor. "No policy needed" only where the model as it is
    fits: keeping everything can fit where plain training does not, on slices (a partition) or with a shared
    parameter's gradients summed in place (runtime R14, simulator Rule 15: GPT-2's tied embedding, 147 MiB at
    GPT-2 small), which only the policy applied does."""
    if no_policy.feasible:
        return "keeping everything fits the budget: no policy needed"
    if found.policy.partitions:
        how = f": on slices ({', '.join(str(p) for p in found.policy.partitions)})"
    elif any(op.in_place_into >= 0 for op in problem.workload.ops):
        how = ": R14 sums the shared gradients in place"
    else:
        how = ""
    return f"keeping everything fits only as applied{how}"


def fit_reserved(
    outcome: SearchOutcome,
    searcher: str,
    err: Console,
    quiet: bool,
    enforce: bool = True,
    expandable_segments: bool = False,
) -> SearchOutcome:
    """NOTE [ Reserved budget ] (autotune/reserved.py): the answer, a finalist, or a new search for fewer
    allocated bytes, that runs within the planned budget on the caching allocator's model (of
    ``expandable_segments:True`` or not); the outcome marked as not fitting when none does in ``ROUNDS``
    searches. ``enforce`` False: the answer checked, not changed."""
    budget = outcome.problem.budget_bytes
    if not enforce:
        outcome.reserved = check_reserved(outcome.problem, outcome.found, expandable_segments)
        return outcome
    current, planned, checked = outcome, [budget], 0
    factors: list[float] = []
    lowest: ReservedFit | None = None
    wall = outcome.wall_s
    for n in range(1, ROUNDS + 1):
        chosen, fit = fit_one(current.problem, current.found, budget, expandable_segments=expandable_segments)
        checked += fit.checked
        if chosen is not None:
            if fit.source == "finalist":
                current.found = as_result(current.problem, current.found, chosen)
            fit.source = fit.source if n == 1 else f"{fit.source} of search {n}"
            fit.checked, fit.planned, fit.factors = checked, planned, factors
            current.reserved, current.wall_s = fit, wall
            reserved_baselines(current, budget, expandable_segments)
            adopt_baseline(current, budget, expandable_segments)
            return current
        if lowest is None or fit.lowest_peak_bytes < lowest.lowest_peak_bytes:
            lowest = fit
        floor = budget_floor(current.problem)
        if n == ROUNDS or current.interrupted or current.problem.budget_bytes <= floor:
            break
        nxt, factor = next_planned(current.problem, current.found, budget, expandable_segments)
        nxt = max(nxt, floor)  # no policy goes below it
        err.print(
            f"none of {fit.checked} policies runs within {format_bytes(budget)} on the caching allocator's model "
            f"(cached blocks and split ends; the answer needs {factor:.2f}x its tensors' peak there): searching "
            f"again for {format_bytes(nxt)} of tensors (--budget-kind allocated plans for tensors alone)",
            highlight=False,
        )
        p = current.problem
        tighter = Problem(p.workload, p.hardware, nxt, options=p.options, allow_compress=p.allow_compress,
                          allow_swap=p.allow_swap, finalists=new_pool(nxt), compiled=p.compiled)  # fmt: skip
        ctx = outcome.ctx.derive(storage=None, study_name=None)  # the user's study keeps its own budget
        again = run_search(tighter, ctx, searcher, out=outcome.policy_path, milp=False, milp_time_s=0.0, err=err,
                           quiet=quiet, user_budget_bytes=outcome.found.policy.budget_bytes)  # fmt: skip
        wall += again.wall_s
        planned.append(nxt)
        factors.append(factor)
        if not again.found.feasible:
            break
        current = again
    assert lowest is not None
    frugal = frugal_on_the_model(outcome.problem, budget, expandable_segments)  # step 5
    runs = [(f, st) for _, f, st in frugal if st is not None]
    if runs:
        f, st = max(runs, key=lambda r: r[0].result.samples_per_s)
        found = dataclasses.replace(as_result(outcome.problem, outcome.found, f), status=Status.FEASIBLE)
        fit = ReservedFit(st.peak_reserved, st.peak_allocated, True, retries=st.retries, source="frugal policy",
                          checked=checked + len(frugal), planned=planned, factors=factors,
                          expandable_segments=expandable_segments)  # fmt: skip
        outcome.found, outcome.reserved, outcome.wall_s = found, fit, wall
        reserved_baselines(outcome, budget, expandable_segments)
        adopt_baseline(outcome, budget, expandable_segments)
        return outcome
    lowest.checked, lowest.planned, lowest.factors, lowest.fits = checked + len(frugal), planned, factors, False
    if frugal:  # what one of them needs with nothing capping the device: a budget step 5 answers within
        lowest.frugal_reserved_bytes, lowest.frugal_policy = least_frugal_reserved(outcome.problem, expandable_segments)
    outcome.reserved, outcome.wall_s = lowest, wall
    outcome.found = dataclasses.replace(outcome.found, status=Status.INFEASIBLE, note=_OVER)
    reserved_baselines(outcome, budget, expandable_segments)
    adopt_baseline(outcome, budget, expandable_segments)
    return outcome


def adopt_baseline(outcome: SearchOutcome, budget_bytes: int, expandable_segments: bool = False) -> None:
    """Step 4 of NOTE [ Reserved budget ], last: where the best baseline held to the budget runs on the model and
    is faster than the answer (a roomier finalist, a frugal policy, or none), it is the answer."""
    top, rf = best_heuristic(outcome), outcome.reserved
    if top is None or rf is None or outcome.baseline_reserved_bytes is None or top.rival != -1:
        return
    if rf.fits and top.result.samples_per_s <= outcome.found.result.samples_per_s:
        return
    st = result_stats(outcome.problem, top, budget_bytes, expandable_segments)
    if st is None:  # cannot be: step 4 found it running on this problem's model
        return
    w = outcome.problem.workload
    f = Finalist(top.policy.to_vector(w), top.policy.options, top.result)
    by = dataclasses.replace(outcome.found, searcher=top.searcher, status=Status.FEASIBLE, note="")
    outcome.found = as_result(outcome.problem, by, f)
    outcome.reserved = ReservedFit(st.peak_reserved, st.peak_allocated, True, retries=st.retries,
                                   source="best baseline", checked=rf.checked, planned=rf.planned, factors=rf.factors,
                                   expandable_segments=expandable_segments)  # fmt: skip


def runs_reserved(budget_bytes: int, expandable_segments: bool = False) -> Callable[[Problem, SearchResult], bool]:
    """For :func:`run_search`'s ``keeping_runs``: whether a result for a problem runs on the caching
    allocator's model with the device capped at ``budget_bytes`` (NOTE [ Reserved budget ])."""

    def runs(problem: Problem, r: SearchResult) -> bool:
        return result_stats(problem, r, budget_bytes, expandable_segments) is not None

    return runs


def reserved_baselines(outcome: SearchOutcome, budget_bytes: int, expandable_segments: bool = False) -> None:
    """Step 4 of NOTE [ Reserved budget ]: the baselines held to the answer's budget kind. The feasible ones
    are checked fastest first on the caching allocator's model with the device capped at ``budget_bytes``; each
    that runs out there is marked infeasible, up to the first that runs, whose reserved peak is recorded. Where
    none runs, the heuristics are planned again for ``SHRINK`` of the tensor bytes, as the search is (step 3),
    at most ``ROUNDS`` times, and the fastest that runs then is added to the baselines."""
    if _first_that_runs(outcome, outcome.baselines, budget_bytes, expandable_segments, mark=True) is not None:
        return
    p = outcome.problem
    planned, floor = p.budget_bytes, budget_floor(p)
    ctx = SearchContext() if outcome.ctx is None else outcome.ctx.derive(progress=None, seeds=())
    for _ in range(ROUNDS):
        planned = scaled_budget(planned)
        if planned < floor:
            return
        tighter = Problem(p.workload, p.hardware, planned, options=p.options, allow_compress=p.allow_compress,
                          allow_swap=p.allow_swap, compiled=p.compiled)  # fmt: skip
        again = [get_searcher(name).search(tighter, ctx) for name in baseline_names()]
        runs = _first_that_runs(outcome, again, budget_bytes, expandable_segments)
        if runs is not None:
            outcome.baselines.append(dataclasses.replace(runs, note=f"tensors planned for {format_bytes(planned)}"))
            outcome.baseline_planned_bytes = planned
            return


def _first_that_runs(
    outcome: SearchOutcome,
    baselines: list[SearchResult],
    budget_bytes: int,
    expandable_segments: bool,
    mark: bool = False,
) -> SearchResult | None:
    """The fastest feasible one of ``baselines`` that runs on the allocator's model with the device capped at
    ``budget_bytes`` (its reserved peak recorded in ``outcome``); ``mark``: each faster one marked as running
    out there."""
    ranked = sorted((i for i, b in enumerate(baselines) if b.feasible),
                    key=lambda i: -baselines[i].result.samples_per_s)  # fmt: skip
    for i in ranked:
        b = baselines[i]
        st = result_stats(outcome.problem, b, budget_bytes, expandable_segments)
        if st is not None:
            outcome.baseline_reserved_bytes = st.peak_reserved
            return b
        if mark:
            baselines[i] = dataclasses.replace(b, status=Status.INFEASIBLE, note=_OVER)
    return None


def check_reserved(problem: Problem, found: SearchResult, expandable_segments: bool = False) -> ReservedFit:
    """Whether ``found`` runs within ``problem``'s budget on the caching allocator's model, checked and not
    changed (step 1 of NOTE [ Reserved budget ] alone); when it does not, its reserved peak on the model of
    ``expandable_segments:True`` (0 when it runs out there too)."""
    budget = problem.budget_bytes
    _, fit = fit_one(problem, found, budget, rivals=0, expandable_segments=expandable_segments)
    fit.enforced, fit.planned = False, [budget]
    if not fit.fits and not expandable_segments:  # does the allocator's setting alone make it run?
        _, grown = fit_one(problem, found, budget, rivals=0, expandable_segments=True)
        fit.expandable_peak_bytes = grown.reserved_peak_bytes or 0
    return fit


def warn_reserved(
    out: Console, rf: ReservedFit | None, lever: str = "--budget-kind reserved (the default) plans for that"
) -> None:
    """The warning for an answer checked (not enforced) that runs out on the caching allocator's model;
    ``lever``: what plans for it in the command that printed the answer."""
    if rf is None or rf.enforced or rf.fits:
        return
    es = " with expandable_segments:True" if rf.expandable_segments else ""
    out.print(
        f"[yellow]warning:[/] on a model of PyTorch's CUDA caching allocator{es} (cached blocks and split ends) "
        f"this policy runs out of memory within {format_bytes(rf.planned[0])}: {lever}" + _expandable_lever(rf),
        highlight=False,
    )


def _expandable_lever(rf: ReservedFit) -> str:
    """What expandable_segments:True alone would do for an answer that runs out on the default's model."""
    if rf.expandable_peak_bytes is None:
        return ""
    if rf.expandable_peak_bytes == 0:
        return "; with expandable_segments:True it runs out too"
    past = rf.expandable_peak_bytes - rf.planned[0]
    how = f", {format_bytes(past)} past the budget (A10: the cap is checked before pages are mapped)"
    how = how if past > 0 else ""
    return (
        f"; with expandable_segments:True it runs, {format_bytes(rf.expandable_peak_bytes)} reserved at most{how} "
        "(autotune train --expandable-segments)"
    )


def write_answer(outcome: SearchOutcome) -> bool:
    """Write the answer's policy file, atomically; a policy that does not fit is not an answer: nothing is
    written (False)."""
    if not outcome.found.feasible:
        return False
    # The run's evaluations, as its output counts them (the searcher's own share alone read as a third
    # count beside the JSON's evaluations and simulations).
    outcome.found.policy.provenance.trials = outcome.problem.evaluations
    outcome.found.policy.save(outcome.policy_path)
    outcome.written = True
    return True


def take_measured(outcome: SearchOutcome, measured: MeasuredSearch) -> None:
    """Make the measured answer the outcome's (NOTE [ Measured search ]); with no measured answer, the
    outcome's result is marked infeasible: nothing fits when measured."""
    outcome.measured = measured
    f, chosen = outcome.found, measured.chosen
    if chosen is None:
        outcome.found = dataclasses.replace(f, status=Status.INFEASIBLE, note="nothing fits when measured")
        return
    policy = answer_policy(outcome.problem, chosen, f, f.policy.budget_bytes or outcome.problem.budget_bytes)
    note = f.note if chosen.label == ANSWER else f"measured: {chosen.label}"
    outcome.found = dataclasses.replace(f, policy=policy, result=chosen.finalist.result, note=note)


def best_heuristic(outcome: SearchOutcome) -> SearchResult | None:
    feasible = [r for r in outcome.baselines if r.feasible]
    return max(feasible, key=lambda r: r.result.samples_per_s) if feasible else None


# -- reporting -------------------------------------------------------------------------------------------------
_DONE = {Action.KEEP: "kept", Action.SWAP: "swapped", Action.RECOMPUTE: "recomputed", Action.COMPRESS: "compressed"}


def _policies(n: int) -> str:
    return f"{n} {'policy' if n == 1 else 'policies'}"


def memory_by_action(problem: Problem, policy: Policy) -> dict[str, int]:
    """Candidate bytes per action, named for the report ("kept", "swapped", ...)."""
    return {_DONE[a]: n for a, n in policy.bytes_by_action(problem.workload).items()}


def planned_bytes(outcome: SearchOutcome) -> int:
    """The budget as planned for (as typed less its reserve): the problem's, or where a later search planned
    fewer tensor bytes (NOTE [ Reserved budget ] step 3), the first's."""
    rf = outcome.reserved
    return rf.planned[0] if rf is not None and rf.planned else outcome.problem.budget_bytes


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
        "planned_budget_bytes": planned_bytes(outcome),
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
        "study_name": outcome.ctx.study_name,
        "storage": outcome.ctx.storage,
        "evaluations": p.evaluations,
        "simulations": p.evaluations - p.cached,  # the evaluations not answered from the cache
        "wall_s": outcome.wall_s,
        "converged": outcome.ctx.state.converged_s is not None,  # the search stopped early, before --timeout
        "interrupted": outcome.interrupted,
        "written": outcome.written,
        "measured": _measured_json(outcome),
        "finalists": outcome.measured.to_dict() if outcome.measured is not None else None,
        "budget_kind": "reserved" if outcome.reserved is not None and outcome.reserved.enforced else "allocated",
        "reserved": outcome.reserved.to_dict() if outcome.reserved is not None else None,
        "best_heuristic_reserved_peak_bytes": outcome.baseline_reserved_bytes,
        "best_heuristic_planned_bytes": outcome.baseline_planned_bytes,  # planned again for fewer tensor bytes
        "partitions_searched": outcome.searched,
    }


def _measured_json(outcome: SearchOutcome) -> dict[str, Any] | None:
    """The answer as measured, and its planned time corrected by the other finalists' measurements."""
    ms = outcome.measured
    m = ms.chosen if ms is not None else None
    if ms is None or m is None:
        return None
    calibrated = ms.calibrated_iter_s(m)
    return {
        "peak_bytes": m.peak_bytes,
        "iter_s": m.iter_s,
        "samples_per_s": m.samples_per_s,
        "calibrated_samples_per_s": m.samples / calibrated if calibrated else None,
    }


def render(out: Console, outcome: SearchOutcome) -> None:
    p, f = outcome.problem, outcome.found
    w = p.workload
    top = best_heuristic(outcome)
    base = outcome.no_policy
    budget = format_bytes(f.policy.budget_bytes or p.budget_bytes)
    plan = planned_bytes(outcome)
    planned = f" (planned for {format_bytes(plan)})" if f.policy.budget_bytes != plan else ""
    t = Table(title=f"{w.model}, batch {w.batch_size}, {p.hardware.name}, budget {budget}{planned}")
    for col in ("policy", "peak", "fits", "iteration", "samples/s", "slowdown"):
        t.add_column(col, justify="left" if col == "policy" else "right")

    def row(label: str, r: SimResult, style: str = "") -> None:
        t.add_row(
            label,
            format_bytes(r.peak_bytes),
            "yes" if r.peak_bytes <= plan and not r.host_over_bytes else "no",
            f"{r.iter_s * 1e3:.1f} ms",
            f"{r.samples_per_s:,.1f}",
            f"{base.samples_per_s / r.samples_per_s - 1:+.1%}",
            style=style,
        )

    row(f"found ({f.searcher}{', ' + f.note if f.note else ''})", f.result, "bold green" if f.feasible else "red")
    if top is not None:
        # Searched among partitions (NOTE [ Choosing a partition ] C5): the baseline's, where not the answer's.
        other = top.policy.partitions != f.policy.partitions
        sliced = f", on {', '.join(str(p) for p in top.policy.partitions) or 'no partition'}" if other else ""
        held = "; reserved bytes fit" if outcome.baseline_reserved_bytes is not None else ""
        if outcome.baseline_planned_bytes is not None:  # step 4: planned again for fewer tensor bytes
            held += f", {top.note}"
        row(f"best baseline ({top.searcher}{sliced}{held})", top.result)
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
    phase = where.phase.value  # forward, backward or optimizer
    # Rule 10: with --grad-accum k the times are one micro-batch's and the optimizer step's; the iteration runs k.
    per = f" of one of {w.grad_accum} micro-batches (the optimizer step in compute)" if w.grad_accum > 1 else ""
    out.print(
        f"peak {format_bytes(r.peak_bytes)} during op {r.peak_op} ({where.name}, {where.module}, {phase}); "
        f"time{per}: compute {r.compute_s * 1e3:.1f} ms, recompute {r.recompute_s * 1e3:.1f} ms, "
        f"stalls {r.stall_s * 1e3:.1f} ms, compress {r.compress_s * 1e3:.1f} ms"
        + (f", waiting for the host {r.host_wait_s * 1e3:.1f} ms" if w.grad_accum == 1 else "")
    )
    if outcome.measured is not None:
        render_measured(out, outcome.measured)
    rf = outcome.reserved
    es = " with expandable_segments:True" if rf is not None and rf.expandable_segments else ""
    if rf is not None and not rf.enforced and not rf.fits:
        warn_reserved(out, rf)
    elif rf is not None and rf.fits and rf.reserved_peak_bytes is not None:
        how = "the answer" if rf.source == "answer" else f"the {rf.source} (the first answer does not)"
        again = f"; tensors planned for {format_bytes(rf.planned[-1])}" if len(rf.planned) > 1 else ""
        given = f", {rf.retries} time(s) giving cached blocks back" if rf.retries else ""
        out.print(
            f"reserved: {how} runs within {format_bytes(rf.planned[0])} on a model of PyTorch's CUDA caching "
            f"allocator{es}, {format_bytes(rf.reserved_peak_bytes)} reserved at most{given} ({_policies(rf.checked)} "
            f"checked{again}; {_baselines_held(outcome)}; --budget-kind allocated plans for tensors alone)"
            + ("; train it with autotune train --expandable-segments" if es else ""),
            highlight=False,
        )
    if outcome.written:
        converged = "; converged, stopped before the time limit" if outcome.ctx.state.converged_s is not None else ""
        out.print(
            f"policy written to {outcome.policy_path} ({p.evaluations:,} evaluations, {p.evaluations - p.cached:,} of "
            f"them simulated, the rest found in the cache; {outcome.wall_s:.1f} s"
            f"{converged}); check it with `autotune simulate --policy {outcome.policy_path}`"
        )


def _baselines_held(outcome: SearchOutcome) -> str:
    """What step 4 of NOTE [ Reserved budget ] did to the baselines, for the reserved line."""
    over = sum(b.note == _OVER for b in outcome.baselines)
    if outcome.baseline_planned_bytes is not None:
        return (f"none of the {_policies(over)} of the baselines runs there; the best baseline is the fastest that "
                f"runs with tensors planned for {format_bytes(outcome.baseline_planned_bytes)}")  # fmt: skip
    if outcome.baseline_reserved_bytes is not None:
        return f"the best baseline is held to it too, {over} faster ones running out there"
    return f"none of the {_policies(over)} of the baselines runs there"


def render_measured(out: Console, m: MeasuredSearch) -> None:
    """The finalists, planned against measured, the answer marked."""
    t = Table(title=f"finalists trained for real (budget {format_bytes(m.budget_bytes)})")
    for col in ("#", "policy", "peak planned", "peak measured", "fits", "samples/s planned", "samples/s measured"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for i, row in enumerate(m.rows, 1):
        r = row.finalist.result
        t.add_row(
            str(i),
            row.label,
            format_bytes(r.peak_bytes),
            format_bytes(row.peak_bytes),
            "yes" if row.fits(m.budget_bytes) else "no",
            f"{r.samples_per_s:,.1f}",
            f"{row.samples_per_s:,.1f}" if row.samples_per_s else "out of memory",
            style="bold green" if row is m.chosen else "",
        )
    out.print(t)
    if m.note:
        out.print(m.note)
    errors = m.errors()
    if errors is not None and m.time_scale is not None:
        scaled = (
            f"; scaled by the other finalists' ratio, each prediction is off by up to {errors[1]:.1%}"
            if errors[1] is not None
            else ""
        )
        out.print(
            f"plan vs measurement: time off by up to {errors[0]:.1%}; this device runs {m.time_scale:.3f}x the "
            f"planned time (median){scaled}"
        )


def no_answer(outcome: SearchOutcome) -> str:
    """One line for a search without an answer: the lowest peak reached, what to do."""
    p, f = outcome.problem, outcome.found
    budget = f.policy.budget_bytes or p.budget_bytes
    m = outcome.measured
    if m is not None and m.rows:
        low = m.lowest_peak() or 0
        oom = sum(not math.isfinite(r.iter_s) for r in m.rows)
        if oom:  # capped at the budget, as `autotune train` runs: the allocator's cached blocks count
            return (
                f"no policy fits {format_bytes(budget)} when trained: {oom} of {len(m.rows)} finalists ran out of "
                f"memory with the device capped there (the caching allocator's reserved bytes, not only the "
                f"tensors', the lowest allocated peak {format_bytes(low)}); nothing written to "
                f"{outcome.policy_path}; raise --budget, or lower --batch-size"
            )
        return (
            f"no policy fits {format_bytes(budget)} when trained: the lowest measured peak of {len(m.rows)} "
            f"finalists is {format_bytes(low)}; nothing written to {outcome.policy_path}; raise --budget to at "
            f"least {format_bytes(low)} or lower --batch-size"
        )
    rf = outcome.reserved
    if rf is not None and not rf.fits:
        needs = rf.frugal_reserved_bytes
        # step 5: what a most frugal policy reserves with nothing capping the device, and the reserve on top
        raise_to = (
            "raise --budget"
            if needs is None
            else f"raise --budget to at least {format_bytes(needs + budget - rf.planned[0])}"
        )
        reserves = "" if needs is None else f"; {rf.frugal_policy} reserves {format_bytes(needs)} there"
        return (
            f"no policy runs within {format_bytes(rf.planned[0])} on the caching allocator's model"
            f"{' with expandable_segments:True' if rf.expandable_segments else ''} ({len(rf.planned)} searches, "
            f"{_policies(rf.checked)} checked, the lowest tensor peak {format_bytes(rf.lowest_peak_bytes)}"
            f"{reserves}): nothing written to {outcome.policy_path}; {raise_to}, lower --batch-size, "
            + ("" if rf.expandable_segments else "try --expandable-segments, ")
            + "or plan for tensors alone with --budget-kind allocated"
        )
    floor = budget_floor(p)
    if f.result.peak_bytes <= p.budget_bytes and f.result.host_over_bytes:
        host = p.hardware.host_memory_bytes or 0
        return (
            f"no policy found within {format_bytes(p.budget_bytes)} that swaps no more than the "
            f"{format_bytes(host)} of host memory it may pin: the closest fits the device but swaps "
            f"{format_bytes(f.result.d2h_bytes)} ({f.searcher}); nothing written to {outcome.policy_path}; raise "
            "--host-memory if the host has more, search longer (--timeout), or lower --batch-size"
        )
    return (
        f"no policy found within {format_bytes(p.budget_bytes)}: the lowest peak reached is "
        f"{format_bytes(f.result.peak_bytes)} ({f.searcher}; no policy can go below {format_bytes(floor)}); "
        f"nothing written to {outcome.policy_path}; raise "
        f"--budget to at least {format_bytes(f.result.peak_bytes + budget - p.budget_bytes)}, search longer "
        "(--timeout), or lower --batch-size"
    )


def dumps(outcome: SearchOutcome) -> str:
    return json.dumps(to_json(outcome))
