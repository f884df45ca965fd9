"""Runtime overhead and simulator fidelity, measured side by side in one process.

    python experiments/bench_runtime.py [--device cpu] [--model resnet18] [--batch-size 8] [--rounds 5]

1. Overhead: plain PyTorch against the runtime applying an all-keep policy with its hooks installed
   (normally an all-keep policy installs none), interleaved round by round. Target: <= 2%.
2. Recompute against torch.utils.checkpoint: the policy that recomputes every block's inside and keeps block
   inputs, against non-reentrant checkpointing of each block; time and peak. Target: not slower.
3. Fidelity: for keep, swap-all, recompute and two random mixed policies, the measured peak and time against
   the simulator's prediction for this device (a real-mode trace, so measured op times; the calibrated cpu
   profile on the CPU, the detected GPU's profile on CUDA). Target on the CPU: time within 15%.

experiments/gpu_check.py runs the same on a CUDA device for resnet50 and GPT-2.
"""

from __future__ import annotations

import argparse
import statistics
import traceback

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from autotune.models import build_model
from autotune.train import _profile_for
from autotune.workloads import TraceRequest, trace_model
from envs.simulator import Simulator, uniform_actions
from runtime.apply import PolicyRuntime
from runtime.keys import block_paths
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions
from runtime.trace import make_optimizer
from runtime.workload import Workload


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)  # type: ignore[no-any-return]


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every block (runtime.keys.block_paths: elements of Sequential/ModuleList) in checkpoint."""
    blocks = {b for p, b in block_paths(model).items() if p == b and "." in b}
    for path in sorted(blocks, key=len, reverse=True):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(parent, (torch.nn.Sequential, torch.nn.ModuleList)):
            parent[int(name)] = _Checkpointed(parent[int(name)])  # type: ignore[index]
    return model


def one_iteration(entry, opt, around=None):  # type: ignore[no-untyped-def]
    m = run_iterations(
        entry.module,
        entry.batch,
        entry.loss_fn,
        opt,
        steps=1,
        warmup=0,
        batch_size=entry.batch_size,
        around_step=around,
    )
    return m[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = args.device
    print(
        f"{args.model} batch {args.batch_size} on {dev} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )

    w, _ = trace_model(
        TraceRequest(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, mode="real", device=dev)
    )
    for section in (overhead, recompute_vs_checkpoint, fidelity):
        try:
            section(args, w)
        except Exception:  # one broken section must not hide the others' figures
            print(f"\n{section.__name__} failed:\n{traceback.format_exc()}", flush=True)


def overhead(args: argparse.Namespace, w: Workload) -> None:
    """1. The hooks' overhead, interleaved with plain PyTorch round by round."""
    dev = args.device
    plain = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=dev)
    hooked = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=dev)
    keep = Policy.uniform(w, Action.KEEP, hardware="measured")
    rt = PolicyRuntime(keep, hooked.module)
    opt_p, opt_h = make_optimizer("sgd", plain.module.parameters()), make_optimizer("sgd", hooked.module.parameters())
    one_iteration(plain, opt_p)
    one_iteration(hooked, opt_h, lambda: rt.step(force_hooks=True))
    t_plain, t_hooked = [], []
    for _ in range(args.rounds):
        t_plain.append(one_iteration(plain, opt_p).iter_s)
        t_hooked.append(one_iteration(hooked, opt_h, lambda: rt.step(force_hooks=True)).iter_s)
    ratio = statistics.median(h / p for h, p in zip(t_hooked, t_plain, strict=True))
    print(
        f"\n1. overhead of the runtime's hooks (all kept): median ratio {ratio:.3f} "
        f"({(ratio - 1) * 100:+.1f}%; plain median {statistics.median(t_plain) * 1e3:.1f} ms) target <= +2%"
    )


def recompute_vs_checkpoint(args: argparse.Namespace, w: Workload) -> None:
    """2. The recompute policy against torch.utils.checkpoint on every block."""
    dev = args.device
    pol = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="measured")
    ours = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=dev)
    ref = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=dev)
    checkpoint_blocks(ref.module)
    rt2 = PolicyRuntime(pol, ours.module)
    opt_o, opt_r = make_optimizer("sgd", ours.module.parameters()), make_optimizer("sgd", ref.module.parameters())
    one_iteration(ours, opt_o, rt2.step)
    one_iteration(ref, opt_r)
    mo, mr = [], []
    for _ in range(args.rounds):
        mo.append(one_iteration(ours, opt_o, rt2.step))
        mr.append(one_iteration(ref, opt_r))
    ratio2 = statistics.median(a.iter_s / b.iter_s for a, b in zip(mo, mr, strict=True))
    print(
        f"2. recompute policy / torch.utils.checkpoint per block: time ratio {ratio2:.3f}; peak "
        f"{mo[0].peak_bytes / 2**20:.1f} MiB vs {mr[0].peak_bytes / 2**20:.1f} MiB  target: ratio <= 1"
    )


def fidelity(args: argparse.Namespace, w: Workload) -> None:
    """3. Predicted against measured peak and time for five policies."""
    dev = args.device
    hw = _profile_for(dev)
    sim = Simulator(w, hw)
    rng = np.random.default_rng(0)
    k = len(w.candidates)
    policies = {
        "keep": uniform_actions(w, Action.KEEP),
        "swap-all": uniform_actions(w, Action.SWAP),
        "recompute": uniform_actions(w, Action.RECOMPUTE),
        "mixed-1": rng.integers(0, 3, k).astype(np.int8),
        "mixed-2": rng.integers(0, 3, k).astype(np.int8),
    }
    print(f"3. fidelity on the {hw.name} profile (op times measured by the real trace on this device)")
    print(
        f"   {'policy':10s} {'peak pred':>10s} {'measured':>10s} {'err':>7s}   "
        f"{'time pred':>10s} {'measured':>10s} {'err':>7s}"
    )
    errors = []
    for label, vec in policies.items():
        policy = Policy.from_vector(w, vec, hardware=hw.name, options=PolicyOptions(prefetch_lookahead=2))
        pred = sim.run(policy)
        entry = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=dev)
        opt = make_optimizer("sgd", entry.module.parameters())
        prt = PolicyRuntime(policy, entry.module)
        meas = run_iterations(
            entry.module,
            entry.batch,
            entry.loss_fn,
            opt,
            steps=max(1, args.rounds // 2),
            batch_size=args.batch_size,
            around_step=prt.step,
        )
        mp = statistics.median(m.peak_bytes for m in meas)
        mt = statistics.median(m.iter_s for m in meas)
        errors.append(abs(pred.iter_s - mt) / mt)
        print(
            f"   {label:10s} {pred.peak_bytes / 2**20:8.1f}Mi {mp / 2**20:8.1f}Mi {(pred.peak_bytes - mp) / mp:+7.1%}"
            f"   {pred.iter_s * 1e3:8.1f}ms {mt * 1e3:8.1f}ms {(pred.iter_s - mt) / mt:+7.1%}"
        )
    print(f"   largest time error {max(errors):.1%} (target on the CPU: <= 15%)")


if __name__ == "__main__":
    main()
