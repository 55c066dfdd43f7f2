"""PNG plots of an aggregated benchmark report (matplotlib, headless).

Input is plain Python data already aggregated by Spark in loadtest/report.py, so this module
never touches Spark and can be tested or reused on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run on servers without a display

import matplotlib.pyplot as plt  # noqa: E402

# (median, min, max) of one metric for one broker in one scenario
Stat = tuple[float, float, float]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def throughput_bars(
    throughput: Mapping[str, Mapping[str, Mapping[str, Stat]]],
    brokers: Sequence[str],
    labels: Mapping[str, str],
    out_dir: Path,
) -> list[Path]:
    """One PNG per direction (publish, consume): scenarios on x, one bar per broker.

    ``throughput[direction][scenario][broker] = (median, min, max)`` in msgs/s; the error bar
    spans min..max across runs. Scenarios with no rate in a direction are left out of its plot.
    """
    written: list[Path] = []
    for direction, per_scenario in throughput.items():
        scenarios = sorted(s for s, per_broker in per_scenario.items()
                           if any(v[0] > 0 for v in per_broker.values()))
        if not scenarios:
            continue
        width = 0.8 / max(1, len(brokers))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(scenarios) + 2), 4.5))
        for i, broker in enumerate(brokers):
            xs, meds, lo, hi = [], [], [], []
            for j, scenario in enumerate(scenarios):
                stat = per_scenario[scenario].get(broker)
                if stat is None:
                    continue
                med, mn, mx = stat
                xs.append(j - 0.4 + width * (i + 0.5))
                meds.append(med)
                lo.append(med - mn)
                hi.append(mx - med)
            if xs:
                ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=labels.get(broker, broker))
        ax.set_xticks(range(len(scenarios)))
        ax.set_xticklabels(scenarios, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"{direction} msgs/s (median, bar = min..max)")
        ax.set_title(f"{direction.capitalize()} throughput per scenario")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"throughput-{_safe(direction)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def latency_cdfs(
    cdfs: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    brokers: Sequence[str],
    labels: Mapping[str, str],
    out_dir: Path,
) -> list[Path]:
    """One PNG per scenario: latency CDF per broker.

    ``cdfs[scenario][broker] = (quantiles, latency_us)`` as computed by Spark's percentile_approx.
    """
    written: list[Path] = []
    for scenario in sorted(cdfs):
        per_broker = cdfs[scenario]
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for broker in brokers:
            if broker not in per_broker:
                continue
            qs, values = per_broker[broker]
            ax.plot(values, qs, drawstyle="steps-post", label=labels.get(broker, broker))
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (µs, log scale)")
        ax.set_ylabel("fraction of messages ≤ latency")
        ax.set_ylim(0, 1.01)
        ax.set_title(f"Latency CDF — {scenario}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = out_dir / f"latency-cdf-{_safe(scenario)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
