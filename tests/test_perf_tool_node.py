"""shardmq-perf end to end against a real ShardMQ node (tests/harness.py): counts and --verify only."""

from __future__ import annotations

import json

from loadtest.amqp_client import AMQPClient
from loadtest.amqp_throughput import ThroughputOptions
from loadtest.cli import EXIT_OK, main
from tests.harness import wait_until


def test_throughput_verified_against_node(node, capsys):
    rc = main(["amqp", "throughput", "--uri", node.url, "-x", "2", "-y", "2", "--pmessages", "1000",
               "-c", "100", "-a", "10", "-q", "200", "--verify", "--broker-pid", str(node.pid), "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    assert r["published"] == r["confirmed"] == r["consumed"] == 2000
    assert r["verify"]["ok"]
    assert r["broker_rss_bytes"] > 0
    # publish -> confirm, timed by the publishers: every confirmed message is in it
    c = [r["extra"][f"confirm_latency_{k}_us"] for k in ("min", "p50", "p95", "p99", "max")]
    assert 0 <= c[0] and c == sorted(c), r["extra"]


def test_routing_key_count_publishes_round_robin_over_keys_bound_to_the_queue(node, capsys):
    """--routing-key-count 4: every message reaches the perf queue through one of four bindings, and
    the keys take turns (a spy queue per key gets exactly a quarter)."""
    keys = ThroughputOptions(routing_key_count=4).routing_keys("rr")
    assert keys == ["0.rr", "1.rr", "2.rr", "3.rr"]
    with AMQPClient(node.url).connect() as c:
        c.exchange_declare("perf-rr", "direct")
        for i, key in enumerate(keys):
            c.queue_declare(f"spy-{i}")
            c.queue_bind(f"spy-{i}", "perf-rr", key)
        rc = main(["amqp", "throughput", "--uri", node.url, "--exchange", "perf-rr", "--routing-key", "rr",
                   "--routing-key-count", "4", "--pmessages", "2002", "-c", "300", "--verify", "--json"])
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == EXIT_OK, r
        assert r["published"] == r["confirmed"] == r["consumed"] == 2002 and r["verify"]["ok"]
        assert [c.queue_declare(f"spy-{i}", passive=True)[1] for i in range(4)] == [501, 501, 500, 500]


def test_fanout_exchange_verifies_every_copy_per_queue(node, capsys):
    """--exchange-type fanout: each publish reaches both queues, and each queue's two consumers share its
    copies: 2 x 600 publishes arrive 2,400 times, none a duplicate."""
    rc = main(["amqp", "throughput", "--uri", node.url, "-x", "2", "-y", "4", "--queues", "2", "--exchange",
               "perf-fan", "--exchange-type", "fanout", "--pmessages", "600", "-c", "100", "--verify", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    assert (r["published"], r["confirmed"], r["consumed"]) == (1200, 1200, 2400), r
    v = r["verify"]
    assert v["ok"] and (v["copies"], v["received_unique"], v["duplicates"], v["missing"]) == (2, 2400, 0, 0), v


def test_fanout_exchange_consumers_read_every_copy_up_to_cmessages(node, capsys):
    """--cmessages with fanout: the run waits for each queue's copy of every publish (slow consumers,
    1,000 msg/s each, so a run that stopped at one delivery per publish would end with a third of them)."""
    rc = main(["amqp", "throughput", "--uri", node.url, "-x", "1", "-y", "3", "--queues", "3", "--exchange",
               "perf-fan-c", "--exchange-type", "fanout", "--pmessages", "500", "-c", "100", "--cmessages", "500",
               "--consume-rate", "1000", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    assert (r["published"], r["consumed"]) == (500, 1500), r


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
    # Both are real readings of the node's tree; their order is not the tool's to promise: the node and
    # its shards trim their heaps ~2 s after boot (this node is fresh), which can give back more than
    # 100 connections take (failed so under load). The per-connection figure is the growth, clamped at 0.
    assert e["rss_after_bytes"] == r["broker_rss_bytes"] > 0 and e["rss_before_bytes"] > 0
    assert e["rss_delta_bytes"] == e["rss_after_bytes"] - e["rss_before_bytes"]
    assert e["rss_per_connection_bytes"] == max(0, e["rss_delta_bytes"]) // 100


def test_persistent_confirm_and_ack_flood_keeps_flowing(node):
    # Regression: with full 512-item batches sent from put(), a ZeroMQ FD edge could be consumed
    # by the send and confirms/PROCESSED were then never read: this exact scenario hung 4 runs in 6.
    # Each run is a subprocess with a hard bound, so a hang fails the test instead of the suite.
    import subprocess
    import sys

    for i in range(3):
        proc = subprocess.run(
            [sys.executable, "-m", "loadtest.cli", "amqp", "throughput", "--uri", node.url, "-x", "1", "-y", "1",
             "-s", "1024", "--persistent", "-c", "1000", "-a", "1", "-q", "1000", "-z", "2",
             "--queue", f"flood-{i}", "--json"],
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["published"] == r["confirmed"] > 0, r
        assert r["consumed"] > 0, r


def test_trace_stages_follows_sampled_messages_through_every_hop(node_factory, tmp_path, capsys):
    """--trace-stages on the node and the perf tool: every traced message has all stages, in order."""
    from broker.stage_trace import SAMPLE
    from loadtest import trace_stages

    trace_dir = tmp_path / "trace"
    node = node_factory(frontends=1, shards=1, extra_args=["--trace-stages", str(trace_dir)])
    n = 40 * SAMPLE  # ~40 sampled messages
    rc = main(["amqp", "throughput", "--uri", node.url, "-x", "1", "-y", "1", "-s", "16", "--pmessages", str(n),
               "--cmessages", str(n), "-z", "60", "--rate", "20000", "--trace-stages", str(trace_dir), "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK and r["consumed"] == n, r
    roles = {p.name.split("-")[0] for p in trace_dir.glob("*.trace")}
    pids = node.pids()  # a pair (--colocate) writes one trace: pair-PID.trace
    paired = pids["frontend"]["0"] == pids["shard"]["0"]
    assert roles == ({"pair", "client"} if paired else {"frontend", "shard", "client"}), roles
    # The node's processes write their lines from a timer (broker/stage_trace.py FLUSH_S), while they
    # run: every message the client traced gets all its stages without stopping the node.
    def complete() -> list[dict[str, int]]:
        paths = trace_stages.load(trace_dir)
        got = [s for s in paths.values() if "client_recv" in s]
        return got if len(got) >= 10 and all(set(trace_stages.STAGES) <= set(s) for s in got) else []

    complete = wait_until(complete, 30, "every traced message's stages in the trace files")
    for s in complete:
        times = [s[stage] for stage in trace_stages.STAGES]
        assert times == sorted(times), s
    assert set(trace_stages.breakdown(trace_stages.load(trace_dir))) == set(trace_stages.HOPS)
    assert trace_stages.main([str(trace_dir)]) == 0


def _metrics(node) -> dict[str, float]:
    """The node's aggregated Prometheus counters/gauges (frontends report every --stats-interval)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(text)}


def _wait_metrics(node, predicate, timeout: float = 20.0, context=None) -> dict[str, float]:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(node)
        if predicate(m):
            return m
        assert time.monotonic() < deadline, (context(m) if callable(context) else
                                             {k: v for k, v in m.items() if k.startswith("rabbitmq_connections")})
        time.sleep(0.05)


def _settled_connection_counts(node) -> dict[str, float]:
    """The counters once the harness's own probe connections are all reported closed: the same
    numbers for 1 s (5 report intervals of 200 ms; a frontend that started listening last may not
    have reported its first connections yet)."""
    import time

    key = ("rabbitmq_connections_opened", "rabbitmq_connections_closed", "rabbitmq_connections")
    last, since = None, time.monotonic()
    while True:
        m = _wait_metrics(node, lambda m: m["rabbitmq_connections_opened"] >= 1 and m["rabbitmq_connections"] == 0
                          and m["rabbitmq_connections_closed"] == m["rabbitmq_connections_opened"])
        now = tuple(m[k] for k in key)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return m
        time.sleep(0.1)


def test_idle_connections_are_held_with_heartbeats_and_memory_counted(node_factory):
    """The idle-connections scenario's tool (connection-count, asyncio) on a real node: every
    connection is open at once (the node's gauge says so), stays open through heartbeats of 1 s
    (a client that did not send them would be dropped after 2 s), and the node's whole process
    tree is measured (RSS and PSS, 5 processes)."""
    import subprocess
    import sys

    node = node_factory(frontends=2, shards=2, extra_args=["--stats-interval", "200", "--heartbeat", "1"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.cli", "amqp", "connection-count", "--uri", node.url, "-n", "200",
         "--hold", "4", "--broker-pid", str(node.pid), "--json"], stdout=subprocess.PIPE, text=True)
    try:
        _wait_metrics(node, lambda m: m["rabbitmq_connections"] == 200)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_OK, out
    r = json.loads(out.strip().splitlines()[-1])
    e = r["extra"]
    assert (e["connections"], e["connections_alive"], e["errors"]) == (200, 200, 0), e
    assert r["params"]["heartbeat"] is None  # the broker's proposal (1 s) was accepted
    pids = node.pids()  # node, 2 frontends, 2 shards: 5 processes, or 3 with 2 pairs (--colocate)
    assert e["broker_processes"] == 1 + len({*pids["frontend"].values(), *pids["shard"].values()})
    # before/after are both real readings of the tree; their order is not the tool's to promise: the node
    # and the shards trim their heaps ~2 s after boot, which can give back more than 200 connections take
    assert e["rss_after_bytes"] == r["broker_rss_bytes"] > e["pss_after_bytes"] > 0
    assert e["rss_before_bytes"] > e["pss_before_bytes"] > 0
    assert e["rss_delta_bytes"] == e["rss_after_bytes"] - e["rss_before_bytes"]
    assert e["rss_per_connection_bytes"] == max(0, e["rss_delta_bytes"]) // 200
    assert e["pss_per_connection_bytes"] == max(0, e["pss_after_bytes"] - e["pss_before_bytes"]) // 200
    _wait_metrics(node, lambda m: m["rabbitmq_connections"] == 0)  # all closed again


def test_connection_churn_count_matches_the_node(node_factory, capsys):
    """connection-churn's count is exact: the node opened and closed exactly that many connections."""
    node = node_factory(frontends=2, shards=2, extra_args=["--stats-interval", "200"])
    m0 = _settled_connection_counts(node)
    rc = main(["amqp", "connection-churn", "--uri", node.url, "-z", "2", "-c", "4", "--broker-pid", str(node.pid),
               "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == EXIT_OK, r
    e = r["extra"]
    n = e["connections"]
    assert n > 0 and e["errors"] == 0, e
    assert e["connections_per_s"] > 0 and e["broker_cpu_us_per_connection"] > 0
    opened0, closed0 = m0["rabbitmq_connections_opened"], m0["rabbitmq_connections_closed"]
    _wait_metrics(node, lambda m: m["rabbitmq_connections_opened"] - opened0 == n
                  and m["rabbitmq_connections_closed"] - closed0 == n and m["rabbitmq_connections"] == 0,
                  context=lambda m: (f"tool {n}, node opened {m['rabbitmq_connections_opened'] - opened0} "
                                     f"closed {m['rabbitmq_connections_closed'] - closed0} since {m0}"))


def test_queue_count_reports_rates_per_tenth(node, capsys):
    rc = main(["amqp", "queue-count", "--uri", node.url, "-n", "2000", "--json"])
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"]
    assert rc == EXIT_OK, e
    assert e["queues"] == 2000
    assert len(e["tenths_declares_per_s"]) == 4 and all(r > 0 for r in e["tenths_declares_per_s"])
    assert e["deletes_per_s"] > 0


def test_delete_stall_deletes_queues_and_a_vhost_while_probing(node, capsys):
    rc = main(["amqp", "delete-stall", "--uri", node.url, "-n", "300", "--json"])
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"]
    assert rc == EXIT_OK, e
    assert e["queues"] == 300 and e["probe_during_confirms"] > 0
    assert e["worst_stall_ms"] >= e["probe_during_p50_ms"] > 0
    rc = main(["amqp", "delete-stall", "--uri", node.url, "-n", "300", "--durable", "--vhost", "stall-v",
               "--api", f"http://guest:guest@127.0.0.1:{node.http_port}", "--probe-durable", "--json"])
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"]
    assert rc == EXIT_OK, e
    assert e["vhost"] == "stall-v" and e["probe_during_confirms"] > 0 and e["probe_durable"] is True
    from tests.mgmt_api import Api
    from tests.test_queues import exists

    conn = node.connect()
    try:  # the probe deleted its queue, and the first run its 300 queues
        assert not exists(conn, "perf-del-probe") and not exists(conn, "perf-del-0")
    finally:
        conn.close()
    assert Api(node.http_port).call("GET", "/api/vhosts/stall-v")[0] == 404


def test_confirm_rtt_counts_every_confirmed_publish(node, capsys):
    from tests.harness import wait_until
    from tests.mgmt_api import Api

    rc = main(["amqp", "confirm-rtt", "--uri", node.url, "--time", "1", "--json"])
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"]
    assert rc == EXIT_OK, e
    assert e["confirms"] > 0 and e["rtt_max_us"] >= e["rtt_p99_us"] >= e["rtt_p50_us"] > 0
    assert e["confirms_per_s"] > 0 and e["durable"] is False
    rc = main(["amqp", "confirm-rtt", "--uri", node.url, "--time", "0.5", "--durable", "--queue", "rtt-d", "--json"])
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"]
    assert rc == EXIT_OK and d["durable"] is True and d["confirms"] > 0, d
    # Every round trip counted is one publish the node counted (a fresh node: nothing else published).
    api = Api(node.http_port)
    wait_until(lambda: api.call("GET", "/api/overview")[1].get("message_stats", {}).get("publish")
               == e["confirms"] + d["confirms"], 15, "the node's publish count to equal the confirms counted",
               context=lambda: str(api.call("GET", "/api/overview")[1].get("message_stats")))


def test_boot_time_declares_then_times_boots(tmp_path, capsys):
    from loadtest import boot_time

    assert boot_time.main(["--queues", "300", "--data-dir", str(tmp_path / "data"), "--boots", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["declared"] == 300
    assert lines[1]["boot"] == 1 and lines[1]["queues"] == 300 and lines[1]["ready_s"] >= lines[1]["amqp_s"] > 0
    assert "node" in lines[1]["cpu"] and len(lines[1]["cpu"]) >= 2  # the node and its workers, by name
    assert lines[1]["cpu_s"] == round(sum(lines[1]["cpu"].values()), 2)
    # A second run finds the queues and only measures.
    assert boot_time.main(["--queues", "300", "--data-dir", str(tmp_path / "data"), "--boots", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [list(x) for x in lines][0][0] == "boot"
    # --mqtt-sessions: an old shared KV log the boot places (per shard logs after it, nothing left shared).
    assert boot_time.main(["--queues", "300", "--data-dir", str(tmp_path / "data"), "--boots", "1",
                           "--mqtt-sessions", "100"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mqtt_sessions"] == 100
    kv = tmp_path / "data" / "kv"
    logs = [p.name for p in kv.rglob("*.log")]
    assert logs and all(".shard-" in name for name in logs), logs
    assert (kv / "placed-for").exists()


def test_memory_lists_every_process_of_a_node_and_sums_them(node, capsys):
    assert main(["memory", str(node.pid), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    roles = sorted(r["role"] for r in out["processes"])
    pids = node.pids()
    if pids["frontend"]["0"] == pids["shard"]["0"]:  # 2 pairs (--colocate)
        assert roles == ["node", "pair-0", "pair-1"]
    else:
        assert roles == ["frontend-0", "frontend-1", "node", "shard-0", "shard-1"]
    for key in ("rss", "pss", "uss"):
        assert out["total"][key] == sum(r[key] for r in out["processes"]) > 0
    assert all(r["rss"] >= r["pss"] >= r["uss"] > 0 for r in out["processes"])
    assert main(["memory", str(node.pid)]) == 0
    assert "total" in capsys.readouterr().out


def test_confirm_latency_counts_each_message_once_by_its_burst():
    from array import array
    from collections import deque

    from loadtest.amqp_throughput import _settle_confirm_latency, confirm_latency_summary

    pending = deque([[1, 100, 0], [101, 200, 5_000_000]])  # two bursts of 100, sent at 0 and 5 ms
    lats, counts = array("q"), array("q")
    _settle_confirm_latency(pending, 40, 2_000_000, lats, counts)  # 40 confirmed at 2 ms
    _settle_confirm_latency(pending, 40, 3_000_000, lats, counts)  # nothing new
    _settle_confirm_latency(pending, 150, 9_000_000, lats, counts)  # 60 of burst 1, 50 of burst 2
    assert list(zip(lats, counts, strict=True)) == [(2_000_000, 40), (9_000_000, 60), (4_000_000, 50)]
    assert [list(b) for b in pending] == [[151, 200, 5_000_000]]
    summary = confirm_latency_summary([{"confirm_lats": lats.tobytes(), "confirm_counts": counts.tobytes()}])
    # 150 messages: 40 at 2 ms, 50 at 4 ms, 60 at 9 ms (nearest rank)
    assert summary == {"min": 2000, "p50": 4000, "p95": 9000, "p99": 9000, "max": 9000}
    assert confirm_latency_summary([{"confirm_lats": b"", "confirm_counts": b""}]) is None
