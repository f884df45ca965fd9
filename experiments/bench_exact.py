"""The default searcher against the exact yardstick on small instances (issue 19, items 1-2).

    python experiments/bench_exact.py [--exact-s 120] [--search-s 20] [--fractions 0.8,0.7,0.6,0.5,0.4]
        [--cases chain6,chain9,framed8,diamond,synthetic3,synthetic5] [--csv FILE]

Per cell (a hand-made workload on a test profile, or the synthetic CNN on a GPU profile or the CPU's; budget
= fraction of its no-policy peak): the branch and bound (agents/solvers/exact.py) over every policy, look-ahead
and release point, without an incumbent, for at most ``--exact-s``: the optimum when proven (or that nothing
fits), else its best and bound; then the portfolio (20 trials, ``--search-s``) and its ratio to the proven
optimum. The summary: cells where a policy fits, where the optimum is proven, and the portfolio within 1% of
it (target: every such cell) with the cells below listed.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.base import Problem, SearchContext, get_searcher
from agents.solvers.exact import solve_exact
from runtime.hardware import HardwareProfile, get_profile
from runtime.synthetic import synthetic_workload
from runtime.workload import Workload, peak_report
from tests.synthetic import chain_workload, diamond_workload, fixed_profile, framed_chain_workload
from tests.test_search import _PROFILES, TAU, S

HAND_MADE: dict[str, Callable[[], Workload]] = {
    "chain6": lambda: chain_workload(6, S, TAU),
    "chain9": lambda: chain_workload(9, S, TAU),
    "framed8": lambda: framed_chain_workload(8, S, TAU, block=2),
    "diamond": lambda: diamond_workload(S, TAU),
}
SYNTHETIC = {"synthetic3": 3, "synthetic5": 5}
SYNTHETIC_PROFILES = ("a100-40gb", "v100-16gb", "cpu")


def cases(names: list[str]) -> list[tuple[str, Workload, HardwareProfile]]:
    out: list[tuple[str, Workload, HardwareProfile]] = []
    for name in names:
        if name in HAND_MADE:
            out += [(f"{name}/{p}", HAND_MADE[name](), fixed_profile(**kw)) for p, kw in _PROFILES.items()]  # type: ignore[arg-type]
        elif name in SYNTHETIC:
            out += [
                (f"{name}/{p}", synthetic_workload(blocks=SYNTHETIC[name]), get_profile(p)) for p in SYNTHETIC_PROFILES
            ]
        else:
            raise SystemExit(f"unknown case {name!r}: expected some of {', '.join([*HAND_MADE, *SYNTHETIC])}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exact-s", type=float, default=120.0)
    ap.add_argument("--search-s", type=float, default=20.0)
    ap.add_argument("--fractions", default="0.8,0.7,0.6,0.5,0.4")
    ap.add_argument("--cases", default=",".join([*HAND_MADE, *SYNTHETIC]))
    ap.add_argument("--csv", type=Path, default=Path("experiments/results/exact.csv"))
    args = ap.parse_args()
    rows: list[dict[str, object]] = []
    for name, w, hw in cases(args.cases.split(",")):
        peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
        for fraction in (float(f) for f in args.fractions.split(",")):
            budget = int(peak * fraction)
            started = time.perf_counter()
            ex = solve_exact(Problem(w, hw, budget), time_limit_s=args.exact_s)
            row: dict[str, object] = {"case": name, "budget": f"{fraction:.0%}", "optimal": ex.optimal,
                                      "exact": ex.samples_per_s, "exact_s": time.perf_counter() - started}  # fmt: skip
            if ex.result is None:
                print(f"{name} {fraction:.0%}: nothing fits ({'proven' if ex.optimal else 'none found'})", flush=True)
                rows.append(row)
                continue
            started = time.perf_counter()
            ctx = SearchContext(trials=20, time_limit_s=args.search_s)
            got = get_searcher("portfolio").search(Problem(w, hw, budget), ctx)
            speed = got.result.samples_per_s if got.feasible else 0.0
            row.update(portfolio=speed, portfolio_s=time.perf_counter() - started, ratio=speed / ex.samples_per_s)
            rows.append(row)
            proven = "optimum" if ex.optimal else f"best (bound {ex.bound_samples_per_s:,.3f})"
            print(
                f"{name} {fraction:.0%}: {proven} {ex.samples_per_s:,.3f} in {row['exact_s']:.1f} s; portfolio "
                f"{speed:,.3f} in {row['portfolio_s']:.1f} s: {row['ratio']:.4f}",
                flush=True,
            )
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "budget", "optimal", "exact", "exact_s", "portfolio",
                                               "portfolio_s", "ratio"])  # fmt: skip
        writer.writeheader()
        writer.writerows(rows)
    fits = [r for r in rows if r["exact"]]
    proven = [r for r in fits if r["optimal"]]
    short = [r for r in proven if float(r["ratio"]) < 0.99]  # type: ignore[arg-type]
    print(f"\ncells: {len(rows)}; a policy fits in {len(fits)}; the optimum proven in {len(proven)}")
    print(f"portfolio within 1% of the proven optimum in {len(proven) - len(short)} of {len(proven)} (target: all)")
    for r in short:
        print(f"  short: {r['case']} {r['budget']}: {float(r['ratio']):.4f}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
