"""Headline experiment 4: swap or recompute? The share of the saved-activation bytes each action takes in
the best policy found, as the host link gets faster (PCIe 3.0, 4.0, 5.0 x16, NVLink-C2C), everything else
about the GPU unchanged: the question the seeds argue over (vDNN and Zhang et al. swap, Chen et al. and
Checkmate recompute, Capuchin, SuperNeurons and DELTA mix both).

    python experiments/exp_swap_vs_recompute.py [--models resnet50,...] [--profile h100-80gb]
        [--shares 0.5,0.25] [--search-s 10] [--out experiments/results/swap_vs_recompute]

The links are the profile's with only the host-to-device and device-to-host rates replaced (effective
rates of one direction: PCIe 3.0 12 GB/s, 4.0 25 GB/s, 5.0 50 GB/s as in runtime/hardware.py; NVLink-C2C
450 GB/s, half of Grace Hopper's 900 GB/s both ways). The default GPU is the H100 SXM, the chip that
exists with all four (GH200 for NVLink-C2C). Budgets hold the saved activations to ``--shares`` of their
bytes at the no-policy peak (headline_common.activation_budget); each cell runs every heuristic and then
the portfolio for ``--search-s`` seconds, seeded with them and with the policy found for the next slower
link (which also fits with a faster one, and runs at least as fast). Writes <out>.csv and <out>.png. Simulator figures.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from headline_common import (
    activation_budget,
    experiment_parser,
    fmt,
    markdown_table,
    pyplot,
    read_csv,
    save_png,
    search_cell,
    show,
    trace,
    write_csv,
)

from runtime.hardware import HardwareProfile, get_profile
from runtime.policy import ACTIONS

LINKS = {"pcie3": 12e9, "pcie4": 25e9, "pcie5": 50e9, "nvlink-c2c": 450e9}
HEADER = [
    "model",
    "batch",
    "profile",
    "link",
    "link_bytes_per_s",
    "share",
    "budget_bytes",
    *(a.value for a in ACTIONS),
    "samples_per_s_no_policy",
    "samples_per_s",
    "slowdown",
    "swap_only",
    "recompute_only",
]


def with_link(hw: HardwareProfile, name: str, rate: float) -> HardwareProfile:
    return dataclasses.replace(hw, name=f"{hw.name}+{name}", h2d_bytes_per_s=rate, d2h_bytes_per_s=rate)


def main() -> None:
    ap = experiment_parser(__doc__, "swap_vs_recompute")
    ap.add_argument("--profile", default="h100-80gb")
    ap.add_argument("--shares", default="0.5,0.25")
    ap.add_argument("--search-s", type=float, default=10.0)
    args = ap.parse_args()
    if args.replot:
        show(read_csv(args.out.with_suffix(".csv")), table, plot, args.out)
        return
    base = get_profile(args.profile)
    rows: list[dict[str, object]] = []
    for model in args.models:
        w = trace(model, base)  # the links differ; the kernels, and so the trace, do not
        total = sum(c.nbytes for c in w.candidates)
        for share in (float(s) for s in args.shares.split(",")):
            previous = None  # the slower link's policy also fits here, as fast or faster: a seed
            for link, rate in LINKS.items():
                hw = with_link(base, link, rate)
                cell = search_cell(w, hw, activation_budget(w, hw, share), args.search_s, extra_seeds=[previous])
                previous = cell.found.policy if cell.found is not None and cell.found.feasible else None
                row: dict[str, object] = {
                    "model": model,
                    "batch": w.batch_size,
                    "profile": base.name,
                    "link": link,
                    "link_bytes_per_s": rate,
                    "share": share,
                    "budget_bytes": cell.budget,
                    "samples_per_s_no_policy": cell.no_policy.samples_per_s,
                    "swap_only": cell.slowdown(cell.heuristic("vdnn")),
                    "recompute_only": cell.slowdown(cell.heuristic("checkpoint-sqrt")),
                }
                if cell.found is not None and cell.found.feasible:
                    by = cell.found.policy.bytes_by_action(w)
                    row.update({a.value: by[a] / total for a in ACTIONS})
                    row["samples_per_s"] = cell.found.result.samples_per_s
                    row["slowdown"] = cell.slowdown(cell.found)
                rows.append(row)
                print(
                    f"{model} b{w.batch_size} {share:.0%} {link}: swap {fmt(row.get('swap'), 'share')}, recompute "
                    f"{fmt(row.get('recompute'), 'share')}, slowdown {fmt(row.get('slowdown'), 'pct')}; "
                    f"{cell.wall_s:.0f} s",
                    flush=True,
                )
                write_csv(args.out.with_suffix(".csv"), HEADER, rows)
    show(rows, table, plot, args.out)
    print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.png')}")


def table(rows: list[dict[str, object]]) -> str:
    header = ["model", "activations kept", *(f"{link}: swap / recompute (slowdown)" for link in LINKS)]
    body = []
    keys = list(dict.fromkeys((str(r["model"]), float(r["share"])) for r in rows))  # type: ignore[arg-type]
    for model, share in keys:
        sub = {r["link"]: r for r in rows if r["model"] == model and r["share"] == share}
        batch = next(iter(sub.values()))["batch"]
        line = [f"{model} b{batch}", f"{share:.0%}"]
        for link in LINKS:
            r = sub.get(link, {})
            if r.get("slowdown") is None:
                line.append("no fit")
            else:
                line.append(f"{fmt(r['swap'], 'share')} / {fmt(r['recompute'], 'share')} ({fmt(r['slowdown'], 'pct')})")
        body.append(line)
    return markdown_table(header, body)


def plot(rows: list[dict[str, object]], path: Path) -> None:
    plt = pyplot()
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    shares = list(dict.fromkeys(float(r["share"]) for r in rows))  # type: ignore[arg-type]
    fig, axes = plt.subplots(
        len(shares), len(models), figsize=(2.9 * len(models), 3.1 * len(shares)), squeeze=False, sharey=True
    )
    colors = {"keep": "#9e9e9e", "swap": "#1f77b4", "recompute": "#ff7f0e", "compress": "#2ca02c"}
    for i, share in enumerate(shares):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sub = {r["link"]: r for r in rows if r["model"] == model and r["share"] == share}
            xs = list(range(len(LINKS)))
            bottom = [0.0] * len(xs)
            for a in ACTIONS:
                vals = [100 * float(sub.get(link, {}).get(a.value) or 0.0) for link in LINKS]  # type: ignore[arg-type]
                if any(vals):
                    ax.bar(xs, vals, bottom=bottom, color=colors[a.value], label=a.value, width=0.7)
                    bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
            for x, link in zip(xs, LINKS, strict=True):
                slow = sub.get(link, {}).get("slowdown")
                label = f"{100 * slow:+.0f}%" if isinstance(slow, (int, float)) else "no fit"
                ax.annotate(label, (x, 101), ha="center", fontsize=7)
            ax.set_xticks(xs, [link.replace("nvlink-", "NVL-") for link in LINKS], fontsize=7)
            ax.set_ylim(0, 112)
            if i == 0:
                ax.set_title(model, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"activations held to {share:.0%}\n% of saved-activation bytes", fontsize=8)
    legend: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", fontsize=8, ncol=len(legend))
    fig.suptitle(
        f"Action mix of the best policy by host link ({rows[0]['profile']}, simulated); above the bars: slowdown",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.94))
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
