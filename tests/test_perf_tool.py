"""shardmq-perf end to end against its built-in fake broker (loadtest/sink.py) and a fake MQTT broker.

Counts and verification only: nothing here asserts speed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from broker.amqp import encoder
from loadtest import results
from loadtest.amqp_client import AMQPClient, AMQPUri
from loadtest.amqp_throughput import TRANSIENT_PROPS, ThroughputOptions, ThroughputRun, _verify_copies
from loadtest.cli import EXIT_ERROR, EXIT_OK, EXIT_VERIFY, main
from loadtest.mqtt_throughput import (
    PUBACK,
    PUBLISH,
    SUBSCRIBE,
    decode_varint,
    encode_connect,
    encode_publish,
    encode_subscribe,
    encode_varint,
    split_packets,
)
from loadtest.ports import free_port
from loadtest.scenarios_amqp import rss_growth
from loadtest.sink import SinkProcess

pytestmark = pytest.mark.integration  # starts the perf tool's sink broker processes


@pytest.fixture
def sink():
    with SinkProcess("relay") as s:
        yield s


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1])


def test_one_publisher_one_consumer_verified(sink, capsys, tmp_path):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--pmessages", "3000", "--verify",
                              "--results-dir", str(tmp_path), "--broker-name", "sink", "--scenario", "t1"])
    assert rc == EXIT_OK, r
    assert (r["published"], r["consumed"], r["confirmed"]) == (3000, 3000, 0)
    assert r["verify"]["ok"] and r["verify"]["missing"] == 0 and r["verify"]["duplicates"] == 0
    lat = r["latency_us"]
    assert 0 <= lat["min"] <= lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert r["broker_rss_bytes"] is None
    run_dir = tmp_path / r["run_id"]
    on_disk = results.read_run(run_dir)
    assert on_disk["broker"] == "sink" and on_disk["scenario"] == "t1"
    assert set(on_disk) >= {"run_id", "broker", "scenario", "params", "started_at", "duration_s", "published",
                            "consumed", "confirmed", "publish_rate", "consume_rate", "latency_us",
                            "broker_rss_bytes"}
    rates = results.read_jsonl(run_dir / "rates.jsonl")
    assert sum(x["published"] for x in rates) == 3000 and sum(x["consumed"] for x in rates) == 3000
    lats = results.read_jsonl(run_dir / "latency.jsonl")
    assert 0 < len(lats) <= 3000 and set(lats[0]) == {"t", "latency_us"}


def test_many_publishers_confirms_manual_acks_several_queues(sink, capsys):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "-x", "3", "-y", "2", "--queues", "2",
                              "--pmessages", "1000", "-c", "64", "-a", "7", "-q", "100", "-s", "100",
                              "--persistent", "--verify"])
    assert rc == EXIT_OK, r
    assert r["published"] == r["confirmed"] == r["consumed"] == 3000
    assert r["verify"]["ok"] and set(r["verify"]["per_publisher"]) == {"0", "1", "2"}


def test_exchange_and_routing_key(sink, capsys):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--exchange", "perf-x",
                              "--routing-key", "rk", "--pmessages", "500", "--verify"])
    assert rc == EXIT_OK and r["consumed"] == 500 and r["verify"]["ok"]


def test_routing_key_count_needs_an_exchange_and_delivers_everything(sink, capsys):
    assert main(["amqp", "throughput", "--uri", sink.uri, "--routing-key-count", "3", "--pmessages", "10"]) == 2
    assert "--routing-key-count needs --exchange" in capsys.readouterr().err
    assert main(["amqp", "throughput", "--uri", sink.uri, "--exchange", "x", "--routing-key-count", "0"]) == 2
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--exchange", "perf-x", "--routing-key-count",
                              "7", "-x", "2", "-y", "2", "--queues", "2", "--pmessages", "1500", "--verify"])
    assert rc == EXIT_OK and r["consumed"] == 3000 and r["verify"]["ok"], r


def test_large_bodies_split_over_frames(sink, capsys):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "-s", "300000", "--pmessages", "20",
                              "--verify"])
    assert rc == EXIT_OK and r["consumed"] == 20 and r["verify"]["ok"]


def test_cmessages_stops_consumer_exactly(sink, capsys):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--cmessages", "700", "-z", "20"])
    assert rc == EXIT_OK
    assert r["consumed"] == 700 and r["published"] >= 700


def test_publish_only_and_consume_only_are_bounded(sink, capsys):
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "-y", "0", "--pmessages", "400", "-c", "10"])
    assert rc == EXIT_OK and r["published"] == r["confirmed"] == 400 and r["consumed"] == 0
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "-x", "0", "-z", "0.5"])
    assert rc == EXIT_OK and r["published"] == 0


def _prefill(sink, capsys, queue: str, n: int) -> None:
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "-y", "0", "--pmessages", str(n),
                              "--queue", queue, "--keep"])
    assert rc == EXIT_OK and r["published"] == n


def _publish_raw(uri: str, queue: str, n: int) -> None:
    """n stamped publishes from this thread (no worker processes: forking from a thread is unsafe)."""
    with AMQPClient(uri).connect() as c:
        for _ in range(n):
            body = struct.pack(">QQ", time.monotonic_ns(), 0xFFFF << 48)
            c.send(encoder.encode_publish(1, "", queue, False, TRANSIENT_PROPS, body, c.frame_max))


def test_consume_only_drains_a_backlog_to_cmessages(sink, capsys):
    _prefill(sink, capsys, "backlog", 1500)
    rc, r = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--publishers", "0", "--consumers", "1",
                              "--queue", "backlog", "--cmessages", "1500", "-z", "60",
                              "--consume-rate", "3000"])  # paced, so the drain outlasts the first check
    assert rc == EXIT_OK, r
    assert (r["published"], r["consumed"]) == (0, 1500)
    assert r["latency_us"]["max"] is not None


def test_consume_only_stops_when_consumers_go_idle_after_receiving(sink, capsys):
    _prefill(sink, capsys, "short-backlog", 300)
    opts = ThroughputOptions(uri=sink.uri, publishers=0, consumers=2, queue="short-backlog", cmessages=1000,
                             time_s=60, drain_idle_s=0.3, consume_rate=1000)
    result = ThroughputRun(opts).run()
    assert result.consumed == 300 and result.published == 0


def test_consume_only_on_an_empty_queue_waits_for_the_first_message(sink, capsys):
    # idleness before the first delivery is no reason to stop: only -z (or, without -z, the drain
    # timeout) ends it, and the messages published meanwhile are still drained.
    opts = ThroughputOptions(uri=sink.uri, publishers=0, consumers=1, queue="late", cmessages=50,
                             time_s=60, drain_idle_s=0.1)
    run = ThroughputRun(opts)
    timer = threading.Timer(0.6, _publish_raw, (sink.uri, "late", 50))
    timer.start()
    try:
        result = run.run()
    finally:
        timer.join()
    assert result.consumed == 50
    opts = ThroughputOptions(uri=sink.uri, publishers=0, consumers=1, queue="empty", cmessages=10,
                             drain_timeout_s=0.3)
    assert ThroughputRun(opts).run().consumed == 0  # no -z: still bounded


def test_rss_growth_is_clamped_and_flags_noise():
    g = rss_growth([1000, 1200, 1100], [51_200, 51_000, 51_100], 50)
    assert g["rss_per_connection_bytes"] == (51_200 - 1200) // 50 and not g["rss_delta_within_noise"]
    assert g["rss_after_bytes"] == 51_200
    g = rss_growth([10_000, 10_400, 10_200], [9_900, 10_000, 9_950], 10)
    assert g["rss_delta_bytes"] == -400 and g["rss_per_connection_bytes"] == 0 and g["rss_delta_within_noise"]
    g = rss_growth([10_000] * 3, [10_100] * 3, 10)
    assert g["rss_per_connection_bytes"] == 10 and not g["rss_delta_within_noise"]
    assert rss_growth(None, None, 10)["rss_per_connection_bytes"] is None


def test_connection_count_samples_rss_with_all_connections_open(sink, capsys):
    # our own pid as the "broker": this process holds the client sockets, so its RSS is what grows
    rc, r = run_json(capsys, ["amqp", "connection-count", "--uri", sink.uri, "-n", "30",
                              "--broker-pid", str(os.getpid())])
    assert rc == EXIT_OK
    e = r["extra"]
    assert e["connections"] == 30
    assert e["rss_before_bytes"] > 0 and e["rss_after_bytes"] == r["broker_rss_bytes"] > 0
    assert e["rss_per_connection_bytes"] >= 0
    assert e["rss_delta_bytes"] == e["rss_after_bytes"] - e["rss_before_bytes"]
    assert isinstance(e["rss_delta_within_noise"], bool)


def test_bench_and_report_subcommands_dispatch(capsys, tmp_path):
    assert main(["bench", "--scenarios", "nope", "--results-dir", str(tmp_path), "--doc", ""]) == 2
    assert "shardmq-perf bench: unknown scenario" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "shardmq-perf report: no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["drop_every", "dup_every"])
def test_verify_fails_on_loss_or_duplicates(capsys, fault):
    with SinkProcess("relay", **{fault: 97}) as s:
        rc, r = run_json(capsys, ["amqp", "throughput", "--uri", s.uri, "--pmessages", "1000", "--verify"])
    assert rc == EXIT_VERIFY
    v = r["verify"]
    assert not v["ok"]
    if fault == "drop_every":
        assert v["missing"] == 10 and v["duplicates"] == 0
    else:
        assert v["duplicates"] == 10 and v["missing"] == 0


@pytest.mark.parametrize(("flags", "groups"), [
    ({"exchange": "x", "exchange_type": "fanout", "queues": 3, "consumers": 5}, [[0, 3], [1, 4], [2]]),
    ({"exchange": "amq.fanout", "queues": 2, "consumers": 2}, [[0], [1]]),
    ({"exchange": "x", "exchange_type": "headers", "queues": 2, "consumers": 2}, [[0], [1]]),
    ({"exchange": "x", "routing_key": "k", "queues": 2, "consumers": 2}, [[0], [1]]),  # one key binds both
    ({"exchange": "x", "exchange_type": "fanout", "queues": 3, "consumers": 1}, [[0]]),  # unread queues
    ({"exchange": "x", "queues": 2, "consumers": 2}, [[0, 1]]),  # direct by queue name: one copy
    ({"queues": 2, "consumers": 4}, [[0, 1, 2, 3]]),
    ({"exchange": "x", "exchange_type": "fanout", "consumers": 2}, [[0, 1]]),  # one queue
])
def test_copy_groups_follow_where_the_exchange_routes_each_publish(flags, groups):
    assert ThroughputRun(ThroughputOptions(**flags)).copy_groups() == groups


def _consumer_result(idx: int, seqs: list[int], dups: int = 0) -> dict:
    bits = bytearray(1 + max(seqs, default=0) // 8)
    for seq in seqs:
        bits[seq >> 3] |= 1 << (seq & 7)
    return {"idx": idx, "seen": {0: bytes(bits)}, "dups": dups, "foreign": 0}


def test_verify_counts_each_copy_in_its_own_group():
    """A fanout run: each queue's consumers must get every publish once between them; a copy lost in one
    queue is missing even though the other queue has it, and a copy in each queue is no duplicate."""
    pubs = [{"idx": 0, "published": 4}]
    groups = [[0, 2], [1]]
    ok = _verify_copies(pubs, [_consumer_result(0, [0, 1]), _consumer_result(2, [2, 3]),
                               _consumer_result(1, [0, 1, 2, 3])], groups)
    assert ok.ok and (ok.published, ok.copies, ok.received_unique, ok.duplicates) == (4, 2, 8, 0), ok
    lost = _verify_copies(pubs, [_consumer_result(0, [0, 1]), _consumer_result(2, [3]),
                                 _consumer_result(1, [0, 1, 2, 3])], groups)
    assert not lost.ok and (lost.missing, lost.duplicates) == (1, 0), lost
    twice = _verify_copies(pubs, [_consumer_result(0, [0, 1, 2]), _consumer_result(2, [2, 3]),
                                  _consumer_result(1, [0, 1, 2, 3])], groups)
    assert not twice.ok and (twice.missing, twice.duplicates) == (0, 1), twice


def test_cleans_up_only_what_it_created(sink, capsys):
    with AMQPClient(sink.uri).connect() as c:
        c.queue_declare("pre-existing")
        rc, _ = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--queue", "pre-existing",
                                  "--pmessages", "10"])
        assert rc == EXIT_OK and c.queue_exists("pre-existing")
        rc, _ = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--queues", "2", "--pmessages", "10"])
        assert rc == EXIT_OK and not c.queue_exists("perf-test-1") and not c.queue_exists("perf-test-2")
        rc, _ = run_json(capsys, ["amqp", "throughput", "--uri", sink.uri, "--queue", "kept", "--keep",
                                  "--pmessages", "10"])
        assert rc == EXIT_OK and c.queue_exists("kept")


def test_usage_and_connection_errors(capsys):
    assert main(["amqp", "throughput", "--uri", "amqp://127.0.0.1:1/", "--verify", "-s", "8"]) == 2
    port = free_port()  # nobody listens there
    assert main(["amqp", "throughput", "--uri", f"amqp://127.0.0.1:{port}/", "-z", "1"]) == EXIT_ERROR


def test_sink_ceiling_reports_both_rates(capsys):
    rc, r = run_json(capsys, ["amqp", "sink-ceiling", "-z", "1", "-a", "50"])
    assert rc == EXIT_OK and r["broker"] == "sink"
    assert r["published"] > 0 and r["consumed"] > 0 and r["latency_us"]["max"] is not None


@pytest.mark.parametrize("cmd", [["queue-count", "-n", "120"], ["connection-count", "-n", "20"],
                                 ["bind-churn", "-z", "0.3"], ["connection-churn", "-z", "0.3", "-x", "2"]])
def test_other_amqp_scenarios(sink, capsys, cmd, tmp_path):
    rc, r = run_json(capsys, ["amqp", *cmd, "--uri", sink.uri, "--broker-pid", str(os.getpid()),
                              "--results-dir", str(tmp_path)])
    assert rc == EXIT_OK
    assert r["broker_rss_bytes"] > 0 and r["extra"]
    if cmd[0] == "queue-count":
        assert r["extra"]["queues"] == 120
        ex = r["extra"]
        assert ex["first_10pct_declares_per_s"] > 0 and ex["last_10pct_declares_per_s"] > 0 and ex["deletes_per_s"] > 0
        with AMQPClient(sink.uri).connect() as c:
            assert not c.queue_exists("perf-qc-0")
    if cmd[0] == "connection-count":
        assert r["extra"]["connections"] == 20
    if cmd[0].endswith("churn"):
        assert next(v for k, v in r["extra"].items() if k in ("bind_unbind_pairs", "connections")) > 0
    assert results.read_run(tmp_path / r["run_id"])["extra"] == r["extra"]


def test_results_helpers():
    assert results.latency_summary([]) == results.empty_latency()
    s = results.latency_summary(list(range(1, 101)))
    assert s == {"min": 1, "p50": 50, "p95": 95, "p99": 99, "max": 100}
    d = results.downsample(list(range(250_000)))
    assert len(d) == results.MAX_LATENCY_SAMPLES and d == sorted(d)
    assert results.broker_rss_bytes(None) is None
    assert results.broker_rss_bytes(os.getpid()) > 0


def test_uri_parsing():
    u = AMQPUri.parse("amqp://u%40x:p%2Fw@h:1234/%2F")
    assert (u.host, u.port, u.user, u.password, u.vhost) == ("h", 1234, "u@x", "p/w", "/")
    assert AMQPUri.parse("amqp://127.0.0.1").vhost == "/"
    assert AMQPUri.parse("amqp://h/dev").vhost == "dev"


# ---------------------------------------------------------------------------------------------- MQTT


def test_mqtt_varint_spec_examples():
    # MQTT 3.1.1 section 2.2.3 boundary values
    for n, enc in [(0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (16383, b"\xff\x7f"),
                   (16384, b"\x80\x80\x01"), (2097151, b"\xff\xff\x7f"), (2097152, b"\x80\x80\x80\x01"),
                   (268435455, b"\xff\xff\xff\x7f")]:
        assert encode_varint(n) == enc
        assert decode_varint(enc, 0) == (n, len(enc))
    assert decode_varint(b"\x80", 0) is None


def test_mqtt_packet_bytes():
    assert encode_connect("c", keepalive=0) == b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x00\x00\x01c"
    assert encode_connect("c", "u", "p")[9] == 0xC2
    assert encode_publish("a/b", b"xy", 1, 10) == b"\x32\x09\x00\x03a/b\x00\x0axy"
    assert encode_publish("a/b", b"xy") == b"\x30\x07\x00\x03a/bxy"
    assert encode_subscribe(1, "a/b", 1) == b"\x82\x08\x00\x01\x00\x03a/b\x01"


class FakeMQTTBroker:
    """Just enough MQTT 3.1.1: CONNACK, SUBACK, PUBLISH fan-out to exact-topic subscribers, PUBACK."""

    def __init__(self) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.subs: list[tuple[socket.socket, int, threading.Lock]] = []
        self.lock = threading.Lock()
        self.pubacks_received = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = bytearray()
        send_lock = threading.Lock()
        next_id = 0
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    return
                buf += data
                packets, pos = split_packets(buf, 0, len(buf))
                out = []
                for first, start, end in packets:
                    kind = first >> 4
                    if kind == 1:
                        assert bytes(buf[start : start + 7]) == b"\x00\x04MQTT\x04"
                        out.append(b"\x20\x02\x00\x00")
                    elif kind == SUBSCRIBE:
                        assert first & 0x0F == 2
                        pid = bytes(buf[start : start + 2])
                        qos = buf[end - 1]
                        with self.lock:
                            self.subs.append((sock, qos, send_lock))
                        out.append(b"\x90\x03" + pid + bytes((qos,)))
                    elif kind == PUBLISH:
                        qos = (first >> 1) & 3
                        tlen = struct.unpack_from(">H", buf, start)[0]
                        topic = bytes(buf[start + 2 : start + 2 + tlen]).decode()
                        at = start + 2 + tlen
                        if qos:
                            out.append(b"\x40\x02" + bytes(buf[at : at + 2]))
                            at += 2
                        payload = bytes(buf[at:end])
                        with self.lock:
                            for s, sq, lk in self.subs:
                                q = min(qos, sq)
                                next_id = next_id % 65535 + 1
                                with lk:
                                    s.sendall(encode_publish(topic, payload, q, next_id))
                    elif kind == PUBACK:
                        with self.lock:
                            self.pubacks_received += 1
                    elif kind == 14:
                        return
                del buf[:pos]
                if out:
                    with send_lock:
                        sock.sendall(b"".join(out))
        except OSError:
            return
        finally:
            with self.lock:
                self.subs = [x for x in self.subs if x[0] is not sock]
            sock.close()

    def close(self) -> None:
        self.lsock.close()


@pytest.mark.parametrize("qos", [0, 1])
def test_mqtt_throughput_against_fake_broker(capsys, qos):
    broker = FakeMQTTBroker()
    try:
        rc, r = run_json(capsys, ["mqtt", "throughput", "--uri", f"mqtt://127.0.0.1:{broker.port}",
                                  "-x", "2", "-y", "2", "--qos", str(qos), "--pmessages", "800", "--verify"])
    finally:
        broker.close()
    assert rc == EXIT_OK, r
    assert r["published"] == 1600 and r["consumed"] == 3200  # every subscriber gets every message
    assert r["confirmed"] == (1600 if qos else 0)
    assert r["verify"]["ok"] and r["verify"]["received_unique"] == 3200
    if qos:
        assert broker.pubacks_received == 3200


def test_console_script_declared():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'shardmq-perf = "loadtest.cli:main"' in text
