"""PNG plots of serving-benchmark results (matplotlib, Agg backend: no display needed).

The functions take plain numbers, not runner objects, so they can redraw old results.json
files too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

_CDF_METRICS = (("ttft", "TTFT"), ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))


def plot_latency_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: Path) -> Path:
    """Empirical CDFs of TTFT, ITL and E2E (ms), one line per label (e.g. "strait c=8").

    ``series[label][metric]`` holds the samples for metric "ttft", "itl" and "e2e".
    """
    fig, axes = plt.subplots(1, len(_CDF_METRICS), figsize=(5 * len(_CDF_METRICS), 4))
    for ax, (metric, title) in zip(axes, _CDF_METRICS, strict=True):
        low, high = float("inf"), 0.0
        for label, metrics in series.items():
            values = sorted(metrics.get(metric, ()))
            if not values:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=label)
            low, high = min(low, values[0]), max(high, values[-1])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if low > 0 and high / low > 20:  # tails spanning decades read better on a log axis
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (target, load level) of a sweep."""

    target: str
    x: float  # arrival rate (req/s) or concurrency
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    goodput_per_s: float


def plot_sweep(points: Sequence[SweepPoint], x_label: str, path: Path) -> Path:
    """Throughput, TTFT (p50 solid, p99 dashed) and goodput against the load, per target."""
    fig, (ax_tps, ax_ttft, ax_good) = plt.subplots(1, 3, figsize=(15, 4))
    targets = list(dict.fromkeys(p.target for p in points))
    for index, target in enumerate(targets):
        color = f"C{index % 10}"
        mine = sorted((p for p in points if p.target == target), key=lambda p: p.x)
        xs = [p.x for p in mine]
        ax_tps.plot(xs, [p.output_tokens_per_s for p in mine], "o-", color=color, label=target)
        ax_ttft.plot(
            xs, [_nan(p.ttft_p50_ms) for p in mine], "o-", color=color, label=f"{target} p50"
        )
        ax_ttft.plot(
            xs, [_nan(p.ttft_p99_ms) for p in mine], "s--", color=color, label=f"{target} p99"
        )
        ax_good.plot(xs, [p.requests_per_s for p in mine], "o:", color=color, alpha=0.5)
        ax_good.plot(xs, [p.goodput_per_s for p in mine], "o-", color=color, label=target)
    ax_tps.set_title("output throughput")
    ax_tps.set_ylabel("tokens/s")
    ax_ttft.set_title("time to first token")
    ax_ttft.set_ylabel("ms")
    ax_good.set_title("goodput (solid) and completed (dotted)")
    ax_good.set_ylabel("requests/s")
    for ax in (ax_tps, ax_ttft, ax_good):
        ax.set_xlabel(x_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
