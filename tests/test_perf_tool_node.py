"""shardmq-perf end to end against a real ShardMQ node (tests/harness.py): counts and --verify only."""

from __future__ import annotations

import json

from loadtest.cli import EXIT_OK, main


def test_throughput_verified_against_node(node, capsys):
    rc = main(["amqp", "throughput", "--uri", node.url, "-x", "2", "-y", "2", "--pmessages", "1000",
               "-c", "100", "-a", "10", "-q", "200", "--verify", "--broker-pid", str(node.pid), "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    assert r["published"] == r["confirmed"] == r["consumed"] == 2000
    assert r["verify"]["ok"]
    assert r["broker_rss_bytes"] > 0


def test_consume_only_drains_a_backlog_on_node(node, capsys):
    rc = main(["amqp", "throughput", "--uri", node.url, "-y", "0", "--pmessages", "3000", "-c", "500",
               "--queue", "drain", "--keep", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK and r["confirmed"] == 3000, r
    rc = main(["amqp", "throughput", "--uri", node.url, "--publishers", "0", "--consumers", "1", "--queue", "drain",
               "--cmessages", "3000", "-z", "60", "--consume-rate", "5000", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    assert (r["published"], r["consumed"]) == (0, 3000)


def test_connection_count_rss_on_node(node, capsys):
    rc = main(["amqp", "connection-count", "--uri", node.url, "-n", "100", "--broker-pid", str(node.pid), "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    e = r["extra"]
    assert e["connections"] == 100
    assert e["rss_after_bytes"] == r["broker_rss_bytes"] > e["rss_before_bytes"] > 0
    assert e["rss_per_connection_bytes"] == (e["rss_after_bytes"] - e["rss_before_bytes"]) // 100 > 0
