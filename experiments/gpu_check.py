"""The CUDA checks, as one prepared script for a GPU machine (nothing here runs without CUDA).

    python experiments/gpu_check.py [--out DIR] [--quick] [--budget-s 450]

In order, each step bounded in time, the whole run meant to fit in 8 minutes on an H200:

1. tests/test_cuda.py: bit-identical gradients for every policy kind, later steps included; pinned
   buffers; the allocator's peak against the simulator. A failure makes the script exit non-zero.
2. What runtime R15 allocates for cuBLAS's workspaces against the plan's (runtime/target.py G6), then the
   runtime's host costs on this GPU's host (runtime/host_costs.py), for the built-in GPU profiles.
3. experiments/bench_runtime.py --device cuda for ResNet-50 at batch 64 and GPT-2 small at 8 x 1024:
   hooks against plain PyTorch, per-block recompute against torch.utils.checkpoint, predicted against
   measured peak and time for six policies on the detected profile (a real-mode CUDA trace), and where a
   recompute step's time goes (its section 4: phases on the device's clock, kernels against idle time).
4. End to end, as a user runs it: ``autotune search --gpu <detected>`` (the plan is for this GPU, so a
   real-mode CUDA trace, 30 s of search, then the default ``--measure 5``: the finalists trained on the GPU,
   NOTE [ Measured search ]) then ``autotune train --device cuda`` under the answer: predicted against
   measured samples/s and peak, and the measured peak against the budget.
5. Traces against the allocator: for ResNet-50 b64, GPT-2 small 8 x 1024, BERT-base 8 x 512 and ViT-B/16 b32
   in fp32, and GPT-2 small and the user-model Llama in bf16 (autocast: G5 in runtime/target.py; its row
   says ``precision``),
   the no-policy peak of a fake-mode trace taken for this GPU's profile (NOTE [ GPU-faithful fake traces ]
   in runtime/target.py) and of a real-mode CUDA trace against the allocator's, and their saved keys: the
   keys one has and the other lacks are printed, and ``traces.json`` keeps, per model, the real trace's
   peak, op count and every saved key with its size (the fixture tests/test_target.py compares fake traces
   with, on a machine without a GPU). The same run records every request the caching allocator got (a
   memory snapshot, kept as JSON in ``traces.json``) and its reserved peak (``max_memory_reserved``), and
   prints the allocator's model (envs/allocator.py) replaying those requests, and on the fake and real
   traces, against it. For ResNet-50 and GPT-2 the same under four policies (keep, swap, recompute, a random
   mix; applied by the runtime, planned on the real trace): the simulator's peak against
   ``max_memory_allocated``, and the allocator's model under the policy (``envs.allocator.policy_stats``,
   NOTE [ Reserved budget ]) against ``max_memory_reserved`` (target: within 3%), the requests kept in
   ``traces.json`` (issue "Memory as the allocator holds it", item 3), each run as ``autotune train`` runs it.
   For convolutional models, each convolution's workspace by its signature (``conv_workspaces``: cuDNN's,
   which no fake trace can know).
6. Expandable segments: in a fresh process (the allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` when CUDA
   initialises) with ``expandable_segments:True`` appended to it, ResNet-50 b64 under keep and a random mix as
   in step 5: the allocator's model of that setting (A8-A11 in envs/allocator.py) against
   ``max_memory_reserved``, and the model replaying the recorded requests, in ``expandable.json``. The same
   child runs on the CPU as a dry run of its code (``--expandable-child resnet18 --batch 2 --device cpu``).
7. Partition (runtime/partition.py), as step 4 with ``--partition features/4``: VGG-16 b64 searched within
   3 GB (below its unpartitioned floor) and trained on the GPU: the slices' planned peak and samples/s
   against the allocator's and the clock's, in ``partition.json``.
8. torch.compile (runtime/compiled.py), as step 4 with ``--compile`` on ``search`` and ``train``: ResNet-50
   b64 within 3 GB planned for compiled training (keep and recompute), one finalist trained compiled by the
   search (``--measure 1``: a compile takes minutes), the answer trained under inductor on the GPU: planned
   against measured peak and samples/s (the simulator does not model inductor's memory: on the CPU its
   channels-last weight copies held 5.4% over the plan on ResNet-18), and how many decisions the compiled
   graph applied, in ``compiled.json``. (GPT-2 does not compile as one graph on torch 2.11.)

Figures go to stdout and, as JSON fixtures, to ``--out`` (default ``$OUT``, else ``gpu-check/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
E2E = [  # model, batch, seq_len, budget
    ("resnet50", 64, None, "3GB"),
    ("gpt2", 8, 1024, "8GB"),
]
TRACED = [  # step 5: model, batch, seq_len, precision
    *[(m, b, s, "fp32") for m, b, s, _ in E2E],
    ("bert-base", 8, 512, "fp32"),
    ("vit_b_16", 32, None, "fp32"),
    ("gpt2", 8, 1024, "bf16"),
    ("experiments.user_models:tiny_llama", None, None, "bf16"),  # G5 then G1: rotary q, k in fp32 under autocast
]
EXPANDABLE = ("resnet50", 64, None)  # step 6: model, batch, seq_len
PARTITION = ("vgg16", 64, None, "3GB", ["--partition", "features/4"])  # step 7: as E2E, and search's options
COMPILED = ("resnet50", 64, None, "3GB", ["--compile", "--measure", "1"])  # step 8: as E2E, search's options
STEPS = ("tests", "host", "bench", "e2e", "traces", "expandable", "partition", "compiled")  # --only's names


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def run(
    cmd: list[str], timeout: float, out: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str] | None:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=max(5.0, timeout), capture_output=True, text=True, env=env)
    except subprocess.TimeoutExpired as e:
        print((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or "", flush=True)
        print(f"(stopped after {timeout:.0f} s)", flush=True)
        return None
    print(proc.stdout[-6000:], flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], flush=True)
    if out is not None:
        out.write_text(proc.stdout)
    return proc


def host_costs(out: Path) -> None:
    """Step 2, and first of all (nothing has used cuBLAS in this process yet): what runtime R15 allocates
    for cuBLAS's workspaces against what the plan holds for them (runtime/target.py G6)."""
    from runtime.host_costs import calibrate
    from runtime.target import CUBLAS_HANDLES, allocate_library_workspaces, cublas_workspace_bytes

    before = torch.cuda.memory_allocated()
    allocate_library_workspaces(torch.device("cuda"))
    workspaces = torch.cuda.memory_allocated() - before
    planned = CUBLAS_HANDLES * cublas_workspace_bytes(
        torch.cuda.get_device_capability(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    )
    print(f"\ncuBLAS workspaces (runtime R15): {workspaces / 2**20:.3f} MiB allocated, the plan's (G6) "
          f"{planned / 2**20:.3f} MiB", flush=True)  # fmt: skip
    costs = calibrate("cuda", 4.0)
    print("host costs on this GPU's host:", costs, flush=True)
    row = {**costs.__dict__, "cublas_workspace_bytes": workspaces, "planned_workspace_bytes": planned}
    (out / "host_costs.json").write_text(json.dumps(row, indent=2))


def end_to_end(
    model: str,
    batch: int,
    seq: int | None,
    budget: str,
    out: Path,
    clock: Clock,
    extra: tuple[str, ...] = (),
    train_extra: tuple[str, ...] = (),
    search_s: float = 120.0,
) -> dict[str, Any]:
    from runtime.hardware import detect

    profile = detect().profile
    if profile is None:
        return {"error": "no built-in profile for this GPU"}
    policy = out / f"{model}-b{batch}.{profile.name}.policy.json"
    search = [sys.executable, "-m", "autotune.cli", "search", "--model", model, "--batch-size", str(batch),
              "--budget", budget, "--gpu", profile.name, "--timeout", "30", "--out", str(policy), "--json",
              "--storage", f"sqlite:///{Path(os.environ.get('TMPDIR', '/tmp')) / 'gpu-check-e2e.db'}"]  # fmt: skip
    if seq:
        search += ["--seq-len", str(seq)]
    search += list(extra)
    found = run(search, min(search_s, clock.left()))
    if found is None or found.returncode != 0 or not policy.exists():
        return {"error": "search failed"}
    plan = json.loads(found.stdout)
    train = [sys.executable, "-m", "autotune.cli", "train", "--policy", str(policy), "--device", "cuda",
             "--steps", "6", "--json", *train_extra]  # fmt: skip
    trained = run(train, min(180.0, clock.left()))
    if trained is None or trained.returncode != 0:
        return {"error": "train failed", "planned": plan}
    got = json.loads(trained.stdout)
    row = {
        "model": model, "batch": batch, "seq_len": seq, "budget_bytes": plan.get("budget_bytes"),
        "planned_peak_bytes": plan.get("peak_bytes"), "planned_samples_per_s": plan.get("samples_per_s"),
        "measured": got.get("measured"), "predicted": got.get("predicted"),
        "prediction_error": got.get("prediction_error"),
        "out_of_memory": got.get("out_of_memory"), "out_of_memory_iteration": got.get("out_of_memory_iteration"),
        "search_measured": plan.get("measured"),
        "finalists": plan.get("finalists"), "compile_report": got.get("compile_report"),
        "alloc_retries": got.get("alloc_retries"), "segments_freed": got.get("segments_freed"),
    }  # fmt: skip
    written = json.loads(policy.read_text())  # how its recomputes run: regions (nodes or checkpointed), replays
    row["regions"] = len((written.get("schedule") or {}).get("regions") or [])
    row["region_nodes"] = (written.get("options") or {}).get("region_nodes")
    row["recomputed"] = sum(1 for a in written.get("actions", {}).values() if a == "recompute")
    f = plan.get("finalists") or {}
    if f.get("finalists"):
        print(
            f"   {model}: measured search: {len(f['finalists'])} finalists, answer #{f.get('chosen')}, time scale "
            f"{f.get('time_scale')}, plan time error {f.get('plan_time_error')} -> {f.get('plan_time_error_scaled')} "
            "scaled by the other finalists",
            flush=True,
        )
    measured = got.get("measured") or {}
    if measured and plan.get("samples_per_s"):
        ratio = measured["samples_per_s"] / plan["samples_per_s"]
        fits = measured["peak_bytes"] <= (plan.get("budget_bytes") or float("inf"))
        print(
            f"   {model}: planned {plan['samples_per_s']:.1f} samples/s at {plan['peak_bytes'] / 2**30:.3f} GiB; "
            f"trained {measured['samples_per_s']:.1f} ({ratio:.2f}x, target >= 0.90) at "
            f"{measured['peak_bytes'] / 2**30:.3f} GiB ({'within' if fits else 'over'} the budget); the allocator "
            f"retried {got.get('alloc_retries')} times within the cap ({got.get('segments_freed')} segments freed); "
            f"{row['recomputed']} tensors recomputed, {row['regions']} regions "
            f"({'as nodes' if row['region_nodes'] else 'checkpointed'})",
            flush=True,
        )
    return row


def fake_vs_allocator(model: str, batch: int, seq: int | None, precision: str = "fp32") -> dict[str, Any]:
    from autotune.models import build_model
    from autotune.workloads import TraceRequest, trace_model
    from envs.allocator import no_policy_stats
    from runtime.hardware import detect
    from runtime.measure import run_iterations
    from runtime.target import cublas_workspace_bytes
    from runtime.trace import make_optimizer
    from runtime.workload import peak_report

    hw = detect().profile
    g = hw.alloc_granularity_bytes if hw else 512
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: [])()  # 1 flash, 2 efficient, 0 math, 3 cuDNN
    print(f"== {model} batch {batch}" + (f" x {seq}" if seq else "") + f" {precision} (profile "
          f"{hw.name if hw else None}; SDPA "
          f"priority {[int(b) for b in order]})", flush=True)  # fmt: skip
    req = TraceRequest(model=model, batch_size=batch, seq_len=seq, precision=precision, target=hw)
    fake, _ = trace_model(req)
    real, _ = trace_model(dataclasses.replace(req, mode="real", device="cuda", target=None))
    # The allocator from a clean cache, every request recorded (NOTE [ CUDA caching allocator ]: its model
    # replays them, envs/allocator.py); the traces above left blocks cached, and a model of theirs that a
    # cycle still holds would count (BERT's first H200 recording held 0.5 GB more than its requests): what
    # the process holds at the start is kept with the requests (``held_before_bytes``: the cuBLAS workspaces,
    # and anything else left).
    gc.collect()
    torch.cuda.empty_cache()
    held_before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=1_000_000)  # no stacks: fast
    try:
        entry = build_model(model, batch_size=batch, seq_len=seq, device="cuda")
        opt = make_optimizer("sgd", entry.module.parameters())
        measured = run_iterations(entry.module, entry.batch, entry.loss_fn, opt, steps=2, batch_size=batch,
                                  precision=precision)[-1]  # fmt: skip
        reserved = torch.cuda.max_memory_reserved()  # over the last step, after the warm-up's
        requests = allocator_requests(torch.cuda.memory._snapshot())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    row: dict[str, Any] = {"model": model, "batch": batch, "seq_len": seq, "profile": hw.name if hw else None,
                           "torch": torch.__version__, "allocator_peak_bytes": measured.peak_bytes,
                           "allocator_reserved_peak_bytes": reserved, "held_before_bytes": held_before,
                           "requests": requests}  # fmt: skip
    replayed = replay_requests(requests)
    print(f"   held before the recording: {held_before / 2**20:.1f} MiB (the two cuBLAS workspaces: "
          f"{2 * cublas_workspace_bytes(torch.cuda.get_device_capability()) / 2**20:.1f} MiB)", flush=True)  # fmt: skip
    print(
        f"   reserved: allocator {reserved / 2**30:.3f} GiB; its model replaying the {len(requests)} recorded "
        f"requests {replayed.peak_reserved / 2**30:.3f} GiB ({(replayed.peak_reserved - reserved) / reserved:+.1%})",
        flush=True,
    )
    for name, w in (("fake", fake), ("real", real)):
        p = peak_report(w, g).peak_bytes
        modelled = no_policy_stats(w).peak_reserved
        row[name] = {"peak_bytes": p, "ops": len(w.ops), "saved": {c.key: c.nbytes for c in w.candidates},
                     "reserved_peak_bytes": modelled}  # fmt: skip
        print(f"   reserved, the allocator's model on the {name} trace: {modelled / 2**30:.3f} GiB "
              f"({(modelled - reserved) / reserved:+.1%})", flush=True)  # fmt: skip
        print(
            f"   no-policy peak, {name} trace: {p / 2**30:.3f} GiB; allocator {measured.peak_bytes / 2**30:.3f} GiB "
            f"({(p - measured.peak_bytes) / measured.peak_bytes:+.1%}); {len(w.ops)} ops, {len(w.candidates)} saved",
            flush=True,
        )
    only_fake = sorted(set(row["fake"]["saved"]) - set(row["real"]["saved"]))
    only_real = sorted(set(row["real"]["saved"]) - set(row["fake"]["saved"]))
    print(f"   saved keys only in the fake trace: {only_fake[:8]}{' ...' if len(only_fake) > 8 else ''} "
          f"({len(only_fake)}); only in the real one: {only_real[:8]}{' ...' if len(only_real) > 8 else ''} "
          f"({len(only_real)})", flush=True)  # fmt: skip
    row["real_plain_host_s"] = real.meta.get("plain_host_s")
    row["real_plain_iter_s"] = real.meta.get("plain_iter_s")
    # The plain model and its gradients would count in every policy's measured peak (the first H200 run's
    # policies measured +0.23 GiB on ResNet-50 and +0.93 GiB on GPT-2 over plain training for it).
    del entry, opt, measured
    torch.cuda.empty_cache()
    row["precision"] = precision
    if precision == "fp32" and any("Convolution" in k for k in row["real"]["saved"]):
        row["conv_workspaces"] = conv_workspaces(model, batch, seq)
    if (model, batch, seq) in [(m, b, s) for m, b, s, _ in E2E] and hw is not None and precision == "fp32":
        row["policies"] = policy_allocator(model, batch, seq, real, hw)
    return row


def policy_allocator(
    model: str,
    batch: int,
    seq: int | None,
    w: Any,
    hw: Any,
    device: str = "cuda",
    labels: tuple[str, ...] = ("keep", "swap", "recompute", "mixed"),
    expandable_segments: bool = False,
) -> dict[str, Any]:
    """Under keep, swap, recompute and a random mix (the runtime applying each, planned on ``w``; ``labels``
    of them): the simulator's peak against the allocator's, and the caching allocator's model under the policy
    (of ``expandable_segments:True`` or not, as the allocator runs) against the reserved peak, from a clean
    cache over two steps after the runtime's learning step. On ``device`` "cpu" (a dry run of this code)
    nothing is recorded."""
    import numpy as np

    from autotune.models import build_model
    from envs.allocator import ITERATIONS, policy_stats
    from envs.simulator import Simulator, uniform_actions
    from runtime.apply import PolicyRuntime
    from runtime.measure import run_iterations
    from runtime.policy import Action, Policy, PolicyOptions
    from runtime.trace import make_optimizer

    cuda = device == "cuda"
    k = len(w.candidates)
    vectors = {
        "keep": uniform_actions(w, Action.KEEP),
        "swap": uniform_actions(w, Action.SWAP),
        "recompute": uniform_actions(w, Action.RECOMPUTE),
        "mixed": np.random.default_rng(0).integers(0, 3, k).astype(np.int8),
    }
    sim = Simulator(w, hw)
    out: dict[str, Any] = {}
    for label, vec in ((k, v) for k, v in vectors.items() if k in labels):
        policy = Policy.from_vector(w, vec, hardware=hw.name, options=PolicyOptions())
        # As `autotune train` (and a training loop) runs it, and as the model replays it: from a clean cache, the
        # model built, the optimizer's state made in the first iteration (the runtime's learning step), then
        # ITERATIONS - 1 more; reserved bytes only grow uncapped, so the last peak is the run's. (Until this
        # round the first step ran before a cleared cache and the recording: the state then sat in segments
        # that no replay from a clean cache has, which moved the comparison by -10% to +16%.)
        requests: list[list[Any]] = []
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=1_000_000)
        try:
            entry = build_model(model, batch_size=batch, seq_len=seq, device=device)
            opt = make_optimizer("sgd", entry.module.parameters())
            rt = PolicyRuntime(policy, entry.module)
            steps = run_iterations(entry.module, entry.batch, entry.loss_fn, opt, steps=ITERATIONS - 1,
                                   batch_size=batch, around_step=rt.step)  # fmt: skip
            measured = steps[-1]
            reserved = torch.cuda.max_memory_reserved() if cuda else 0
            if cuda:
                requests = allocator_requests(torch.cuda.memory._snapshot())
        finally:
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
        planned = sim.run(vec, options=policy.options)
        modelled = policy_stats(w, hw, vec, policy.options, expandable_segments=expandable_segments)
        if requests:
            replayed = replay_requests(requests)
            print(f"   {label:9s} the model replaying the {len(requests)} recorded requests: "
                  f"{replayed.peak_reserved / 2**30:.3f} GiB reserved "
                  f"({(replayed.peak_reserved - reserved) / reserved:+.1%})", flush=True)  # fmt: skip
        out[label] = {"planned_peak_bytes": planned.peak_bytes, "allocator_peak_bytes": measured.peak_bytes,
                      "model_reserved_peak_bytes": modelled.peak_reserved,
                      "model_allocated_peak_bytes": modelled.peak_allocated,
                      "allocator_reserved_peak_bytes": reserved, "requests": requests}  # fmt: skip
        err = (modelled.peak_reserved - reserved) / reserved if reserved else float("nan")
        print(
            f"   {label:9s} peak planned {planned.peak_bytes / 2**30:.3f} GiB, allocator "
            f"{measured.peak_bytes / 2**30:.3f} GiB; reserved: model {modelled.peak_reserved / 2**30:.3f} GiB, "
            f"allocator {reserved / 2**30:.3f} GiB ({err:+.1%}, target within 3%)",
            flush=True,
        )
        del entry, opt, rt
        if cuda:
            torch.cuda.empty_cache()
    return out


def conv_workspaces(model: str, batch: int | None, seq: int | None, device: str = "cuda") -> list[dict[str, Any]]:
    """Each convolution of one training step (forward and backward) with what it allocated beyond its outputs
    (cuDNN's workspace, chosen by its algorithm: no fake trace can know it; issue "GPU-faithful traces" item 3),
    keyed by what decides it: the op, the input and weight shapes, stride, padding, dilation, groups, dtype. On
    ``device`` "cpu" a dry run (every workspace 0)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.models import build_model
    from runtime.trace import make_optimizer

    cuda = device.startswith("cuda")
    ops = {torch.ops.aten.convolution.default: "forward", torch.ops.aten.convolution_backward.default: "backward"}
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func not in ops:
                return func(*args, **kwargs)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = func(*args, **kwargs)
            ws = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() if cuda else 0
            # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
            # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, ...)
            shift = 1 if ops[func] == "backward" else 0
            x, w = args[shift], args[shift + 1]
            stride, padding, dilation = args[shift + 3 : shift + 6]
            groups = args[shift + 8]
            key = (ops[func], tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), tuple(dilation),
                   int(groups), str(x.dtype))  # fmt: skip
            row = rows.setdefault(key, {"op": key[0], "input": key[1], "weight": key[2], "stride": key[3],
                                        "padding": key[4], "dilation": key[5], "groups": key[6], "dtype": key[7],
                                        "workspace_bytes": 0, "calls": 0})  # fmt: skip
            row["workspace_bytes"] = max(row["workspace_bytes"], int(ws))
            row["calls"] += 1
            return out

    entry = build_model(model, batch_size=batch, seq_len=seq, device=device)
    opt = make_optimizer("sgd", entry.module.parameters())
    for _ in range(2):  # the second: cuDNN's choices made, what training runs from then on
        rows.clear()
        opt.zero_grad(set_to_none=True)
        with Recorder():
            entry.loss_fn(entry.module, entry.batch).backward()
        opt.step()
    del entry, opt
    if cuda:
        torch.cuda.empty_cache()
    out = list(rows.values())
    total = sum(r["workspace_bytes"] * r["calls"] for r in out)
    print(f"   convolutions: {len(out)} signatures, the largest workspace "
          f"{max((r['workspace_bytes'] for r in out), default=0) / 2**20:.1f} MiB, {total / 2**30:.2f} GiB "
          "allocated and freed a step", flush=True)  # fmt: skip
    return out


def allocator_requests(snapshot: dict[str, Any]) -> list[list[Any]]:
    """The program's requests in a memory snapshot's trace, in order: ["alloc", address, bytes asked, stream]
    and ["free", address, 0, stream] (when the block returns to the allocator)."""
    out: list[list[Any]] = []
    for e in snapshot["device_traces"][0]:
        if e["action"] in ("alloc", "free_completed"):
            out.append(["alloc" if e["action"] == "alloc" else "free", e["addr"], e["size"], e["stream"]])
    return out


def expandable_child(model: str, batch: int, seq: int | None, device: str = "cuda") -> dict[str, Any]:
    """Step 6, in the process started with expandable_segments:True: keep and a random mix, the allocator's
    model of that setting against ``max_memory_reserved`` and against the recorded requests replayed. On
    ``device`` "cpu" a dry run (the h200 profile, nothing recorded)."""
    from autotune.train import expandable_in_effect
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import detect, get_profile

    cuda = device == "cuda"
    hw = detect().profile if cuda else get_profile("h200")
    if hw is None:
        return {"error": "no built-in profile for this GPU"}
    w, _ = trace_model(TraceRequest(model=model, batch_size=batch, seq_len=seq, mode="real", device=device))
    effect = expandable_in_effect() if cuda else None
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    print(f"== expandable segments: {model} batch {batch}" + (f" x {seq}" if seq else "") + f" (profile {hw.name}; "
          f"PYTORCH_CUDA_ALLOC_CONF={conf!r}, in effect: {effect})", flush=True)  # fmt: skip
    rows = policy_allocator(model, batch, seq, w, hw, device, labels=("keep", "mixed"), expandable_segments=True)
    for label, row in rows.items():
        reserved = row["allocator_reserved_peak_bytes"]
        replayed = replay_requests(row["requests"], expandable_segments=True).peak_reserved if row["requests"] else 0
        row["replayed_reserved_peak_bytes"] = replayed
        err = (replayed - reserved) / reserved if reserved else float("nan")
        print(f"   {label:9s} reserved: the model replaying the {len(row['requests'])} recorded requests "
              f"{replayed / 2**30:.3f} GiB ({err:+.1%})", flush=True)  # fmt: skip
    return {"model": model, "batch": batch, "seq_len": seq, "profile": hw.name, "torch": torch.__version__,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "in_effect": effect, "policies": rows}  # fmt: skip


def expandable_run(out: Path, clock: Clock) -> None:
    """Step 6: :func:`expandable_child` in a fresh process with expandable_segments:True appended to the
    allocator's configuration."""
    from autotune.train import with_expandable_segments

    model, batch, seq = EXPANDABLE
    cmd = [sys.executable, "experiments/gpu_check.py", "--expandable-child", model, "--batch", str(batch),
           "--out", str(out)] + (["--seq-len", str(seq)] if seq else [])  # fmt: skip
    run(cmd, min(180.0, clock.left()), env={**os.environ, **with_expandable_segments(os.environ)})


def replay_requests(requests: list[list[Any]], expandable_segments: bool = False) -> Any:
    """The model of envs/allocator.py over recorded requests (their first frees may be of blocks allocated
    before the recording: left out), with ``expandable_segments`` or not (A8-A11)."""
    from envs.allocator import recorded_requests, replay

    return replay(recorded_requests(requests), expandable_segments=expandable_segments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    ap.add_argument("--quick", action="store_true", help="the CUDA tests and the host costs only")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new steps after this")
    ap.add_argument("--only", default=",".join(STEPS), help=f"the steps to run, of {','.join(STEPS)} (all)")
    ap.add_argument("--models", default=None, help="steps bench, e2e and traces: only these models (comma-separated)")
    ap.add_argument("--expandable-child", metavar="MODEL", help="step 6 only, in this process (set the allocator's "
                    "configuration first); with --device cpu a dry run")  # fmt: skip
    ap.add_argument("--batch", type=int, default=64, help="--expandable-child's batch size")
    ap.add_argument("--seq-len", type=int, default=None, help="--expandable-child's tokens per sample")
    ap.add_argument("--device", default="cuda", help="--expandable-child's device: cuda, or cpu for a dry run")
    args = ap.parse_args()
    if args.expandable_child:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device here; --expandable-child --device cpu is the dry run")
        row = expandable_child(args.expandable_child, args.batch, args.seq_len, args.device)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "expandable.json").write_text(json.dumps(row, indent=2))
        return
    steps = set(args.only.split(","))
    if steps - set(STEPS):
        sys.exit(f"gpu_check: --only {args.only}: expected steps of {','.join(STEPS)}")
    models = set(args.models.split(",")) if args.models else None

    def wanted(model: str) -> bool:
        return models is None or model in models

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget_s)
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    failures: list[str] = []

    if "tests" in steps:
        tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"], 150.0)
        if tests is None or tests.returncode != 0:
            failures.append("tests/test_cuda.py")
    if "host" in steps:
        try:
            host_costs(out)
        except Exception:
            print(traceback.format_exc(), flush=True)
            failures.append("host costs")
    if not args.quick:
        for model in [m for m in ("resnet50", "gpt2") if "bench" in steps and wanted(m)]:
            if clock.left() < 60:
                print(f"(no time left for bench_runtime {model})", flush=True)
                continue
            cmd = [sys.executable, "experiments/bench_runtime.py", "--device", "cuda", "--models", model,
                   "--rounds", "5", "--sections", "hooks,recompute_vs_checkpoint,fidelity,phases",
                   "--json", str(out / f"bench_runtime_{model}.json")]  # fmt: skip
            run(cmd, min(120.0, clock.left()))
        rows = []
        for model, batch, seq, budget in [e for e in E2E if "e2e" in steps and wanted(e[0])]:
            if clock.left() < 90:
                print(f"(no time left for the end-to-end run of {model})", flush=True)
                continue
            try:
                rows.append(end_to_end(model, batch, seq, budget, out, clock))
            except Exception:
                print(traceback.format_exc(), flush=True)
            if rows:  # after each model: a run stopped from outside keeps the rows it finished
                (out / "end_to_end.json").write_text(json.dumps(rows, indent=2))
        traces = []
        for model, batch, seq, precision in [t for t in TRACED if "traces" in steps and wanted(t[0])]:
            if clock.left() < 45:
                break
            try:
                traces.append(fake_vs_allocator(model, batch, seq, precision))
            except Exception:
                print(traceback.format_exc(), flush=True)
            if traces:
                (out / "traces.json").write_text(json.dumps(traces, indent=2))
        if "expandable" in steps and clock.left() >= 90:
            expandable_run(out, clock)
        elif "expandable" in steps:
            print("(no time left for the expandable-segments run)", flush=True)
        if "partition" in steps and clock.left() >= 90:
            model, batch, seq, budget, extra = PARTITION
            try:
                row = end_to_end(model, batch, seq, budget, out, clock, tuple(extra))
                (out / "partition.json").write_text(json.dumps(row, indent=2))
            except Exception:
                print(traceback.format_exc(), flush=True)
        elif "partition" in steps:
            print("(no time left for the partition run)", flush=True)
        if "compiled" in steps and clock.left() >= 120:
            model, batch, seq, budget, extra = COMPILED
            try:
                row = end_to_end(model, batch, seq, budget, out, clock, tuple(extra), ("--compile",), 300.0)
                (out / "compiled.json").write_text(json.dumps(row, indent=2))
            except Exception:
                print(traceback.format_exc(), flush=True)
        elif "compiled" in steps:
            print("(no time left for the compiled run)", flush=True)
    print(f"\ngpu_check: {time.perf_counter() - clock.start:.0f} s; failures: {failures or 'none'}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
