"""Every method's samples/s at 70% and 50% of the no-policy peak: the README's baselines table.

    python experiments/baselines_table.py [--gpu a100-40gb] [--time-limit 20] [--out baselines.csv]

Prints a Markdown table (one row per model and budget, one column per method, infeasible results marked)
and writes the same numbers as CSV. Simulated on the named profile; no GPU is needed or used.
"""

from __future__ import annotations

import argparse
import csv

from agents.base import Problem, SearchContext, baseline_names, get_searcher
from autotune.workloads import TraceRequest, trace_model
from runtime.hardware import get_profile
from runtime.workload import peak_report

MODELS = [("resnet50", 64, None), ("resnet101", 64, None), ("gpt2", 8, 1024)]
FRACTIONS = (0.7, 0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="a100-40gb")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per exact solver")
    ap.add_argument("--out", default="baselines.csv")
    args = ap.parse_args()
    hw = get_profile(args.gpu)
    methods = baseline_names() + baseline_names(exact=True)
    records = []
    for model, batch, seq in MODELS:
        w, _ = trace_model(TraceRequest(model=model, batch_size=batch, seq_len=seq, target=hw))
        peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
        for fraction in FRACTIONS:
            problem = Problem(w, hw, int(peak * fraction))
            row = {"model": model, "batch": batch, "budget": f"{fraction:.0%}", "budget_gib": peak * fraction / 2**30}
            for name in methods:
                r = get_searcher(name).search(problem, SearchContext(time_limit_s=args.time_limit))
                # A timed-out solver's incumbent counts when it fits the budget.
                row[name] = r.result.samples_per_s if r.result.feasible else None
                row[f"{name}_status"] = r.status.value
            records.append(row)
            print(f"done {model} {fraction:.0%}", flush=True)
    header = ["model", "budget", *methods]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in records:
        cells = [f"{row['model']} b{row['batch']}", f"{row['budget']} ({row['budget_gib']:.2f} GiB)"]
        for name in methods:
            value = row[name]
            status = row[name + "_status"]
            if value is None:
                cells.append(f"— ({status.lower()})")
            else:
                cells.append(f"{value:,.0f}" + (f" ({status.lower()})" if status in ("TIMEOUT", "OPTIMAL") else ""))
        print("| " + " | ".join(cells) + " |")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    print(f"\nsamples/s on {hw.name} (simulated); '—' = no feasible policy found. CSV: {args.out}")


if __name__ == "__main__":
    main()
