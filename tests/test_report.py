"""The Spark results pipeline, run for real on a small synthetic results directory.

Expected numbers are computed here in plain Python from the same synthetic data and compared with
what ``python -m loadtest.report`` prints into report.md.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
from pathlib import Path

# The spark extra and a Java runtime are installed by scripts/test.sh: a missing one is a failure
# to see, not a skip.
import matplotlib  # noqa: F401, E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pyspark  # noqa: F401, E402
import pytest

pytestmark = pytest.mark.integration  # starts Spark (a JVM)

assert shutil.which("java") is not None, "Spark needs a Java runtime (scripts/test.sh installs one)"

ROOT = Path(__file__).resolve().parent.parent
BROKERS = ("shardmq", "rabbitmq")
SCENARIOS = ("1p1c-16b", "fanout-4q")
RUNS = 3
ONE_BROKER = "queues-1000"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(root: Path, run_id: str, broker: str, scenario: str, pub: int, con: int, rss: int,
               latencies: list[int], latency_as_parquet: bool) -> None:
    d = root / run_id
    d.mkdir(parents=True)
    duration = 10.0
    (d / "run.json").write_text(json.dumps({
        "run_id": run_id, "broker": broker, "scenario": scenario,
        "params": {"size": 16, "publishers": 1}, "started_at": "2024-01-01T00:00:00+00:00",
        "duration_s": duration, "published": pub * 10, "consumed": con * 10, "confirmed": 0,
        "publish_rate": float(pub), "consume_rate": float(con),
        "latency_us": {"min": min(latencies), "p50": None, "p95": None, "p99": None, "max": max(latencies)},
        "broker_rss_bytes": rss,
    }, indent=2))
    with open(d / "rates.jsonl", "w") as f:
        for t in range(1, 11):
            f.write(json.dumps({"t": t, "published": pub, "consumed": con}) + "\n")
    ts = [i / len(latencies) * duration for i in range(len(latencies))]
    if latency_as_parquet:
        pq.write_table(pa.table({"t": ts, "latency_us": latencies}), d / "latency.parquet")
    else:
        with open(d / "latency.jsonl", "w") as f:
            for t, us in zip(ts, latencies, strict=True):
                f.write(json.dumps({"t": round(t, 6), "latency_us": us}) + "\n")


def _make_results(root: Path) -> dict:
    """Synthetic runs; returns what each (scenario, broker) holds, for the independent computation."""
    rnd = random.Random(42)
    truth: dict = {}
    for s_i, scenario in enumerate(SCENARIOS):
        for b_i, broker in enumerate(BROKERS):
            base = 40_000 - 15_000 * b_i + 5_000 * s_i
            g = truth.setdefault((scenario, broker), {"pub": [], "con": [], "rss": [], "lat": []})
            for r in range(RUNS):
                pub = base + rnd.randint(-3000, 3000)
                con = pub - rnd.randint(0, 500)
                rss = rnd.randint(40, 400) * 1048576
                lat = [int(rnd.lognormvariate(5 + b_i * 0.5, 0.8)) + 5 for _ in range(150)]
                # one run keeps its samples as Parquet: the pipeline accepts both formats
                as_parquet = (scenario, broker, r) == (SCENARIOS[1], BROKERS[1], 1)
                _write_run(root, f"run-{scenario}-{broker}-{r}", broker, scenario, pub, con, rss, lat, as_parquet)
                g["pub"].append(pub)
                g["con"].append(con)
                g["rss"].append(rss)
                g["lat"].extend(lat)
    # A count-style scenario measured on one broker only: no rates, no latency samples, extra numbers.
    for r in range(RUNS):
        d = root / f"run-queues-{r}"
        d.mkdir()
        rate = 500.0 + 100 * r
        (d / "run.json").write_text(json.dumps({
            "run_id": d.name, "broker": "shardmq", "scenario": ONE_BROKER, "params": {},
            "started_at": "2024-01-01T00:00:00+00:00", "duration_s": 2.0, "published": 0, "consumed": 0,
            "confirmed": 0, "publish_rate": 0.0, "consume_rate": 0.0,
            "latency_us": {"min": None, "p50": None, "p95": None, "p99": None, "max": None},
            "broker_rss_bytes": 100 * 1048576,
            "extra": {"queues": 1000, "declares_per_s": rate, "rss_per_queue_bytes": 4096 * (r + 1)},
        }))
        (d / "rates.jsonl").write_text("")
        (d / "latency.jsonl").write_text("")
        truth.setdefault((ONE_BROKER, "shardmq"), {"declares": [], "rss_per_queue": []})
        truth[(ONE_BROKER, "shardmq")]["declares"].append(rate)
        truth[(ONE_BROKER, "shardmq")]["rss_per_queue"].append(4096 * (r + 1))
    return truth


def _nearest_rank(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[max(0, math.ceil(p * len(s)) - 1)]


def _num(text: str) -> float:
    return float(text.replace(",", "").replace("×", "").strip())


def _parse_table(md: str) -> dict[tuple[str, str], list[str]]:
    rows: dict[tuple[str, str], list[str]] = {}
    scenario = ""
    for line in md.splitlines():
        if not line.startswith("| ") or line.startswith("| scenario |"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        scenario = cells[0] or scenario
        rows[(scenario, cells[1])] = cells
    return rows


def _median_cell(cell: str) -> tuple[float, float, float]:
    m = re.fullmatch(r"([\d,.]+) \(([\d,.]+)–([\d,.]+)\)", cell)
    assert m, cell
    return _num(m[1]), _num(m[2]), _num(m[3])


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("results")
    truth = _make_results(root)
    out = root / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.report", str(root), "--out", str(out), "--master", "local[2]"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return truth, out


def test_rates_medians_min_max_and_ratio(report: tuple[dict, Path]) -> None:
    truth, out = report
    rows = _parse_table((out / "report.md").read_text())
    for scenario in SCENARIOS:
        for metric, key in (("publish msgs/s", "pub"), ("consume msgs/s", "con")):
            cells = rows[(scenario, metric)]
            got = {b: _median_cell(cells[2 + i]) for i, b in enumerate(BROKERS)}
            for broker in BROKERS:
                vals = truth[(scenario, broker)][key]
                assert got[broker] == (statistics.median(vals), min(vals), max(vals))
            expected_ratio = (statistics.median(truth[(scenario, "shardmq")][key])
                              / statistics.median(truth[(scenario, "rabbitmq")][key]))
            assert abs(_num(cells[4]) - expected_ratio) <= 0.005 + 1e-9


def test_latency_percentiles_over_all_samples(report: tuple[dict, Path]) -> None:
    truth, out = report
    rows = _parse_table((out / "report.md").read_text())
    summary = json.loads((out / "summary.json").read_text())
    by_key = {(r["scenario"], r["metric"]): r for r in summary["rows"]}
    for scenario in SCENARIOS:
        for broker in BROKERS:
            lat = truth[(scenario, broker)]["lat"]
            assert len(lat) == RUNS * 150
            for name, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                # percentile_approx is exact at this sample count (far below its 10000 accuracy)
                assert by_key[(scenario, f"latency {name} µs")]["brokers"][broker]["median"] == _nearest_rank(lat, p)
            cell = rows[(scenario, "latency min–max µs")][2 + BROKERS.index(broker)]
            lo, hi = (_num(x) for x in cell.split("–"))
            assert (lo, hi) == (min(lat), max(lat))
            assert by_key[(scenario, "latency p99 µs")]["brokers"][broker]["n"] == len(lat)


def test_peak_rss(report: tuple[dict, Path]) -> None:
    truth, out = report
    summary = json.loads((out / "summary.json").read_text())
    rows = _parse_table((out / "report.md").read_text())
    for scenario in SCENARIOS:
        for broker in BROKERS:
            assert summary["peak_rss_bytes"][scenario][broker] == max(truth[(scenario, broker)]["rss"])
        rss_text = rows[(scenario, "publish msgs/s")][5]
        shard_mib = max(truth[(scenario, "shardmq")]["rss"]) / 1048576
        assert f"ShardMQ {shard_mib:.1f} MiB" in rss_text


def test_plots_are_valid_pngs(report: tuple[dict, Path]) -> None:
    _, out = report
    names = {"throughput-publish.png", "throughput-consume.png"} | {f"latency-cdf-{s}.png" for s in SCENARIOS}
    assert names <= {p.name for p in out.glob("*.png")}
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 300 and height >= 200
        assert data[-8:-4] == b"IEND"


def test_one_broker_scenario_with_extra_measurements(report: tuple[dict, Path]) -> None:
    truth, out = report
    rows = _parse_table((out / "report.md").read_text())
    metrics = {m for (s, m) in rows if s == ONE_BROKER}
    assert metrics == {"declares_per_s", "queues", "rss_per_queue"}  # zero rates and no latency: no rows
    cells = rows[(ONE_BROKER, "declares_per_s")]
    declares = truth[(ONE_BROKER, "shardmq")]["declares"]
    assert _median_cell(cells[2]) == (statistics.median(declares), min(declares), max(declares))
    assert cells[3] == "—" and cells[4] == "—"  # no RabbitMQ runs, so no ratio
    per_queue = sorted(truth[(ONE_BROKER, "shardmq")]["rss_per_queue"])
    assert rows[(ONE_BROKER, "rss_per_queue")][2] == (
        f"{per_queue[1] / 1024:.1f} KiB ({per_queue[0] / 1024:.1f} KiB–{per_queue[2] / 1024:.1f} KiB)")
    assert not (out / f"latency-cdf-{ONE_BROKER}.png").exists()
