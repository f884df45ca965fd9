"""Headline experiment 3: memory saved at equal throughput loss. How much of the no-policy peak each method
saves while staying within 2%, 5%, 10% and 20% of no policy's samples/s (DELTA: 40-70% of GPU memory
saved "with acceptable time delay").

    python experiments/exp_memory_saved.py [--models resnet50,...] [--profile a100-40gb]
        [--shares 0.9,0.8,...,0.1] [--levels 0.02,0.05,0.1,0.2] [--search-s 8]
        [--out experiments/results/memory_saved] [--replot]

For each model it sweeps budgets (the no-policy peak less a share of the saved activations at that peak,
headline_common.activation_budget) and at each runs every heuristic and the portfolio. Every policy found
(at any budget) is a point (peak, slowdown); a method's saving at a loss level is 1 - its smallest peak
with at most that slowdown / the no-policy peak. "best heuristic" pools every published heuristic's points;
DELTA is also shown alone. The pool has about ten points per budget where autotune has one (its answer at
that budget, the fastest policy it found within it), so between two budgets of the grid a heuristic can
show a larger saving. Writes <out>.csv (one row per model x level) and <out>.png (slowdown against
memory saved, the fronts), and every point in <out>_points.csv; ``--replot`` redraws the table and the PNG
from that file without searching. Simulator figures, on the profile's datasheet rates.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from headline_common import (
    MODELS,
    RESULTS,
    activation_budget,
    fmt,
    markdown_table,
    models_arg,
    pyplot,
    save_png,
    search_cell,
    trace,
    write_csv,
)

from autotune.plots import pareto_front
from runtime.hardware import get_profile
from runtime.workload import peak_report

HEADER = ["model", "batch", "profile", "level", "no_policy_peak_bytes", "autotune", "best_heuristic", "delta"]
POINTS_HEADER = ["model", "batch", "profile", "no_policy_peak_bytes", "method", "saved", "slowdown"]
METHODS = ("autotune", "best_heuristic", "delta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=models_arg, default=list(MODELS))
    ap.add_argument("--profile", default="a100-40gb")
    ap.add_argument("--shares", default="0.9,0.8,0.7,0.6,0.5,0.4,0.35,0.3,0.25,0.2,0.15,0.1")
    ap.add_argument("--levels", default="0.02,0.05,0.1,0.2")
    ap.add_argument("--search-s", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_saved")
    ap.add_argument("--replot", action="store_true", help="redraw from <out>_points.csv, no search")
    args = ap.parse_args()
    hw = get_profile(args.profile)
    levels = [float(x) for x in args.levels.split(",")]
    points_csv = args.out.with_name(args.out.name + "_points.csv")
    if args.replot:
        replot(points_csv, levels, args.out)
        return
    rows: list[dict[str, object]] = []
    fronts: dict[str, dict[str, list[tuple[float, float]]]] = {}  # model -> method -> (saved, slowdown)
    point_rows: list[dict[str, object]] = []
    for model in args.models:
        w = trace(model, hw)
        peak = peak_report(w, hw.alloc_granularity_bytes).peak_bytes
        points: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
        for share in (float(s) for s in args.shares.split(",")):
            cell = search_cell(w, hw, activation_budget(w, hw, share), args.search_s)
            if cell.found is None:
                print(f"{model}: {share:.0%} of the activations is below the floor, skipped", flush=True)
                continue
            for r in cell.heuristics:
                s = cell.slowdown(r)
                if s is not None:
                    points["best_heuristic"].append((1 - r.result.peak_bytes / peak, s))
                    if r.searcher == "delta":
                        points["delta"].append((1 - r.result.peak_bytes / peak, s))
            s = cell.slowdown(cell.found)
            if s is not None:
                points["autotune"].append((1 - cell.found.result.peak_bytes / peak, s))
            top = cell.best_heuristic()
            print(
                f"{model} b{w.batch_size} at {share:.0%} of the activations: autotune {fmt(s, 'pct')}, "
                f"{top.searcher if top else 'no heuristic'} {fmt(cell.slowdown(top), 'pct')}; {cell.wall_s:.0f} s",
                flush=True,
            )
        fronts[model] = points
        rows += level_rows(model, w.batch_size, hw.name, peak, points, levels)
        point_rows += [
            {"model": model, "batch": w.batch_size, "profile": hw.name, "no_policy_peak_bytes": peak,
             "method": m, "saved": saved, "slowdown": slow}
            for m in METHODS for saved, slow in points[m]
        ]  # fmt: skip
        write_csv(args.out.with_suffix(".csv"), HEADER, rows)
        write_csv(points_csv, POINTS_HEADER, point_rows)
    finish(rows, fronts, levels, args.out, hw.name)


def level_rows(
    model: str, batch: int, profile: str, peak: int, points: dict[str, list[tuple[float, float]]], levels: list[float]
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for level in levels:
        row: dict[str, object] = {
            "model": model,
            "batch": batch,
            "profile": profile,
            "level": level,
            "no_policy_peak_bytes": peak,
        }
        for m in METHODS:
            row[m] = max((saved for saved, s in points[m] if s <= level), default=None)
        rows.append(row)
    return rows


def replot(points_csv: Path, levels: list[float], out: Path) -> None:
    with points_csv.open() as f:
        raw = list(csv.DictReader(f))
    fronts: dict[str, dict[str, list[tuple[float, float]]]] = {}
    meta: dict[str, tuple[int, str, int]] = {}
    for r in raw:
        fronts.setdefault(r["model"], {m: [] for m in METHODS})[r["method"]].append(
            (float(r["saved"]), float(r["slowdown"]))
        )
        meta[r["model"]] = (int(r["batch"]), r["profile"], int(r["no_policy_peak_bytes"]))
    rows: list[dict[str, object]] = []
    for model, points in fronts.items():
        batch, profile, peak = meta[model]
        rows += level_rows(model, batch, profile, peak, points, levels)
    write_csv(out.with_suffix(".csv"), HEADER, rows)
    finish(rows, fronts, levels, out, next(iter(meta.values()))[1])


def finish(
    rows: list[dict[str, object]],
    fronts: dict[str, dict[str, list[tuple[float, float]]]],
    levels: list[float],
    out: Path,
    profile: str,
) -> None:
    print()
    print(table(rows, levels))
    plot(fronts, rows, out.with_suffix(".png"), profile)
    at20 = [r["autotune"] for r in rows if r["level"] == 0.2 and isinstance(r["autotune"], (int, float))]
    if at20:
        print(f"\nautotune at <= 20% slowdown saves {min(at20):.0%}-{max(at20):.0%} of the peak (DELTA: 40-70%)")
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")


def table(rows: list[dict[str, object]], levels: list[float]) -> str:
    header = ["model", "no-policy peak"] + [f"<= {lv:.0%} slower: autotune / heuristic / DELTA" for lv in levels]
    body = []
    for model in dict.fromkeys(str(r["model"]) for r in rows):
        sub = {float(r["level"]): r for r in rows if r["model"] == model}  # type: ignore[arg-type]
        first = next(iter(sub.values()))
        line = [f"{model} b{first['batch']}", fmt(first["no_policy_peak_bytes"], "gib")]
        for lv in levels:
            r = sub[lv]
            line.append(" / ".join(fmt(r[m], "share") for m in METHODS))
        body.append(line)
    return markdown_table(header, body)


def plot(
    fronts: dict[str, dict[str, list[tuple[float, float]]]], rows: list[dict[str, object]], path: Path, profile: str
) -> None:
    plt = pyplot()
    models = list(fronts)
    cols = min(3, len(models))
    nrows = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    style = {"autotune": ("o", "-"), "best_heuristic": ("s", "--"), "delta": ("^", ":")}
    for ax, model in zip(axes.flat, models, strict=False):
        for m in METHODS:
            pts = fronts[model][m]
            ax.scatter([100 * x for x, _ in pts], [100 * y for _, y in pts], marker=style[m][0], s=14, alpha=0.45)
            front = pareto_front(pts)
            ax.plot([100 * x for x, _ in front], [100 * y for _, y in front], style[m][1], label=m.replace("_", " "))
        peak = next(r["no_policy_peak_bytes"] for r in rows if r["model"] == model)
        ax.set_title(f"{model} (no-policy peak {fmt(peak, 'gib')})", fontsize=9)
        ax.set_xlabel("memory saved (% of the no-policy peak)")
        ax.set_ylabel("slowdown (%)")
        tops = [100 * y for m in METHODS for _, y in pareto_front(fronts[model][m])]
        ax.set_ylim(0, min(100.0, 1.15 * max(tops, default=10.0) + 2))  # points above: slower than any front
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(models) :]:
        ax.set_visible(False)
    fig.suptitle(f"Memory saved against slowdown ({profile}, simulated): lower right is better", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
