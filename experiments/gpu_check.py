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
import subprocess
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    cases = [("resnet18", "8", None)] if args.quick else [("resnet50", "64", None), ("gpt2", "8", "1024")]
    for model, batch, seq in cases:
        cmd = [
            sys.executable,
            "experiments/bench_runtime.py",
            "--device",
            "cuda",
            "--model",
            model,
            "--batch-size",
            batch,
            "--rounds",
            "5",
        ]
        if seq:
            cmd += ["--seq-len", seq]
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=False)
        _fake_vs_allocator(model, int(batch), int(seq) if seq else None)


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
