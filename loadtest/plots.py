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


def _duration_us(v: float, _pos: object = None) -> str:
    """Axis label of a latency in µs: 500 µs, 2 ms, 1.5 s."""
    if v < 1000:
        return f"{v:g} µs"
    if v < 1_000_000:
        return f"{v / 1000:g} ms"
    return f"{v / 1_000_000:g} s"


def bars(
    per_scenario: Mapping[str, Mapping[str, Stat]],
    brokers: Sequence[str],
    labels: Mapping[str, str],
    path: Path,
    ylabel: str,
    title: str,
) -> Path | None:
    """One PNG: scenarios on x, one bar per broker, error bar min..max; None if nothing to plot.

    ``per_scenario[scenario][broker] = (median, min, max)``. Scenarios whose medians are all zero
    are left out. The y axis turns logarithmic when the bars span more than 50x (declares/s next to
    connections/s), so small ones stay visible.
    """
    scenarios = sorted(s for s, per_broker in per_scenario.items() if any(v[0] > 0 for v in per_broker.values()))
    if not scenarios:
        return None
    width = 0.8 / max(1, len(brokers))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(scenarios) + 2), 4.8))
    for i, broker in enumerate(brokers):
        xs, meds, lo, hi = [], [], [], []
        for j, scenario in enumerate(scenarios):
            stat = per_scenario[scenario].get(broker)
            if stat is None:
                continue
            med, mn, mx = stat
            xs.append(j - 0.4 + width * (i + 0.5))
            meds.append(med)
            lo.append(max(0.0, med - mn))
            hi.append(max(0.0, mx - med))
        if xs:
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=labels.get(broker, broker))
    positive = [v[0] for per in per_scenario.values() for v in per.values() if v[0] > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
        path = bars(per_scenario, brokers, labels, out_dir / f"throughput-{_safe(direction)}.png",
                    f"{direction} msgs/s (median, bar = min..max)", f"{direction.capitalize()} throughput per scenario")
        if path is not None:
            written.append(path)
    return written


def latency_by_rate(
    latency: Mapping[str, Mapping[int, Mapping[str, Mapping[str, float]]]],
    brokers: Sequence[str],
    labels: Mapping[str, str],
    path: Path,
    percentiles: Sequence[str] = ("p50", "p99"),
) -> Path | None:
    """One PNG, one panel per mode (e.g. auto-ack, ack): latency percentiles against the offered rate.

    ``latency[mode][rate][broker][pct] = µs``. Each broker has one colour, each percentile one
    line style; both axes are logarithmic (rates 1k..50k, latencies µs..s). None if no data.
    """
    modes = [m for m in latency if latency[m]]
    if not modes:
        return None
    fig, axes = plt.subplots(1, len(modes), figsize=(6.0 * len(modes), 4.8), squeeze=False, sharey=True)
    styles = ("-o", "--s", ":^", "-.v")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, mode in zip(axes[0], modes, strict=True):
        per_rate = latency[mode]
        rates = sorted(per_rate)
        for b_i, broker in enumerate(brokers):
            for p_i, pct in enumerate(percentiles):
                pts = [(r, per_rate[r][broker][pct]) for r in rates
                       if broker in per_rate[r] and per_rate[r][broker].get(pct) is not None]
                if pts:
                    ax.plot([r for r, _ in pts], [v for _, v in pts], styles[p_i % len(styles)],
                            color=colours[b_i % len(colours)], label=f"{labels.get(broker, broker)} {pct}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{r:,}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("offered rate, msgs/s (1 publisher, 1 consumer, 16 B)")
        ax.set_title(f"End-to-end latency at a fixed rate: {mode}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    from matplotlib.ticker import FuncFormatter, LogLocator

    axes[0][0].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[0][0].yaxis.set_major_formatter(FuncFormatter(_duration_us))
    axes[0][0].set_ylabel("latency (log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
