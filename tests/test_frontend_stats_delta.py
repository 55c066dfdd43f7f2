"""Frontends report only the connections that opened, changed or closed (issue #15): idle
connections cost the node nothing per stats interval, and the management API's connection and
consumer lists stay right through opens, changes, closes and a lost report."""

from __future__ import annotations

import urllib.request

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.node_stats import NodeStats
from tests.harness import wait_until
from tests.mgmt_api import Api

pytestmark = pytest.mark.integration


def fe_metrics(node) -> dict[str, float]:
    """{metric name: value} of frontend 0's STATS series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("shardmq_frontend_") and s.labels.get("frontend") == "0"}


def wait_for(check, what: str, timeout: float = 15.0):
    return wait_until(check, timeout, what, 0.05)


def reports_after(node, n: int) -> dict[str, float]:
    """Metrics once frontend 0 has sent n more reports than now (each ends an interval)."""
    start = fe_metrics(node)["shardmq_frontend_stats_reports_total"]
    return wait_for(lambda: (m := fe_metrics(node))["shardmq_frontend_stats_reports_total"] >= start + n and m,
                    f"{n} more frontend reports")


def test_idle_connections_send_no_rows_and_the_api_follows_changes(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    params = pika.URLParameters(node.url + "?heartbeat=0")  # no heartbeats: idle means no bytes move
    conns = [pika.BlockingConnection(params) for _ in range(20)]
    chans = [c.channel() for c in conns]
    wait_for(lambda: len(api.get("/api/connections")) == 20, "20 connections listed")
    # Past the report that carried the last open: every connection sent at least once (up to 3 times:
    # a row is sent once authenticated, and connection.open and channel.open may each fall in a later
    # interval), then nothing while they idle.
    rows0 = reports_after(node, 2)["shardmq_frontend_stats_rows_sent_total"]
    assert 20 <= rows0 <= 60, rows0
    assert reports_after(node, 5)["shardmq_frontend_stats_rows_sent_total"] == rows0, "idle connections sent rows"

    # One connection consumes: that one row (with its consumer) is sent in the intervals it moved in
    # (declare, consume), the rest stay quiet.
    chans[3].queue_declare("delta-q")
    chans[3].basic_consume("delta-q", lambda *a: None, consumer_tag="ctag-3")
    consumers = wait_for(lambda: api.get("/api/consumers") or None, "the consumer listed")
    assert [(c["consumer_tag"], c["queue"]["name"]) for c in consumers] == [("ctag-3", "delta-q")]
    m = reports_after(node, 3)
    assert rows0 < m["shardmq_frontend_stats_rows_sent_total"] <= rows0 + 4, (rows0, m)
    assert len(api.get("/api/connections")) == 20

    # Bytes moved on one connection: its counters in the API follow.
    before = {c["peer_port"]: c["recv_oct"] for c in api.get("/api/connections")}
    for _ in range(50):
        chans[5].basic_publish("", "delta-q", b"x" * 100)
    conns[5].process_data_events(0)

    def grew():
        now = {c["peer_port"]: c["recv_oct"] for c in api.get("/api/connections")}
        moved = [p for p in now if now[p] > before.get(p, 0)]
        return moved if len(moved) == 1 else None
    wait_for(grew, "one connection's recv_oct grew")

    # Closes: the closed connections and the consumer of the closed one leave the lists.
    for c in conns[:5]:
        c.close()
    wait_for(lambda: len(api.get("/api/connections")) == 15, "15 connections listed")
    assert api.get("/api/consumers") == []
    assert fe_metrics(node)["shardmq_frontend_connections"] == 15
    for c in conns[5:]:
        c.close()
    wait_for(lambda: api.get("/api/connections") == [], "no connection listed")


def test_frontend_deltas_merge_and_a_gap_asks_for_a_full_report():
    st = NodeStats()

    def row(cid: int, recv: int = 0, channels: int = 1) -> list:
        return [cid, "127.0.0.1", 5000 + cid, "guest", "/", {}, 0, recv, 0, False,
                [[n, 0, False, 0, 0, 0, False, False] for n in range(1, channels + 1)]]

    assert st.update("frontend", 0, {"seq": 1, "full": True, "connections": [row(1), row(2)],
                                     "consumers": [[2, 1, "t", "q", False, 0]], "closed": [],
                                     "counters": {"connections_opened": 2}}) is False
    assert sorted(r[0] for _, r in st.connections()) == [1, 2] and len(st.consumers()) == 1
    # A delta: 3 opens, 1 closes, 2 changes and drops its consumer; unchanged rows stay.
    assert st.update("frontend", 0, {"seq": 2, "full": False, "connections": [row(3), row(2, recv=9)],
                                     "consumers": [], "closed": [1], "counters": {"connections_opened": 3}}) is False
    assert {r[0]: r[7] for _, r in st.connections()} == {2: 9, 3: 0}
    assert st.consumers() == []
    assert st.frontend_counter("connections_opened") == 3
    assert "connections" not in st.frontends[0]  # rows live in the merged table only
    # seq 3 lost: the node must ask for a full report, which replaces the table
    assert st.update("frontend", 0, {"seq": 4, "full": False, "connections": [], "consumers": [],
                                     "closed": [], "counters": {}}) is True
    assert st.update("frontend", 0, {"seq": 5, "full": True, "connections": [row(4)], "consumers": [],
                                     "closed": [], "counters": {}}) is False
    assert [r[0] for _, r in st.connections()] == [4]
    # A frontend of an older version (no seq) sends full reports; forget drops its rows
    st.update("frontend", 1, {"connections": [row(7)], "consumers": [[7, 1, "u", "q", True, 0]]})
    assert sorted(r[0] for _, r in st.connections()) == [4, 7] and len(st.consumers()) == 1
    st.forget("frontend", 1)
    assert [r[0] for _, r in st.connections()] == [4] and st.consumers() == []
