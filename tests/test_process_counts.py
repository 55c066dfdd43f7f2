"""loadtest.process_counts, the tool behind the default process counts: pinning, CPU accounting,
the summary (never a speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import process_counts as pc


def test_one_core_pins_node_and_load_generator_apart() -> None:
    one, every = pc.Config("1", 2, 1), pc.Config("all", 2, 2)
    assert one.node_prefix() == ["taskset", "-c", "0"] and one.perf_prefix() == ["taskset", "-c", "1"]
    assert every.node_prefix() == every.perf_prefix() == []


def test_summary_medians_per_configuration() -> None:
    rows = []
    for i, (pub, con, cpu) in enumerate([(100, 50, 10.0), (300, 100, 12.0), (200, 200, 11.0)]):
        rows.append({"cores": "all", "frontends": 2, "shards": 2, "scenario": "4p4c-16b-4queues", "load1": 1.0 + i,
                     "publish_rate": pub, "consume_rate": con, "cpu_us_per_msg": cpu})
        rows.append({"cores": "1", "frontends": 1, "shards": 1, "scenario": "latency-10k", "load1": 2.0,
                     "publish_rate": 10000, "consume_rate": 9000 + 500 * i, "p50_us": 100 * (i + 1), "p99_us": 900,
                     "cpu_us_per_msg": 20.0})
    rows.append({"cores": "1", "frontends": 1, "shards": 1, "scenario": "latency-10k", "error": "boom"})
    md = pc.summarize(rows)
    # msgs/s = mean of publish and consume: 75, 200, 200 -> median 200
    assert "| all | 2F x 2S | 3 | 200 (75–200) | 11.0 (10.0–12.0) | 1.0–3.0 |" in md
    assert "| 1 | 1F x 1S | 3 | 200 | 900 | 9,000 | 20.0 (20.0–20.0) | 2.0–2.0 |" in md
    assert "1 runs failed: latency-10k 1 1x1" in md


def test_cpu_of_a_process_tree_counts_the_children(tmp_path: Path) -> None:
    # a parent that starts a busy child: the tree's CPU grows by the child's
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass\\ntime.sleep(30)']); "
            "time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while pc.tree_cpu_seconds(parent.pid) < 0.5:
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.1)
        assert len(pc.tree_affinity(parent.pid)) == len(os.sched_getaffinity(0))
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.integration  # starts a node under taskset and runs the perf tool against it
def test_a_one_core_run_pins_the_node(tmp_path: Path) -> None:
    assert pc.main(["--counts", "1x1", "--cores", "1", "--scenarios", "latency-10k", "--rounds", "1",
                    "--duration", "1", "--out", str(tmp_path)]) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and "error" not in rows[0], rows
    assert rows[0]["node_cpus"] == [0]
    assert rows[0]["consumed"] > 0 and rows[0]["node_cpu_s"] > 0
    assert "| 1 | 1F x 1S | 1 |" in (tmp_path / "summary.md").read_text()


def test_every_scenario_is_a_valid_perf_tool_command() -> None:
    from loadtest.cli import build_parser
    for name, argv in pc.SCENARIOS.items():
        args = build_parser().parse_args(["amqp", *argv, "--json", "--time", "6"])
        assert args.json and args.time_s == 6, name
    assert set(pc.OPERATIONS) <= set(pc.SCENARIOS)
    # the control plane and connection churn weigh on the default count as well as the message paths
    assert {"bind-churn", "connection-churn", "fanout-4queues", "latency-1k"} <= set(pc.SCENARIOS)


def test_operation_scenarios_count_operations_not_messages() -> None:
    run = {"duration_s": 2.0, "published": 0, "consumed": 0, "extra": {"bind_unbind_pairs": 500, "pairs_per_s": 250}}
    assert pc.result_fields("bind-churn", run, 0.1) == {"ops": 500, "ops_per_s": 250.0, "cpu_us_per_op": 200.0}
    churn = {"duration_s": 4.0, "extra": {"connections": 1000}}
    assert pc.result_fields("connection-churn", churn, 0.5) == {"ops": 1000, "ops_per_s": 250.0, "cpu_us_per_op": 500.0}
    msgs = {"published": 300, "consumed": 100, "publish_rate": 150.0, "consume_rate": 50.0,
            "latency_us": {"p50": 7, "p99": 9}}
    assert pc.result_fields("1p1c-16b-transient", msgs, 0.002)["cpu_us_per_msg"] == 10.0


def test_summary_has_an_operations_table() -> None:
    rows = [{"cores": "all", "frontends": f, "shards": 1, "scenario": s, "load1": 3.0, "ops": 10, "ops_per_s": r,
             "cpu_us_per_op": c}
            for f, s, r, c in [(1, "bind-churn", 2000.0, 300.0), (1, "bind-churn", 1000.0, 320.0),
                               (1, "bind-churn", 1500.0, 310.0), (2, "bind-churn", 900.0, 600.0),
                               (1, "connection-churn", 1800.0, 150.0)]]
    md = pc.summarize(rows)
    assert "| cores | frontends x shards | runs | bind-churn: /s | bind-churn: CPU µs/op | connection-churn: /s " in md
    assert "| all | 1F x 1S | 3 | 1,500 (1,000–2,000) | 310 (300–320) | 1,800 | 150 | 3.0–3.0 |" in md
    assert "| all | 2F x 1S | 1 | 900 | 600 | — | — | 3.0–3.0 |" in md
    assert "msgs/s" not in md  # no message scenario ran: no empty message table


@pytest.mark.integration  # a node and the perf tool's churn commands
def test_churn_scenarios_count_operations_against_a_node(tmp_path: Path) -> None:
    assert pc.main(["--counts", "1x1", "--cores", "all", "--scenarios", "bind-churn,connection-churn",
                    "--rounds", "1", "--duration", "1", "--out", str(tmp_path)]) == 0
    rows = {r["scenario"]: r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert set(rows) == {"bind-churn", "connection-churn"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["ops"] > 0 and r["ops_per_s"] > 0 and r["cpu_us_per_op"] > 0, r
    assert "| all | 1F x 1S | 1 |" in (tmp_path / "summary.md").read_text()
