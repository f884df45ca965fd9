"""What `autotune profile` and `autotune hardware` report: JSON-able summaries and their rendering as rich
tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.budget import budget_of
from autotune.units import format_bytes
from envs.allocator import no_policy_stats, plan_offsets, workload_intervals
from envs.simulator import Simulator, peak_floor
from runtime.hardware import Detection, HardwareProfile, op_times_s
from runtime.workload import Phase, Workload, peak_report

MIB = 2**20


def profile_report(
    w: Workload,
    hw: HardwareProfile,
    *,
    trace_s: float,
    budget_bytes: int | None,
    top: int,
    workload_file: str | None = None,
) -> dict[str, Any]:
    """Everything `autotune profile` prints; ``--json`` prints exactly this object. ``workload_file``: the trace
    was read from there (``--workload``), not taken."""
    peak = peak_report(w, hw.alloc_granularity_bytes)
    times = op_times_s(w, hw)
    phase_s = {p.value: 0.0 for p in Phase}
    for op, t in zip(w.ops, times, strict=True):
        phase_s[op.phase.value] += t
    largest = sorted(w.candidates, key=lambda c: -c.nbytes)[:top]
    peak_op = w.ops[peak.peak_op] if w.ops else None
    report: dict[str, Any] = {
        "model": w.model,
        "batch_size": w.batch_size,
        "grad_accum": w.grad_accum,  # micro-batches per iteration: phase_s and compute_s are one's (Rule 10)
        "seq_len": w.seq_len,
        "image_size": w.image_size,  # None: the model's default
        "optimizer": w.optimizer,
        "mode": w.mode,
        "device": w.device,
        "traced_for": w.meta.get("traced_for"),  # a fake trace: the profile whose kernels it took
        "workload_file": workload_file,
        "trace_s": round(trace_s, 3),
        "fingerprint": w.fingerprint,
        "shape_fingerprint": w.shape_fingerprint,
        "ops": len(w.ops),
        "candidates": len(w.candidates),
        "candidates_over_1mib": sum(c.nbytes > MIB for c in w.candidates),
        "activation_bytes": w.activation_bytes,
        "parameter_bytes": w.parameter_bytes,
        "persistent_bytes": peak.persistent_bytes,
        "peak_bytes": peak.peak_bytes,
        "peak_op": None
        if peak_op is None
        else {
            "index": peak_op.index,
            "name": peak_op.name,
            "phase": peak_op.phase.value,
            "module": peak_op.module,
        },
        "peak_breakdown_bytes": peak.by_kind_bytes,
        "gpu": hw.name,
        # Rule 9's iteration without a policy, the host's clock included (Rule 12), as simulate, search and
        # sweep say it (the ops' compute alone read 3,163.0 samples/s here and 3,155.6 there); the phases: compute.
        "iter_s": (plain := Simulator(w, hw).no_policy()).iter_s,
        "samples_per_s": plain.samples_per_s,
        "compute_s": sum(times),
        "phase_s": phase_s,
        "op_times": "measured" if w.mode == "real" and w.meta.get("device_profile") == hw.name else "roofline",
        "largest": [
            {
                "key": c.key,
                "bytes": c.nbytes,
                "shape": list(w.tensors[c.tensor].shape),
                "dtype": w.tensors[c.tensor].dtype,
                "producer": w.ops[c.producer].name,
            }
            for c in largest
        ],
    }
    floor = peak_floor(w, hw)
    at = w.ops[floor.op] if w.ops else None
    report["floor"] = {  # what no policy goes below (envs.simulator.peak_floor)
        "bytes": floor.bytes,
        "op": floor.op,
        "name": at.name if at else None,
        "phase": at.phase.value if at else None,
        "module": at.module if at else None,
    }
    # What PyTorch's CUDA caching allocator would reserve for the no-policy iteration (a model of it: NOTE
    # [ CUDA caching allocator ] in envs/allocator.py); on the CPU there is no such cache.
    cache = no_policy_stats(w) if hw.is_gpu else None
    report["reserved_peak_bytes"] = cache.peak_reserved if cache else None
    report["allocated_peak_bytes"] = cache.peak_allocated if cache else None
    # ... and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (A8-A11), which `autotune train
    # --expandable-segments` sets
    grown = no_policy_stats(w, expandable_segments=True) if hw.is_gpu else None
    report["expandable_reserved_peak_bytes"] = grown.peak_reserved if grown else None
    # ... and one arena planned from the lifetimes (seed 003's pool, envs.allocator.plan_offsets)
    report["planned_pool_bytes"] = plan_offsets(workload_intervals(w)).arena_bytes if cache else None
    if budget_bytes is not None:
        report["budget_bytes"] = budget_bytes
        report["fits"] = peak.peak_bytes <= budget_bytes
        report["below_floor"] = budget_bytes < floor.bytes
        # What `autotune search` plans for at this budget (NOTE [ Budget and reserve ]): on a GPU profile the
        # budget less the default reserve, so that this verdict and the search's agree (a budget could fit
        # here with room to spare and be refused by search as below what any policy needs).
        plan = budget_of(budget_bytes, None, hw)
        planned = plan.planned_bytes
        report["reserve_bytes"] = plan.reserve_bytes
        report["planned_budget_bytes"] = planned
        report["fits_planned"] = peak.peak_bytes <= planned
        report["planned_below_floor"] = planned < floor.bytes
    return report


def render_profile(console: Console, r: dict[str, Any]) -> None:
    seq = f" x {r['seq_len']} tokens" if r["seq_len"] else ""
    seq += f" at {r['image_size']} px" if r.get("image_size") else ""
    if r.get("workload_file"):
        how = f"read from {escape(r['workload_file'])}"
    elif r["mode"] == "fake" and r.get("traced_for"):
        how = f"for {r['traced_for']}'s kernels in {r['trace_s']:.2f} s"
    else:
        how = f"on {r['device']} in {r['trace_s']:.2f} s"
    console.print(
        f"[bold]{r['model']}[/] batch {r['batch_size']}{seq}, {r['optimizer']}, {r['mode']} trace {how}: "
        f"{r['ops']} ops, fingerprint {r['fingerprint']}"
    )
    mem = Table(title="Memory at the no-policy peak", show_footer=True)
    mem.add_column("kind", footer="peak")
    mem.add_column("live at peak", justify="right", footer=format_bytes(r["peak_bytes"]))
    mem.add_column("share", justify="right", footer="100%")
    for kind, nbytes in r["peak_breakdown_bytes"].items():
        if nbytes:
            mem.add_row(kind.replace("_", " "), format_bytes(nbytes), f"{100 * nbytes / r['peak_bytes']:.1f}%")
    console.print(mem)
    op = r["peak_op"]
    if op:
        console.print(f"peak during op {op['index']} {op['name']} ({op['phase']}, module {op['module']})")
    console.print(
        f"saved activations (candidates): {r['candidates']} tensors, {format_bytes(r['activation_bytes'])}; "
        f"{r['candidates_over_1mib']} over 1 MiB. Parameters: {format_bytes(r['parameter_bytes'])}."
    )
    big = Table(title=f"Largest {len(r['largest'])} candidates")
    for col in ("key", "size", "shape", "dtype", "producer"):
        big.add_column(col, justify="right" if col == "size" else "left")
    for c in r["largest"]:
        big.add_row(
            c["key"],
            format_bytes(c["bytes"]),
            "x".join(map(str, c["shape"])),
            c["dtype"],
            c["producer"].removeprefix("aten."),
        )
    console.print(big)
    ph = r["phase_s"]
    k = r["grad_accum"]
    per = f" for one of {k} micro-batches and the optimizer step" if k > 1 else ""
    console.print(
        f"estimated iteration on {r['gpu']} ({r['op_times']} op times): {r['iter_s'] * 1e3:.1f} ms, "
        f"{r['samples_per_s']:.1f} samples/s; the ops' compute{per}: forward {ph['forward'] * 1e3:.1f}, "
        f"backward {ph['backward'] * 1e3:.1f}, optimizer {ph['optimizer'] * 1e3:.1f} ms"
    )
    if r["reserved_peak_bytes"]:
        over = r["reserved_peak_bytes"] / r["peak_bytes"] - 1
        grown = r["expandable_reserved_peak_bytes"]
        console.print(
            f"PyTorch's CUDA caching allocator would reserve {format_bytes(r['reserved_peak_bytes'])} for it "
            f"({over:+.1%}: cached blocks and unused block ends; a model of the allocator, checked against an "
            f"H200's on real steps), {format_bytes(grown)} with expandable_segments:True "
            f"({grown / r['peak_bytes'] - 1:+.1%}); "
            f"one arena planned from the lifetimes would hold it in {format_bytes(r['planned_pool_bytes'])} "
            f"({r['planned_pool_bytes'] / r['reserved_peak_bytes'] - 1:+.1%})"
        )
    f = r["floor"]
    console.print(
        f"no policy can go below {format_bytes(f['bytes'])} ({100 * f['bytes'] / r['peak_bytes']:.0f}% of the "
        f"peak): at op {f['op']} {f['name']} ({f['phase']}, module {f['module']}) the state, what the step holds "
        "there and the activations that op reads"
    )
    if "budget_bytes" in r:
        gap = r["peak_bytes"] - r["budget_bytes"]
        verdict = (
            f"[green]fits[/] with {format_bytes(-gap)} to spare"
            if gap <= 0
            else f"[red]exceeds it[/] by {format_bytes(gap)}: "
            + ("[red]below what any policy can reach[/]" if r["below_floor"] else "a memory policy is needed")
        )
        console.print(f"budget {format_bytes(r['budget_bytes'])}: the no-policy peak {verdict}")
        if r.get("reserve_bytes"):
            planned = r["planned_budget_bytes"]
            gap = r["peak_bytes"] - planned
            verdict = (
                f"fits that with {format_bytes(-gap)} to spare"
                if gap <= 0
                else f"exceeds that by {format_bytes(gap)}: "
                + ("below what any policy can reach" if r["planned_below_floor"] else "a memory policy is needed")
            )
            console.print(
                f"`autotune search` plans for the budget less a {format_bytes(r['reserve_bytes'])} reserve for "
                f"workspaces (--reserve), {format_bytes(planned)}: the no-policy peak {verdict}"
            )


def hardware_report(profiles: list[HardwareProfile], found: Detection) -> dict[str, Any]:
    """What `autotune hardware --json` prints: the built-in profiles and what was detected here."""
    return {
        "detected": {
            "profile": found.profile.name if found.profile else None,
            "device_name": found.device_name,
            "memory_bytes": found.memory_bytes,
            "message": found.message,
        },
        "profiles": [p.to_dict() for p in profiles],
    }


def render_hardware(console: Console, profiles: list[HardwareProfile], found: Detection) -> None:
    table = Table(title="Hardware profiles")
    widest = max((len(p.name) for p in profiles), default=4)  # a name is typed to --gpu: never cut (80 columns)
    for col in ("name", "memory", "FP32 TFLOP/s", "TF32", "BF16", "FP16", "HBM GB/s", "host link GB/s", "device"):
        table.add_column(
            col,
            justify="left" if col in ("name", "device") else "right",
            min_width=widest if col == "name" else None,
            no_wrap=col == "name",
        )
    for p in profiles:

        def tf(k: str, p: HardwareProfile = p) -> str:
            v = p.flops_per_s.get(k)
            return f"{v / 1e12:.1f}" if v else "-"

        table.add_row(
            p.name,
            format_bytes(p.memory_bytes),
            tf("fp32"),
            tf("tf32"),
            tf("bf16"),
            tf("fp16"),  # the V100's and T4's tensor cores (no BF16 there)
            f"{p.memory_bytes_per_s / 1e9:,.0f}",
            f"{p.h2d_bytes_per_s / 1e9:.0f}",
            p.description,
        )
    console.print(table)
    console.print("cpu: this machine's CPU, measured when a command first plans for it (--gpu cpu)")
    console.print(f"detected: {found.message}")
