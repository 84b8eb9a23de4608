"""Latency-percentile PNGs for the benchmarks (``--plot F.png``).

matplotlib is optional (not a project dependency): without it :func:`plot_latency_percentiles`
raises :class:`PlotUnavailable` and the caller says so and carries on. The figure is built
with ``matplotlib.figure.Figure`` directly, so no pyplot state or GUI backend is involved.
"""

from __future__ import annotations

import numpy as np

# Percentiles marked and labelled on every curve; the x axis is stretched towards the tail
# (x = -log10(1 - p/100), so 90, 99 and 99.9 are evenly spaced), where serving latency lives.
MARKED_PERCENTILES = (50.0, 90.0, 99.0)
AXIS_TICKS = (50.0, 90.0, 99.0, 99.9)
TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def tail_axis(percentile):
    """Where percentile ``p`` (0..99.9) sits on the x axis: -log10(1 - p/100)."""
    return -np.log10(1.0 - np.asarray(percentile, dtype=float) / 100.0)


def percentile_curve(values_s: list[float], points: int = 301) -> tuple[np.ndarray, np.ndarray]:
    """(percentiles 0..99.9 spaced evenly on the tail axis, latency in ms at each), with numpy's
    linear interpolation as vLLM's percentiles use."""
    pct = 100.0 * (1.0 - 10.0 ** -np.linspace(0.0, 3.0, points))
    return pct, np.percentile(np.asarray(values_s, dtype=float) * 1000.0, pct)


def plot_latency_percentiles(series_s: dict[str, list[float]], path: str, title: str) -> str:
    """One panel per non-empty series (seconds): latency (ms) against percentile; returns
    ``path``. Raises PlotUnavailable without matplotlib, ValueError when every series is empty."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed (pip install matplotlib)") from None
    panels = [(name, values) for name, values in series_s.items() if len(values)]
    if not panels:
        raise ValueError("no latency samples to plot (did every request fail?)")
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(6.0 * cols, 4.0 * rows), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (name, values) in zip(axes, panels):
        samples_ms = np.asarray(values, dtype=float) * 1000.0
        pct, ms = percentile_curve(values)
        ax.plot(tail_axis(pct), ms, linewidth=1.5)
        for p in MARKED_PERCENTILES:
            y = float(np.percentile(samples_ms, p))
            ax.plot([tail_axis(p)], [y], "o", color="tab:red", markersize=4)
            ax.annotate(f"P{p:g} {y:.1f}", (tail_axis(p), y), textcoords="offset points", xytext=(-4, 6),
                        ha="right", fontsize=8)
        label = TITLES.get(name, name.upper())
        ax.set_title(f"{label}: {len(samples_ms)} samples, mean {samples_ms.mean():.1f} ms")
        ax.set_xticks(tail_axis(AXIS_TICKS), [f"{t:g}" for t in AXIS_TICKS])
        ax.set_xlabel("percentile")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_xlim(0.0, 3.0)
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=100)
    return path
