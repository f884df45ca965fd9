"""Saved-activation bytes under bf16 autocast against fp32, and where they differ from one half.

    python experiments/precision_bytes.py [--models resnet50,gpt2] [--precision bf16] [--gpu a100-40gb]

Traces each model twice in fake mode (fp32, then the given autocast precision), same batch, and splits the
candidates (saved activations) of the autocast trace by what made them:

- weight casts: autocast's casts of parameters (cached for the forward, saved by matmul/conv backward);
- batch casts: casts of the input batch (in fp32 the batch itself is saved, and is not a candidate);
- other casts: casts of activations (into or out of autocast's fp32 ops);
- fp32 activations: made by ops autocast runs in fp32 (softmax, losses, norms on some paths);
- low-precision activations: everything else.

Also the no-policy peak and the simulated iteration time on ``--gpu`` (tensor-core rates for bf16).
"""

from __future__ import annotations

import argparse
import sys

from headline_common import MODELS

from autotune.workloads import TraceRequest, trace_model
from envs.simulator import Simulator, uniform_actions
from runtime.hardware import get_profile
from runtime.policy import Action
from runtime.workload import TensorKind, Workload, peak_report

SIZES = {"resnet50": {"batch_size": 64}, "gpt2": {"batch_size": 8, "seq_len": 1024}}


def split(w: Workload) -> dict[str, int]:
    out = dict.fromkeys(("weight casts", "batch casts", "other casts", "fp32 activations", "low-precision"), 0)
    for c in w.candidates:
        op = w.ops[c.producer]
        src = [w.tensors[t].kind for t in op.inputs]
        if op.name == "aten._to_copy.default":
            kind = (
                "weight casts"
                if TensorKind.PARAMETER in src
                else "batch casts"
                if TensorKind.INPUT in src
                else "other casts"
            )
        elif w.tensors[c.tensor].dtype == "float32":
            kind = "fp32 activations"
        else:
            kind = "low-precision"
        out[kind] += c.nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--gpu", default="a100-40gb")
    args = ap.parse_args()
    hw = get_profile(args.gpu)
    for model in args.models.split(","):
        kw = SIZES.get(model) or {"batch_size": MODELS[model]["batch"], **MODELS[model]["kw"]}
        # Traced for the profile, as `autotune search` traces (the GPU's kernels: runtime/target.py).
        w32, _ = trace_model(TraceRequest(model=model, target=hw, **kw))
        wlo, _ = trace_model(TraceRequest(model=model, precision=args.precision, target=hw, **kw))
        b32 = sum(c.nbytes for c in w32.candidates)
        blo = sum(c.nbytes for c in wlo.candidates)
        parts = split(wlo)
        sim32, simlo = Simulator(w32, hw), Simulator(wlo, hw)
        t32 = sim32.run(uniform_actions(w32, Action.KEEP)).iter_s
        tlo = simlo.run(uniform_actions(wlo, Action.KEEP)).iter_s
        p32 = peak_report(w32, hw.alloc_granularity_bytes).peak_bytes
        plo = peak_report(wlo, hw.alloc_granularity_bytes).peak_bytes
        print(f"{model} batch {w32.batch_size}{f' x {w32.seq_len}' if w32.seq_len else ''}:")
        print(
            f"  saved activations: fp32 {b32 / 2**20:,.1f} MiB ({len(w32.candidates)} tensors), {args.precision} "
            f"{blo / 2**20:,.1f} MiB ({len(wlo.candidates)} tensors): ratio {blo / b32:.4f}"
        )
        for k, v in parts.items():
            print(f"    {k:>18}: {v / 2**20:10,.1f} MiB ({v / blo:6.1%} of {args.precision}, {v / b32:6.1%} of fp32)")
        top: dict[str, int] = {}  # fp32 activations by module kind and producer: where one half is missed
        for c in wlo.candidates:
            op = wlo.ops[c.producer]
            if wlo.tensors[c.tensor].dtype == "float32" and op.name != "aten._to_copy.default":
                where = f"{c.key.split('#')[0].split('.')[-1]} {op.name.split('.')[1]}"
                top[where] = top.get(where, 0) + c.nbytes
        for where, v in sorted(top.items(), key=lambda kv: -kv[1])[:6]:
            print(f"      fp32 from {where}: {v / 2**20:,.1f} MiB")
        low = parts["low-precision"]
        print(f"  without the casts and fp32 ops: {low / b32:.4f} of fp32's bytes")
        print(f"  no-policy peak: {p32 / 2**30:.2f} GiB -> {plo / 2**30:.2f} GiB ({plo / p32:.3f})")
        print(f"  iteration on {hw.name}: {t32 * 1e3:.1f} ms -> {tlo * 1e3:.1f} ms ({tlo / t32:.3f})")


if __name__ == "__main__":
    sys.exit(main())
