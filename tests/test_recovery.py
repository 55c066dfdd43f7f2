"""Node-level durability: what survives a graceful restart and a kill -9 of the node.

Every test runs its own real node (tests/harness.py) and talks to it with pika:
durable definitions and persistent messages come back, transient ones do not,
damaged segment tails are cut at start, the data-dir lock keeps a second node
out, and a different shard count still finds every queue.
"""

from __future__ import annotations

import glob
import hashlib
import os
import struct
import subprocess

import pika
import pika.exceptions
import pytest

from tests.harness import Node, pumping, wait_until

PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)
_REC_HEAD = struct.Struct("<II")


def restart(node: Node, how: str) -> None:
    if how == "graceful":
        assert node.stop() == 0
        node.start()
    else:
        node.kill9()
        node.restart()


def passive_count(node: Node, queue: str) -> int | None:
    """Ready messages of ``queue``, or None when it does not exist (404 on a passive declare)."""
    conn = node.connect()
    try:
        ch = conn.channel()
        try:
            return ch.queue_declare(queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404, exc
            return None
    finally:
        if conn.is_open:
            conn.close()


def exchange_exists(node: Node, exchange: str) -> bool:
    conn = node.connect()
    try:
        ch = conn.channel()
        try:
            ch.exchange_declare(exchange, passive=True)
            return True
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404, exc
            return False
    finally:
        if conn.is_open:
            conn.close()


def drain(node: Node, queue: str, limit: int = 100_000) -> list[bytes]:
    """Every ready body of ``queue`` in order, acked (basic.get until empty)."""
    bodies = []
    conn = node.connect()
    try:
        ch = conn.channel()
        while len(bodies) < limit:
            method, _props, body = ch.basic_get(queue)
            if method is None:
                break
            ch.basic_ack(method.delivery_tag)
            bodies.append(body)
    finally:
        conn.close()
    return bodies


def wait_for(conn, predicate, timeout: float = 10.0) -> None:
    """Run pika's I/O loop until ``predicate()`` holds; fail after ``timeout`` seconds."""
    wait_until(predicate, timeout, "the condition", 0.05, pause=pumping(conn))


def publish_confirmed(ch, exchange: str, key: str, bodies, props=PERSISTENT) -> None:
    """Publish on a channel in confirm mode; pika returns from basic_publish only once acked."""
    for body in bodies:
        ch.basic_publish(exchange, key, body, props, mandatory=True)


def segment_files(node: Node, vhost: str, queue: str) -> list[str]:
    qdir = node.data_dir / hashlib.sha1(vhost.encode()).hexdigest() / hashlib.sha1(queue.encode()).hexdigest()
    return sorted(str(p) for p in qdir.glob("msgs.*") if not p.name.endswith(".corrupt"))


def record_spans(path: str) -> list[tuple[int, int]]:
    """(start, end) of every record of a segment file, walking the length prefixes (docs/storage.md)."""
    with open(path, "rb") as f:
        data = f.read()
    spans = []
    pos = 4
    while pos + 8 <= len(data):
        length, _crc = _REC_HEAD.unpack_from(data, pos)
        if length == 0:
            break
        spans.append((pos, pos + 8 + length))
        pos += 8 + length
    return spans


# ---------------------------------------------------------------------------------- definitions
@pytest.mark.parametrize("how", ["graceful", "kill9"])
def test_durable_definitions_survive_and_route(node_factory, how):
    node = node_factory(frontends=1, shards=2)
    conn = node.connect()
    ch = conn.channel()
    ch.exchange_declare("d.topic", "topic", durable=True)
    ch.exchange_declare("d.fanout", "fanout", durable=True)
    ch.exchange_declare("t.direct", "direct", durable=False)
    ch.queue_declare("d.q", durable=True)
    ch.queue_declare("d.q2", durable=True)
    ch.queue_declare("t.q", durable=False)
    ch.queue_declare("x.q", durable=True, exclusive=True)
    ch.queue_bind("d.q", "d.topic", "a.*")
    ch.exchange_bind("d.topic", "d.fanout", "")  # destination d.topic, source d.fanout
    ch.queue_bind("d.q2", "t.direct", "k")  # binding to a transient exchange goes with it
    ch.queue_bind("t.q", "d.topic", "a.*")
    ch.confirm_delivery()
    publish_confirmed(ch, "d.topic", "a.b", [b"before"])
    assert ch.queue_declare("t.q", passive=True).method.message_count == 1
    if how == "graceful":
        conn.close()
    restart(node, how)  # kill -9 with the exclusive queue's connection still open

    assert exchange_exists(node, "d.topic")
    assert exchange_exists(node, "d.fanout")
    assert not exchange_exists(node, "t.direct")
    assert passive_count(node, "d.q") == 1
    assert passive_count(node, "d.q2") == 0
    assert passive_count(node, "t.q") is None
    assert passive_count(node, "x.q") is None

    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    publish_confirmed(ch, "d.topic", "a.c", [b"direct"])
    publish_confirmed(ch, "d.fanout", "a.d", [b"via-e2e"])
    with pytest.raises(pika.exceptions.UnroutableError):
        publish_confirmed(ch, "d.topic", "b.c", [b"nowhere"])
    conn.close()
    assert drain(node, "d.q") == [b"before", b"direct", b"via-e2e"]
    # The exclusive name is free again for another connection.
    conn = node.connect()
    conn.channel().queue_declare("x.q", exclusive=True)
    conn.close()


# ------------------------------------------------------------------------------------ messages
@pytest.mark.parametrize("how", ["graceful", "kill9"])
def test_persistent_messages_survive_acked_stay_gone_transient_dropped(node_factory, how):
    node = node_factory(frontends=1, shards=2)
    pub = node.connect()
    pch = pub.channel()
    pch.queue_declare("msgs", durable=True)
    pch.confirm_delivery()
    publish_confirmed(pch, "", "msgs", [b"p%d" % i for i in range(40)])
    publish_confirmed(pch, "", "msgs", [b"t%d" % i for i in range(10)], TRANSIENT)
    publish_confirmed(pch, "", "msgs", [b"p%d" % i for i in range(40, 50)])

    cons = node.connect()
    cch = cons.channel()
    cch.basic_qos(prefetch_count=20)
    got: list[tuple[int, bytes]] = []
    cch.basic_consume("msgs", lambda _c, m, _p, b: got.append((m.delivery_tag, b)))
    wait_for(cons, lambda: len(got) >= 20)
    assert [b for _, b in got] == [b"p%d" % i for i in range(20)]
    for tag, _ in got[:10]:
        cch.basic_ack(tag)
    # The shard frees prefetch only once it has applied the acks: 10 more deliveries prove it.
    wait_for(cons, lambda: len(got) >= 30)
    assert [b for _, b in got] == [b"p%d" % i for i in range(30)]
    assert pch.queue_declare("msgs", passive=True).method.message_count == 30  # p30..p49, t0..t9
    if how == "graceful":
        pub.close()
        cons.close()
    restart(node, how)

    # Acked p0..p9 stay gone; unacked p10..p29 are ready again; transient t* are dropped.
    assert passive_count(node, "msgs") == 40
    bodies = drain(node, "msgs")
    assert sorted(bodies) == sorted(b"p%d" % i for i in range(10, 50))
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    publish_confirmed(ch, "", "msgs", [b"after"])
    conn.close()
    assert drain(node, "msgs") == [b"after"]


# --------------------------------------------------------------------------------- corrupt tails
def _damage(path: str, how: str) -> None:
    spans = record_spans(path)
    start, end = spans[-1]
    with open(path, "r+b") as f:
        if how == "garbage":
            f.seek(end)
            f.write(b"\xde\xad\xbe\xef" * 8)
        elif how == "truncate":
            f.truncate(start + (end - start) // 2)
        else:  # flip one byte of the last record's body
            f.seek(end - 2)
            byte = f.read(1)
            f.seek(end - 2)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("how", ["garbage", "truncate", "flip"])
def test_corrupt_tail_of_last_segment_is_cut(node_factory, how):
    node = node_factory(frontends=1, shards=1)
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare("tail", durable=True)
    ch.confirm_delivery()
    publish_confirmed(ch, "", "tail", [b"m%02d" % i for i in range(20)])
    conn.close()
    assert node.stop() == 0

    segs = segment_files(node, "/", "tail")
    assert segs, f"no segment under {node.data_dir}"
    assert len(record_spans(segs[-1])) == 20
    _damage(segs[-1], how)
    node.start()

    expected = [b"m%02d" % i for i in range(20 if how == "garbage" else 19)]
    assert passive_count(node, "tail") == len(expected)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    publish_confirmed(ch, "", "tail", [b"new1", b"new2"])
    conn.close()
    assert drain(node, "tail") == [*expected, b"new1", b"new2"]
    if how == "flip":
        # The last record was synced (confirmed): damage, counted and set aside, not a quiet cut.
        assert "damaged record(s) lost" in node.log_text()
        assert glob.glob(segs[-1] + ".damaged-*")
    elif how == "truncate":
        # The file was cut below the synced mark: confirmed bytes lost, said at ERROR (and counted).
        assert "confirmed data lost" in node.log_text() or "damaged record(s) lost" in node.log_text()
    # What was appended after the cut is itself durable and readable on the next start.
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    publish_confirmed(ch, "", "tail", [b"last"])
    conn.close()
    node.kill9()
    node.restart()
    assert drain(node, "tail") == [b"last"]


# ------------------------------------------------------------------------------------- the lock
def test_second_node_on_same_data_dir_refuses_to_start(node_factory):
    first = node_factory(frontends=1, shards=1)
    second = node_factory(start=False, name="second", frontends=1, shards=1)
    second.data_dir = first.data_dir
    second.start(wait=False)
    try:
        code = second.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"second node kept running on a locked data dir\n{second.log_tail()}")
    assert code != 0
    log = second.log_text()
    assert "in use by another shardmq node" in log and str(first.pid) in log
    # The first node is untouched: its lock file still names it and it still serves.
    assert (first.data_dir / ".lock").read_text().strip() == str(first.pid)
    assert passive_count(first, "nothing-here") is None
    assert os.path.isdir(first.data_dir / "run")
    assert first.pids()["node"] == first.pid


# ------------------------------------------------------------------------------- shard count
@pytest.mark.parametrize("new_shards", [1, 3])
def test_restart_with_other_shard_count_keeps_queues_and_messages(node_factory, new_shards):
    node = node_factory(frontends=1, shards=2)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    names = [f"sq{i}" for i in range(8)]
    ch.exchange_declare("sx", "fanout", durable=True)
    for i, name in enumerate(names):
        ch.queue_declare(name, durable=True)
        ch.queue_bind(name, "sx")
        publish_confirmed(ch, "", name, [b"%s-%d" % (name.encode(), k) for k in range(i + 1)])
    conn.close()
    assert node.stop() == 0
    node.shards = new_shards
    node.start()
    assert len(node.pids()["shard"]) == new_shards

    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    publish_confirmed(ch, "sx", "", [b"fan"])
    conn.close()
    for i, name in enumerate(names):
        assert drain(node, name) == [*(b"%s-%d" % (name.encode(), k) for k in range(i + 1)), b"fan"]


@pytest.mark.parametrize("how", ["graceful", "kill9"])
def test_messages_unacked_at_a_restart_come_back_redelivered(node, how):
    """As RabbitMQ's queue index remembers deliveries: a message delivered and not acked when the
    node stopped is redelivered=true after it; one never delivered is redelivered=false."""
    q = "redelivered-" + how
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    for i in range(4):
        ch.basic_publish("", q, b"m%d" % i, PERSISTENT)
    for _ in range(2):  # m0, m1 delivered, not acked
        method = ch.basic_get(q, auto_ack=False)[0]
        assert method is not None and not method.redelivered
    restart(node, how)
    conn = node.connect()
    try:
        ch = conn.channel()
        got = []
        for _ in range(4):
            method, _props, body = ch.basic_get(q, auto_ack=True)
            assert method is not None
            got.append((body, method.redelivered))
        assert got == [(b"m0", True), (b"m1", True), (b"m2", False), (b"m3", False)]
    finally:
        conn.close()
