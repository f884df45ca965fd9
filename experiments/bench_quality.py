"""Search quality: every searcher against the baselines, per model x profile x budget, on the simulator.

    python experiments/bench_quality.py [--models resnet50,...] [--profiles a100-40gb,v100-16gb]
        [--fractions 0.8,0.6,0.45,0.3] [--search-s 10] [--portfolio-s 20] [--milp-s 10] [--csv FILE]
        [--precision fp32|bf16|fp16]

For each cell (budget = fraction of the model's no-policy peak on that profile) it prints samples/s of: no
policy (the ceiling, over budget), the best heuristic (exact solvers excluded), the MILP (and whether it
proved optimality for its coarsened model), each composite searcher run alone without warm start (new
searchers appear as new columns), and the default portfolio; then the targets:

- the portfolio's gain over the best heuristic, median over the cells where the best heuristic is more
  than 5% below the ceiling (target >= 5%);
- the portfolio against the MILP where it proved optimality (target >= 98%) and where it timed out (above
  its incumbent);
- the Optuna searcher alone against the portfolio (target >= 95% in most cells).

The ceiling is the no-policy speed, not the optimum at the budget: a cell can be far below it with no
better policy existing. Searchers run with their seeds fixed; the time limits make runs on a busy machine
find less.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

from agents.base import Problem, SearchResult, baseline_names, get_searcher, list_searchers
from autotune.models import default_batch_size
from autotune.workloads import TraceRequest, trace_model
from runtime.hardware import get_profile
from runtime.workload import peak_report

MODELS = {
    "resnet50": {},
    "resnet101": {},
    "vgg16": {},
    "densenet121": {},
    "gpt2": {"seq_len": 1024},
    "bert-base": {},
}
ALONE = ("optuna-tpe", "optuna-nsga2", "refine")  # composites run without seeds; new ones go here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profiles", default="a100-40gb,v100-16gb")
    ap.add_argument("--fractions", default="0.8,0.6,0.45,0.3")
    ap.add_argument("--search-s", type=float, default=10.0, help="seconds for each searcher alone")
    ap.add_argument("--portfolio-s", type=float, default=20.0)
    ap.add_argument("--milp-s", type=float, default=10.0)
    ap.add_argument("--csv", type=Path, default=Path("experiments/results/quality.csv"))
    ap.add_argument("--precision", default="fp32", help="fp32, or bf16/fp16 under torch.autocast")
    args = ap.parse_args()
    alone = [s for s in ALONE if s in list_searchers()]
    rows: list[dict[str, object]] = []
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    header = ["model", "precision", "profile", "budget", "ceiling", "best_heuristic", "heuristic", "milp"]
    header += ["milp_status"]
    header += [*alone, "portfolio", "portfolio_vs_heuristic", "optuna_vs_portfolio", "portfolio_s"]
    print(" | ".join(header), flush=True)
    for model in args.models.split(","):
        kw = MODELS.get(model, {})
        started = time.perf_counter()
        req = TraceRequest(model=model, batch_size=default_batch_size(model), precision=args.precision, **kw)  # type: ignore[arg-type]
        w, _ = trace_model(req)
        took = time.perf_counter() - started
        print(f"# {model} batch {w.batch_size} {w.precision}: traced in {took:.1f} s", flush=True)
        for profile in args.profiles.split(","):
            hw = get_profile(profile)
            peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
            for fraction in (float(f) for f in args.fractions.split(",")):
                row = cell(w, hw, int(peak * fraction), alone, args)
                row.update(model=model, precision=w.precision, profile=profile, budget=f"{fraction:.0%}")
                rows.append(row)
                print(" | ".join(_fmt(row.get(h)) for h in header), flush=True)
                with args.csv.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=header)
                    writer.writeheader()
                    writer.writerows(rows)
    summarize(rows)


def cell(w, hw, budget: int, alone: list[str], args: argparse.Namespace) -> dict[str, object]:  # type: ignore[no-untyped-def]
    def problem(time_s: float) -> Problem:
        return Problem(w, hw, budget, time_limit_s=time_s, trials=0)

    p = problem(args.milp_s)
    ceiling = p.simulator.run(p.keep_all()).samples_per_s
    seeds = [get_searcher(n).search(p) for n in baseline_names()]
    feasible = [r for r in seeds if r.feasible]
    top = max(feasible, key=lambda r: r.result.samples_per_s) if feasible else None
    milp = get_searcher("milp").search(p)
    row: dict[str, object] = {
        "ceiling": ceiling,
        "best_heuristic": top.searcher if top else None,
        "heuristic": _speed(top),
        "milp": _speed(milp),
        "milp_status": milp.status.value,
    }
    for name in alone:
        row[name] = _speed(get_searcher(name).search(problem(args.search_s)))
    started = time.perf_counter()
    pp = problem(args.portfolio_s)
    pp.seeds = seeds
    port = get_searcher("portfolio").search(pp)
    row["portfolio_s"] = time.perf_counter() - started
    row["portfolio"] = _speed(port)
    h, ps, o = row["heuristic"], row["portfolio"], row.get("optuna-tpe")
    row["portfolio_vs_heuristic"] = ps / h - 1 if isinstance(h, float) and isinstance(ps, float) else None
    row["optuna_vs_portfolio"] = o / ps if isinstance(o, float) and isinstance(ps, float) else None
    return row


def _speed(r: SearchResult | None) -> float | None:
    return r.result.samples_per_s if r is not None and r.feasible else None


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return "—" if v is None else str(v)


def summarize(rows: list[dict[str, object]]) -> None:
    hard = [
        r
        for r in rows
        if isinstance(r["heuristic"], float) and r["heuristic"] < 0.95 * r["ceiling"]  # type: ignore[operator]
    ]
    gains = [r["portfolio_vs_heuristic"] for r in hard if isinstance(r["portfolio_vs_heuristic"], float)]
    print(f"\ncells: {len(rows)}; best heuristic more than 5% below the ceiling in {len(hard)}")
    if gains:
        print(f"portfolio over the best heuristic, median over those: {statistics.median(gains):+.2%} (target +5%)")
    no_heuristic = [r for r in rows if r["heuristic"] is None and isinstance(r["portfolio"], float)]
    print(f"cells where no heuristic fits but the portfolio does: {len(no_heuristic)}")
    opt = [r for r in rows if r["milp_status"] == "OPTIMAL" and isinstance(r["milp"], float)]
    ok = [r for r in opt if isinstance(r["portfolio"], float) and r["portfolio"] >= 0.98 * r["milp"]]  # type: ignore[operator]
    print(f"MILP proved optimal (coarsened model) in {len(opt)} cells; portfolio >= 98% of it in {len(ok)}")
    timed = [r for r in rows if r["milp_status"] == "TIMEOUT" and isinstance(r["milp"], float)]
    above = [r for r in timed if isinstance(r["portfolio"], float) and r["portfolio"] > r["milp"]]  # type: ignore[operator]
    print(f"MILP timed out with an incumbent in {len(timed)} cells; portfolio above it in {len(above)}")
    ratios = [r["optuna_vs_portfolio"] for r in rows if isinstance(r["optuna_vs_portfolio"], float)]
    if ratios:
        n95 = sum(x >= 0.95 for x in ratios)  # type: ignore[operator]
        print(f"optuna-tpe alone >= 95% of the portfolio in {n95} of {len(ratios)} cells (target: most)")


if __name__ == "__main__":
    sys.exit(main())
