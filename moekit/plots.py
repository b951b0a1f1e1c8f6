"""PNG plots of `moekit bench` rows. matplotlib is an optional extra (`pip install 'moekit[plot]'`),
imported only when a plot is drawn; without it `require_matplotlib` raises `PlotError` saying so.

Figures are drawn with matplotlib's object API (no pyplot, no global state, no display needed).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Sequence


class PlotError(RuntimeError):
    """Plots cannot be drawn (matplotlib missing)."""


def require_matplotlib():
    """The matplotlib module, or PlotError with the command that installs it."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise PlotError("plots need matplotlib, which is not installed: pip install 'moekit[plot]'") from None
    return matplotlib


def _figure(num_panels: int):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(num_panels, 3)
    rows = -(-num_panels // cols)
    fig = Figure(figsize=(5.5 * cols, 4.2 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    return fig, axes[:num_panels]


def _by_model(rows: Sequence[dict]) -> dict[str, dict[str, list[dict]]]:
    """model -> backend label -> rows sorted by batch size (rows with a positive time only: the
    axes are logarithmic, and a 0 µs median (bench reports it as an error) would be drawn as a
    line plunging off the bottom of the panel)."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[r["model"]]  # keep models without any timed row as (empty) panels
        if r.get("median_us") is None or not r["median_us"] > 0:
            continue
        out[r["model"]][r["backend"]].append(r)
    for backends in out.values():
        for series in backends.values():
            series.sort(key=lambda r: r["batch_size"])
    return out


def _log2_batch_axis(ax, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    if sizes:
        ticks = sorted(set(sizes))
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], rotation=45 if len(ticks) > 8 else 0)
    ax.set_xlabel("batch size M (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, path: str | os.PathLike) -> None:
    fig.savefig(path, format="png", dpi=110)


def latency_plot(rows: Sequence[dict], path: str | os.PathLike, *, title: str = "") -> None:
    """Median latency against batch size per backend (log-log), p20-p80 shaded, floor dashed."""
    models = _by_model(rows)
    fig, axes = _figure(max(len(models), 1))
    if title:
        fig.suptitle(title, fontsize=10)
    for ax, (model, backends) in zip(axes, models.items()):
        sizes = []
        for backend, series in backends.items():
            m = [r["batch_size"] for r in series]
            sizes += m
            med = [r["median_us"] for r in series]
            line = ax.plot(m, med, marker="o", markersize=3, label=backend)[0]
            ax.fill_between(m, [r["p20_us"] for r in series], [r["p80_us"] for r in series],
                            color=line.get_color(), alpha=0.15, linewidth=0)
        floor = {}
        for series in backends.values():
            for r in series:
                if r.get("floor_us") is not None:
                    floor[r["batch_size"]] = r["floor_us"]
        if floor:
            m = sorted(floor)
            ax.plot(m, [floor[k] for k in m], "k--", linewidth=1, label="floor (roofline)")
        ax.set_yscale("log")
        _log2_batch_axis(ax, sizes)
        ax.set_ylabel("median latency (µs)")
        ax.set_title(model, fontsize=10)
        if backends:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no timed points", ha="center", va="center", transform=ax.transAxes)
    _save(fig, path)


def efficiency_plot(rows: Sequence[dict], path: str | os.PathLike, *, title: str = "", has_ceilings: bool = True) -> None:
    """Efficiency (floor / time) against batch size per backend. Without ceilings (CPU) the plot
    is still written and says why it is empty."""
    models = _by_model(rows)
    fig, axes = _figure(max(len(models), 1))
    if title:
        fig.suptitle(title, fontsize=10)
    for ax, (model, backends) in zip(axes, models.items()):
        sizes, drawn = [], False
        for backend, series in backends.items():
            pts = [(r["batch_size"], r["efficiency"]) for r in series if r.get("efficiency") is not None]
            sizes += [r["batch_size"] for r in series]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=backend)
                drawn = True
        _log2_batch_axis(ax, sizes)
        top = max([1.0] + [r["efficiency"] for s in backends.values() for r in s if r.get("efficiency") is not None])
        ax.set_ylim(0, top * 1.05)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_ylabel("efficiency = floor / time")
        ax.set_title(model, fontsize=10)
        if drawn:
            ax.legend(fontsize=8)
        else:
            why = ("no ceilings on the CPU:\nefficiency needs a GPU's measured\ncopy bandwidth and matmul rate"
                   if not has_ceilings else "no efficiency values")
            ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=9, transform=ax.transAxes)
    _save(fig, path)


__all__ = ["PlotError", "require_matplotlib", "latency_plot", "efficiency_plot"]
