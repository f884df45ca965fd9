"""Search quality: every searcher against the baselines, per model x profile x budget, on the simulator.

    python experiments/bench_quality.py [--models resnet50,...|heldout] [--profiles a100-40gb,v100-16gb]
        [--fractions 0.8,0.6,0.45,0.3] [--search-s 10] [--portfolio-s 20] [--milp-s 10] [--csv FILE]
        [--precision fp32|bf16|fp16] [--agent] [--skip milp,portfolio,exact] [--exact-s 60] [--exact-units 12]
        [--allow-partition]

For each cell (budget = fraction of the model's no-policy peak on that profile) it prints samples/s of: no
policy (the ceiling, over budget), the best heuristic (exact solvers excluded), the MILP (and whether it
proved optimality for its coarsened model), each composite searcher run alone without warm start (new
searchers appear as new columns), the default portfolio, and the exact yardstick (agents/solvers/exact.py:
branch and bound on the simulator over policies that decide ``--exact-units`` blocks as units, the
portfolio's answer its incumbent): that optimum where proven, else its proven bound on samples/s and the
gap; the portfolio decides each tensor, so it may go above the unit optimum. Then the targets:

- the portfolio's gain over the best heuristic, median over the cells where the best heuristic is more
  than 5% below the ceiling (target >= 5%);
- the portfolio against the MILP where it proved optimality (target >= 98%) and where it timed out (above
  its incumbent);
- the Optuna searcher alone against the portfolio (target >= 95% in most cells);
- the portfolio against the unit optimum where proven (issue 19: >= 99%), and the gap where not.

With ``--agent`` (the pretrained agent, agents/pretrained.py) each cell also gets the agent's one pass
(``ppo-onepass``, and its time) and ``ppo-pretrained`` (one pass, then Optuna refinement) at the same time
as each searcher alone, and the summary adds the agent's targets: one pass >= the best heuristic in every
cell (the cells that fall short are listed), ppo-pretrained >= optuna-tpe alone at the same time, one pass
under a second on ResNet-101; and, unless portfolio is skipped, the portfolio with the one pass among its
seeds (``portfolio_agent``, same time in all; the default since) against the portfolio without it
(``portfolio`` in this mode). ``--models heldout`` is the agent's held-out split (experiments/train_agent.py:
models never used in training, their batch sizes, profiles and budgets); the README's held-out table::

    python experiments/bench_quality.py --models heldout --agent --skip milp,optuna-nsga2,refine \
        --search-s 8 --portfolio-s 16 --csv experiments/results/agent_heldout.csv

With ``--allow-partition`` a cell whose budget lies below 1.1x the model's floor is run, every column, on the
model traced with the partition `autotune search --allow-partition` would choose (autotune/partitions.py; the
``partition`` column), the ceiling staying the unpartitioned no-policy speed.

The ceiling is the no-policy speed, not the optimum at the budget: a cell can be far below it with no
better policy existing. Searchers run with their seeds fixed; the time limits make runs on a busy machine
find less.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import sys
import time
from pathlib import Path

from agents import portfolio
from agents.base import Problem, SearchContext, SearchResult, baseline_names, get_searcher, list_searchers
from agents.solvers.exact import solve_exact
from agents.solvers.milp.data import decision_units
from autotune.models import default_batch_size
from autotune.partitions import choose
from autotune.workloads import TraceRequest, trace_model
from runtime.hardware import HardwareProfile, get_profile
from runtime.partition import Partition, parse_partitions
from runtime.target import trace_key
from runtime.workload import Workload, peak_report

MODELS = {
    "resnet50": {},
    "resnet101": {},
    "vgg16": {},
    "densenet121": {},
    "gpt2": {"seq_len": 1024},
    "bert-base": {},
}
ALONE = ("optuna-tpe", "optuna-nsga2", "refine")  # composites run without seeds; new ones go here
AGENT_ALONE = ("ppo-pretrained",)  # with --agent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models", default=",".join(MODELS), help="model names, or heldout[=m1,m2] (the agent's split, or part)"
    )
    ap.add_argument("--profiles", default="a100-40gb,v100-16gb")
    ap.add_argument("--fractions", default="0.8,0.6,0.45,0.3")
    ap.add_argument("--search-s", type=float, default=10.0, help="seconds for each searcher alone")
    ap.add_argument("--portfolio-s", type=float, default=20.0)
    ap.add_argument("--milp-s", type=float, default=10.0)
    ap.add_argument("--exact-s", type=float, default=60.0, help="branch and bound time per cell")
    ap.add_argument("--exact-units", type=int, default=12, help="blocks decided together by the exact yardstick")
    ap.add_argument("--csv", type=Path, default=Path("experiments/results/quality.csv"))
    ap.add_argument("--precision", default="fp32", help="fp32, or bf16/fp16 under torch.autocast")
    ap.add_argument("--agent", action="store_true", help="add the pretrained agent's columns and targets")
    ap.add_argument("--skip", default="", help="columns not to run: milp, portfolio, or searchers run alone")
    ap.add_argument("--allow-partition", action="store_true", help="partition where the budget is below the floor")
    args = ap.parse_args()
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    alone = [s for s in (*ALONE, *(AGENT_ALONE if args.agent else ())) if s in list_searchers() and s not in skip]
    workloads: list[tuple[str, dict[str, object], int | None]] = []
    if args.models.split("=")[0] == "heldout":
        from train_agent import HELDOUT, HELDOUT_FRACTIONS, HELDOUT_PROFILES

        names = args.models.partition("=")[2]
        chosen = [h for h in HELDOUT if not names or h.model in names.split(",")]
        workloads = [(h.model, {"seq_len": h.seq_len} if h.seq_len else {}, h.batch) for h in chosen]
        args.profiles = ",".join(HELDOUT_PROFILES)
        args.fractions = ",".join(str(f) for f in HELDOUT_FRACTIONS)
    else:
        workloads = [(m, MODELS.get(m, {}), None) for m in args.models.split(",")]
    rows: list[dict[str, object]] = []
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    header = ["model", "batch", "precision", "profile", "budget", "ceiling", "best_heuristic", "heuristic"]
    header[5:5] = ["partition"] if args.allow_partition else []
    header += [] if "milp" in skip else ["milp", "milp_status"]
    header += ["ppo-onepass", "onepass_s"] if args.agent else []
    header += [*alone] + ([] if "portfolio" in skip else ["portfolio", "portfolio_vs_heuristic", "portfolio_s"])
    header += ["optuna_vs_portfolio"] if "portfolio" not in skip and "optuna-tpe" in alone else []
    header += ["portfolio_agent"] if "portfolio" not in skip and args.agent else []
    header += [] if "exact" in skip else ["exact", "exact_status", "exact_bound", "portfolio_vs_exact"]
    print(" | ".join(header), flush=True)
    for model, kw, batch in workloads:
        traces: dict[object, Workload] = {}  # one per trace_key: profiles that take the same kernels share it
        for profile in args.profiles.split(","):
            hw = get_profile(profile)
            if trace_key(hw) not in traces:
                traces[trace_key(hw)] = _trace(model, kw, batch, args.precision, hw)
            w = traces[trace_key(hw)]
            peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
            for fraction in (float(f) for f in args.fractions.split(",")):
                budget = int(peak * fraction)
                on = w
                if args.allow_partition:
                    retrace = functools.partial(_trace, model, kw, batch, args.precision, hw)
                    on = choose(w, hw, budget, retrace, others=False).workload
                row = cell(on, hw, budget, alone, args, skip)
                if on is not w:  # the unpartitioned model's no-policy speed
                    plain = Problem(w, hw, budget)
                    row["ceiling"] = plain.simulator.run(plain.keep_all()).samples_per_s
                row.update(model=model, batch=w.batch_size, precision=w.precision, profile=profile)
                row["partition"] = ",".join(str(p) for p in parse_partitions(on.meta.get("partitions"))) or "-"
                row["budget"] = f"{fraction:.0%}"
                rows.append(row)
                print(" | ".join(_fmt(row.get(h)) for h in header), flush=True)
                with args.csv.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
                    writer.writeheader()
                    writer.writerows(rows)
    summarize(rows)
    if args.agent:
        summarize_agent(rows)


def _trace(
    model: str,
    kw: dict[str, object],
    batch: int | None,
    precision: str,
    hw: HardwareProfile,
    partitions: tuple[Partition, ...] = (),
) -> Workload:
    """``model``'s fake trace for ``hw``'s kernels, as `autotune search` traces it (runtime/target.py)."""
    started = time.perf_counter()
    b = batch or default_batch_size(model)
    req = TraceRequest(model=model, batch_size=b, precision=precision, target=hw, partitions=partitions, **kw)  # type: ignore[arg-type]
    w, _ = trace_model(req)
    took = time.perf_counter() - started
    sliced = f" with {', '.join(str(p) for p in partitions)}" if partitions else ""
    # The cuBLAS workspaces of a GPU trace follow this variable (runtime/target.py G6), so say when it is set.
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    workspaces = f" (cuBLAS workspaces from CUBLAS_WORKSPACE_CONFIG={config})" if config and hw.is_gpu else ""
    print(
        f"# {model} batch {w.batch_size} {w.precision} for {hw.name}{sliced}: traced in {took:.1f} s{workspaces}",
        flush=True,
    )
    return w


def cell(w, hw, budget: int, alone: list[str], args: argparse.Namespace, skip: set[str]) -> dict[str, object]:  # type: ignore[no-untyped-def]
    def within(time_s: float, seeds: tuple[SearchResult, ...] = ()) -> SearchContext:
        return SearchContext(time_limit_s=time_s, trials=0, seeds=seeds)

    def seeded() -> tuple[Problem, tuple[SearchResult, ...]]:
        """A problem with the baselines run on it, as `autotune search` runs them: what they simulated on the
        way (``Problem.best_seen``) is the portfolio's too."""
        q = Problem(w, hw, budget)
        return q, tuple(get_searcher(n).search(q) for n in baseline_names())

    p = Problem(w, hw, budget)
    ceiling = p.simulator.run(p.keep_all()).samples_per_s
    q, seeds = seeded()  # the portfolio's problem and seeds
    feasible = [r for r in seeds if r.feasible]
    top = max(feasible, key=lambda r: r.result.samples_per_s) if feasible else None
    row: dict[str, object] = {
        "ceiling": ceiling,
        "best_heuristic": top.searcher if top else None,
        "heuristic": _speed(top),
    }
    if "milp" not in skip:
        milp = get_searcher("milp").search(p, within(args.milp_s))
        row.update(milp=_speed(milp), milp_status=milp.status.value)
    onepass = None
    if args.agent:
        started = time.perf_counter()  # from the trace: the simulator's construction counts
        onepass = get_searcher("ppo-onepass").search(Problem(w, hw, budget), within(args.search_s))
        row["ppo-onepass"] = _speed(onepass)
        row["onepass_s"] = time.perf_counter() - started
    for name in alone:
        row[name] = _speed(get_searcher(name).search(Problem(w, hw, budget), within(args.search_s)))
    port: SearchResult | None = None
    if "portfolio" not in skip:
        started = time.perf_counter()
        portfolio.AGENT_SEED = not args.agent  # --agent: this column without the agent, the next one with it
        try:
            port = get_searcher("portfolio").search(q, within(args.portfolio_s, seeds))
        finally:
            portfolio.AGENT_SEED = True
        row["portfolio_s"] = time.perf_counter() - started
        row["portfolio"] = _speed(port)
        if onepass is not None:  # the portfolio with the agent's one pass among its seeds, in the same time
            qa, qa_seeds = seeded()
            pa = within(args.portfolio_s - float(row["onepass_s"]), (*qa_seeds, onepass))  # type: ignore[arg-type]
            row["portfolio_agent"] = _speed(get_searcher("portfolio").search(qa, pa))
        h, ps, o = row["heuristic"], row["portfolio"], row.get("optuna-tpe")
        row["portfolio_vs_heuristic"] = ps / h - 1 if isinstance(h, float) and isinstance(ps, float) else None
        row["optuna_vs_portfolio"] = o / ps if isinstance(o, float) and isinstance(ps, float) else None
    if "exact" not in skip:
        p = Problem(w, hw, budget)
        start = (port.policy.to_vector(w), port.policy.options) if port is not None and port.feasible else None
        ex = solve_exact(p, decision_units(p, args.exact_units), time_limit_s=args.exact_s, incumbent=start)
        row["exact"] = ex.samples_per_s if ex.result is not None else None
        row["exact_status"] = "OPTIMAL" if ex.optimal else f"gap {ex.gap:.2%}"
        row["exact_bound"] = ex.bound_samples_per_s if not ex.optimal else row["exact"]
        ps = row.get("portfolio")
        row["portfolio_vs_exact"] = ps / ex.samples_per_s if isinstance(ps, float) and ex.samples_per_s else None
    return row


def _speed(r: SearchResult | None) -> float | None:
    return r.result.samples_per_s if r is not None and r.feasible else None


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return "—" if v is None else str(v)


def summarize(rows: list[dict[str, object]]) -> None:
    if "portfolio" not in rows[0]:
        return
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
    opt = [r for r in rows if r.get("milp_status") == "OPTIMAL" and isinstance(r["milp"], float)]
    ok = [r for r in opt if isinstance(r["portfolio"], float) and r["portfolio"] >= 0.98 * r["milp"]]  # type: ignore[operator]
    print(f"MILP proved optimal (coarsened model) in {len(opt)} cells; portfolio >= 98% of it in {len(ok)}")
    timed = [r for r in rows if r.get("milp_status") == "TIMEOUT" and isinstance(r["milp"], float)]
    above = [r for r in timed if isinstance(r["portfolio"], float) and r["portfolio"] > r["milp"]]  # type: ignore[operator]
    print(f"MILP timed out with an incumbent in {len(timed)} cells; portfolio above it in {len(above)}")
    ratios = [r["optuna_vs_portfolio"] for r in rows if isinstance(r["optuna_vs_portfolio"], float)]
    if ratios:
        n95 = sum(x >= 0.95 for x in ratios)  # type: ignore[operator]
        print(f"optuna-tpe alone >= 95% of the portfolio in {n95} of {len(ratios)} cells (target: most)")
    proven = [r for r in rows if r.get("exact_status") == "OPTIMAL" and isinstance(r.get("exact"), float)]
    if proven:
        at = sum(isinstance(r["portfolio_vs_exact"], float) and r["portfolio_vs_exact"] >= 0.99 for r in proven)  # type: ignore[operator]
        print(f"exact yardstick proved the unit optimum in {len(proven)} cells; portfolio >= 99% of it in {at}")
    open_ = [r for r in rows if str(r.get("exact_status", "")).startswith("gap")]
    if open_:
        gaps = ", ".join(f"{r['model']} {r['profile']} {r['budget']}: {r['exact_status']}" for r in open_)
        print(f"unproven (portfolio against the proven bound): {gaps}")


def summarize_agent(rows: list[dict[str, object]]) -> None:
    """The pretrained agent's targets (see the module docstring)."""

    def at_least(a: object, b: object) -> bool:  # None: does not fit; a fitting policy beats none
        return b is None or (isinstance(a, float) and isinstance(b, float) and a >= b * (1 - 1e-9))

    name = [f"{r['model']} {r['profile']} {r['budget']}" for r in rows]
    short = [n for n, r in zip(name, rows, strict=True) if not at_least(r["ppo-onepass"], r["heuristic"])]
    print(f"\none pass >= the best heuristic in {len(rows) - len(short)} of {len(rows)} cells (target: all)")
    for n, r in zip(name, rows, strict=True):
        if n in short:
            print(f"  short: {n}: one pass {_fmt(r['ppo-onepass'])}, {r['best_heuristic']} {_fmt(r['heuristic'])}")
    if "ppo-pretrained" in rows[0] and "optuna-tpe" in rows[0]:
        ok = [at_least(r["ppo-pretrained"], r["optuna-tpe"]) for r in rows]
        print(f"ppo-pretrained >= optuna-tpe alone (same time) in {sum(ok)} of {len(rows)} cells (target: all)")
        for n, r, good in zip(name, rows, ok, strict=True):
            if not good:
                print(f"  short: {n}: {_fmt(r['ppo-pretrained'])} vs {_fmt(r['optuna-tpe'])}")
    if "portfolio_agent" in rows[0]:
        pairs = [(r["portfolio_agent"], r["portfolio"]) for r in rows]
        up = sum(isinstance(a, float) and (b is None or a > b * (1 + 1e-9)) for a, b in pairs)
        down = sum(isinstance(b, float) and (a is None or a < b * (1 - 1e-9)) for a, b in pairs)
        gains = [a / b - 1 for a, b in pairs if isinstance(a, float) and isinstance(b, float)]
        print(f"portfolio with the one pass among its seeds: faster in {up}, slower in {down} of {len(rows)} cells; "
              f"median {statistics.median(gains):+.2%}" if gains else "")  # fmt: skip
    times = [(r["onepass_s"], r["model"]) for r in rows if isinstance(r["onepass_s"], float)]
    if times:
        print(f"one-pass time: median {statistics.median(t for t, _ in times):.2f} s, max {max(times)[0]:.2f} s "
              f"({max(times)[1]}); target < 1 s on resnet101")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
