"""Simulator speed: evaluations per second for ResNet-101 at batch 64 on one core, for random policies and for
neighbours, as local search and Optuna's neighbourhoods evaluate them.

    python experiments/bench_simulator.py [--model resnet101] [--batch-size 64] [--gpu a100-40gb] [--evals 2000]

Random policies draw every candidate's action uniformly (a new prefetch look-ahead each). Neighbours differ
from one sparse base policy (a tenth of the candidates not kept, random actions) in 1-3 candidates, with
the base's options. Prints evaluations/s over several rounds (this machine is shared and noisy: the spread
is reported, and the median decides), beside the same measurement for the op-by-op reference on a few
policies, as a ratio. Target (issue 19, item 3): at least 5,000 evaluations per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from autotune.workloads import TraceRequest, trace_model
from envs.simulator import Simulator
from envs.simulator_reference import simulate_reference
from runtime.hardware import get_profile
from runtime.policy import PolicyOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet101")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--gpu", default="a100-40gb")
    ap.add_argument("--evals", type=int, default=2000, help="evaluations per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core, as the target says

    hw = get_profile(args.gpu)
    # Traced for the profile, as `autotune search` traces (the GPU's kernels: runtime/target.py).
    w, trace_s = trace_model(TraceRequest(model=args.model, batch_size=args.batch_size, target=hw))
    t0 = time.perf_counter()
    sim = Simulator(w, hw)
    setup_s = time.perf_counter() - t0
    k = len(w.candidates)
    print(
        f"{args.model} batch {args.batch_size} on {hw.name}: {len(w.ops)} ops, {k} candidates; "
        f"trace {trace_s:.2f} s, simulator setup {setup_s * 1e3:.1f} ms"
    )

    rng = np.random.default_rng(0)
    policies = [rng.integers(0, 4, k).astype(np.int8) for _ in range(args.evals)]
    opts = [PolicyOptions(prefetch_lookahead=int(rng.integers(0, 6)), lossy=True) for _ in range(args.evals)]
    base = np.zeros(k, dtype=np.int8)
    changed = rng.choice(k, k // 10, replace=False)
    base[changed] = rng.integers(1, 4, len(changed))
    neighbours = []
    for _ in range(args.evals):
        acts = base.copy()
        at = rng.choice(k, int(rng.integers(1, 4)), replace=False)
        acts[at] = (acts[at] + rng.integers(1, 4, len(at))) % 4  # another action
        neighbours.append(acts)
    sets = {
        "random policies": (policies, opts),
        "neighbours": (neighbours, [PolicyOptions(prefetch_lookahead=2, lossy=True)] * args.evals),
    }
    medians = {}
    for name, (acts_list, opts_list) in sets.items():
        rates = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for acts, o in zip(acts_list, opts_list, strict=True):
                sim.run(acts, options=o)
            rates.append(args.evals / (time.perf_counter() - start))
        medians[name] = statistics.median(rates)
        print(
            f"fast simulator, {name}: median {medians[name]:,.0f} evaluations/s over {args.rounds} rounds of "
            f"{args.evals} (min {min(rates):,.0f}, max {max(rates):,.0f})"
        )
    median = medians["random policies"]

    ref_n = 5
    start = time.perf_counter()
    for acts, o in zip(policies[:ref_n], opts[:ref_n], strict=True):
        simulate_reference(w, hw, acts, options=o)
    ref_rate = ref_n / (time.perf_counter() - start)
    print(f"op-by-op reference: {ref_rate:,.1f} evaluations/s; fast / reference = {median / ref_rate:,.0f}x")
    for name, rate in medians.items():
        print(f"target >= 5,000 evaluations/s, {name}: {'met' if rate >= 5000 else 'MISSED'}")


if __name__ == "__main__":
    main()
