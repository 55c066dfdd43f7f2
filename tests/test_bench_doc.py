"""shardmq-perf bench's page: plots written into docs/benchmarks/ and embedded in the page, results of
a run of some scenarios merged with the earlier runs' (no broker runs here: synthetic results)."""

from __future__ import annotations

import json
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import bench, bench_doc

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BROKERS = ("shardmq", "rabbitmq")
LATENCY = [s.name for s in bench.SCENARIOS if bench_doc.fixed_rate(s.argv)]
THROUGHPUT = ["1p1c-16b-transient-autoack", "4p4c-16b-4queues"]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", path
    return struct.unpack(">II", data[16:24])


def _cell(v: float, n: int = 2) -> dict:
    return {"median": v, "min": v * 0.9, "max": v * 1.1, "n": n}


def _summary(scenarios: list[str], scale: float = 1.0) -> dict:
    """A report summary.json (loadtest/report.py Summary.to_json) with made-up numbers."""
    rows = []
    for s in scenarios:
        fixed = bench_doc.fixed_rate(bench.BY_NAME[s].argv)
        rate = fixed[0] if fixed else 50_000 * scale
        for metric, v in (("publish msgs/s", rate), ("consume msgs/s", rate)):
            rows.append({"scenario": s, "metric": metric, "brokers": {b: _cell(v) for b in BROKERS}, "ratio": 1.0})
        for pct, us in (("p50", 400.0), ("p99", 3000.0)):
            rows.append({"scenario": s, "metric": f"latency {pct} µs", "ratio": 1.5,
                         "brokers": {"shardmq": _cell(us * 1.5 * scale, 200), "rabbitmq": _cell(us, 200)}})
    if "bindings-per-second" in scenarios:
        rows = [r for r in rows if r["scenario"] != "bindings-per-second"]
        rows.append({"scenario": "bindings-per-second", "metric": "extra.pairs_per_s", "ratio": 0.5,
                     "brokers": {"shardmq": _cell(300.0 * scale), "rabbitmq": _cell(600.0)}})
    return {"brokers": list(BROKERS), "scenarios": scenarios, "rows": rows,
            "peak_rss_bytes": {s: {b: 150 * 1048576 for b in BROKERS} for s in scenarios},
            "runs": {s: {b: 2 for b in BROKERS} for s in scenarios}}


def _table_row(doc: str, scenario: str, metric: str) -> list[str]:
    current = ""
    for line in doc.splitlines():
        if line.startswith("| ") and not line.startswith("| scenario |") and "|---" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            current = cells[0] or current
            if current == scenario and cells[1] == metric:
                return cells
    raise AssertionError(f"no row {scenario} / {metric}")


def test_the_page_embeds_its_plots_and_a_subset_run_keeps_the_other_scenarios(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# old\n" + bench.KEEP_MARKER + "\n## By hand\nkept text\n")
    first = LATENCY + THROUGHPUT + ["bindings-per-second"]
    bench.write_doc(doc, ["--repeats", "2"], _summary(first), [], [], tmp_path / "r1", "3.10.8")
    page = doc.read_text()
    images = tmp_path / "docs" / "benchmarks"
    pngs = {"latency-by-rate.png", "throughput-publish.png", "throughput-consume.png", "operations.png"}
    assert pngs == {p.name for p in images.glob("*.png")}
    for name in pngs:
        width, height = _png_size(images / name)
        assert width >= 500 and height >= 300
        assert f"](benchmarks/{name})" in page  # embedded, relative to the page
    assert page.endswith(bench.KEEP_MARKER + "\n## By hand\nkept text\n")
    assert _table_row(page, "4p4c-16b-4queues", "publish msgs/s")[2] == "50,000 (45,000–55,000)"
    assert "Not measured yet: " in page and "idle-connections-1000" in page.split("Not measured yet: ")[1]

    # a run of one scenario: its numbers change, the others stay, each names its run
    bench.write_doc(doc, ["--scenarios", "4p4c-16b-4queues"], _summary(["4p4c-16b-4queues"], scale=2.0), [], [],
                    tmp_path / "r2", "3.10.8")
    page = doc.read_text()
    assert _table_row(page, "4p4c-16b-4queues", "publish msgs/s")[2] == "100,000 (90,000–110,000)"
    assert _table_row(page, "1p1c-16b-transient-autoack", "publish msgs/s")[2] == "50,000 (45,000–55,000)"
    assert _table_row(page, "latency-10k-ack", "latency p99 µs")[2] == "4,500"
    runs = [ln for ln in page.splitlines() if re.match(r"\| \d{8}T\d{6}Z", ln)]
    assert len(runs) == 2
    assert runs[0].endswith("| " + ", ".join(sorted(set(first) - {"4p4c-16b-4queues"})) + " |")
    assert "`shardmq-perf bench --scenarios 4p4c-16b-4queues`" in runs[1] and runs[1].endswith("| 4p4c-16b-4queues |")
    store = json.loads((images / "results.json").read_text())
    assert set(store["scenarios"]) == set(first)
    assert page.endswith("kept text\n")

    # --no-merge: the page covers this run only; plots with nothing to show are removed
    bench.write_doc(doc, ["--scenarios", "4p4c-16b-4queues", "--no-merge"], _summary(["4p4c-16b-4queues"]), [], [],
                    tmp_path / "r3", "3.10.8", no_merge=True)
    page = doc.read_text()
    assert {p.name for p in images.glob("*.png")} == {"throughput-publish.png", "throughput-consume.png"}
    assert "latency-by-rate.png" not in page and "1p1c-16b-transient-autoack | publish" not in page
    with pytest.raises(AssertionError):
        _table_row(page, "latency-10k-ack", "latency p99 µs")


def test_merge_drops_scenarios_the_bench_no_longer_has() -> None:
    store = bench_doc.merge(bench_doc.empty_store(), _summary(["4p4c-16b-4queues"]), "r1", {"when": "a"},
                            bench.BY_NAME)
    store["scenarios"]["renamed-away"] = dict(store["scenarios"]["4p4c-16b-4queues"])
    store = bench_doc.merge(store, _summary(["bindings-per-second"]), "r2", {"when": "b"}, bench.BY_NAME)
    assert set(store["scenarios"]) == {"4p4c-16b-4queues", "bindings-per-second"}
    assert set(store["runs"]) == {"r1", "r2"}
    store = bench_doc.merge(store, _summary(["4p4c-16b-4queues"]), "r3", {"when": "c"}, bench.BY_NAME)
    assert set(store["runs"]) == {"r2", "r3"}  # r1 has no scenario left


def test_fixed_rate_scenarios_come_from_their_arguments() -> None:
    got = {s.name: bench_doc.fixed_rate(s.argv) for s in bench.SCENARIOS if bench_doc.fixed_rate(s.argv)}
    assert got["latency-1k-autoack"] == (1000, bench_doc.AUTOACK)
    assert got["latency-50k-ack"] == (50000, bench_doc.ACK)
    assert len(got) == 6 and bench_doc.fixed_rate(bench.BY_NAME["4p4c-16b-4queues"].argv) is None


LATER = "20260105T100000Z-abc123"  # a later bench invocation's id (its runs carry a RUN_RECORD)


def _record(i: int, broker: str) -> dict:
    """The RUN_RECORD of run i of the LATER invocation: 10:00 + 5 min per run, each lasting 4 min."""
    return {"invocation": LATER, "command": "shardmq-perf bench --scenarios publish-only-16b --append",
            "commit": "def5678", "broker": broker, "broker_version": "3.12.1" if broker == "rabbitmq" else "def5678",
            "repeat": 1, "started_at": f"2026-01-05T10:{5 * i:02d}:00+00:00",
            "ended_at": f"2026-01-05T10:{5 * i + 4:02d}:00+00:00", "load1_start": 0.5 + 0.1 * i, "load1_end": 2.0}


def _write_run(root: Path, i: int, broker: str, scenario: str, rate: float, latencies: list[int],
               record: dict | None = None) -> None:
    d = root / f"run-{i:03d}"
    d.mkdir()
    if record is not None:
        (d / bench.RUN_RECORD).write_text(json.dumps(record))
    (d / "run.json").write_text(json.dumps({
        "run_id": d.name, "broker": broker, "scenario": scenario, "params": {},
        "started_at": "2026-01-02T03:04:05+00:00", "duration_s": 10.0, "published": int(rate * 10),
        "consumed": int(rate * 10), "confirmed": 0, "publish_rate": rate, "consume_rate": rate,
        "latency_us": {"min": min(latencies), "p50": None, "p95": None, "p99": None, "max": max(latencies)},
        "broker_rss_bytes": 100 * 1048576}))
    (d / "rates.jsonl").write_text("".join(json.dumps({"t": t, "published": int(rate), "consumed": int(rate)}) + "\n"
                                           for t in range(1, 11)))
    (d / "latency.jsonl").write_text("".join(json.dumps({"t": k / 100, "latency_us": us}) + "\n"
                                             for k, us in enumerate(latencies)))


@pytest.mark.integration  # runs the Spark report (a JVM)
def test_from_results_renders_the_page_through_the_spark_report(tmp_path: Path) -> None:
    rnd = random.Random(7)
    results = tmp_path / "results"
    results.mkdir()
    i = 0
    for scenario in ["latency-1k-autoack", "latency-10k-autoack", "latency-1k-ack", "publish-only-16b"]:
        fixed = bench_doc.fixed_rate(bench.BY_NAME[scenario].argv)
        for b_i, broker in enumerate(BROKERS):
            for _ in range(2):
                i += 1
                lat = [int(rnd.lognormvariate(6 + b_i * 0.3, 0.5)) for _ in range(200)]
                _write_run(results, i, broker, scenario, float(fixed[0] if fixed else 90_000 - 20_000 * b_i), lat)
    (results / bench.RUN_INFO).write_text(json.dumps({"commit": "abc1234", "command": "shardmq-perf bench -r 2",
                                                         "load1": [1.0, 2.5]}))
    # A later invocation appended runs to the same directory (other numbers): not part of this page.
    for k, broker in enumerate(BROKERS * 2):
        _write_run(results, 100 + k, broker, "publish-only-16b", 70_000.0, [500] * 20, _record(k, broker))
    doc = tmp_path / "benchmarks.md"
    command = [sys.executable, "-m", "loadtest.bench", "--from-results", str(results), "--doc", str(doc),
               "--master", "local[1]"]
    refused = subprocess.run(command, cwd=bench.ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and not doc.exists()
    assert "--invocation" in refused.stderr and bench.UNRECORDED in refused.stderr and LATER in refused.stderr
    proc = subprocess.run([*command, "--invocation", bench.UNRECORDED], cwd=bench.ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = doc.read_text()
    for name in ("latency-by-rate.png", "throughput-publish.png"):
        _png_size(tmp_path / "benchmarks" / name)
        assert f"](benchmarks/{name})" in page
    run_row = next(ln for ln in page.splitlines() if re.match(r"\| \d{8}T\d{6}Z", ln))
    assert "| 2026-01-02 03:04 UTC | abc1234 | 1.0–2.5 |" in run_row and "`shardmq-perf bench -r 2`" in run_row
    assert "```sh\nshardmq-perf bench -r 2\n```" in page  # Reproduce: the run's command, not --from-results
    assert "| ShardMQ commit | abc1234 |" in page  # the run's commit, not the checkout's
    assert _table_row(page, "publish-only-16b", "publish msgs/s")[2] == "90,000 (90,000–90,000)"
    assert _table_row(page, "latency-10k-autoack", "publish msgs/s")[3] == "10,000 (10,000–10,000)"


def test_the_run_row_and_the_reproduce_command_come_from_the_runs_own_records(tmp_path: Path) -> None:
    """Runs that carry a RUN_RECORD name their invocation on the page: its command and commit, the
    first start to the last end, the load range at the runs' starts, RabbitMQ's version as it ran."""
    results = tmp_path / "results"
    results.mkdir()
    for k, broker in enumerate(BROKERS * 2):
        _write_run(results, k, broker, "publish-only-16b", 70_000.0, [500] * 20, _record(k, broker))
    (group,) = bench.invocations(results)
    assert group.id == LATER and len(group.runs) == 4
    doc = tmp_path / "docs" / "benchmarks.md"
    bench.write_doc(doc, ["--ignored"], _summary(["publish-only-16b"]), [], [], results, None, run_info=group.info)
    page = doc.read_text()
    run_row = next(ln for ln in page.splitlines() if re.match(r"\| \d{8}T\d{6}Z", ln))
    assert "| 2026-01-05 10:00–10:19 UTC | def5678 | 0.5–0.8 |" in run_row
    assert "`shardmq-perf bench --scenarios publish-only-16b --append`" in run_row
    assert "```sh\nshardmq-perf bench --scenarios publish-only-16b --append\n```" in page
    assert "| ShardMQ commit | def5678 |" in page and "| RabbitMQ | 3.12.1 |" in page
