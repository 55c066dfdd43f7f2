"""Listing one page of 100,000 queues stays fast: the HTTP layer over real Definitions and NodeStats.

The node here is a stand-in holding only what the management routes read (definitions, the
workers' stats, settings): starting 100,000 real queue stores is the storage's business, this
measures what the API adds. Prints the measured times (quoted in docs/management.md's note).
"""

from __future__ import annotations

import asyncio
import base64
import time
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from broker.config import Settings
from broker.definitions import Definitions
from broker.http.server import make_app
from broker.node_stats import NodeStats

N = 100_000


def _node() -> SimpleNamespace:
    defs = Definitions()
    defs.apply_all(defs.default_user_ops("guest", "guest"))
    ops = [["queue.declare", "/", f"q-{i:06d}", {"durable": True, "exclusive_owner": None, "auto_delete": False,
                                                  "arguments": {}, "shard": i % 4}] for i in range(N)]
    defs.apply_all(ops)
    stats = NodeStats()
    for shard in range(4):
        stats.update("shard", shard, {"queues": [["/", f"q-{i:06d}", i % 97, i % 5, i % 3, 10 * (i % 97)]
                                                 for i in range(shard, N, 4)]})
    return SimpleNamespace(defs=defs, stats=stats, settings=Settings(data_dir="/nonexistent"), alarms=[],
                           ready=True, is_leader=True)


def test_one_page_of_100k_queues_is_fast():
    node = _node()
    auth = {"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()}

    async def run() -> dict[str, float]:
        timings = {}
        async with TestClient(TestServer(make_app(node))) as client:
            for label, path in (("by name", "/api/queues?page=1&page_size=100"),
                                ("by messages, reversed", "/api/queues?page=1&page_size=100&sort=messages"
                                                          "&sort_reverse=true"),
                                ("filtered", "/api/queues?page=1&page_size=100&name=q-09")):
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    resp = await client.get(path, headers=auth)
                    data = await resp.json()
                    best = min(best, time.perf_counter() - t0)
                    assert resp.status == 200 and len(data["items"]) == 100
                timings[label] = best
            assert data["filtered_count"] == 10_000
        return timings

    timings = asyncio.run(run())
    print("GET /api/queues page of 100 at 100k queues:", {k: f"{v * 1000:.0f} ms" for k, v in timings.items()})
    assert timings["by name"] < 1.0, timings  # generous for a loaded 2-core CI machine


def test_aggregated_metrics_scrape_of_100k_queues_is_cheap():
    from broker.http.metrics import _render

    node = _node()
    node.sup = SimpleNamespace(workers=[])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        body = _render(node, per_object=False)
        best = min(best, time.perf_counter() - t0)
    print(f"/metrics (aggregated) at 100k queues: {best * 1000:.0f} ms, {len(body)} bytes")
    assert b"rabbitmq_queues 100000.0" in body
    assert len(body) < 20_000 and best < 1.0  # no per-queue series unless asked for
