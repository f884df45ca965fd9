"""Plots people would rather look at than read: self-contained HTML (plotly.js embedded, works offline)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from runtime.fileio import atomic_write

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def memory_unit(largest_bytes: float) -> tuple[str, int]:
    """The binary unit for an axis whose values reach ``largest_bytes``: GiB from 1 GiB up, else MiB, else KiB
    (a small model's 4 and 5 MiB budgets both read 0.00 GiB)."""
    return next(((name, size) for name, size in _UNITS if largest_bytes >= size), _UNITS[-1])


def memory_timeline_figure(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    *,
    title: str,
    budget_bytes: int | None = None,
    peak_labels: Sequence[str] | None = None,
) -> Any:
    """Device memory over one iteration: one line per (name, times_s, live_bytes), its peak marked, and the
    budget as a horizontal line."""
    import plotly.graph_objects as go

    fig = go.Figure()
    unit, size = memory_unit(max([max(live, default=0) for _, _, live in series] + [budget_bytes or 0]))
    for i, (name, times, live) in enumerate(series):
        gib = [b / size for b in live]
        ms = [t * 1e3 for t in times]
        fig.add_trace(go.Scatter(x=ms, y=gib, mode="lines", name=name, line={"shape": "hv"}))
        top = max(range(len(gib)), key=gib.__getitem__)
        label = peak_labels[i] if peak_labels else ""
        fig.add_trace(
            go.Scatter(
                x=[ms[top]],
                y=[gib[top]],
                mode="markers+text",
                name=f"{name}: peak {gib[top]:.2f} {unit}",
                text=[f"peak {gib[top]:.2f} {unit}"],
                textposition="top center",
                marker={"size": 10, "symbol": "x"},
                hovertext=[label],
                showlegend=True,
            )
        )
    if budget_bytes is not None:
        fig.add_hline(
            y=budget_bytes / size,
            line_dash="dash",
            line_color="red",
            annotation_text=f"budget {budget_bytes / size:.2f} {unit}",
        )
    fig.update_layout(
        title=title,
        xaxis_title="time in the iteration (ms)",
        yaxis_title=f"device memory ({unit})",
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory saved, slowdown) points no other point beats (saves at least as much for less slowdown),
    by increasing memory saved: the staircase the reports draw."""
    out: list[tuple[float, float]] = []
    for saved, slow in sorted(points, key=lambda p: (-p[0], p[1])):  # most saved first
        if not out or slow < out[-1][1]:
            out.append((saved, slow))
    return sorted(out)


def write_html(fig: Any, path: str | os.PathLike[str]) -> None:
    """Write a figure as one self-contained HTML file, atomically (temp file, then rename), titled as the figure
    (plotly writes no ``<title>``: a browser's tab showed the file's name)."""
    import html

    page = fig.to_html(include_plotlyjs=True, full_html=True)
    title = html.escape(fig.layout.title.text or "autotune")
    atomic_write(path, page.replace("<head>", f"<head><title>{title}</title>", 1))
