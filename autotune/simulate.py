"""`autotune simulate`: score one policy (a file or a uniform action) against no policy."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.budget import Budget, budget_of, parse_budget, record_budget, warn_over_device
from autotune.models import check_model_name, given_image_size
from autotune.search import traced_here
from autotune.units import format_bytes, format_size_echo
from autotune.workloads import TraceRequest, check_sizes
from envs.simulator import SimResult, Simulator, compiled_twin, uniform_actions
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile, resolve_profile
from runtime.policy import ACTIONS, Action, Policy, PolicyOptions, Prediction, Provenance, load_policy
from runtime.workload import Workload


def run_simulate(
    out: Console,
    err: Console,
    *,
    model: str | None,
    batch_size: int | None,
    seq_len: int | None,
    gpu: str | None,
    policy_file: Path | None,
    image_size: int | None = None,
    action: str | None,
    budget: str | None,
    lookahead: int | None,
    lossy: bool | None,
    optimizer: str | None,
    region_nodes: bool | None = None,
    precision: str | None,
    grad_accum: int | None,
    timeline: Path | None,
    save_policy: Path | None,
    as_json: bool,
    trace: Callable[[TraceRequest], tuple[Workload, float]],
) -> None:
    if (policy_file is None) == (action is None):
        raise AutotuneError("give either --policy FILE or --action keep|swap|recompute|compress (exactly one)")
    act = _parse_action(action) if action is not None else None
    # The options of a uniform action: a policy file holds its own (they were ignored beside it).
    given_options = {"--lookahead": lookahead, "--lossy": lossy, "--region-nodes/--checkpoint-regions": region_nodes}
    if policy_file is not None and any(v is not None for v in given_options.values()):
        flag = next(f for f, v in given_options.items() if v is not None)
        raise AutotuneError(
            f'{flag} applies with --action; the policy file {policy_file} has its own options (its "options" '
            f"field): drop {flag}, or edit the file"
        )
    if lookahead is not None and lookahead < 0:
        raise AutotuneError(
            f"invalid --lookahead {lookahead}: expected 0 (copy back on demand) or more unpack points to prefetch "
            "ahead, e.g. --lookahead 2"
        )
    # An option the uniform action does not use was ignored with exit 0 (a QA run: --action keep --lossy).
    for flag, given, used_by in (("--lossy", lossy, Action.COMPRESS), ("--lookahead", lookahead, Action.SWAP)):
        if act is not None and act != used_by and given is not None and given is not False:
            raise AutotuneError(
                f"{flag} applies with --action {used_by.value}, not --action {act.value}, which does not use it: "
                f"drop {flag}"
            )
    lookahead = 2 if lookahead is None else lookahead
    lossy, region_nodes = bool(lossy), True if region_nodes is None else region_nodes
    if act == Action.COMPRESS and not lossy:
        raise AutotuneError("--action compress is lossy (gradients change): add --lossy to allow it")
    loaded: Policy | None = None
    named_by_file = False
    if policy_file is not None:
        loaded = load_policy(policy_file)  # format and schema now; the workload check after tracing
        named_by_file = model is None
        model = model or loaded.model
        batch_size = batch_size or loaded.batch_size
        seq_len = seq_len or loaded.seq_len
        image_size = image_size or loaded.image_size
        gpu = gpu or loaded.hardware
        precision = precision or loaded.precision  # another one: check_against says why it cannot apply
        grad_accum = grad_accum or loaded.grad_accum
        optimizer = optimizer or loaded.optimizer  # another one: check_against says why it cannot apply
    if model is None:
        raise AutotuneError("no model: pass --model NAME (see `autotune models`)")
    try:
        check_model_name(model)  # before the profile (--gpu cpu calibrates this CPU: seconds)
    except AutotuneError as e:
        if not named_by_file:
            raise
        raise AutotuneError(f"the policy file {policy_file} names its model: {e}") from None
    given_by_file = loaded is not None and (seq_len, image_size) == (loaded.seq_len, loaded.image_size)
    check_sizes(model, seq_len, image_size, source=str(policy_file) if given_by_file else None)
    if loaded is not None:
        assert policy_file is not None
        loaded.check_settings(
            batch_size=batch_size or loaded.batch_size,
            seq_len=seq_len,
            image_size=given_image_size(model, image_size),
            precision=precision or "fp32",
            grad_accum=grad_accum or 1,
            optimizer=optimizer or "sgd",
            source=str(policy_file),
        )
    given = parse_budget(budget) if budget is not None else (loaded.budget_bytes if loaded else None)
    recorded = loaded.reserve_bytes if loaded is not None else None
    if given is not None and recorded is not None:  # before the profile (--gpu cpu calibrates this CPU: seconds)
        Budget(format_bytes(given), given, recorded).check_left(source=str(policy_file))
    if budget is not None and not as_json:
        err.print(f"budget: {format_size_echo(budget, given or 0)}")
    try:
        hw, hw_note = resolve_profile(gpu)
    except AutotuneError as e:
        if loaded is None or gpu != loaded.hardware:
            raise
        raise AutotuneError(f"{policy_file}: hardware: {e}; or pass --gpu NAME") from None
    if not as_json and hw_note:
        err.print(hw_note)
    if given is not None:
        warn_over_device(err, given, hw)
    # Planned as the search plans (NOTE [ Budget and reserve ]): the budget (the file's, or --budget) less the
    # reserve the file records, else the profile's default one, so that simulate's verdict is the search's.
    plan: Budget | None = None
    if given is not None:
        plan = budget_of(given, None, hw) if recorded is None else Budget(format_bytes(given), given, recorded)
        if plan.reserve_bytes and not as_json:
            kept = "the file's" if recorded is not None else "the default"
            err.print(
                f"planning for {format_bytes(plan.planned_bytes)}: the budget {format_bytes(given)} less {kept} "
                f"{format_bytes(plan.reserve_bytes)} reserve for workspaces, as search plans",
                highlight=False,
            )
    budget_bytes = plan.planned_bytes if plan is not None else None

    req = TraceRequest(
        model=model,
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer or "sgd",
        precision=precision or "fp32",
        grad_accum=grad_accum or 1,
        target=hw,
        partitions=loaded.partitions if loaded is not None else (),
    )
    req.validate()
    # Traced as the search traced it (real mode where the plan is for this machine): the same workload scored.
    hw, req, host_note = traced_here(req, hw)
    if host_note and not as_json:
        err.print(host_note, highlight=False)
    if loaded is not None and model != loaded.model:  # another model's name: its parameters, before the trace
        from autotune.train import check_structure

        check_structure(loaded, req, source=str(policy_file))
    w, _ = trace(req)
    if loaded is not None:
        assert policy_file is not None
        loaded.check_against(w, source=str(policy_file))
        policy = loaded
    else:
        assert act is not None
        options = PolicyOptions(prefetch_lookahead=lookahead, lossy=lossy, region_nodes=region_nodes)
        policy = Policy.from_vector(
            w,
            uniform_actions(w, act),
            hardware=hw.name,
            budget_bytes=given,
            options=options,
            searcher=f"uniform-{act.value}",
        )

    compiled = policy.compile_backend
    if compiled is not None:  # planned for torch.compile: scored on the twin of a compiled step, as it was searched
        w, hw = compiled_twin(w, hw, compiled)
        if not as_json:
            err.print(f"planned for torch.compile ({compiled}): simulated as a compiled step (simulator Rule 16)")
    sim = Simulator(w, hw)
    started = time.perf_counter()
    result = sim.run(policy, budget_bytes=budget_bytes, timeline=timeline is not None)
    elapsed = time.perf_counter() - started
    # No policy is the model without slices, whatever the policy partitions (as search, maxbatch and sweep say).
    plain = Simulator(trace(dataclasses.replace(req, partitions=()))[0], hw) if req.partitions else sim
    baseline = plain.no_policy(budget_bytes=budget_bytes, timeline=timeline is not None)
    cache = _cache(w, hw, policy, budget_bytes) if hw.is_gpu else None

    if save_policy is not None:
        policy.predicted = Prediction(result.peak_bytes, result.iter_s, result.samples_per_s)
        record_budget(policy, plan)
        policy.provenance = Provenance.now(policy.provenance.searcher, trials=1, wall_s=elapsed)
        policy.save(save_policy)
    if timeline is not None:
        _write_timeline(timeline, w, hw.name, result, baseline, budget_bytes, policy.provenance.searcher)

    if as_json:
        d = result.to_dict()
        d.pop("timeline", None)
        d.update(
            model=w.model,
            batch_size=w.batch_size,
            gpu=hw.name,
            fingerprint=w.fingerprint,
            compile_backend=compiled,
            peak_op_name=w.ops[result.peak_op].name,
            actions={a.value: n for a, n in policy.counts(w).items()},
            no_policy={
                "peak_bytes": baseline.peak_bytes,
                "iter_s": baseline.iter_s,
                "samples_per_s": baseline.samples_per_s,
            },
            budget_bytes=given,  # as typed, as search's is; the verdict is against the planned budget
            planned_budget_bytes=budget_bytes,
            policy_path=str(save_policy) if save_policy else None,
            timeline_path=str(timeline) if timeline else None,
            **(cache or {}),
        )
        print(json.dumps(d))
        return
    _render(out, w, hw.name, policy, result, baseline, planned=plan is not None and plan.reserve_bytes > 0)
    if cache is not None:

        def verdict(within: bool | None) -> str:
            return "" if within is None else ", within the budget it " + ("runs" if within else "[red]runs out[/]")

        over = cache["reserved_peak_bytes"] / result.peak_bytes - 1
        grown = cache["expandable_reserved_peak_bytes"]
        out.print(
            f"PyTorch's CUDA caching allocator (a model) reserves "
            f"{format_bytes(cache['reserved_peak_bytes'])} for it ({over:+.1%}: cached blocks and split ends)"
            f"{verdict(cache['runs_within_budget'])}; with expandable_segments:True {format_bytes(grown)} "
            f"({grown / result.peak_bytes - 1:+.1%}){verdict(cache['expandable_runs_within_budget'])}; one arena "
            f"planned from its lifetimes: {format_bytes(cache['planned_pool_bytes'])}"
        )
    if save_policy is not None:
        out.print(f"policy written to {save_policy}")
    if timeline is not None:
        out.print(f"memory timeline written to {timeline}")


def _cache(w: Workload, hw: HardwareProfile, policy: Policy, budget_bytes: int | None) -> dict[str, Any]:
    """The caching allocator's model over three iterations of the policy (NOTE [ Reserved budget ]): its
    reserved and allocated peaks, and whether it runs with the device capped at the budget."""
    from envs.allocator import OutOfMemory, plan_offsets, policy_requests, request_intervals

    requests = policy_requests(w, hw, policy.to_vector(w), policy.options)  # one op-by-op simulation
    planned = plan_offsets(request_intervals(requests.steady())).arena_bytes  # seed 003's pool
    out: dict[str, Any] = {}
    for prefix, expandable in (("", False), ("expandable_", True)):  # expandable_segments:True: A8-A11
        free = requests.replay(expandable_segments=expandable)
        within: bool | None = None
        if budget_bytes is not None:
            try:
                requests.replay(capacity_bytes=budget_bytes, expandable_segments=expandable)
                within = True
            except OutOfMemory:
                within = False
        out[f"{prefix}reserved_peak_bytes"] = free.peak_reserved
        out[f"{prefix}allocated_peak_bytes"] = free.peak_allocated
        out[f"{prefix}runs_within_budget"] = within
    out["planned_pool_bytes"] = planned
    return out


def _parse_action(text: str) -> Action:
    try:
        return Action(text.lower())
    except ValueError:
        names = ", ".join(a.value for a in ACTIONS)
        raise AutotuneError(f"unknown action '{text}': expected one of {names}") from None


def _render(
    out: Console, w: Workload, gpu: str, policy: Policy, r: SimResult, base: SimResult, planned: bool = False
) -> None:
    """The table of ``r`` against no policy; ``planned``: the budget in ``r`` is the given one less a reserve."""
    counts = ", ".join(f"{n} {a.value}" for a, n in policy.counts(w).items() if n)
    out.print(f"[bold]{w.model}[/] batch {w.batch_size} on {gpu}: {counts}")
    # Rule 10: with --grad-accum k the times are one micro-batch's and the optimizer step's; the iteration runs k.
    k = w.grad_accum
    per = f"compute, recompute, compress and stall: one of {k} micro-batches (the optimizer step in compute)"
    host = "host: the iteration beyond the other four, where it waits for Python (dispatch, autotune's hooks, replays)"
    table = Table(title="Simulated iteration", caption=per if k > 1 else host)
    cols = ("", "peak", "iteration", "samples/s", "compute", "recompute", "compress", "stall", "host", "swapped")
    for col in cols if k == 1 else tuple(c for c in cols if c != "host"):
        table.add_column(col, justify="left" if not col else "right")
    for name, x in (("no policy", base), ("this policy", r)):
        times = [x.compute_s, x.recompute_s, x.compress_s, x.stall_s] + ([x.host_wait_s] if k == 1 else [])
        table.add_row(
            name,
            format_bytes(x.peak_bytes),
            f"{x.iter_s * 1e3:.1f} ms",
            f"{x.samples_per_s:,.1f}",
            *(f"{s * 1e3:.1f} ms" for s in times),
            format_bytes(x.d2h_bytes),
        )
    out.print(table)
    slowdown = base.samples_per_s / r.samples_per_s - 1
    saved = 1 - r.peak_bytes / base.peak_bytes
    op = w.ops[r.peak_op]
    out.print(
        f"peak {saved:+.1%} memory saved, {slowdown:+.1%} slower; peak during op {op.index} {op.name} "
        f"({op.phase.value}, {op.module})"
    )
    if r.budget_bytes is not None:
        verdict = (
            "[green]fits[/]" if r.feasible else f"[red]exceeds it by {format_bytes(r.peak_bytes - r.budget_bytes)}[/]"
        )
        out.print(f"budget {format_bytes(r.budget_bytes)}{' (planned)' if planned else ''}: {verdict}")


def _write_timeline(
    path: Path, w: Workload, gpu: str, r: SimResult, base: SimResult, budget: int | None, name: str
) -> None:
    from autotune.plots import memory_timeline_figure, write_html

    assert r.timeline is not None and base.timeline is not None
    series = [
        ("no policy", base.timeline["op_start_s"], base.timeline["live_bytes"]),
        (name, r.timeline["op_start_s"], r.timeline["live_bytes"]),
    ]
    labels = [f"op {x.peak_op} {w.ops[x.peak_op].name} ({w.ops[x.peak_op].module})" for x in (base, r)]
    fig = memory_timeline_figure(
        series,
        title=f"{w.model}, batch {w.batch_size}, on {gpu}: device memory",
        budget_bytes=budget,
        peak_labels=labels,
    )
    write_html(fig, path)
