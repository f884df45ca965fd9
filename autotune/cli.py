"""The ``autotune`` command line.

Errors a user can cause are :class:`~runtime.errors.AutotuneError`: printed on one line, exit code 2, no
traceback unless ``--debug`` is given (anywhere on the command line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

# The profiler's own log lines (kineto: "USDT ... profiler_start", "ERROR ... gpuGetDeviceCount failed" on a
# machine without a GPU) are not the command's output: quiet unless the user asked for them. Read when torch
# loads, so set before the first import of it below.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import typer
from rich.console import Console
from rich.markup import escape

from autotune import __version__
from autotune.units import file_stem
from runtime.errors import AutotuneError, from_interrupt, note_sigint, noting_sigint, sigint_arrived
from runtime.fileio import check_folder, check_writable

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Make deep-learning training fit in GPU memory: capture, simulate and search memory policies.",
    pretty_exceptions_enable=False,
)
# Piped or redirected, tables get room for every value (rich's 80 columns cut profile names, method names and
# figures to "…"); a terminal's width, or COLUMNS where set, otherwise. Piped or redirected, a message line stays
# one line (a file name or a command in it was cut in two at the 200th column).
out = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200, soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=True)  # a message stays on one line, however long
_DEBUG = False


def _version(value: bool) -> None:
    if value:
        out.print(f"autotune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """autotune: keep / swap / recompute / compress saved activations to fit a memory budget."""


ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Model name (see `autotune models`) or package.module:factory.")
]
BatchOpt = Annotated[
    int | None,
    typer.Option("--batch-size", "-b", help="Batch size \\[default: the model's, 64 for CNNs, 8 for LMs]."),
]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="Tokens per sample (language models).")]
ImageOpt = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        help="Image height and width in pixels (torchvision models; factories with an image_size parameter) "
        "\\[default: the model's, 224 for torchvision, 299 for inception_v3].",
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help="Hardware profile to plan for (see `autotune hardware`; cpu: this machine); default: the detected "
        "GPU, else a100-40gb.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
AccumOpt = Annotated[
    int,
    typer.Option("--grad-accum", help="Micro-batches per optimizer step (gradient accumulation), each a batch."),
]
PrecisionOpt = Annotated[
    str,
    typer.Option("--precision", help="fp32, or mixed precision under torch.autocast: bf16, fp16 (with a GradScaler)."),
]
HostOpt = Annotated[
    str | None,
    typer.Option(
        "--host-memory",
        help="Host memory swapped tensors may pin (one buffer each, kept across steps): a policy swapping more does "
        "not fit \\[default: this machine's memory where the plan is for its GPU, else unbounded].",
    ),
]
BudgetKindOpt = Annotated[
    str | None,
    typer.Option(
        "--budget-kind",
        help="reserved: a policy runs within the budget on a model of PyTorch's CUDA caching allocator (cached blocks "
        "and split ends: what runs out); allocated: its tensors alone fit \\[default: reserved on a GPU profile; "
        "allocated on cpu, which has no caching allocator, and with --measure, whose finalists run capped at the "
        "budget].",
    ),
]
ExpandableOpt = Annotated[
    bool,
    typer.Option(
        "--expandable-segments",
        help="Check the reserved bytes on the allocator's model of expandable_segments:True (train with autotune "
        "train --expandable-segments).",
    ),
]
ReserveOpt = Annotated[
    str | None,
    typer.Option(
        "--reserve",
        help="Memory kept back from the budget for what a trace cannot see (cuDNN/cuBLAS workspaces and handles) "
        "\\[default: 128MiB on GPU profiles, 0 on cpu].",
    ),
]


@app.command()
def profile(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Model name (see `autotune models`) or package.module:factory \\[required unless --workload].",
        ),
    ] = None,
    batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    image_size: ImageOpt = None,
    gpu: GpuOpt = None,
    optimizer: Annotated[str, typer.Option(help="sgd (momentum 0.9), adam or adamw.")] = "sgd",
    mode: Annotated[
        str, typer.Option(help="fake: no memory, seconds; real: run on the device and time every op.")
    ] = "fake",
    device: Annotated[str, typer.Option(help="cpu or cuda[:N] (real mode).")] = "cpu",
    budget: Annotated[
        str | None, typer.Option(help="Memory budget to compare the peak with, e.g. 6GB, 6GiB, 6000MB.")
    ] = None,
    workload: Annotated[Path | None, typer.Option(help="Read a saved workload instead of tracing.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Save the workload (JSON; .gz compresses).")] = None,
    top: Annotated[int, typer.Option(help="How many of the largest candidates to list.")] = 10,
    precision: PrecisionOpt = "fp32",
    grad_accum: AccumOpt = 1,
    as_json: JsonOpt = False,
) -> None:
    """Capture one training iteration and show where the memory goes."""
    from autotune.budget import parse_budget
    from autotune.report import profile_report, render_profile
    from autotune.units import format_size_echo
    from autotune.workloads import TraceRequest
    from runtime.hardware import get_profile, resolve_profile
    from runtime.target import trace_key
    from runtime.workload import Workload

    check_writable(out_file, "--out")
    if top < 0:
        raise AutotuneError(f"invalid --top {top}: expected 0 or more candidates to list, e.g. --top 10")
    if workload is None:
        if model is None:
            raise AutotuneError("--model is required: a model name (see `autotune models`) or package.module:factory, "
                                "or --workload FILE to read a saved trace")  # fmt: skip
        _early_checks(model, batch_size=batch_size, seq_len=seq_len, image_size=image_size, optimizer=optimizer,
                      precision=precision, grad_accum=grad_accum)  # fmt: skip
    budget_bytes = parse_budget(budget) if budget is not None else None
    if budget is not None and not as_json:
        err.print(f"budget: {format_size_echo(budget, budget_bytes or 0)}")
    saved = Workload.load(workload) if workload is not None else None
    if saved is not None and ((mode != "fake" and mode != saved.mode) or device != "cpu"):  # they trace: ignored here
        flag = f"--device {device}" if device != "cpu" else f"--mode {mode}"
        raise AutotuneError(
            f"{flag} with --workload {workload}, a {saved.mode} trace read from the file ({flag.split()[0]} sets how "
            f"a new trace runs): drop {flag}, or trace again without --workload"
        )
    traced_for = saved.meta.get("traced_for") if saved is not None and saved.mode == "fake" else None
    # Without --gpu: the profile a fake trace took its kernels from, or the one of the device a real trace ran on
    # (its op times measured, as search plans --gpu cpu): a CPU's trace showed an a100-40gb's roofline times.
    default = traced_for
    if saved is None and mode == "real":
        from autotune.workloads import device_profile

        default = device_profile(device)
    elif saved is not None and saved.mode == "real":
        default = saved.meta.get("device_profile")
    hw, hw_note = resolve_profile(gpu if gpu is not None or default is None else default)
    if traced_for is not None and trace_key(None if traced_for == "cpu" else get_profile(traced_for)) != trace_key(hw):
        raise AutotuneError(
            f"--gpu {hw.name} with --workload {workload}, a fake trace taken with {traced_for}'s kernels (their "
            f"choices differ from {hw.name}'s): pass --gpu {traced_for}, or trace again without --workload"
        )
    if budget_bytes is not None:
        from autotune.budget import warn_over_device

        warn_over_device(err, budget_bytes, hw)
    if saved is not None:
        assert workload is not None
        w, trace_s = saved, 0.0
        from autotune.models import given_image_size

        _check_workload_matches(w, workload, model=model, batch_size=batch_size, seq_len=seq_len,
                                image_size=given_image_size(w.model, image_size), optimizer=optimizer,
                                precision=precision, grad_accum=grad_accum)  # fmt: skip
    else:
        assert model is not None
        req = TraceRequest(
            model=model,
            batch_size=batch_size,
            seq_len=seq_len,
            image_size=image_size,
            optimizer=optimizer,
            mode=mode,
            device=device,
            precision=precision,
            grad_accum=grad_accum,
            target=hw,
        )
        w, trace_s = _trace(req)
        measured_on = w.meta.get("device_profile")
        if mode == "real" and measured_on != hw.name:  # runtime.hardware.op_times_s: measured for their own only
            err.print(
                f"note: the times below are {hw.name}'s roofline estimates; the op times this real trace measured "
                f"are {measured_on}'s (plan with --gpu {measured_on} to use them)",
                highlight=False,
            )
    if out_file is not None:
        w.save(out_file)
    report = profile_report(w, hw, trace_s=trace_s, budget_bytes=budget_bytes, top=top,
                            workload_file=str(workload) if saved is not None else None)  # fmt: skip
    if as_json:
        print(json.dumps(report))
        return
    if hw_note:
        err.print(hw_note)
    render_profile(out, report)
    if out_file is not None:
        out.print(f"workload saved to {out_file}")


def _positive(value: float) -> bool:
    """A positive, finite number (click reads "nan" and "inf" as floats, and nan passes every comparison)."""
    return math.isfinite(value) and value > 0


def _check_seed(seed: int) -> None:
    """--seed: what Optuna's and NumPy's generators take, checked before any work."""
    if not 0 <= seed < 2**32:
        raise AutotuneError(f"invalid --seed {seed}: expected an integer from 0 to 4294967295, e.g. --seed 0")


def _check_heartbeat(heartbeat: float | None) -> None:
    if heartbeat is not None and not _positive(heartbeat):
        raise AutotuneError(f"invalid --heartbeat {heartbeat}: expected a positive number of seconds, e.g. 60")


def _check_budget_kind(budget_kind: str | None, expandable_segments: bool, gpu: str | None) -> None:
    """--budget-kind and --expandable-segments (NOTE [ Reserved budget ]): a known kind, and none of the GPU
    caching allocator's options on the CPU."""
    from autotune.reserved import check_kind

    if budget_kind is not None:
        check_kind(budget_kind)
    if gpu == "cpu" and (budget_kind == "reserved" or expandable_segments):  # the GPU's caching allocator
        what = "--budget-kind reserved" if budget_kind == "reserved" else "--expandable-segments"
        raise AutotuneError(
            f"{what} with --gpu cpu: the CPU has no CUDA caching allocator to reserve memory; drop {what}, or plan "
            "for a GPU (--gpu a100-40gb)"
        )


def _early_checks(
    model: str | None,
    budget: str | None = None,
    reserve: str | None = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    optimizer: str = "sgd",
    precision: str = "fp32",
    grad_accum: int = 1,
    device: str | None = None,
    measure: int | None = None,
    partition: str | None = None,
    allow_partition: bool = False,
    host_memory: str | None = None,
) -> None:
    """What the user typed, checked before the profile is resolved (``--gpu cpu`` calibrates this CPU: seconds)
    and before any trace, each with the message the later check would give."""
    from autotune.budget import plan_budget
    from autotune.models import check_model_name
    from autotune.search import check_device, check_measure, parse_host_memory
    from autotune.workloads import TraceRequest, check_sizes
    from runtime.hardware import get_profile

    if budget is not None:  # the size's syntax; the reserve's default waits for the profile
        plan_budget(budget, reserve, get_profile("a100-40gb"))
    check_device(device)
    check_measure(measure)
    parse_partition_option(partition)
    if partition is not None and allow_partition:
        raise AutotuneError(
            f"--partition {partition} with --allow-partition: --partition names the submodule and its slices, "
            "--allow-partition lets the search choose them; pass one of the two"
        )
    TraceRequest(
        model=model or "",
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        precision=precision,
        grad_accum=grad_accum,
    ).validate()
    if host_memory is not None:
        parse_host_memory(host_memory)
    if model is not None:
        check_model_name(model)
        check_sizes(model, seq_len, image_size)


def _check_workload_matches(w: Any, path: Path, **given: Any) -> None:
    """profile --workload: the trace settings given beside it (those not left at their defaults) are the saved
    trace's, else refused: they were ignored, and the report was another model's or batch's than asked."""
    defaults = {"optimizer": "sgd", "precision": "fp32", "grad_accum": 1}
    for name, value in given.items():
        if value is None or value == defaults.get(name):
            continue
        has = getattr(w, name)
        if (value.lower() if isinstance(value, str) else value) != (has.lower() if isinstance(has, str) else has):
            flag = "--" + name.replace("_", "-")
            raise AutotuneError(
                f"{flag} {value} with --workload {path}, a trace of {w.model} at batch {w.batch_size} with {name} "
                f"{'at the default' if has is None else has}: drop {flag} (the trace says it), or trace again "
                "without --workload"
            )


def parse_partition_option(text: str | None) -> tuple[Any, ...]:
    """``--partition features/4,layer2/2`` as runtime.partition.Partition records."""
    from runtime.partition import Partition

    if not text:
        return ()
    out = []
    for item in text.split(","):
        module, sep, chunks = item.strip().rpartition("/")
        if not sep or not module or not chunks.isdigit():
            raise AutotuneError(
                f"invalid --partition {item.strip()!r}: expected MODULE/SLICES with a module path and a whole number "
                "of slices, e.g. --partition features/4"
            )
        out.append(Partition(module, int(chunks)))
    return tuple(out)


def _choose_partition(
    w: Any, hw: Any, budget_bytes: int, req: Any, trace: Any = None, *, others: bool = True, together: str = ""
) -> list[Any]:
    """--allow-partition: NOTE [ Choosing a partition ] in autotune/partitions.py, said on stderr. The
    workloads to search (C1, C4): the rule's choice, the other candidates' (``others``), then the unpartitioned
    one where the budget is above its floor. ``trace``: how a partitioned variant is traced (default: ``req``
    again with the partitions). ``together``: the searcher that chooses among them itself (C5), if it does."""
    from autotune import search as sr
    from autotune.partitions import choose, retracer
    from runtime.partition import partition_label

    with err.status("choosing a partition…", spinner="dots") as status:
        choice = choose(
            w, hw, budget_bytes, trace or retracer(req), progress=lambda msg: status.update(msg), others=others
        )
    tried = "; ".join(
        f"{p}: floor {sr.format_bytes(f)}, frugal policy {sr.format_bytes(g)}" for p, f, g in choice.tried
    )
    if choice.partitions:
        err.print(
            f"partition: {', '.join(str(p) for p in choice.partitions)} (unpartitioned: floor "
            f"{sr.format_bytes(choice.floor_bytes)}, frugal policy {sr.format_bytes(choice.frugal_bytes)}; "
            f"tried {tried})",
            highlight=False,
        )
    elif choice.tried:
        err.print(f"partition: none lowers the floor (tried {tried})", highlight=False)
    rivals = choice.searched(w, budget_bytes)
    if len(rivals) > 1 and others:  # C4: the search chooses among them
        names = [partition_label(r.meta.get("partitions")) for r in rivals]
        above = "; the budget is above the unpartitioned floor too" if rivals[-1] is w else ""
        how = (
            f"together ({', '.join(names)}): {together} chooses the partition among its own decisions"
            if together
            else f"in turn ({', '.join(names)}), each for its share of the time left, the fastest answer taken"
        )
        err.print(f"searching {len(rivals)} partitions {how}{above}", highlight=False)
    return rivals


def _partitioner(hw: Any, budget_bytes: int, req: Any) -> Any:
    """maxbatch --allow-partition: each size's workload, partitioned where NOTE [ Choosing a partition ] says."""
    from autotune.partitions import choose, retracer

    def partition(w: Any) -> Any:
        trace = retracer(dataclasses.replace(req, batch_size=w.batch_size))
        return choose(w, hw, budget_bytes, trace, others=False).workload

    return partition


def _with_local_host_costs(hw: Any, req: Any, here: str | None) -> tuple[Any, Any]:
    """The profile and the trace request with this host's runtime costs where the plan is for this machine's
    GPU (autotune.search.with_local_host_costs), said on stderr; after ``req`` is validated, since measuring
    takes seconds."""
    from autotune import search as sr

    hw, note = sr.with_local_host_costs(hw, here)
    if not note:
        return hw, req
    err.print(note, highlight=False)
    return hw, dataclasses.replace(req, target=hw)


def _trace(req: Any) -> tuple[Any, float]:
    """Trace with a spinner on stderr (a ResNet-101 takes a few seconds)."""
    from autotune.workloads import trace_model

    req.validate()
    with err.status(f"Tracing {req.model} ({req.mode} mode)…", spinner="dots"):
        return trace_model(req)


@app.command()
def simulate(
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Model name or package.module:factory \\[default: the policy file's]."),
    ] = None,
    batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    image_size: ImageOpt = None,
    gpu: GpuOpt = None,
    policy_file: Annotated[
        Path | None,
        typer.Option("--policy", help="Policy file to simulate; batch size, profile and budget default to its own."),
    ] = None,
    action: Annotated[
        str | None,
        typer.Option(
            help="One action for every candidate: keep, swap, recompute "
            "(block inputs kept, like checkpointing every block) or "
            "compress."
        ),
    ] = None,
    budget: Annotated[str | None, typer.Option(help="Memory budget, e.g. 6GB, 6GiB, 6000MB.")] = None,
    lookahead: Annotated[
        int | None,
        typer.Option(help="Prefetch look-ahead for swaps (unpack points; 0 = on demand), with --action \\[2]."),
    ] = None,
    lossy: Annotated[bool | None, typer.Option(help="Allow compression (lossy), with --action compress.")] = None,
    region_nodes: Annotated[
        bool | None,
        typer.Option(
            "--region-nodes/--checkpoint-regions",
            help="With --action: recomputed blocks run as one autograd node each (no Python per saved tensor), "
            "or under torch.utils.checkpoint (less memory in their backward) \\[region nodes].",
        ),
    ] = None,
    optimizer: Annotated[
        str | None, typer.Option(help="sgd (momentum 0.9), adam or adamw \\[default: the policy file's, or sgd].")
    ] = None,
    timeline: Annotated[Path | None, typer.Option(help="Write the memory timeline as an HTML plot.")] = None,
    save_policy: Annotated[Path | None, typer.Option(help="Write the simulated policy as a policy file.")] = None,
    precision: Annotated[
        str | None,
        typer.Option("--precision", help="fp32, bf16 or fp16 (autocast) \\[default: the policy file's, or fp32]."),
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option("--grad-accum", help="Micro-batches per optimizer step \\[default: the policy file's, or 1]."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate one iteration under a policy file or a uniform action and print the SimResult."""
    check_writable(save_policy, "--save-policy")
    check_writable(timeline, "--timeline", "timeline.html")
    from autotune.simulate import run_simulate

    run_simulate(
        out,
        err,
        model=model,
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        gpu=gpu,
        policy_file=policy_file,
        action=action,
        budget=budget,
        lookahead=lookahead,
        lossy=lossy,
        region_nodes=region_nodes,
        optimizer=optimizer,
        precision=precision,
        grad_accum=grad_accum,
        timeline=timeline,
        save_policy=save_policy,
        as_json=as_json,
        trace=_trace,
    )


@app.command()
def baselines(
    model: ModelOpt,
    budget: Annotated[str, typer.Option(help="Memory budget, e.g. 6GB, 6GiB, 6000MB.")],
    batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    image_size: ImageOpt = None,
    gpu: GpuOpt = None,
    only: Annotated[str | None, typer.Option(help="Comma-separated methods \\[default: all].")] = None,
    save: Annotated[
        Path | None, typer.Option(help="Write each method's policy file into this folder (made if missing).")
    ] = None,
    allow_compress: Annotated[bool, typer.Option(help="Let methods propose compression (lossy).")] = False,
    time_limit: Annotated[float, typer.Option(help="Seconds each exact solver may take.")] = 30.0,
    reserve: ReserveOpt = None,
    partition: Annotated[
        str | None, typer.Option(help="Run these submodules on slices of the batch, MODULE/SLICES (as search).")
    ] = None,
    allow_partition: Annotated[
        bool, typer.Option(help="Partition where the budget lies below the unpartitioned floor (as search).")
    ] = False,
    optimizer: Annotated[str, typer.Option(help="sgd (momentum 0.9), adam or adamw.")] = "sgd",
    precision: PrecisionOpt = "fp32",
    grad_accum: AccumOpt = 1,
    budget_kind: BudgetKindOpt = None,
    expandable_segments: ExpandableOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every published heuristic and exact solver at the budget and compare them; on a GPU profile each
    policy is held, as `autotune search` holds its answer, to the bytes the caching allocator reserves."""
    from agents.base import SearchContext
    from autotune import baselines as bl
    from autotune import search as sr
    from autotune.budget import plan_budget
    from autotune.workloads import TraceRequest
    from runtime.hardware import resolve_profile

    check_folder(save, "--save")
    if not _positive(time_limit):
        raise AutotuneError(f"invalid --time-limit {time_limit}: expected a positive number of seconds, e.g. 30")
    _early_checks(model, budget, reserve, batch_size=batch_size, seq_len=seq_len, image_size=image_size,
                  optimizer=optimizer, precision=precision, grad_accum=grad_accum, partition=partition,
                  allow_partition=allow_partition)  # fmt: skip
    _check_budget_kind(budget_kind, expandable_segments, gpu)
    methods = bl.select_methods(only)
    hw, note = resolve_profile(gpu)
    reserved = budget_kind != "allocated" and hw.is_gpu  # NOTE [ Reserved budget ]: as search holds its answer
    plan = plan_budget(budget, reserve, hw)
    parts = parse_partition_option(partition)
    if not as_json:
        plan.echo(err, hw)
        err.print(note)
    req = TraceRequest(
        model=model,
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        precision=precision,
        grad_accum=grad_accum,
        target=hw,
        partitions=parts,
    )
    req.validate()
    hw, req, host_note = sr.traced_here(req, hw)
    if host_note:
        err.print(host_note, highlight=False)
    w, _ = _trace(req)
    if allow_partition and not parts:
        # The methods compare on one model: the unpartitioned one where the budget is above its floor.
        w = _choose_partition(w, hw, plan.planned_bytes, req, others=False)[-1]
    problem = sr.planned_problem(w, hw, plan, allow_compress=allow_compress, partitioning=allow_partition,
                                 reserved=reserved, expandable_segments=expandable_segments)  # fmt: skip
    results = bl.run_baselines(problem, SearchContext(time_limit_s=time_limit), methods, err)
    held = None
    if reserved:
        with err.status("checking the reserved bytes (the caching allocator's model)…", spinner="dots"):
            results, held = bl.held_to_reserved(problem, results, expandable_segments)
    # No policy is the model without slices, whatever the methods partition (as search says).
    plain = (
        sr.plain_no_policy(problem, _trace(dataclasses.replace(req, partitions=()))[0])
        if w.meta.get("partitions")
        else None
    )
    table = bl.rows(problem, results, plain, held)
    if save is not None:
        bl.save(save, problem, results, plan)
    if as_json:
        print(bl.to_json(problem, table, plan, plain, save, held))
        return
    bl.render(out, problem, table, plan, held)
    if save is not None:
        over = sum(1 for r in results if not r.feasible)  # in tensors, or on the allocator's model where held
        named = f" ({over} over the budget: *.infeasible.policy.json)" if over else ""
        out.print(f"policies written to {save}/{named}")


@app.command()
def search(
    model: ModelOpt,
    budget: Annotated[str, typer.Option(help="Memory budget, e.g. 6GB, 6GiB, 6000MB.")],
    batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    image_size: ImageOpt = None,
    gpu: GpuOpt = None,
    searcher: Annotated[
        str,
        typer.Option(
            help="portfolio (default), optuna-tpe, optuna-nsga2, refine, ppo-pretrained (the shipped agent's "
            "one pass, then Optuna), ppo-onepass, ppo, or a baseline's name. The baselines run first and seed it; "
            "the answer is the fastest of its policy and theirs (the table says whose; `autotune baselines --only "
            "NAME --save DIR` writes one baseline's own)."
        ),
    ] = "portfolio",
    trials: Annotated[
        int | None, typer.Option(help="Optuna trials (reproducible under --seed) \\[default: until --timeout].")
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds for the whole search at most; without --trials it stops once converged.")
    ] = 60.0,
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL: resume or inspect the study there (optuna-dashboard).")
    ] = "sqlite:///autotune.db",
    study: Annotated[str | None, typer.Option(help="Study name \\[default: model, batch, profile, budget].")] = None,
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Policy file to write \\[default: <model>.policy.json].")
    ] = None,
    milp: Annotated[bool, typer.Option(help="Also run the MILP solver (exact on a coarsened model).")] = False,
    reserve: ReserveOpt = None,
    host_memory: HostOpt = None,
    budget_kind: BudgetKindOpt = None,
    expandable_segments: ExpandableOpt = False,
    allow_compress: Annotated[bool, typer.Option(help="Let searchers propose compression (lossy).")] = False,
    partition: Annotated[
        str | None,
        typer.Option(
            help="Run these submodules on slices of the batch, MODULE/SLICES comma-separated (e.g. features/4): "
            "gradients then differ from unpartitioned training by rounding (runtime/partition.py)."
        ),
    ] = None,
    allow_partition: Annotated[
        bool,
        typer.Option(
            help="Let the search partition a submodule where the budget lies below what no unpartitioned policy "
            "reaches (gradients then differ by rounding; autotune/partitions.py)."
        ),
    ] = False,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Plan for training under torch.compile (policy.compiled, autotune train --compile): keep and "
            "recompute only; --measure trains the finalists compiled.",
        ),
    ] = False,
    backend: Annotated[
        str | None,
        typer.Option(help="torch.compile's backend that --compile --measure trains under (default: inductor)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the samplers.")] = 0,
    optimizer: Annotated[str, typer.Option(help="sgd (momentum 0.9), adam or adamw.")] = "sgd",
    precision: PrecisionOpt = "fp32",
    grad_accum: AccumOpt = 1,
    heartbeat: Annotated[
        float | None,
        typer.Option(
            help="Seconds between Optuna heartbeats, for workers sharing one storage: a dead worker's trial is "
            "failed and retried."
        ),
    ] = None,
    measure: Annotated[
        int | None,
        typer.Option(
            help="Train the K best distinct policies for real on the planned device and answer with the fastest "
            "whose measured peak fits \\[default: 5 where the plan is for this machine's GPU (2 with --compile), "
            "else 0]."
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Where to trace and measure: cpu, cuda or cuda:N \\[default: the planned one].")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Find the fastest policy within the budget and write it as a policy file (the main job)."""
    from agents.base import SearchContext, better
    from agents.finalists import Finalists
    from agents.optuna_search import check_storage, check_study, existing_trials, study_name
    from autotune import search as sr
    from autotune.budget import plan_budget
    from autotune.partitions import partition_tag
    from autotune.workloads import TraceRequest
    from runtime.hardware import resolve_profile
    from runtime.partition import parse_partitions

    if not _positive(timeout):
        raise AutotuneError(f"invalid --timeout {timeout}: expected a positive number of seconds, e.g. --timeout 60")
    _check_heartbeat(heartbeat)
    if trials is not None and trials <= 0:
        raise AutotuneError(f"invalid --trials {trials}: expected a positive number, e.g. --trials 200")
    check_writable(out_path, "--out")
    from agents.base import get_searcher

    get_searcher(searcher)  # unknown names fail before tracing
    from autotune.reserved import new_pool

    _check_budget_kind(budget_kind, expandable_segments, gpu)
    parts = parse_partition_option(partition)
    sliced = bool(parts) or allow_partition
    if compile_ and (sliced or allow_compress):  # before the profile: calibrating the CPU's takes seconds
        what = "--allow-compress" if allow_compress else "--partition/--allow-partition"
        raise AutotuneError(
            f"--compile with {what}: under torch.compile a policy can only keep and recompute (NOTE [ Compiled "
            f"policies ] C5 in runtime/compiled.py); drop {what} or --compile"
        )
    if backend is not None and not compile_:
        raise AutotuneError(
            f"--backend {backend} without --compile: the backend is torch.compile's; add --compile to plan for "
            "it, or leave --backend out"
        )
    if backend is not None:
        from runtime.compiled import check_backend

        check_backend(backend)
    _check_seed(seed)
    _early_checks(
        model, budget, reserve, batch_size=batch_size, seq_len=seq_len, image_size=image_size, optimizer=optimizer,
        precision=precision, grad_accum=grad_accum, device=device, measure=measure, partition=partition,
        allow_partition=allow_partition, host_memory=host_memory,
    )  # fmt: skip
    check_storage(storage)  # before the profile: --gpu cpu calibrates this CPU first (seconds)
    hw, note = resolve_profile(gpu)
    here = sr.plan_device(hw, device)
    hw, host_note = sr.with_host_memory(hw, host_memory, here)
    k = sr.measure_count(measure, here, hw, compiled=compile_)
    if backend is not None and not k:
        raise AutotuneError(
            f"--backend {backend} without --measure: nothing is compiled in a simulated search; add --measure K to "
            "train the finalists compiled on the planned device (--gpu cpu, or this machine's GPU), or leave "
            "--backend out"
        )
    plan = plan_budget(budget, reserve, hw)
    req = TraceRequest(
        model=model,
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        precision=precision,
        grad_accum=grad_accum,
        mode="real" if here is not None else "fake",
        device=here or "cpu",
        target=hw,
        partitions=parts,
    )
    req.validate()
    plan.echo(err, hw)
    err.print(note)
    if host_note:
        err.print(host_note, highlight=False)
    compiled = (backend or "inductor") if compile_ else None  # simulated as its twin (simulator Rule 16)
    if compiled == "inductor" and not k:  # Rule 16 is aot_eager's memory, not inductor's
        check = "--measure K trains the finalists compiled" if here is not None else "search with --measure on the GPU"
        err.print(
            "note: the plan is the simulator's twin of a compiled step (Rule 16), exact to 0.004% under aot_eager on "
            "the CPU; inductor's fusion and buffers are not modelled (-20% to +17% of the plan on a CNN on the CPU): "
            f"{check} to check its peak",
            highlight=False,
        )
    hw, req = _with_local_host_costs(hw, req, here)
    backends: dict[tuple[Any, ...], Any] = {}

    def backend_for(partitions: tuple[Any, ...]) -> Any:
        """The environment's real backend traces the model it will train (NOTE [ Measured search ]), with
        the partitions it will run (the candidates measured are those searched)."""
        from autotune.real_backend import real_backend

        if partitions not in backends:
            with err.status(f"Tracing {model} on {here} (real mode: measured op times)…", spinner="dots"):
                backends[partitions] = real_backend(
                    model, batch_size, here or "cpu", steps=3, seq_len=seq_len, image_size=image_size,
                    optimizer=req.optimizer, precision=req.precision, grad_accum=grad_accum, partitions=partitions,
                    compile_backend=compiled,
                )  # fmt: skip
        return backends[partitions]

    w = backend_for(parts).workload if k else _trace(req)[0]
    rivals = [w]
    # No policy is the unpartitioned model's, whatever the answer partitions.
    plain = _trace(dataclasses.replace(req, partitions=()))[0] if parts else w
    # NOTE [ Reserved budget ]: what the caching allocator reserves, by default on a GPU profile
    reserved = budget_kind != "allocated" and hw.is_gpu and not k
    # C5: a searcher that chooses the partition among its own decisions searches them together (its finalists,
    # measured or checked on the allocator's model, are one partition's: there they are searched in turn).
    chooser = searcher if get_searcher(searcher).chooses_partition and not k and not reserved else ""
    if allow_partition and not parts:  # NOTE [ Choosing a partition ]: one workload, or more searched (C4, C5)
        trace = (lambda ps: backend_for(ps).workload) if k else None
        rivals = _choose_partition(w, hw, plan.planned_bytes, req, trace, together=chooser)
        searched = {parse_partitions(r.meta.get("partitions")) for r in rivals}
        for key in [key for key in backends if key not in searched]:
            del backends[key]  # the models of the partitions not taken, on the device no longer
    path = out_path or Path(f"{file_stem(w.model)}.policy.json")
    outcome: Any = None
    searching, answers = time.perf_counter(), []
    groups = [rivals] if chooser and len(rivals) > 1 else [[r] for r in rivals]
    for i, group in enumerate(groups):
        wi = group[0]
        finalists = Finalists(plan.planned_bytes, capacity=4 * k) if k else None
        finalists = new_pool(plan.planned_bytes) if reserved else finalists
        problem = sr.planned_problem(
            wi, hw, plan, allow_compress=allow_compress, finalists=finalists, partitioning=allow_partition,
            compiled=compiled, reserved=reserved, expandable_segments=expandable_segments,
        )  # fmt: skip
        problem.rivals = tuple(
            sr.planned_problem(r, hw, plan, allow_compress=allow_compress, partitioning=allow_partition,
                               compiled=compiled)
            for r in group[1:]
        )  # fmt: skip
        # The portfolio keeps the name its studies always had; another searcher gets its own, so that two
        # searchers on one problem never share a study (their trials' parameters can differ).
        name = study or study_name(problem, "optuna-tpe" if searcher == "portfolio" else searcher)
        if len(group) > 1 and not study:  # C5: one study over the partitions, with a partition parameter
            name = f"{name}.partitions"
        elif len(group) == 1 and study and len(rivals) > 1 and wi.meta.get("partitions"):
            # Its candidates are the slices' tensors: a study of its own (the rule's choice's name as it was).
            name = f"{study}.partitioned" + ("" if i == 0 else partition_tag(wi))
        # C4: each its share of the time left (a search that converged early leaves the rest to the others).
        left = max(1.0, timeout - (time.perf_counter() - searching))
        ctx = SearchContext(
            time_limit_s=left / (len(groups) - i),
            seed=seed,
            trials=trials if trials is not None else 0,
            storage=storage,
            study_name=name,
            heartbeat_s=heartbeat,
        )
        # The portfolio (and ppo-pretrained) run their Optuna phases in studies of their own (agents/portfolio.py).
        for n in get_searcher(searcher).study_names(name):
            check_study(storage, n, problem)  # before the baselines: another problem's study is refused
        found = {n: existing_trials(storage, n) for n in get_searcher(searcher).study_names(name)}
        resumed = sum(found.values())
        if resumed and list(found) == [name]:
            more = f"up to {max(0, trials - resumed)} more (--trials is the study's total)" if trials else "more"
            err.print(f"resuming study {name} in {storage}: {resumed} trials found, running {more}")
        elif resumed:
            studies = ", ".join(f"{n} ({k})" for n, k in found.items() if k)
            err.print(f"resuming the search's Optuna studies in {storage}: {studies} trials found; the baselines and "
                      "refinement run again")  # fmt: skip
        got = sr.run_search(
            problem,
            ctx,
            searcher,
            out=path,
            milp=milp,
            milp_time_s=min(30.0, timeout / 2),
            err=err,
            quiet=False,
            user_budget_bytes=plan.given_bytes,
            plain=plain,
            keeping_runs=sr.runs_reserved(plan.planned_bytes, expandable_segments) if reserved else None,
        )
        if len(rivals) > 1:
            shown = ", ".join(str(p) for p in got.found.policy.partitions) or "no partition"
            fits = "fits" if got.found.feasible else "does not fit"
            chose = f" ({searcher}'s choice of {len(group)})" if len(group) > 1 else ""
            err.print(f"{shown}{chose}: {got.found.result.samples_per_s:,.1f} samples/s ({fits})", highlight=False)
            answers.append({
                "partitions": [p.to_dict() for p in got.found.policy.partitions],
                "samples_per_s": got.found.result.samples_per_s,
                "peak_bytes": got.found.result.peak_bytes,
                "feasible": got.found.feasible,
                "study_name": got.ctx.study_name,
                "chosen_among": [[p.to_dict() for p in parse_partitions(g.meta.get("partitions"))] for g in group]
                if len(group) > 1 else None,
            })  # fmt: skip
        if outcome is None or better(got.found.result, outcome.found.result):
            outcome = got
        if got.interrupted:
            break
    problem, name = outcome.problem, outcome.ctx.study_name
    outcome.searched = answers
    backend = backends.pop(outcome.found.policy.partitions, None) if k else None
    backends.clear()  # the model not taken goes before anything is measured: a device's peak counts all
    if backend is not None and outcome.found.feasible and not outcome.interrupted:
        from autotune.measured import measure as measure_finalists

        with err.status("measuring", spinner="dots") as status:
            measured = measure_finalists(
                problem, backend, k, budget_bytes=plan.given_bytes, found=outcome.found, baselines=outcome.baselines,
                progress=lambda msg: status.update(msg),
            )  # fmt: skip
        sr.take_measured(outcome, measured)
    if hw.is_gpu and not k and outcome.found.feasible and not outcome.interrupted:
        with err.status("checking the reserved bytes (the caching allocator's model)…", spinner="dots"):
            outcome = sr.fit_reserved(
                outcome, searcher, err, quiet=False, enforce=reserved, expandable_segments=expandable_segments
            )
    sr.write_answer(outcome)
    if as_json:
        print(sr.dumps(outcome))
    else:
        sr.render(out, outcome)
    faster = outcome.found.result.samples_per_s / outcome.no_policy.samples_per_s - 1
    if req.mode == "real" and outcome.found.policy.partitions and outcome.found.feasible and faster > 0.05:
        # A policy only adds work to its model; slices and no slices are two real-mode traces, timed apart.
        err.print(
            f"warning: the answer on slices plans {faster:.0%} faster than no policy without them: the two models "
            "were traced apart, and this machine's op times varied between the traces (a busy machine?); their "
            "comparison says nothing here, the peaks stand",
            highlight=False,
        )
    if outcome.interrupted:
        where = f"the best policy so far is in {path}" if outcome.written else "no policy fits yet"
        # Only an Optuna study is resumed; another searcher's run keeps nothing in the storage (one named a
        # study to resume that did not exist).
        again = ""
        if get_searcher(searcher).study_names(name):
            # One study: its name; several (partitions in turn), named from --study or the problem: the same command.
            if study or len(groups) == 1:
                again = f"; resume with --storage {storage} --study {study or name}"
            else:
                again = f"; resume by running the same command with --storage {storage} (its studies are named from it)"
        err.print(f"{_stopped()}: {where}{again}")
        raise SystemExit(_stop_code())
    if not outcome.written:
        err.print(f"[bold red]error:[/] {sr.no_answer(outcome)}", highlight=False)
        raise SystemExit(1)


@app.command()
def maxbatch(
    model: ModelOpt,
    budget: Annotated[str, typer.Option(help="Memory budget, e.g. 16GB.")],
    gpu: GpuOpt = None,
    seq_len: SeqOpt = None,
    image_size: ImageOpt = None,
    max_slowdown: Annotated[
        float | None, typer.Option(help="Largest accepted slowdown against no policy at the same batch, e.g. 0.2.")
    ] = None,
    start_batch: Annotated[int, typer.Option(help="First batch size tried (then doubled).")] = 16,
    per_size: Annotated[float, typer.Option(help="Seconds of search per batch size.")] = 10.0,
    reserve: ReserveOpt = None,
    host_memory: HostOpt = None,
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Policy file \\[default: <model>.b<batch>.policy.json].")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the samplers.")] = 0,
    optimizer: Annotated[str, typer.Option(help="sgd (momentum 0.9), adam or adamw.")] = "sgd",
    precision: PrecisionOpt = "fp32",
    grad_accum: AccumOpt = 1,
    measure: Annotated[
        int | None,
        typer.Option(
            help="Train the K best distinct policies of the largest sizes for real on the planned device: the "
            "answer is the largest size whose fastest measured policy fits \\[default: 5 where the plan is for "
            "this machine's GPU, else 0]."
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Where to measure: cpu, cuda or cuda:N \\[default: the planned one].")
    ] = None,
    allow_partition: Annotated[
        bool,
        typer.Option(
            help="Let each size partition a submodule where the budget lies below what no unpartitioned policy "
            "reaches (as search --allow-partition)."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Find the largest batch that trains within the budget, with the best policy found for it."""
    from autotune import maxbatch as mb
    from autotune import search as sr
    from autotune.budget import plan_budget, record_budget
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import resolve_profile

    mb.check_start(start_batch)
    check_writable(out_path, "--out")
    if max_slowdown is not None and not (math.isfinite(max_slowdown) and max_slowdown >= 0):
        raise AutotuneError(f"invalid --max-slowdown {max_slowdown}: expected 0 or more, e.g. --max-slowdown 0.2")
    if not _positive(per_size):
        raise AutotuneError(f"invalid --per-size {per_size}: expected a positive number of seconds, e.g. 10")
    _check_seed(seed)
    _early_checks(model, budget, reserve, seq_len=seq_len, image_size=image_size, optimizer=optimizer,
                  precision=precision, grad_accum=grad_accum, device=device, measure=measure,
                  host_memory=host_memory)  # fmt: skip
    hw, note = resolve_profile(gpu)
    here = sr.plan_device(hw, device)
    hw, host_note = sr.with_host_memory(hw, host_memory, here)
    k = sr.measure_count(measure, here, hw)
    plan = plan_budget(budget, reserve, hw)
    budget_bytes = plan.given_bytes
    plan.check_left()
    plan.echo(err, hw)
    err.print(note)
    if host_note:
        err.print(host_note, highlight=False)
    req = TraceRequest(
        model=model,
        batch_size=start_batch,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        precision=precision,
        grad_accum=grad_accum,
        target=hw,
    )
    req.validate()
    hw, req = _with_local_host_costs(hw, req, here)

    def trace(b: int) -> Any:
        return trace_model(dataclasses.replace(req, batch_size=b))[0]

    with err.status("maxbatch", spinner="dots") as status:
        search = mb.MaxBatch(
            trace,
            hw,
            plan.planned_bytes,
            per_size_s=per_size,
            max_slowdown=max_slowdown,
            seed=seed,
            progress=lambda msg: status.update(f"maxbatch: {msg}"),
            partition=_partitioner(hw, plan.planned_bytes, req) if allow_partition else None,
        )
        try:
            outcome = search.run(start_batch)
            if k and outcome.max_batch:
                from autotune.real_backend import real_backend

                def backend_at(b: int, partitions: tuple[Any, ...]) -> Any:
                    return real_backend(model, b, here or "cpu", steps=3, seq_len=seq_len, image_size=image_size,
                                        optimizer=req.optimizer, precision=req.precision, grad_accum=grad_accum,
                                        partitions=partitions)  # fmt: skip

                outcome = search.measure(outcome, backend_at, k, budget_bytes)
        except KeyboardInterrupt:
            status.stop()
            err.print(f"maxbatch: {search.reached()}; nothing written", highlight=False)
            if not as_json:
                raise
            err.print(_stopped())  # the outcome as an object, then the exit (README: what --json prints)
            stopped = {"error": _stopped(), "exit_code": _stop_code(), "searched": search.searched(), "policy": None}
            print(json.dumps(stopped), flush=True)
            raise SystemExit(_stop_code()) from None
        status.update("maxbatch: checking the reserved bytes (the caching allocator's model)")
        outcome = search.check_allocator(outcome)
    if outcome.best is not None and outcome.best.found is not None:
        path = out_path or Path(f"{file_stem(model)}.b{outcome.max_batch}.policy.json")
        record_budget(outcome.best.found.policy, plan).save(path)
        outcome.policy_path = path
    result = outcome.to_json(hw, budget_bytes, plan.planned_bytes)
    if as_json:
        print(json.dumps(result))
    else:
        mb.render(out, model, hw, budget_bytes, outcome, result)
    if not outcome.measured_sizes and outcome.max_batch == 0:
        slower = f" at most {max_slowdown:.0%} slower than no policy" if max_slowdown is not None else ""
        err.print(
            f"[bold red]error:[/] no batch size trains within {sr.format_bytes(plan.planned_bytes)} (planned)"
            f"{slower}, not even 1; nothing written; raise --budget"
            + (" or --max-slowdown" if max_slowdown is not None else "")
            + "".join(f" (at batch size {b} {model} does not train: {e})" for b, e in search.untrainable.items()),
            highlight=False,
        )
        raise SystemExit(1)
    if outcome.measured_sizes and outcome.measured is None:  # --measure tried sizes, none fit
        tried = ", ".join(str(b) for b in outcome.measured_sizes)
        err.print(
            f"[bold red]error:[/] no batch size trains within {sr.format_bytes(budget_bytes)} when measured: the "
            f"largest that fit on the simulator ({tried}) measured over it or too slow; nothing written; raise "
            "--budget or pass --measure 0 for the simulator's answer",
            highlight=False,
        )
        raise SystemExit(1)


@app.command()
def train(
    policy_file: Annotated[Path, typer.Option("--policy", help="The policy file to apply.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="\\[default: the policy's model]")] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", "-b", help="Batch size \\[default: the policy's; another one is refused]."),
    ] = None,
    steps: Annotated[int, typer.Option(help="Measured iterations (after one warm-up).")] = 3,
    device: Annotated[
        str | None,
        typer.Option(
            help="cpu or cuda[:N] \\[default: cuda where the policy was planned for a GPU and CUDA is here, else cpu]."
        ),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision", help="fp32, bf16 or fp16 (autocast) \\[default: the policy's; another one is refused]."
        ),
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option("--grad-accum", help="Micro-batches per optimizer step \\[default: the policy's]."),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            help="sgd (momentum 0.9), adam or adamw \\[default: the policy's, or sgd; another one is refused]."
        ),
    ] = None,
    expandable_segments: Annotated[
        bool,
        typer.Option(
            "--expandable-segments",
            help="Run PyTorch's caching allocator with expandable_segments:True (appended to "
            "PYTORCH_CUDA_ALLOC_CONF before CUDA initialises) and predict its reserved bytes so (--device cuda).",
        ),
    ] = False,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Train under torch.compile, the policy through selective activation checkpointing at trace time "
            "(keep and recompute only: search with --compile).",
        ),
    ] = False,
    backend: Annotated[
        str | None,
        typer.Option(
            help="torch.compile's backend with --compile (default: the one the policy was planned for, else inductor)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Train N real iterations under a policy; measured peak and time beside the simulator's prediction."""
    from autotune.train import render as render_train
    from autotune.train import train as run_train

    if backend is not None and not compile_:
        raise AutotuneError(
            f"--backend {backend} without --compile: the backend is torch.compile's; add --compile to train under "
            "it, or leave --backend out to train eagerly"
        )

    with err.status("Tracing on the device, then training…", spinner="dots"):
        report = run_train(
            policy_file,
            model=model,
            batch_size=batch_size,
            steps=steps,
            device=device,
            precision=precision,
            grad_accum=grad_accum,
            optimizer=optimizer,
            expandable_segments=expandable_segments,
            compile_backend=backend,
            compiled=compile_,
        )
    d = report.to_dict()
    if as_json:
        print(json.dumps(d))
        return
    render_train(out, report)


@app.command()
def sweep(
    models: Annotated[str, typer.Option(help="Comma-separated model names, e.g. resnet50,resnet101,gpt2.")],
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets, e.g. 4GB,6GB,8GB.")],
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="Comma-separated hardware profiles \\[default: the detected GPU].")
    ] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated: baselines, optuna, ppo.")] = "baselines,optuna",
    batch_size: BatchOpt = None,
    image_size: Annotated[
        int | None,
        typer.Option("--image-size", help="Image height and width in pixels for the image models among --models."),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Tokens per sample for the language models among --models.")
    ] = None,
    trials: Annotated[int, typer.Option(help="Optuna trials per cell, in all (a resumed study counts its own).")] = 60,
    timeout: Annotated[float, typer.Option(help="Seconds per cell and method at most.")] = 60.0,
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL shared by every cell (SQLite file, PostgreSQL, ...).")
    ] = "sqlite:///autotune.db",
    report: Annotated[Path | None, typer.Option(help="Write a self-contained HTML report here.")] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", help="Write each cell's best policy file into this folder (made if missing)."),
    ] = None,
    heartbeat: Annotated[
        float | None,
        typer.Option(help="Seconds between Optuna heartbeats: a dead worker's trial is failed and retried."),
    ] = None,
    optimizer: Annotated[str, typer.Option(help="sgd (momentum 0.9), adam or adamw.")] = "sgd",
    precision: PrecisionOpt = "fp32",
    grad_accum: AccumOpt = 1,
    seed: Annotated[int, typer.Option(help="Seed of the samplers.")] = 0,
    reserve: ReserveOpt = None,
    allow_partition: Annotated[
        bool,
        typer.Option(
            "--allow-partition",
            help="Let a cell whose budget is below what the model reaches run a submodule on slices of the batch "
            "(as search --allow-partition; its own study).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Search every model x budget x profile cell into one Optuna storage (resumable), with an HTML report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from autotune import search as sr
    from autotune import sweep as sw
    from autotune.budget import parse_budget, warn_over_device
    from autotune.units import format_size_echo
    from autotune.workloads import TraceRequest
    from runtime.hardware import get_profile, resolve_profile

    check_writable(report, "--report", "report.html")
    check_folder(out_dir, "--out-dir")
    _check_heartbeat(heartbeat)
    _check_seed(seed)

    method_list = sw.check_methods(methods)
    # Each model and budget once, in the order given (400MiB and 419430400 are one budget: one cell, one file).
    typed = [(b.strip(), parse_budget(b, "--budgets")) for b in budgets.split(",") if b.strip()]
    budget_list = list(dict.fromkeys(n for _, n in typed))
    names = list(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))
    if not names or not budget_list:
        raise AutotuneError("give at least one model and one budget, e.g. --models resnet50 --budgets 4GB,6GB")
    if trials <= 0:
        raise AutotuneError(f"invalid --trials {trials}: expected a positive number, e.g. --trials 60")
    if not _positive(timeout):
        raise AutotuneError(f"invalid --timeout {timeout}: expected a positive number of seconds, e.g. --timeout 60")
    # The --seq-len and --image-size typed: a sweep of vision models passes no --seq-len on, and so on.
    TraceRequest(model="", seq_len=seq_len, image_size=image_size).validate()
    from autotune.models import check_model_name

    for name in names:  # every name before the first cell's trace (minutes for a large model)
        check_model_name(name)
    if gpu:
        profiles = [get_profile(p) for p in dict.fromkeys(p.strip() for p in gpu.split(",") if p.strip())]
    else:
        hw, note = resolve_profile(None)
        err.print(note)
        profiles = [hw]
    from autotune.budget import budget_of

    plans = {(hw.name, b): budget_of(b, reserve, hw) for hw in profiles for b in budget_list}  # --reserve checked
    for plan in plans.values():  # (such cells of a model and profile would all be one study)
        plan.check_left()
    from autotune.models import takes_image_size, takes_seq_len

    reqs = [
        TraceRequest(
            model=m,
            batch_size=batch_size,
            seq_len=seq_len if takes_seq_len(m) else None,  # one --seq-len for the language models
            image_size=image_size if takes_image_size(m) else None,  # one --image-size for the image models
            optimizer=optimizer,
            precision=precision,
            grad_accum=grad_accum,
        )
        for m in names
    ]
    for req in reqs:
        req.validate()
    from agents.optuna_search import check_storage

    check_storage(storage)
    # What was read, once every input is checked (an error is then one line): the budgets as search echoes
    # its one, a budget that the GPU cannot hold, and the reserve kept back.
    err.print(f"budgets: {'; '.join(format_size_echo(t, n) for t, n in typed)}")
    for hw in profiles:
        warn_over_device(err, max(budget_list), hw)
    kept = {hw.name: max(plans[(hw.name, b)].reserve_bytes for b in budget_list) for hw in profiles}
    if any(kept.values()):
        on = "" if all(kept.values()) else f" on {', '.join(n for n, k in kept.items() if k)}"
        err.print(
            f"planning for each budget less a {sr.format_bytes(max(kept.values()))} reserve for workspaces"
            f"{on} (--reserve)"
        )
    from runtime.target import trace_key
    from runtime.workload import Workload

    traced: dict[tuple[int, Any], Workload] = {}  # a fake trace per model and kind of target (runtime/target.py)
    for i, req in enumerate(reqs):
        for hw in profiles:
            if (i, trace_key(hw)) not in traced:
                traced[(i, trace_key(hw))] = _trace(dataclasses.replace(req, target=hw))[0]
    workloads = {hw.name: [traced[(i, trace_key(hw))] for i in range(len(reqs))] for hw in profiles}

    def partition(i: int, w: Workload, hw: Any, budget_bytes: int) -> list[Workload]:
        """--allow-partition: NOTE [ Choosing a partition ] per cell, on fake traces for the cell's profile: the
        workloads to search, as search's (the chosen partition's, then the model's where the budget is above its
        floor too)."""
        from autotune.partitions import choose, retracer

        return choose(w, hw, budget_bytes, retracer(dataclasses.replace(reqs[i], target=hw))).searched(w, budget_bytes)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # Not on a terminal (a log file, CI) a bar is redrawn as lines cut to the width: a line per step of a cell
    # there instead (it said nothing until the last cell was done: minutes, a QA run).
    lines, started = not err.is_terminal, time.perf_counter()
    with Progress(*columns, console=err, transient=as_json, disable=lines) as bar:
        task = bar.add_task("sweep", total=len(reqs) * len(profiles) * len(budget_list))

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, description=what)
            if lines:
                err.print(f"{time.perf_counter() - started:.0f} s, {done} of {total} cells done: {what}",
                          highlight=False, soft_wrap=True)  # fmt: skip

        outcome = sw.run_sweep(
            workloads,
            profiles,
            budget_list,
            methods=method_list,
            storage=storage,
            trials=trials,
            timeout_s=timeout,
            seed=seed,
            heartbeat_s=heartbeat,
            progress=progress,
            reserve=reserve,
            partition=partition if allow_partition else None,
        )
    written: list[str] = []
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for cell in outcome.cells:  # (a Ctrl-C from here on stops the sweep after it: nothing is left half-written)
            w = outcome.workload_of(cell)[1]
            policy = sw.best_policy(cell, w, outcome.profiles[cell.profile])
            if policy is not None:
                given = cell.budget_bytes + cell.reserve_bytes
                # Everything that makes another problem is in the name, as in the cell's study's.
                path = out_dir / f"{file_stem(cell.model)}.{sw.problem_tag(w)}.{cell.profile}.{given}.policy.json"
                policy.save(path)
                written.append(str(path))
    if report is not None:
        from autotune import sweep_report as rp

        trials_by_study = rp.study_trials(storage, [c.study_name for c in outcome.cells])
        text = rp.build_report(outcome.cells, outcome.workload_of, outcome.profiles, trials_by_study)
        rp.write_report(report, text)
    # A Ctrl-C that a finalizer swallowed while the policies or the report were written (runtime.errors
    # noting_sigint): they are written, the cells all stored; the sweep still says it was stopped, and exits so.
    outcome.interrupted = outcome.interrupted or sigint_arrived()
    if as_json:
        print(
            json.dumps(
                {
                    "storage": storage,
                    "cells": [c.to_json() for c in outcome.cells],
                    "report": str(report) if report else None,
                    "policies": written,
                    "wall_s": outcome.wall_s,
                    "interrupted": outcome.interrupted,
                }
            )
        )
    else:
        sw.render(out, outcome, storage, report)
    if outcome.interrupted:  # NOTE [ Sweep storage ]: what the cells reached is stored, and shown above
        at, total = len(outcome.cells), outcome.total
        where = f"in cell {at} of {total}" if at and outcome.cells[-1].interrupted else f"after {at} of {total} cells"
        err.print(
            f"{_stopped()} {where}; the same command resumes from {storage}",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(_stop_code())


def _holds_studies(db: str) -> bool:
    """Whether SQLite file ``db`` has Optuna's tables, read without writing (an empty file is a database with
    none); True for a file that is no database at all, which check_storage refuses with SQLite's words."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{Path(db).resolve().as_uri()}?mode=ro", uri=True)) as conn:
            query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'studies'"
            return conn.execute(query).fetchone() is not None
    except sqlite3.DatabaseError:
        return True


@app.command()
def dashboard(
    storage: Annotated[str, typer.Option(help="Optuna storage URL to serve.")] = "sqlite:///autotune.db",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
) -> None:
    """Serve optuna-dashboard on the sweep's (or search's) storage, on loopback by default."""
    try:
        import optuna_dashboard
    except ImportError:
        raise AutotuneError(
            "optuna-dashboard is not installed: pip install optuna-dashboard (it comes with autotune's own "
            "dependencies; reinstall autotune with `pip install -e .`)"
        ) from None
    if not 0 < port < 65536:
        raise AutotuneError(f"invalid --port {port}: expected 1 to 65535, e.g. --port 8080")
    from agents.optuna_search import check_storage

    if storage in ("sqlite://", "sqlite:///:memory:"):  # the server's connection would be a database of its own
        raise AutotuneError(
            f"--storage {storage}: an in-memory database holds nothing between processes; give the storage "
            "`autotune search` or `autotune sweep` wrote (by default sqlite:///autotune.db in the folder they ran in)"
        )
    from agents.optuna_search import sqlite_file

    if (db := sqlite_file(storage)) is not None and not Path(db).is_file():
        raise AutotuneError(
            f"--storage {storage}: no such file; give the storage `autotune search` or `autotune sweep` wrote "
            "(by default sqlite:///autotune.db in the folder they ran in)"
        )
    if db is not None and not _holds_studies(db):  # Optuna would make its tables in it: another program's file
        raise AutotuneError(
            f"--storage {storage}: the file holds no Optuna storage (no studies table); give the storage "
            "`autotune search` or `autotune sweep` wrote (by default sqlite:///autotune.db in the folder they ran in)"
        )
    check_storage(storage)
    _check_listen(host, port)
    err.print(f"optuna-dashboard on {storage}: http://{host}:{port}/ (Ctrl-C stops it)")
    # A signal turned into KeyboardInterrupt while a request is served is caught by wsgiref's handler, which
    # prints it as a failed request and serves on: the server has nothing to save, so it ends at once.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _end_now)
        signal.signal(signal.SIGTERM, _end_now)
    import optuna

    from agents.optuna_search import best_fitting_first

    optuna_dashboard.run_server(best_fitting_first(optuna.storages.get_storage(storage)), host=host, port=port)


def _end_now(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM in the dashboard: say so and end the process now (exit 128 + the signal's number)."""
    _TERMINATED[0] = signum == signal.SIGTERM
    err.print(_stopped())
    sys.stderr.flush()
    os._exit(128 + signum)


def _check_listen(host: str, port: int) -> None:
    """That the dashboard can listen there, said in one line before it starts (a busy port or a host that
    does not resolve was an internal error after "Listening on ...")."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise AutotuneError(
            f"cannot listen on {host}:{port}: {reason}; pick another --port (or --host), e.g. --port 8081"
        ) from None


@app.command()
def hardware(as_json: JsonOpt = False) -> None:
    """List the built-in hardware profiles and what was detected here."""
    from autotune.report import hardware_report, render_hardware
    from runtime.hardware import detect, list_profiles

    found = detect()
    profiles = list_profiles()
    if as_json:
        print(json.dumps(hardware_report(profiles, found)))
        return
    render_hardware(out, profiles, found)


@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the built-in models (any torchvision classifier, GPT-2 sizes, BERT)."""
    from autotune.models import list_models

    names = list_models()
    if as_json:
        print(json.dumps(names))
        return
    out.print(", ".join(names))
    out.print("\nYour own model: --model package.module:factory (see README, 'Your own model').")


def _is_click(e: BaseException, name: str) -> bool:
    """Whether ``e`` is click's exception ``name``: from click itself or from the copy that typer >= 0.22
    vendors as ``typer._click`` (whose classes are not click's)."""
    import click

    modules = [click.exceptions]
    try:
        from typer._click import exceptions as vendored  # type: ignore[import-not-found,unused-ignore]

        modules.append(vendored)
    except ImportError:
        pass
    return any(isinstance(e, getattr(m, name)) for m in modules if hasattr(m, name))


def _reader_gone() -> None:
    """Exit 0 once stdout's reader has gone: stdout goes to /dev/null, so Python's flush at exit cannot fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0) from None


def _one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    text = str(message).removeprefix("autotune: ")
    label = "warning" if issubclass(category, UserWarning) else category.__name__
    err.print(f"[yellow]{label}:[/] {escape(text)}", highlight=False, soft_wrap=True, emoji=False)


def _usage_error(e: Any, args: list[str]) -> str:
    """click's usage error in one line: the value given where it names an option, and where to look."""
    message = e.format_message().rstrip(".")
    opts = getattr(getattr(e, "param", None), "opts", None) or []
    given = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in opts:
            given = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    if given is not None:
        message = f"{message} (given: {given!r})"
    ctx = getattr(e, "ctx", None)
    return f"{message}; see {ctx.command_path if ctx is not None else 'autotune'} --help"


_TERMINATED = [False]


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, ``docker stop``, a scheduler's preemption) stops a command as Ctrl-C does: a search
    writes its best policy so far, a sweep keeps its cells; then exit 143 (128 + SIGTERM), where it ended at
    once with nothing said and nothing written."""
    _TERMINATED[0] = True
    handler = signal.getsignal(signal.SIGINT)  # the search's own (agents.base noting_sigint), or Python's
    if callable(handler):
        handler(signal.SIGINT, frame)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _TERMINATED[0] = False
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped() -> str:
    return "terminated" if _TERMINATED[0] else "interrupted"


def _stop_code() -> int:
    return 143 if _TERMINATED[0] else 130  # 128 + the signal's number


def _interrupted(as_json: bool = False) -> SystemExit:
    err.print(_stopped())
    return _failed(_stopped(), _stop_code(), as_json)


def _failed(message: str, code: int, as_json: bool) -> SystemExit:
    """The exit for a failure whose message is on stderr; with --json also one object on stdout, so that a script
    reading it gets one (stdout was empty). A command that printed its own object first (search's, maxbatch's
    and sweep's, then exit 1 or 130) raises its SystemExit itself: that one does not come here."""
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}), flush=True)
    return SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ``--debug`` anywhere shows tracebacks; user errors exit with code 2."""
    global _DEBUG
    args = list(sys.argv[1:] if argv is None else argv)
    _DEBUG = "--debug" in args
    args = [a for a in args if a != "--debug"]
    note_sigint(False)  # this command's own Ctrl-C only (tests run several commands in one process)
    with _sigterm_as_interrupt(), noting_sigint():
        _main(args)


def _main(args: list[str]) -> None:
    as_json = "--json" in args
    try:
        with warnings.catch_warnings():
            if not _DEBUG:  # a warning is one line on stderr, as errors are (--debug: Python's, with its source)
                warnings.showwarning = _one_line_warning
            code = app(args, prog_name="autotune", standalone_mode=False)
    except AutotuneError as e:
        if _DEBUG:  # the traceback, then the error as without --debug: its exit code and --json object too
            traceback.print_exc()
        # The message as it is: a key such as ``d1.0#0.0:Cat`` is no emoji code, ``[x]`` no markup.
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True, emoji=False)
        raise _failed(str(e), 2, as_json) from None
    except KeyboardInterrupt:
        raise _interrupted(as_json) from None
    except SystemExit as e:
        # The reader went away (`autotune models | head`): not an error. click answers a broken pipe with exit 1.
        if e.code == 1 and isinstance(e.__context__, BrokenPipeError):
            _reader_gone()
        raise
    except BrokenPipeError:  # the same, where click did not see it
        _reader_gone()
    except Exception as e:  # click's own usage errors carry their exit code (2)
        if (from_interrupt(e) or sigint_arrived()) and not _DEBUG:  # a Ctrl-C that a library turned into another error
            raise _interrupted(as_json) from None
        if _is_click(e, "UsageError"):  # a value of the wrong type, an unknown option: one line, as ours
            if e.format_message():  # type: ignore[attr-defined]  # (none: the help was shown, no command given)
                message = _usage_error(e, args)
                err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
                raise _failed(message, e.exit_code, as_json) from None  # type: ignore[attr-defined]
            raise SystemExit(e.exit_code) from None  # type: ignore[attr-defined]
        if _is_click(e, "ClickException"):
            e.show()  # type: ignore[attr-defined]
            raise _failed(e.format_message(), e.exit_code, as_json) from None  # type: ignore[attr-defined]
        if _is_click(e, "Exit"):
            raise SystemExit(e.exit_code) from None  # type: ignore[attr-defined]
        if _is_click(e, "Abort"):
            raise SystemExit(1) from None
        if _DEBUG:
            traceback.print_exc()
        err.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} ("
            + ("" if _DEBUG else "rerun with --debug for the traceback, and ")
            + "please report it)",
            highlight=False,
            soft_wrap=True,
            emoji=False,
        )
        raise _failed(f"internal error: {type(e).__name__}: {e}", 1, as_json) from None
    # Not standalone, typer returns an ``Exit``'s code instead of raising it, and turns a Ctrl-C outside our
    # own handling (tracing, a command's setup) into ``Exit(130)``: returned, it would end the process with 0.
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        if code == 130:
            raise _interrupted(as_json)
        raise SystemExit(code)


if __name__ == "__main__":
    main()
