"""The sweep's HTML report: one self-contained file (plotly.js inline, no CDN, works offline).

Sections: a summary table; samples/s against budget per model and method; slowdown against memory saved
(every search trial, and the Pareto front); the memory timeline of the chosen policy against no policy; the
action mix per layer; the search history per cell. JavaScript errors are caught into ``#js-errors`` (the
report test reads it in headless Chromium).
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from autotune.plots import memory_unit, pareto_front
from autotune.sweep import CellResult, WorkloadOf, best_policy
from autotune.units import format_bytes
from envs.simulator import Simulator
from runtime.fileio import atomic_write
from runtime.hardware import HardwareProfile
from runtime.policy import ACTIONS

COLORS = {"no policy": "#7f7f7f", "best heuristic": "#ff7f0e", "optuna": "#1f77b4", "ppo": "#2ca02c"}
ACTION_COLORS = {"keep": "#9e9e9e", "swap": "#1f77b4", "recompute": "#ff7f0e", "compress": "#2ca02c"}


def build_report(
    cells: Sequence[CellResult],
    workload_of: WorkloadOf,
    profiles: dict[str, HardwareProfile],
    trials: dict[str, list[dict[str, Any]]],
    *,
    title: str = "autotune sweep",
) -> str:
    """The report's HTML. ``trials``: study name -> [{number, samples_per_s, peak_bytes, feasible}]."""
    import plotly.offline

    # Why a figure has nothing to draw: the trials' figures need Optuna's trials, which a sweep without the
    # optuna method has none of (it said "no fitting policy" where a baseline's fitted).
    no_fit = "no fitting policy in any cell"
    no_trial = (
        no_fit if any(trials.get(c.study_name) for c in cells) else "no Optuna trials: the sweep ran without optuna"
    )
    figures = [
        ("Samples/s against the budget", _throughput(cells), no_fit),
        ("Slowdown against memory saved (every trial; line: Pareto front)", _pareto(cells, trials), no_trial),
        (
            "Memory over one iteration: the chosen policy at the tightest budget against no policy",
            _timelines(cells, workload_of, profiles),
            no_fit,
        ),
        ("Where each action goes, per layer (tightest budget)", _action_mix(cells, workload_of, profiles), no_fit),
        ("Search history (best fitting samples/s so far, per cell)", _history(cells, trials), no_trial),
    ]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:24px;max-width:1400px}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}h2{margin-top:32px}</style>",
        # Caught before plotly runs, so that a headless browser can read them off the page.
        "<script>window.__errors=[];window.addEventListener('error',function(e){window.__errors.push("
        "String(e.message));var p=document.getElementById('js-errors');if(p){p.textContent="
        "window.__errors.join('\\n');}});</script>",
        f"<script>{plotly.offline.get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<pre id='js-errors' style='color:#b00'></pre>",
        _summary_table(cells),
    ]
    for i, (heading, fig, empty) in enumerate(figures):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if fig is None:
            parts.append(f"<p>nothing to show ({empty})</p>")
            continue
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{i}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(path: Any, text: str) -> None:
    atomic_write(path, text)


def _summary_table(cells: Sequence[CellResult]) -> str:
    head = ["model", "batch", "profile", "budget", "no policy", "best heuristic", "optuna", "ppo", "chosen"]
    rows = []
    for c in cells:
        j = c.to_json()

        def f(v: float | None) -> str:
            return "—" if v is None else f"{v:,.1f}"

        h = f"{f(j['best_heuristic_samples_per_s'])} ({j['best_heuristic']})" if j["best_heuristic"] else "—"
        chosen = c.floor_text() if c.below_floor else f"{f(j['samples_per_s'])} ({j['best_method'] or '—'})"
        chosen += f" on {c.slices}" if c.partitions and not c.below_floor else ""  # a submodule run on slices
        chosen += " (interrupted)" if c.interrupted else ""  # as the terminal's table says
        chosen += f"; {c.reserved_text()}" if c.reserved_checked and not c.below_floor else ""
        rows.append(
            [
                c.model,
                str(c.batch_size),
                c.profile,
                _budget(c),
                f"{f(j['no_policy_samples_per_s'])} ({format_bytes(j['no_policy_peak_bytes'])})",
                h,
                f(j["optuna_samples_per_s"]),
                f(j["ppo_samples_per_s"]),
                chosen,
            ]
        )
    out = ["<table><tr>", *(f"<th>{html.escape(x)}</th>" for x in head), "</tr>"]
    for r in rows:
        out += ["<tr>", *(f"<td>{html.escape(x)}</td>" for x in r), "</tr>"]
    out.append("</table><p>samples/s, simulated; the no-policy column is the ceiling (its peak in brackets).</p>")
    return "".join(out)


def _models(cells: Sequence[CellResult]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((c.model, c.profile) for c in cells))


def _throughput(cells: Sequence[CellResult]) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = _models(cells)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[f"{m} on {p}" for m, p in groups])
    shown: set[str] = set()
    for col, (model, profile) in enumerate(groups, start=1):
        sub = sorted((c for c in cells if c.model == model and c.profile == profile), key=lambda c: c.budget_bytes)
        unit, size = memory_unit(max(c.budget_bytes + c.reserve_bytes for c in sub))
        x = [(c.budget_bytes + c.reserve_bytes) / size for c in sub]  # the budget as typed
        series: dict[str, list[float | None]] = {
            "no policy": [c.no_policy["samples_per_s"] for c in sub],
            "best heuristic": [(h[1]["samples_per_s"] if (h := c.best_heuristic()) else None) for c in sub],
            "optuna": [c.best_of("optuna") for c in sub],
            "ppo": [c.ppo["samples_per_s"] if c.ppo and c.ppo["feasible"] else None for c in sub],
        }
        for name, ys in series.items():
            if all(y is None for y in ys):
                continue
            dash = "dash" if name == "no policy" else None
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=ys,
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=name not in shown,
                    line={"color": COLORS[name], "dash": dash},
                ),
                row=1,
                col=col,
            )
            shown.add(name)
        fig.update_xaxes(title_text=f"budget as given ({unit})", row=1, col=col)
    fig.update_yaxes(title_text="samples/s (simulated)", row=1, col=1)
    fig.update_layout(template="plotly_white", height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def _pareto(cells: Sequence[CellResult], trials: dict[str, list[dict[str, Any]]]) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = _models(cells)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[f"{m} on {p}" for m, p in groups])
    any_point = False
    for col, (model, profile) in enumerate(groups, start=1):
        pts: list[tuple[float, float, str]] = []
        answers: list[tuple[float, float, str]] = []
        for c in cells:
            if c.model != model or c.profile != profile:
                continue
            for t in trials.get(c.study_name, []):
                if t["feasible"] and t["samples_per_s"]:
                    pts.append((*_saved_and_slowdown(c, t), f"{_budget(c)} budget, trial {t['number']}"))
            if c.best and c.best.get("samples_per_s"):  # refined after the trials, or a baseline's: not a trial
                answers.append((*_saved_and_slowdown(c, c.best), f"{_budget(c)} budget: answer ({c.best['method']})"))
        if not pts:
            continue
        any_point = True
        marker = {"size": 5, "color": COLORS["optuna"], "opacity": 0.35}
        fig.add_trace(_markers(pts, "trials", marker, legend=col == 1), row=1, col=col)
        front = pareto_front([(saved, slow) for saved, slow, _ in pts])
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in front],
                y=[p[1] for p in front],
                mode="lines",
                name="Pareto front",
                legendgroup="front",
                showlegend=col == 1,
                line={"color": "#d62728", "shape": "hv"},
            ),
            row=1,
            col=col,
        )
        if answers:
            star = {"size": 11, "symbol": "star", "color": "#2ca02c"}
            fig.add_trace(_markers(answers, "each cell's answer", star, legend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="memory saved (% of the no-policy peak)", row=1, col=col)
    if not any_point:
        return None
    fig.update_yaxes(title_text="slowdown against no policy (%)", row=1, col=1)
    fig.update_layout(template="plotly_white", height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def _markers(points: Sequence[tuple[float, float, str]], name: str, marker: dict[str, Any], legend: bool) -> Any:
    """(memory saved, slowdown, hover text) points as one scatter of markers, in the legend once (``legend``)."""
    import plotly.graph_objects as go

    return go.Scatter(
        x=[p[0] for p in points],
        y=[p[1] for p in points],
        mode="markers",
        text=[p[2] for p in points],
        name=name,
        legendgroup=name,
        showlegend=legend,
        marker=marker,
    )


def _saved_and_slowdown(c: CellResult, found: dict[str, Any]) -> tuple[float, float]:
    """A policy's memory saved (% of the cell's no-policy peak) and slowdown against no policy (%)."""
    peak0, speed0 = c.no_policy["peak_bytes"], c.no_policy["samples_per_s"]
    return 100 * (1 - found["peak_bytes"] / peak0), 100 * (speed0 / found["samples_per_s"] - 1)


def _tightest(cells: Sequence[CellResult], model: str, profile: str) -> CellResult | None:
    fitting = [c for c in cells if c.model == model and c.profile == profile and c.best and c.best.get("actions")]
    return min(fitting, key=lambda c: c.budget_bytes) if fitting else None


def _timelines(cells: Sequence[CellResult], workload_of: WorkloadOf, profiles: dict[str, HardwareProfile]) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    chosen = [(m, p, t) for m, p in _models(cells) if (t := _tightest(cells, m, p)) is not None]
    if not chosen:
        return None
    fig = make_subplots(
        rows=1,
        cols=len(chosen),
        subplot_titles=[f"{m} on {p}, budget {_budget(c)}" for m, p, c in chosen],
    )
    unit, size = memory_unit(max(c.budget_bytes for _, _, c in chosen))
    for col, (_model, profile, cell) in enumerate(chosen, start=1):
        (plain, w), hw = workload_of(cell), profiles[profile]
        policy = best_policy(cell, w, hw)
        assert policy is not None
        for name, r, color in (
            ("no policy", Simulator(plain, hw).no_policy(timeline=True), COLORS["no policy"]),
            ("chosen policy", Simulator(w, hw).run(policy, timeline=True), COLORS["optuna"]),
        ):
            assert r.timeline is not None
            fig.add_trace(
                go.Scatter(
                    x=[t * 1e3 for t in r.timeline["op_start_s"]],
                    y=[b / size for b in r.timeline["live_bytes"]],
                    mode="lines",
                    line={"shape": "hv", "color": color},
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=cell.budget_bytes / size, line_dash="dash", line_color="red", row=1, col=col)
        fig.update_xaxes(title_text="time in the iteration (ms)", row=1, col=col)
    fig.update_yaxes(title_text=f"device memory ({unit})", row=1, col=1)
    fig.update_layout(template="plotly_white", height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def _action_mix(cells: Sequence[CellResult], workload_of: WorkloadOf, profiles: dict[str, HardwareProfile]) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    chosen = [(m, p, t) for m, p in _models(cells) if (t := _tightest(cells, m, p)) is not None]
    if not chosen:
        return None
    fig = make_subplots(rows=len(chosen), cols=1, subplot_titles=[f"{m} on {p}" for m, p, _ in chosen])
    for row, (_model, profile, cell) in enumerate(chosen, start=1):
        w = workload_of(cell)[1]
        policy = best_policy(cell, w, profiles[profile])
        assert policy is not None
        per_layer: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys((a.value for a in ACTIONS), 0))
        for cand in w.candidates:
            per_layer[_layer(cand.key)][policy.actions[cand.key].value] += cand.nbytes
        layers = list(per_layer)
        for a in ACTIONS:
            ys = [per_layer[layer][a.value] / 2**20 for layer in layers]
            if any(ys):
                fig.add_trace(
                    go.Bar(
                        x=layers,
                        y=ys,
                        name=a.value,
                        legendgroup=a.value,
                        showlegend=row == 1,
                        marker_color=ACTION_COLORS[a.value],
                    ),
                    row=row,
                    col=1,
                )
        fig.update_yaxes(title_text="saved activations (MiB)", row=row, col=1)
    fig.update_layout(
        template="plotly_white", barmode="stack", height=380 * len(chosen), legend={"orientation": "h", "y": 1.05}
    )
    return fig


def _layer(key: str) -> str:
    """The layer a candidate key belongs to: its module path's first two parts (``layer1.0``)."""
    path = key.split("#", 1)[0]
    parts = path.split(".")
    return ".".join(parts[:2]) if parts and parts[0] else path


def _history(cells: Sequence[CellResult], trials: dict[str, list[dict[str, Any]]]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for c in cells:
        best = None
        xs, ys = [], []
        for t in sorted(trials.get(c.study_name, []), key=lambda t: t["number"]):
            if t["feasible"] and (best is None or t["samples_per_s"] > best):
                best = t["samples_per_s"]
            if best is not None:
                xs.append(t["number"])
                ys.append(best)
        if xs:
            name = f"{c.model} {c.profile} {_budget(c)}"
            line = go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv"}, name=name, legendgroup=name)
            fig.add_trace(line)
            if c.best and c.best.get("samples_per_s"):  # the answer, refined after the last trial (or a baseline's)
                fig.add_trace(
                    go.Scatter(
                        x=[xs[-1]],
                        y=[c.best["samples_per_s"]],
                        mode="markers",
                        marker={"size": 11, "symbol": "star"},
                        name=f"{name}: answer ({c.best['method']})",
                        legendgroup=name,
                    )
                )
    if not fig.data:
        return None
    fig.update_layout(template="plotly_white", height=420, xaxis_title="trial", yaxis_title="samples/s (simulated)")
    return fig


def study_trials(storage: str, names: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Each study's completed trials as the report plots them."""
    import optuna

    out: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            continue
        rows = []
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            a = t.user_attrs
            if "peak_bytes" in a:
                feasible = a.get("constraint", [1.0])[0] <= 0
                rows.append(
                    {
                        "number": t.number,
                        "samples_per_s": a["samples_per_s"],
                        "peak_bytes": a["peak_bytes"],
                        "feasible": feasible,
                    }
                )
        out[name] = rows
    return out


def _budget(c: CellResult) -> str:
    """A cell's budget as typed, and what was planned for where a reserve was kept back."""
    given = format_bytes(c.budget_bytes + c.reserve_bytes)
    return given + (f" (planned {format_bytes(c.budget_bytes)})" if c.reserve_bytes else "")
