"""`autotune train`: real training iterations under a policy, measured beside the simulator's prediction."""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from autotune.models import build_model
from autotune.units import format_bytes
from autotune.workloads import TraceRequest, check_sizes, trace_model
from envs.simulator import Simulator, compiled_twin
from runtime.apply import PolicyRuntime
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile, calibrate_cpu, detect
from runtime.measure import IterationMeasurement, capped_memory, run_iterations
from runtime.policy import Policy, load_policy
from runtime.target import allocate_library_workspaces
from runtime.trace import make_optimizer
from runtime.vocab import Action
from runtime.workload import Workload


@dataclass
class TrainReport:
    model: str
    batch_size: int
    device: str
    profile: str
    steps: list[IterationMeasurement]
    predicted: dict[str, float]
    unknown_keys: list[str]
    out_of_memory: str | None = None
    out_of_memory_iteration: int | None = None  # where it ran out: 1 is the warm-up, then the measured steps
    expandable_segments: bool = False  # --expandable-segments: the allocator's setting, and the model's (A8-A11)
    expandable_in_effect: bool | None = None  # what the allocator reports it runs with (None: not known)
    compiled: str | None = None  # --compile: the backend the policy ran under (runtime/compiled.py)
    compile_report: dict[str, int] | None = None  # applied / changed / dropped decisions under compile
    budget_bytes: int | None = None  # the policy's budget (CUDA: the device is capped at it; the CPU: checked)
    # The profile the policy was searched on and what it planned there, where it is not this run's (a GPU's
    # plan trained on the CPU: the run said only "cpu profile", a QA run)
    planned_for: str | None = None
    planned: dict[str, float] | None = None
    # The torch.compile backend the policy was planned for (its ``compile_backend`` field) where this run trained it
    # eagerly: the prediction is the eager runtime's, which is not what the search scored
    planned_compiled: str | None = None

    def medians(self) -> dict[str, float]:
        if not self.steps:
            return {}
        iter_s = statistics.median(s.iter_s for s in self.steps)
        samples = self.steps[0].samples_per_s * self.steps[0].iter_s  # per iteration
        out = {
            "peak_bytes": statistics.median_low(s.peak_bytes for s in self.steps),  # a measured one, in bytes
            "iter_s": iter_s,
            # of the median time: the median of each step's samples/s is not the samples a median step makes
            "samples_per_s": samples / iter_s,
        }
        reserved = [s.reserved_bytes for s in self.steps if s.reserved_bytes is not None]
        if reserved:  # CUDA: the caching allocator's reserved peak
            out["reserved_bytes"] = statistics.median_low(reserved)
        return out

    def to_dict(self) -> dict[str, Any]:
        measured = self.medians()
        error = {k: (self.predicted[k] - v) / v for k, v in measured.items() if v and k in self.predicted}
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "profile": self.profile,
            "measured": measured,
            "predicted": self.predicted,
            "prediction_error": error,  # relative, (predicted - measured) / measured ("error" is a failure's key)
            "iterations": [s.to_dict() for s in self.steps],
            # CUDA: the allocator's retries within the budget's cap over the measured steps (runtime.measure)
            "alloc_retries": _total(s.alloc_retries for s in self.steps),
            "segments_freed": _total(s.segments_freed for s in self.steps),
            "unknown_keys": self.unknown_keys,
            "out_of_memory": self.out_of_memory,
            "out_of_memory_iteration": self.out_of_memory_iteration,
            "expandable_segments": self.expandable_segments,
            "expandable_in_effect": self.expandable_in_effect,
            "compiled": self.compiled,
            "compile_report": self.compile_report,
            "budget_bytes": self.budget_bytes,
            "planned_for": self.planned_for,
            "planned": self.planned,
            "planned_compiled": self.planned_compiled,
            "within_budget": (
                measured["peak_bytes"] <= self.budget_bytes if measured and self.budget_bytes is not None else None
            ),
        }


def _total(counts: Iterable[int | None]) -> int | None:
    """The sum of per-step counts, None where none was counted (not CUDA)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"  # read first by newer torch (2.14) where it is set
EXPANDABLE = "expandable_segments:True"


def enable_expandable_segments(device: str, environ: MutableMapping[str, str] | None = None) -> None:
    """``expandable_segments:True`` appended to ``PYTORCH_CUDA_ALLOC_CONF`` (an ``expandable_segments`` setting
    already there replaced; ``PYTORCH_ALLOC_CONF`` too where it is set, since newer torch reads it first). The
    caching allocator reads its configuration once, when CUDA initialises: so this must come before."""
    env = os.environ if environ is None else environ
    if not device.startswith("cuda"):
        raise AutotuneError(
            f"--expandable-segments with --device {device}: it is a setting of PyTorch's CUDA caching allocator; "
            "use --device cuda (or drop --expandable-segments)"
        )
    if torch.cuda.is_initialized():
        raise AutotuneError(
            "--expandable-segments: CUDA is already initialised in this process, so the caching allocator has read "
            f"{ALLOC_CONF} already; call autotune train before anything uses CUDA, or set "
            f"{ALLOC_CONF}={EXPANDABLE} before the process starts"
        )
    env.update(with_expandable_segments(env))


def with_expandable_segments(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables of ``env`` with ``expandable_segments:True`` appended (for this process, or a
    child process's environment)."""
    out = {}
    for name in (ALLOC_CONF, ALLOC_CONF_NEW):
        if name == ALLOC_CONF or name in env:
            kept = [kv for kv in env.get(name, "").split(",") if kv.strip() and not _is_expandable_setting(kv)]
            out[name] = ",".join([*kept, EXPANDABLE])
    return out


def _is_expandable_setting(kv: str) -> bool:
    return kv.split(":", 1)[0].strip() == "expandable_segments"


def expandable_in_effect() -> bool | None:
    """Whether the caching allocator runs with expandable segments, from its settings where this torch says
    (``torch._C._accelerator_getAllocatorSettings``, 2.14); None where it does not."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None:
        return None
    values = [kv.split(":", 1)[1].strip().lower() for kv in str(get()).split(",") if _is_expandable_setting(kv)]
    return bool(values) and values[-1] == "true"


def default_device(policy: Policy) -> str:
    """``--device`` left out: the GPU where the policy was planned for one and CUDA is here, else the CPU (a
    policy searched on the detected GPU trained on the CPU by default, minutes a step)."""
    return "cuda" if policy.hardware != "cpu" and torch.cuda.is_available() else "cpu"


def _profile_for(device: str) -> HardwareProfile:
    """This device's profile, with this host's runtime costs measured (the CPU profile's always are; a GPU's as
    `autotune search` measures them when it plans for this machine's GPU)."""
    if device == "cpu":
        return calibrate_cpu()
    found = detect()
    if found.profile is None:
        raise AutotuneError(f"no hardware profile for this GPU ({found.message}); the prediction needs one")
    from autotune.search import with_local_host_costs

    return with_local_host_costs(found.profile, device)[0]


def train(
    policy_path: Path,
    *,
    model: str | None,
    batch_size: int | None,
    steps: int,
    device: str | None,
    precision: str | None = None,
    grad_accum: int | None = None,
    optimizer: str | None = None,
    expandable_segments: bool = False,
    compile_backend: str | None = None,
    compiled: bool = False,
) -> TrainReport:
    """``precision``, ``grad_accum`` and ``optimizer`` None: the policy's (sgd for a file without an optimizer);
    other ones are refused by the policy check.
    ``expandable_segments``: the caching allocator runs with ``expandable_segments:True`` (set here, before
    CUDA initialises) and the reserved bytes are predicted with the matching model (A8-A11).
    ``compile_backend``: the model runs under ``torch.compile`` with that backend and the policy through
    ``policy.compiled`` (NOTE [ Compiled policies ]); the prediction is the simulator's twin of the compiled
    step (Rule 16) for the decisions the compiled graph applies. ``compiled`` without a backend (``--compile``
    alone): the one the policy was planned for, else inductor."""
    if steps <= 0:
        raise AutotuneError(f"invalid --steps {steps}: expected a positive number of iterations, e.g. --steps 3")
    if expandable_segments and device is not None:  # before anything else: the file need not be read for this
        enable_expandable_segments(device)
    policy = load_policy(policy_path)
    if policy.hardware.strip().lower() != "cpu":  # a name no profile has (edited by hand): simulate refuses it too
        from runtime.hardware import get_profile

        try:
            get_profile(policy.hardware)
        except AutotuneError as e:
            raise AutotuneError(f"{policy_path}: hardware: {e}") from None
    if device is None:
        device = default_device(policy)
        if expandable_segments:
            enable_expandable_segments(device)
    if compiled and compile_backend is None:
        compile_backend = policy.compile_backend or "inductor"
    if compile_backend is not None:
        from runtime.compiled import check_backend

        check_backend(compile_backend)
        refuse_uncompilable(policy, source=str(policy_path))
    name = model or policy.model
    batch = batch_size if batch_size is not None else policy.batch_size
    check_sizes(name, policy.seq_len, policy.image_size, source=str(policy_path))
    req = TraceRequest(
        model=name,
        batch_size=batch,
        seq_len=policy.seq_len,
        image_size=policy.image_size,
        mode="real",
        device=device,
        precision=precision or policy.precision,
        grad_accum=grad_accum if grad_accum is not None else policy.grad_accum,
        optimizer=optimizer or policy.optimizer or "sgd",
        partitions=policy.partitions,
    )
    req.validate()
    policy.check_settings(batch_size=batch, seq_len=req.seq_len, image_size=req.image_size, precision=req.precision,
                          grad_accum=req.grad_accum, optimizer=req.optimizer, source=str(policy_path))  # fmt: skip
    check_structure(policy, req, source=str(policy_path))
    # A real-mode trace on this device: it checks the policy against the model before any training, and
    # its measured op times make the prediction for this very device.
    w, _ = trace_model(req)
    policy.check_against(w, source=str(policy_path))
    hw = _profile_for(device)
    return run_policy(
        policy,
        w,
        hw,
        name=name,
        batch=batch,
        steps=steps,
        device=device,
        expandable_segments=expandable_segments,
        compile_backend=compile_backend,
    )


def refuse_uncompilable(policy: Policy, *, source: str) -> None:
    """--compile: refuse before tracing a policy that swaps, compresses or partitions (C5 in
    runtime/compiled.py), which only the eager runtime applies."""
    if policy.partitions:
        raise AutotuneError(
            f"{source} partitions {', '.join(str(p) for p in policy.partitions)}, which torch.compile cannot apply: "
            "train it without --compile, or search without --allow-partition"
        )
    counts = policy.counts()
    if counts[Action.SWAP] or counts[Action.COMPRESS]:
        raise AutotuneError(
            f"{source} swaps {counts[Action.SWAP]} and compresses {counts[Action.COMPRESS]} tensors, which "
            "torch.compile cannot apply (only keep and recompute): search with `autotune search --compile`, or "
            "train it without --compile"
        )


def check_structure(policy: Policy, req: TraceRequest, *, source: str) -> None:
    """Refuse a policy made for another model before tracing it for real (runtime R12): the model is built
    under FakeTensorMode (parameters of the right shapes, no memory, no time) and its parameters compared
    with those the policy recorded. Policies from before they were recorded are checked by the trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runtime.apply import check_model
    from runtime.trace import fake_deepcopy

    if policy.parameter_fingerprint is None:
        return
    try:
        with FakeTensorMode(), fake_deepcopy():
            entry = build_model(req.model, batch_size=req.batch_size, seq_len=req.seq_len, image_size=req.image_size)
    except AutotuneError:
        # A factory that fake tensors cannot build (one that reads values while it builds, as an orthogonal
        # parametrization does; a module moved to channels_last): the trace builds it for real and checks the
        # policy there, and the runtime its parameters (R12) before the first step.
        return
    try:
        check_model(policy, entry.module)
    except AutotuneError as e:
        raise AutotuneError(f"{source}: {e}") from None


def run_policy(
    policy: Policy,
    w: Workload,
    hw: HardwareProfile,
    *,
    name: str,
    batch: int,
    steps: int,
    device: str,
    expandable_segments: bool = False,
    compile_backend: str | None = None,
) -> TrainReport:
    # Under torch.compile the simulator's twin of the compiled step (Rule 16): no regions, no runtime host costs.
    sim_w, sim_hw = (w, hw) if compile_backend is None else compiled_twin(w, hw, compile_backend)
    predicted = Simulator(sim_w, sim_hw).run(policy)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # what the trace left cached: the reserved bytes measured are the training's
        allocate_library_workspaces(torch.device(device))  # runtime R15, before the model: segments of their own
    entry = build_model(name, batch_size=batch, seq_len=policy.seq_len, image_size=policy.image_size, device=device)
    opt = make_optimizer(w.optimizer, entry.module.parameters())
    rt = PolicyRuntime(policy, entry.module) if compile_backend is None else None
    cm = policy.compiled(entry.module, backend=compile_backend) if compile_backend is not None else None
    report = TrainReport(
        name,
        batch,
        device,
        hw.name,
        [],
        {
            "peak_bytes": predicted.peak_bytes,
            "iter_s": predicted.iter_s,
            "samples_per_s": predicted.samples_per_s,
        },
        [],
        expandable_segments=expandable_segments,
        budget_bytes=policy.budget_bytes,
    )
    if policy.hardware != hw.name:
        report.planned_for = policy.hardware
        if policy.predicted is not None:
            pp = policy.predicted
            report.planned = {"peak_bytes": pp.peak_bytes, "iter_s": pp.iter_s, "samples_per_s": pp.samples_per_s}
    if device.startswith("cuda") and hw.is_gpu:  # the caching allocator's model (NOTE [ Reserved budget ])
        from envs.allocator import policy_stats

        vec = policy.to_vector(w)
        stats = policy_stats(sim_w, hw, vec, policy.options, expandable_segments=expandable_segments)
        report.predicted["reserved_bytes"] = stats.peak_reserved
    if expandable_segments:
        report.expandable_in_effect = expandable_in_effect()
    loss_fn = entry.loss_fn
    if cm is not None:
        report.compiled = str(compile_backend)

        def loss_fn(_model: torch.nn.Module, b: Any) -> torch.Tensor:  # the compiled model, the same parameters
            return entry.loss_fn(cm, b)

    calls = 0  # forwards begun: where an out-of-memory error came, in iterations
    measured_loss = loss_fn

    def counted(model: torch.nn.Module, b: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return measured_loss(model, b)

    try:
        with capped_memory(device, policy.budget_bytes):  # the budget enforced: what the allocator reserves
            report.steps = run_iterations(
                entry.module,
                entry.batch,
                counted,
                opt,
                steps=steps,
                batch_size=batch,
                around_step=rt.step if rt is not None else None,
                precision=w.precision,
                grad_accum=w.grad_accum,
                cpu_peak="tracker" if cm is None else "profiler",
            )
    except torch.OutOfMemoryError as e:  # over budget: a result, not a crash
        report.out_of_memory = str(e).splitlines()[0]
        report.out_of_memory_iteration = (max(calls, 1) - 1) // w.grad_accum + 1
    report.unknown_keys = list(rt.stats.unknown_keys) if rt is not None else []
    if cm is None and policy.compile_backend is not None:
        report.planned_compiled = policy.compile_backend
    if cm is not None:  # predict what the compiled graph applies: the changed decisions, as changed
        r = cm.report
        report.compile_report = {"applied": len(r.applied), "changed": len(r.changed), "dropped": len(r.dropped)}
        if r.changed:
            actions = dict(policy.actions)
            actions.update({k: got for k, (_, got, _) in r.changed.items()})
            effective = dataclasses.replace(policy, actions=actions)
            sim = Simulator(sim_w, sim_hw).run(effective)
            report.predicted.update(
                {"peak_bytes": sim.peak_bytes, "iter_s": sim.iter_s, "samples_per_s": sim.samples_per_s}
            )
    return report


def render(out: Console, report: TrainReport) -> None:
    """`autotune train`'s table: each step measured, the median, the prediction and the error."""
    if report.out_of_memory:
        at = report.out_of_memory_iteration
        where = (
            ""
            if at is None
            else (" in the warm-up iteration" if at == 1 else f" in iteration {at} (the first is the warm-up)")
        )
        out.print(f"[red]out of memory at the policy's budget{where}:[/] {report.out_of_memory}")
    table = Table(title=f"{report.model}, batch {report.batch_size}, on {report.device} ({report.profile} profile)")
    for col in ("", "peak", "iteration", "samples/s"):
        table.add_column(col, justify="left" if not col else "right")
    for i, s in enumerate(report.steps):
        table.add_row(
            f"step {i + 1}", format_bytes(s.peak_bytes), f"{s.iter_s * 1e3:.1f} ms", f"{s.samples_per_s:,.2f}"
        )
    d = report.to_dict()
    m, p, e = d["measured"], d["predicted"], d["prediction_error"]
    if m:
        table.add_row(
            "median",
            format_bytes(m["peak_bytes"]),
            f"{m['iter_s'] * 1e3:.1f} ms",
            f"{m['samples_per_s']:,.2f}",
            style="bold",
        )
    table.add_row(
        "predicted", format_bytes(p["peak_bytes"]), f"{p['iter_s'] * 1e3:.1f} ms", f"{p['samples_per_s']:,.2f}"
    )
    if e:
        row = (f"{e['peak_bytes']:+.1%}", f"{e['iter_s']:+.1%}", f"{e['samples_per_s']:+.1%}")
        table.add_row("prediction error", *row)
    out.print(table)
    if report.planned_for is not None:
        there = (
            f" ({format_bytes(report.planned['peak_bytes'])} at {report.planned['samples_per_s']:,.1f} samples/s there)"
            if report.planned
            else ""
        )
        out.print(
            f"the policy was planned for {report.planned_for}{there}; this run is on {report.device}, so its "
            f"prediction is the {report.profile} profile's for the same decisions",
            highlight=False,
        )
    if d["within_budget"] is not None:
        budget, peak = report.budget_bytes or 0, m["peak_bytes"]
        if d["within_budget"]:
            out.print(f"budget {format_bytes(budget)}: the measured peak fits ({format_bytes(budget - peak)} free)")
        else:
            out.print(
                f"[red]budget {format_bytes(budget)}: the measured peak is {format_bytes(peak - budget)} over it[/]"
                + ("" if report.device.startswith("cuda") else " (nothing caps the memory on the CPU)")
            )
    if "reserved_bytes" in m and "reserved_bytes" in p:
        how = " with expandable_segments:True" if report.expandable_segments else ""
        out.print(
            f"reserved by PyTorch's caching allocator{how}: {format_bytes(m['reserved_bytes'])} measured, "
            f"{format_bytes(p['reserved_bytes'])} by its model ({e.get('reserved_bytes', 0.0):+.1%})"
        )
    if d["alloc_retries"] or d["segments_freed"]:  # as the measured search counts them (autotune.real_backend)
        out.print(
            f"[yellow]the caching allocator ran out of room within the budget in {len(report.steps)} steps and "
            f"freed {d['segments_freed']} cached segments to go on ({d['alloc_retries']} times all it held; each "
            "cudaFree a device synchronisation): steps run slower than planned; a policy searched with "
            "--budget-kind reserved (a simulated search's default on a GPU profile) leaves the allocator its room[/]"
        )
    if report.expandable_in_effect is False:
        out.print("[yellow]the caching allocator reports expandable_segments off: this torch or platform ignored it[/]")
    if report.unknown_keys:
        out.print(f"[yellow]{len(report.unknown_keys)} saved tensors not in the policy were kept[/]")
    if report.planned_compiled is not None:
        out.print(
            f"[yellow]the policy was planned for torch.compile ({report.planned_compiled}) and trained eagerly "
            "here, as the eager runtime runs it (predicted so): add --compile to train it as planned[/]"
        )
    if report.compiled is not None and report.compile_report is not None:
        c = report.compile_report
        out.print(
            f"under torch.compile ({report.compiled}): {c['applied']} decisions applied, {c['changed']} changed "
            f"(predicted as changed), {c['dropped']} dropped"
        )
        if report.device == "cpu":
            out.print(
                "the CPU peak of compiled code comes from the allocator's events between ops (kernel scratch left "
                "out, as the plan leaves it: runtime.measure, NOTE [ Device memory on the CPU ])"
            )
