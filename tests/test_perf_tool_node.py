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
