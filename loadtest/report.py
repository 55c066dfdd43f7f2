"""Spark results pipeline: aggregate a directory of ``shardmq-perf`` runs into report.md and PNG plots.

    shardmq-perf report RESULTS_DIR [--master local[*]] [--out DIR]
    python -m loadtest.report RESULTS_DIR ...

Reads every ``RESULTS_DIR/<run_id>/{run,rates,latency}.(json|jsonl|parquet)`` (format: loadtest/results.py)
and computes, per (scenario, broker): median/min/max across runs of the publish and consume rates and of
the numeric measurements in ``extra``; latency percentiles over all samples of all runs; peak broker RSS;
and the ShardMQ/RabbitMQ ratio of medians. All aggregation runs in Spark so a results directory of any
size (or on a cluster's file system, with ``--master``) goes through the same code; only the aggregated
rows are collected to the driver for the Markdown table and the plots.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SHARDMQ = "shardmq"
RABBITMQ = "rabbitmq"
LABELS = {SHARDMQ: "ShardMQ", RABBITMQ: "RabbitMQ"}
# Quantiles sampled for the latency CDF plots (computed in Spark, one percentile_approx per group).
CDF_QUANTILES = [i / 200 for i in range(201)]
LATENCY_PCTS = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
# Throughput rows come first, in this order; extra.* measurements follow alphabetically.
RATE_METRICS = (("publish_rate", "publish msgs/s"), ("consume_rate", "consume msgs/s"))

SPARK_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "true",
    "spark.ui.showConsoleProgress": "false",
}

_session: SparkSession | None = None


def get_spark(master: str = "local[*]") -> SparkSession:
    """The process's one SparkSession (JVM start-up costs seconds; every caller shares it)."""
    global _session
    if _session is not None:
        return _session
    from loadtest.spark_session import quiet_session

    _session = quiet_session(master, "shardmq-perf-report", SPARK_CONF)
    return _session


def stop_spark() -> None:
    global _session
    if _session is not None:
        _session.stop()
        _session = None


# --------------------------------------------------------------------------- loading


@dataclass
class Frames:
    runs: DataFrame  # one row per run: run_dir, scenario, broker, rates, rss, extra_* columns
    rates: DataFrame  # run_dir, t, published, consumed
    latency: DataFrame  # run_dir, t, latency_us


def _paths(results_dir: str, stem: str, exts: tuple[str, ...]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for ext in exts:
        hits = sorted(glob.glob(os.path.join(glob.escape(results_dir), "*", f"{stem}.{ext}")))
        if hits:
            found[ext] = hits
    return found


def _run_dir_col(stem: str) -> Any:
    """The run directory name, taken from each row's source file path (works for a parquet dataset dir too)."""
    from pyspark.sql import functions as F

    return F.regexp_extract(F.col("_metadata.file_path"), rf"([^/]+)/{stem}\.[a-z]+(/[^/]*)?$", 1)


def _read(spark: SparkSession, results_dir: str, stem: str, schema: Any, multiline: bool) -> DataFrame | None:
    frames = []
    for ext, paths in _paths(results_dir, stem, ("json", "jsonl", "parquet")).items():
        if ext == "parquet":
            reader = spark.read if schema is None else spark.read.schema(schema)
            df = reader.parquet(*paths)
        else:
            reader = spark.read.option("multiLine", multiline)
            if schema is not None:
                reader = reader.schema(schema)
            df = reader.json(paths)
        frames.append(df.select("*", _run_dir_col(stem).alias("run_dir")))
    if not frames:
        return None
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df, allowMissingColumns=True)
    return out


def load(spark: SparkSession, results_dir: str) -> Frames:
    """Read all runs of ``results_dir`` into three DataFrames keyed by run directory name."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    rates_schema = T.StructType([T.StructField("t", T.DoubleType()),
                                 T.StructField("published", T.LongType()),
                                 T.StructField("consumed", T.LongType())])
    latency_schema = T.StructType([T.StructField("t", T.DoubleType()),
                                   T.StructField("latency_us", T.LongType())])
    runs = _read(spark, results_dir, "run", None, multiline=True)
    if runs is None:
        raise FileNotFoundError(f"no run.json (or run.parquet) under {results_dir}/*/")
    rates = _read(spark, results_dir, "rates", rates_schema, multiline=False)
    if rates is None:
        rates = spark.createDataFrame([], rates_schema.add("run_dir", T.StringType()))
    latency = _read(spark, results_dir, "latency", latency_schema, multiline=False)
    if latency is None:
        latency = spark.createDataFrame([], latency_schema.add("run_dir", T.StringType()))

    cols = set(runs.columns)
    # The rate from the per-second series stands in when run.json lacks it (older or partial runs).
    series = rates.groupBy("run_dir").agg(
        (F.sum("published") / F.greatest(F.max("t"), F.lit(1.0))).alias("_series_pub"),
        (F.sum("consumed") / F.greatest(F.max("t"), F.lit(1.0))).alias("_series_con"),
    )
    runs = runs.join(series, "run_dir", "left")
    selected = [
        F.col("run_dir"),
        F.lower(F.trim(F.col("broker"))).alias("broker"),
        F.col("scenario").cast("string").alias("scenario"),
    ]
    for name, series_col in (("publish_rate", "_series_pub"), ("consume_rate", "_series_con")):
        own = F.col(name).cast("double") if name in cols else F.lit(None).cast("double")
        selected.append(F.coalesce(own, F.col(series_col)).alias(name))
    rss = F.col("broker_rss_bytes").cast("double") if "broker_rss_bytes" in cols else F.lit(None).cast("double")
    selected.append(rss.alias("broker_rss_bytes"))
    if "extra" in cols:
        extra_type = runs.schema["extra"].dataType
        if isinstance(extra_type, T.StructType):
            for f in extra_type.fields:
                if isinstance(f.dataType, T.NumericType) and not isinstance(f.dataType, T.BooleanType):
                    selected.append(F.col("extra").getField(f.name).cast("double").alias(f"extra.{f.name}"))
    # Cached: summarize() scans the runs three times (metrics, RSS, latency join).
    return Frames(runs=runs.select(*selected).cache(), rates=rates, latency=latency)


# --------------------------------------------------------------------------- aggregation


@dataclass
class Cell:
    median: float
    min: float
    max: float
    n: int


@dataclass
class Summary:
    brokers: list[str]
    scenarios: list[str]
    # metric rows in display order; cells[(scenario, metric)][broker] -> Cell
    metrics: dict[str, list[str]] = field(default_factory=dict)  # scenario -> metric labels
    cells: dict[tuple[str, str], dict[str, Cell]] = field(default_factory=dict)
    peak_rss: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario -> broker -> bytes
    runs: dict[str, dict[str, int]] = field(default_factory=dict)  # scenario -> broker -> run count
    cdfs: dict[str, dict[str, tuple[list[float], list[float]]]] = field(default_factory=dict)

    def ratio(self, scenario: str, metric: str) -> float | None:
        row = self.cells.get((scenario, metric), {})
        a, b = row.get(SHARDMQ), row.get(RABBITMQ)
        if a is None or b is None or b.median == 0:
            return None
        return a.median / b.median

    def to_json(self) -> dict[str, Any]:
        rows = []
        for scenario in self.scenarios:
            for metric in self.metrics.get(scenario, []):
                cells = self.cells[(scenario, metric)]
                rows.append({
                    "scenario": scenario, "metric": metric,
                    "brokers": {b: vars(c) for b, c in cells.items()},
                    "ratio": self.ratio(scenario, metric),
                })
        return {"brokers": self.brokers, "scenarios": self.scenarios, "rows": rows,
                "peak_rss_bytes": self.peak_rss, "runs": self.runs}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        """The inverse of ``to_json`` (without the CDFs): lets shardmq-perf bench merge summary.json
        files of several runs and render them with ``render_markdown``."""
        s = cls(brokers=_order_brokers(list(d.get("brokers", []))), scenarios=sorted(d.get("scenarios", [])),
                peak_rss={k: dict(v) for k, v in d.get("peak_rss_bytes", {}).items()},
                runs={k: dict(v) for k, v in d.get("runs", {}).items()})
        for row in d.get("rows", []):
            scenario, metric = row["scenario"], row["metric"]
            s.metrics.setdefault(scenario, []).append(metric)
            s.cells[(scenario, metric)] = {b: Cell(float(c["median"]), float(c["min"]), float(c["max"]), int(c["n"]))
                                           for b, c in row["brokers"].items()}
        return s


def _order_brokers(found: list[str]) -> list[str]:
    known = [b for b in (SHARDMQ, RABBITMQ) if b in found]
    return known + sorted(b for b in found if b not in known)


def summarize(frames: Frames) -> Summary:
    """Aggregate in Spark; collect only one row per (scenario, broker, metric)."""
    from pyspark.sql import functions as F

    runs = frames.runs
    metric_cols = [c for c in runs.columns if c in ("publish_rate", "consume_rate") or c.startswith("extra.")]
    # Long form (one row per run and metric) so every metric gets the same median/min/max treatment.
    long = runs.select(
        "scenario", "broker", "run_dir",
        F.explode(F.array(*[
            F.struct(F.lit(c).alias("metric"), F.col(f"`{c}`").alias("value")) for c in metric_cols
        ])).alias("m"),
    ).select("scenario", "broker", "m.metric", "m.value").where(F.col("value").isNotNull())
    per_metric = long.groupBy("scenario", "broker", "metric").agg(
        F.median("value").alias("median"), F.min("value").alias("min"), F.max("value").alias("max"),
        F.count("value").alias("n"),
    ).collect()
    per_group = runs.groupBy("scenario", "broker").agg(
        F.max("broker_rss_bytes").alias("peak_rss"), F.countDistinct("run_dir").alias("runs"),
    ).collect()

    lat = frames.latency.join(runs.select("run_dir", "scenario", "broker"), "run_dir").where(
        F.col("latency_us").isNotNull())
    pct_values = [p for _, p in LATENCY_PCTS]
    lat_rows = lat.groupBy("scenario", "broker").agg(
        F.percentile_approx("latency_us", pct_values, 10000).alias("pcts"),
        F.percentile_approx("latency_us", CDF_QUANTILES, 10000).alias("cdf"),
        F.min("latency_us").alias("min"), F.max("latency_us").alias("max"), F.count("latency_us").alias("n"),
    ).collect()

    brokers = _order_brokers(sorted({r["broker"] for r in per_group}))
    scenarios = sorted({r["scenario"] for r in per_group})
    s = Summary(brokers=brokers, scenarios=scenarios)
    for r in per_group:
        if r["peak_rss"] is not None:
            s.peak_rss.setdefault(r["scenario"], {})[r["broker"]] = r["peak_rss"]
        s.runs.setdefault(r["scenario"], {})[r["broker"]] = r["runs"]

    labels = dict(RATE_METRICS)
    found: dict[str, set[str]] = {}
    for r in per_metric:
        # A rate that is zero in every run was not measured by that scenario (e.g. queue-count).
        if r["metric"] in labels and r["max"] == 0:
            continue
        metric = labels.get(r["metric"], r["metric"])
        found.setdefault(r["scenario"], set()).add(r["metric"])
        s.cells.setdefault((r["scenario"], metric), {})[r["broker"]] = Cell(
            float(r["median"]), float(r["min"]), float(r["max"]), int(r["n"]))
    for r in lat_rows:
        pcts = dict(zip([name for name, _ in LATENCY_PCTS], r["pcts"], strict=True))
        for name, value in pcts.items():
            s.cells.setdefault((r["scenario"], f"latency {name} µs"), {})[r["broker"]] = Cell(
                float(value), float(value), float(value), int(r["n"]))
        s.cells.setdefault((r["scenario"], "latency min–max µs"), {})[r["broker"]] = Cell(
            float(r["min"]), float(r["min"]), float(r["max"]), int(r["n"]))
        s.cdfs.setdefault(r["scenario"], {})[r["broker"]] = (list(CDF_QUANTILES), [float(v) for v in r["cdf"]])

    for scenario in scenarios:
        order = [label for key, label in RATE_METRICS if key in found.get(scenario, set())]
        order += [f"latency {name} µs" for name, _ in LATENCY_PCTS]
        order += ["latency min–max µs"]
        order += sorted(m for m in found.get(scenario, set()) if m.startswith("extra."))
        s.metrics[scenario] = [m for m in order if (scenario, m) in s.cells]
    return s


# --------------------------------------------------------------------------- rendering


def fmt_num(v: float) -> str:
    """Thousands separators for large values, three significant digits for small ones."""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def fmt_bytes(v: float) -> str:
    return f"{v / 1048576:.1f} MiB"


def fmt_size(v: float) -> str:
    return f"{v / 1024:.1f} KiB" if abs(v) < 1048576 else fmt_bytes(v)


def _fmt_for(metric: str):  # noqa: ANN202
    return fmt_size if metric.endswith("_bytes") else fmt_num


def metric_label(metric: str) -> str:
    """Display name: ``extra.rss_after_bytes`` -> ``rss_after`` (its cells carry KiB/MiB units)."""
    return metric.removeprefix("extra.").removesuffix("_bytes")


def _cell(metric: str, c: Cell | None) -> str:
    if c is None:
        return "—"
    fmt = _fmt_for(metric)
    if metric == "latency min–max µs":
        return f"{fmt(c.min)}–{fmt(c.max)}"
    if metric.startswith("latency "):
        return fmt(c.median)
    return f"{fmt(c.median)} ({fmt(c.min)}–{fmt(c.max)})"


def label(broker: str) -> str:
    return LABELS.get(broker, broker)


def render_markdown(s: Summary, results_dir: str = "") -> str:
    columns = _order_brokers(sorted(set(s.brokers) | {SHARDMQ, RABBITMQ}))
    head = ["scenario", "metric"] + [f"{label(b)} median (min–max)" for b in columns] + ["ratio", "peak RSS"]
    lines = []
    if results_dir:
        lines.append(f"Results: `{results_dir}`; runs per scenario and broker: "
                     + "; ".join(f"{sc}: " + ", ".join(f"{label(b)} {n}" for b, n in sorted(s.runs[sc].items()))
                                 for sc in s.scenarios))
        lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for scenario in s.scenarios:
        rss = s.peak_rss.get(scenario, {})
        rss_text = " / ".join(f"{label(b)} {fmt_bytes(rss[b])}" for b in columns if b in rss) or "—"
        for i, metric in enumerate(s.metrics.get(scenario, [])):
            cells = s.cells[(scenario, metric)]
            ratio = s.ratio(scenario, metric)
            row = [scenario if i == 0 else "", metric_label(metric)]
            row += [_cell(metric, cells.get(b)) for b in columns]
            row += ["—" if ratio is None or metric == "latency min–max µs" else f"{ratio:.2f}×"]
            row += [rss_text if i == 0 else ""]
            lines.append("| " + " | ".join(row) + " |")
        if not s.metrics.get(scenario):
            lines.append(f"| {scenario} | (no measurements) | " + " | ".join("—" for _ in columns)
                         + f" | — | {rss_text} |")
    lines.append("")
    lines.append("Rates: median over runs of each run's mean rate, (min–max) over runs. Latency: "
                 "percentile_approx over all samples of all runs, end-to-end. Ratio: ShardMQ median / "
                 "RabbitMQ median (for latency, lower is better). Peak RSS: max over runs of the broker's RSS.")
    return "\n".join(lines) + "\n"


def _plot(s: Summary, out: Path) -> list[Path]:
    from loadtest import plots

    throughput: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {}
    for key, metric_label in RATE_METRICS:
        direction = key.split("_")[0]
        per = throughput.setdefault(direction, {})
        for scenario in s.scenarios:
            for broker, c in s.cells.get((scenario, metric_label), {}).items():
                per.setdefault(scenario, {})[broker] = (c.median, c.min, c.max)
    labels = {b: label(b) for b in s.brokers}
    return plots.throughput_bars(throughput, s.brokers, labels, out) + plots.latency_cdfs(
        s.cdfs, s.brokers, labels, out)


def run_report(results_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None,
               master: str = "local[*]") -> Path:
    """Aggregate ``results_dir``; write report.md, summary.json and PNGs into ``out_dir``; return report.md."""
    results_dir = os.path.abspath(results_dir)
    out = Path(out_dir) if out_dir else Path(results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(load(get_spark(master), results_dir))
    (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    pngs = _plot(summary, out)
    md = render_markdown(summary, results_dir)
    if pngs:
        md += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in pngs) + "\n"
    report = out / "report.md"
    report.write_text(md)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardmq-perf report",
                                description="Aggregate shardmq-perf results with Spark into report.md and PNGs.")
    p.add_argument("results_dir", metavar="RESULTS_DIR")
    p.add_argument("--master", default="local[*]", help="Spark master URL (default: local[*])")
    p.add_argument("--out", default=None, help="output directory (default: RESULTS_DIR/report)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.results_dir):
        print(f"shardmq-perf report: no such directory: {args.results_dir}", file=sys.stderr)
        return 2
    try:
        report = run_report(args.results_dir, args.out, args.master)
    except FileNotFoundError as e:
        print(f"shardmq-perf report: {e}", file=sys.stderr)
        return 1
    finally:
        stop_spark()
    print(report.read_text(), end="")
    print(f"\nwritten: {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
