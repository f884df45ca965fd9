"""The CUDA checks, as one prepared script for a GPU machine (nothing here runs without CUDA).

    python experiments/gpu_check.py [--quick]

For resnet50 at batch 64 and GPT-2 small at batch 8 x 1024 tokens, on the local GPU: the runtime's overhead
(all-keep with hooks against plain PyTorch), the recompute policy against torch.utils.checkpoint per block,
and predicted against measured peak (CUDA allocator) and time for keep, swap-all (pinned host buffers,
side streams, prefetch), recompute and two mixed policies, each printed as one table by
experiments/bench_runtime.py. Also prints the fake-mode trace's no-policy peak against the allocator's,
the number the README asks to calibrate. --quick: resnet18 at batch 8 only.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import traceback

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="resnet50,gpt2", help="which of resnet50 and gpt2 to run")
    ap.add_argument("--case-timeout", type=float, default=200.0, help="seconds per model before moving on")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    print(f"pinned host memory works: {torch.empty(8, pin_memory=True).is_pinned()}", flush=True)
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"], args.case_timeout)
    cases = [("resnet18", "8", None)] if args.quick else [("resnet50", "64", None), ("gpt2", "8", "1024")]
    cases = [c for c in cases if args.quick or c[0] in args.models.split(",")]
    for model, batch, seq in cases:
        cmd = [sys.executable, "experiments/bench_runtime.py", "--device", "cuda", "--model", model]
        cmd += ["--batch-size", batch, "--rounds", "5"] + (["--seq-len", seq] if seq else [])
        _run(cmd, args.case_timeout)
        for extra in (_fake_vs_allocator, _profile_steps):
            try:
                extra(model, int(batch), int(seq) if seq else None)
            except Exception:  # report and go on
                print(traceback.format_exc(), flush=True)


def _profile_steps(model: str, batch: int, seq: int | None) -> None:
    """Where the host's time goes in one step of plain PyTorch, the runtime's hooks and the recompute
    policy (cProfile, top functions by own time): a GPU step whose kernels are fast is bound by this."""
    import cProfile
    import pstats

    from autotune.models import build_model
    from autotune.workloads import TraceRequest, trace_model
    from envs.simulator import uniform_actions
    from runtime.apply import PolicyRuntime
    from runtime.policy import Action, Policy

    w, _ = trace_model(TraceRequest(model=model, batch_size=batch, seq_len=seq))
    for label, action in (("plain", None), ("hooks (all kept)", Action.KEEP), ("recompute", Action.RECOMPUTE)):
        entry = build_model(model, batch_size=batch, seq_len=seq, device="cuda")
        rt = (
            None
            if action is None
            else PolicyRuntime(Policy.from_vector(w, uniform_actions(w, action), hardware="h200"), entry.module)
        )

        def step(entry=entry, rt=rt) -> None:  # type: ignore[no-untyped-def]
            ctx = contextlib.nullcontext() if rt is None else rt.step(force_hooks=True)
            with ctx:
                entry.loss_fn(entry.module, entry.batch).backward()
            torch.cuda.synchronize()

        step()
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        print(f"\n--- {model}: {label}, one step under cProfile", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def _run(cmd: list[str], timeout: float) -> None:
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    try:
        subprocess.run(cmd, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"(stopped after {timeout:.0f} s)", flush=True)


def _fake_vs_allocator(model: str, batch: int, seq: int | None) -> None:
    from autotune.models import build_model
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import detect
    from runtime.measure import run_iterations
    from runtime.trace import make_optimizer
    from runtime.workload import peak_report

    hw = detect().profile
    g = hw.alloc_granularity_bytes if hw else 512
    fake, _ = trace_model(TraceRequest(model=model, batch_size=batch, seq_len=seq))
    real, _ = trace_model(TraceRequest(model=model, batch_size=batch, seq_len=seq, mode="real", device="cuda"))
    entry = build_model(model, batch_size=batch, seq_len=seq, device="cuda")
    opt = make_optimizer("sgd", entry.module.parameters())
    measured = run_iterations(entry.module, entry.batch, entry.loss_fn, opt, steps=2, batch_size=batch)[-1]
    for name, w in (("fake (CPU kernels)", fake), ("real (CUDA)", real)):
        p = peak_report(w, g).peak_bytes
        print(
            f"   no-policy peak, {name} trace: {p / 2**30:.3f} GiB; allocator {measured.peak_bytes / 2**30:.3f} GiB "
            f"({(p - measured.peak_bytes) / measured.peak_bytes:+.1%})"
        )


if __name__ == "__main__":
    main()
