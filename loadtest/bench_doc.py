"""The results part of docs/benchmarks.md: merged results of bench runs, their plots and table.

A bench run of some scenarios must not wipe the numbers of the others, so the page is rendered from
a store, ``docs/benchmarks/results.json`` (next to the page, committed with it): per scenario, the
report's rows (loadtest/report.py ``Summary.to_json``) of the latest run that measured it, and per
run its time, commit, command and load average. Each bench run replaces the entries of the
scenarios it measured and keeps the others; the page names the run behind every scenario. The
plots are drawn from the merged store into the same directory, under stable names, so the page
embeds them with relative links:

- ``throughput-publish.png``, ``throughput-consume.png``: msgs/s per scenario, per broker
  (fixed-rate scenarios left out: their rate is the one they were told to send);
- ``operations.png``: the scenarios' ``*_per_s`` measurements (declares/s, bindings/s,
  connections/s ...), whatever scenario reports one;
- ``latency-by-rate.png``: p50 and p99 against the offered rate, one panel per ack mode.

Nothing here knows the scenario list: which scenarios are fixed-rate comes from their perf tool
arguments (``--rate``, ``--ack-every``), so scenarios added to loadtest/bench.py appear here as is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.report import RATE_METRICS, Summary, label, render_markdown

STORE_NAME = "results.json"
STORE_FORMAT = 1
LATENCY_PLOT = "latency-by-rate.png"
OPERATIONS_PLOT = "operations.png"
AUTOACK, ACK = "auto-ack", "manual ack, prefetch 1000"


def assets_dir(doc: str | os.PathLike[str]) -> Path:
    """Where the page's store and images live: ``docs/benchmarks.md`` -> ``docs/benchmarks/``."""
    return Path(doc).with_suffix("")


def fixed_rate(argv: Sequence[str]) -> tuple[int, str] | None:
    """(rate, ack mode) of a scenario that publishes at a fixed ``--rate``; None for the others."""
    if "--rate" not in argv:
        return None
    rate = int(argv[list(argv).index("--rate") + 1])
    acks = "--ack-every" in argv and argv[list(argv).index("--ack-every") + 1] != "0"
    return rate, ACK if acks else AUTOACK


# --------------------------------------------------------------------------- the store


def empty_store() -> dict[str, Any]:
    return {"format": STORE_FORMAT, "runs": {}, "scenarios": {}}


def load_store(path: Path) -> dict[str, Any]:
    """The store at ``path``; an empty one if there is none (or it is of another format)."""
    try:
        store = json.loads(path.read_text())
    except FileNotFoundError:
        return empty_store()
    if store.get("format") != STORE_FORMAT:
        return empty_store()
    return store


def save_store(path: Path, store: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def merge(store: dict[str, Any], summary: Mapping[str, Any], run_id: str, run: Mapping[str, Any],
          known: Iterable[str]) -> dict[str, Any]:
    """``store`` with the scenarios of ``summary`` (a report's summary.json) replaced by this run's.

    Scenarios no longer in ``known`` (renamed or removed from the bench) are dropped, and so are
    runs no scenario comes from any more.
    """
    known = set(known)
    out = {"format": STORE_FORMAT, "runs": dict(store.get("runs", {})),
           "scenarios": {k: v for k, v in store.get("scenarios", {}).items() if k in known}}
    measured = [s for s in summary.get("scenarios", []) if s in known]
    if measured:
        out["runs"][run_id] = dict(run)
    for scenario in measured:
        out["scenarios"][scenario] = {
            "run": run_id,
            "runs": summary.get("runs", {}).get(scenario, {}),
            "peak_rss_bytes": summary.get("peak_rss_bytes", {}).get(scenario, {}),
            "rows": [r for r in summary.get("rows", []) if r["scenario"] == scenario],
        }
    used = {v["run"] for v in out["scenarios"].values()}
    out["runs"] = {k: v for k, v in out["runs"].items() if k in used}
    return out


def store_summary(store: Mapping[str, Any]) -> Summary:
    """The merged store as one report Summary (for ``render_markdown`` and the plots)."""
    scenarios = store.get("scenarios", {})
    brokers = sorted({b for v in scenarios.values() for b in v.get("runs", {})}
                     | {b for v in scenarios.values() for r in v.get("rows", []) for b in r["brokers"]})
    return Summary.from_json({
        "brokers": brokers,
        "scenarios": sorted(scenarios),
        "rows": [r for name in sorted(scenarios) for r in scenarios[name]["rows"]],
        "peak_rss_bytes": {k: v["peak_rss_bytes"] for k, v in scenarios.items() if v.get("peak_rss_bytes")},
        "runs": {k: v["runs"] for k, v in scenarios.items()},
    })


# --------------------------------------------------------------------------- plots


def write_plots(summary: Summary, rates: Mapping[str, tuple[int, str]], out_dir: Path) -> list[Path]:
    """The page's PNGs from a (merged) summary; ``rates`` maps fixed-rate scenarios to (rate, mode).

    Plots that would be empty are not written, and stale ones of the same names are removed, so the
    page never embeds an image of numbers it no longer shows.
    """
    from loadtest import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = {b: label(b) for b in summary.brokers}
    throughput: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {}
    for key, metric in RATE_METRICS:
        per = throughput.setdefault(key.split("_")[0], {})
        for scenario in summary.scenarios:
            if scenario in rates:
                continue
            for broker, c in summary.cells.get((scenario, metric), {}).items():
                per.setdefault(scenario, {})[broker] = (c.median, c.min, c.max)
    operations: dict[str, dict[str, tuple[float, float, float]]] = {}
    for scenario in summary.scenarios:
        # whole-run rates only: the first/last-10% rates (is it flat?) stay in the table
        per_s = [m for m in summary.metrics.get(scenario, []) if m.startswith("extra.") and m.endswith("_per_s")
                 and not m.startswith(("extra.first_", "extra.last_"))]
        for metric in per_s:
            name = scenario if len(per_s) == 1 else f"{scenario}: {metric.removeprefix('extra.')}"
            for broker, c in summary.cells[(scenario, metric)].items():
                operations.setdefault(name, {})[broker] = (c.median, c.min, c.max)
    latency: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for scenario, (rate, mode) in rates.items():
        for pct in ("p50", "p99"):
            for broker, c in summary.cells.get((scenario, f"latency {pct} µs"), {}).items():
                latency.setdefault(mode, {}).setdefault(rate, {}).setdefault(broker, {})[pct] = c.median

    stale = {out_dir / f"throughput-{d}.png" for d in throughput} | {out_dir / OPERATIONS_PLOT,
                                                                     out_dir / LATENCY_PLOT}
    written = plots.throughput_bars(throughput, summary.brokers, labels, out_dir)
    for path in (plots.bars(operations, summary.brokers, labels, out_dir / OPERATIONS_PLOT,
                            "operations/s (median, bar = min..max)", "Declares, bindings, connections per second"),
                 plots.latency_by_rate({m: latency[m] for m in (AUTOACK, ACK) if m in latency}, summary.brokers,
                                       labels, out_dir / LATENCY_PLOT)):
        if path is not None:
            written.append(path)
    for path in stale - set(written):
        path.unlink(missing_ok=True)
    return written


# --------------------------------------------------------------------------- the page's section


_CAPTIONS = {
    "throughput-publish.png": "Publish throughput per scenario (median of the runs, bar = min..max)",
    "throughput-consume.png": "Consume throughput per scenario (fanout counts every copy)",
    OPERATIONS_PLOT: "Operations per second of the declare, binding and connection scenarios",
    LATENCY_PLOT: "End-to-end latency p50 and p99 at a fixed offered rate, auto-ack and manual ack",
}


def results_section(store: Mapping[str, Any], summary: Summary, images: Sequence[Path], doc_dir: Path,
                    all_scenarios: Sequence[str], store_path: Path) -> list[str]:
    """Markdown lines of the page's results: which run each scenario comes from, plots, table."""
    def rel(p: Path) -> str:
        return os.path.relpath(p, doc_dir)

    scenarios = store.get("scenarios", {})
    lines = [f"This page merges the latest run of each scenario (kept in `{rel(store_path)}`): a bench run of",
             "some scenarios replaces their numbers and keeps the others', so every row below names the run it",
             "comes from. `--no-merge` starts the page over from one run.", ""]
    if not scenarios:
        return ["**Not yet measured.** No numbers have been recorded on this machine yet; run the command",
                "above to fill this section.", ""]
    lines += ["| run | measured | ShardMQ commit | load average (1 min) at the runs' starts | command | scenarios |",
              "|---|---|---|---|---|---|"]
    for run_id, run in sorted(store.get("runs", {}).items()):
        names = sorted(k for k, v in scenarios.items() if v["run"] == run_id)
        load = run.get("load1")
        load_text = f"{load[0]:.1f}–{load[1]:.1f}" if load else "—"
        lines.append(f"| {run_id} | {run.get('when', '?')} | {run.get('commit', '?')} | {load_text} | "
                     f"`{run.get('command', '?')}` | {', '.join(names)} |")
    missing = [n for n in all_scenarios if n not in scenarios]
    lines += ["", "Not measured yet: " + (", ".join(missing) if missing else "none (every scenario has numbers)")
              + ".", ""]
    for img in images:
        caption = _CAPTIONS.get(img.name, img.stem)
        lines += [f"![{caption}]({rel(img)})", ""]
    lines += [render_markdown(summary).rstrip(), ""]
    return lines
