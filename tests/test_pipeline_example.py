"""The example orders pipeline (pipeline/examples/orders.py) end to end, on a real node and the run's Spark session."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections import defaultdict

import pytest

from pipeline.examples import orders as ex
from tests.harness import REPO_ROOT


@pytest.fixture
def orders_node(node_factory):
    return node_factory(name="orders", frontends=1, shards=2)


def test_orders_pipeline_windows_parquet_exchange_replay_and_plot(spark, orders_node, tmp_path):
    uri = orders_node.url
    ex.declare(uri)
    end = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    batch = ex.make_orders(3000, 3, end)
    ex.publish_orders(uri, batch)
    want: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for o in batch:
        t = dt.datetime.fromisoformat(o["event_time"]).replace(second=0, microsecond=0)
        want[(t, o["region"])][0] += 1
        want[(t, o["region"])][1] += o["amount"]
    results = str(tmp_path / "windows")
    query = ex.run_streaming(spark, uri, results, str(tmp_path / "ck"), per_trigger=None)
    query.awaitTermination(120)
    assert not query.isActive, "the AvailableNow query did not finish"
    rows = spark.read.schema(ex.STATS_SCHEMA).parquet(results).collect()
    got = {(r.window_start.replace(tzinfo=dt.UTC), r.region): (r.orders, r.amount) for r in rows}
    assert set(got) == set(want) and len(got) == 9
    for key, (n, amount) in want.items():
        assert got[key][0] == n and got[key][1] == pytest.approx(amount, abs=0.01)
    published = ex.read_stats_queue(uri, len(got), timeout=30)
    assert len(published) == 9 and {(m["region"], m["orders"]) for m in published} == {
        (k[1], v[0]) for k, v in got.items()}
    replay = {r.region: (r.orders, r.amount) for r in ex.replay_last_hour(spark, uri)}
    for region in ex.REGIONS:
        assert replay[region][0] == sum(1 for o in batch if o["region"] == region)
    png = tmp_path / "orders.png"
    ex.plot(spark, results, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help_names_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "orders" in out.stdout and "bench" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "orders"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--out" in bad.stderr
