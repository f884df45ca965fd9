"""The plan against a compiled step's memory: random keep/recompute policies under ``policy.compiled``.

    python experiments/compiled_fidelity.py --model resnet18 --batch-size 4 --image-size 64 [-n 6]
        [--backend aot_eager] [--seed 0]

Traces the model in real mode on the CPU (the ``cpu`` profile), draws ``n`` policies (keep everything,
recompute everything, then mixes that recompute each candidate with a probability, 0.5, 0.2 and random ones)
and trains one step of each under ``torch.compile`` with ``--backend`` the way ``autotune train --compile``
does (``autotune.train.run_policy``): the compiled step's peak between ops (runtime/measure.py, NOTE [ Device
memory on the CPU ]) against the simulator's for the decisions the compiled graph applied. One line per
policy; the last says how many were within 0.1% of their plan.
"""

from __future__ import annotations

import argparse

import numpy as np

from autotune.train import run_policy
from autotune.workloads import TraceRequest, trace_model
from runtime.hardware import calibrate_cpu
from runtime.policy import Policy
from runtime.vocab import KEEP, RECOMPUTE

SHARES = (0.0, 1.0, 0.5, 0.2)  # the first policies' share of candidates recomputed; random ones after


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("-n", type=int, default=6, help="policies to train")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile's backend (aot_eager, inductor)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    req = TraceRequest(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                       image_size=args.image_size, mode="real", device="cpu")  # fmt: skip
    w, _ = trace_model(req)
    hw = calibrate_cpu()
    rng = np.random.default_rng(args.seed)
    close = 0
    for i in range(args.n):
        share = SHARES[i] if i < len(SHARES) else float(rng.uniform(0.1, 0.9))
        vec = np.where(rng.random(len(w.candidates)) < share, RECOMPUTE, KEEP).astype(np.int8)
        policy = Policy.from_vector(w, vec, hardware="cpu")
        r = run_policy(policy, w, hw, name=args.model, batch=w.batch_size, steps=1, device="cpu",
                       compile_backend=args.backend)  # fmt: skip
        measured, planned = r.steps[0].peak_bytes, int(r.predicted["peak_bytes"])
        close += abs(measured - planned) <= 0.001 * planned
        c = r.compile_report or {}
        print(f"{args.model} #{i} recompute share {share:.2f}: compiled {measured:,} bytes, planned {planned:,} "
              f"({(measured - planned) / planned:+.3%}); decisions applied {c.get('applied')}, changed "
              f"{c.get('changed')}, dropped {c.get('dropped')}", flush=True)  # fmt: skip
    print(f"{close} of {args.n} policies within 0.1% of their plan under {args.backend}")


if __name__ == "__main__":
    main()
