"""A shard's death costs its clients only what was in flight there (issue #9, items 4 and 5).

The shard is stopped (SIGSTOP) first, so publishes and a tx.commit are certainly in flight and
unanswered when it is killed; the node restarts it. As RabbitMQ does for a crashed queue:
connections stay open, unconfirmed publishes are nacked, a commit in flight fails with 406
"partial tx completion", consumers get basic.cancel and can consume again, and connections with
nothing on that shard see nothing.
"""

from __future__ import annotations

import os
import signal
import time

import pika
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from tests.raw_amqp import RawClient
from tests.test_worker_crash import name_on_shard

# Separate frontend and shard processes (--colocate off, tests/conftest.py): the connections on a crashed shard's frontend stay open.
COLOCATE = "off"

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _publish(c: RawClient, channel: int, queue: str, body: bytes) -> None:
    c.send(pframe.marshal(C.Basic.Publish(exchange="", routing_key=queue), channel)
           + pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties(delivery_mode=2)), channel)
           + pframe.marshal(ContentBody(body), channel))


def _stop_then_kill_shard(node, index: int):
    """SIGSTOP the shard now; returns a function that SIGKILLs it and waits for its restart."""
    pid = node.worker_pid("shard", index)
    os.kill(pid, signal.SIGSTOP)

    def kill() -> int:
        os.kill(pid, signal.SIGKILL)
        return node.wait_worker_restarted("shard", index, pid)

    return kill


def _pump(conn: pika.BlockingConnection, until, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        conn.process_data_events(time_limit=0.05)


def test_tx_commit_in_flight_when_its_shard_dies_fails_with_406(node_factory):
    node = node_factory(frontends=1, shards=2)
    queue = name_on_shard("txq", 0, 2)
    with RawClient(node.port, timeout=15) as c:
        c.handshake()
        c.open_channel(1)
        c.send_method(1, C.Queue.Declare(queue=queue, durable=True))
        c.expect(C.Queue.DeclareOk, channel=1)
        c.send_method(1, C.Tx.Select())
        c.expect(C.Tx.SelectOk, channel=1)
        _publish(c, 1, queue, b"in-tx")
        kill = _stop_then_kill_shard(node, 0)
        c.send_method(1, C.Tx.Commit())
        assert c.next_frame(timeout=0.5) is None  # the commit waits on the stopped shard
        kill()
        close = c.expect(C.Channel.Close, channel=1, timeout=10)  # was: no answer, ever
        assert (close.reply_code, close.reply_text) == (406, "PRECONDITION_FAILED - partial tx completion")
        assert (close.class_id, close.method_id) == (90, 20)
        c.send_method(1, C.Channel.CloseOk())
        # The connection stays; a new transaction on the restarted shard commits.
        c.open_channel(2)
        c.send_method(2, C.Tx.Select())
        c.expect(C.Tx.SelectOk, channel=2)
        _publish(c, 2, queue, b"after")
        c.send_method(2, C.Tx.Commit())
        c.expect(C.Tx.CommitOk, channel=2, timeout=15)


def test_shard_crash_keeps_connections_nacks_publishes_and_cancels_consumers(node_factory):
    node = node_factory(frontends=1, shards=2)
    q0 = name_on_shard("lost", 0, 2)
    q1 = name_on_shard("kept", 1, 2)
    setup = node.connect()
    sch = setup.channel()
    sch.confirm_delivery()
    for q in (q0, q1):
        sch.queue_declare(q, durable=True)
    for i in range(3):
        sch.basic_publish("", q0, b"old-%d" % i, PERSISTENT)
    setup.close()

    # A: consumes q0 (shard 0) without acking; pika announces consumer_cancel_notify.
    a = node.connect()
    ach = a.channel()
    ach.basic_qos(prefetch_count=10)
    got_a: list = []
    cancelled: list = []
    ach.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag_a = ach.basic_consume(q0, lambda _ch, m, _p, body: got_a.append((m.delivery_tag, m.redelivered, body)))
    _pump(a, lambda: len(got_a) == 3, 10, "3 deliveries to A")

    # C: only uses shard 1 (a consumer and a confirming publisher): must see nothing at all.
    c = node.connect()
    cch = c.channel()
    cch.confirm_delivery()
    got_c: list = []
    cch.basic_consume(q1, lambda _ch, m, _p, body: got_c.append(body), auto_ack=True)
    cch.basic_publish("", q1, b"c-before", PERSISTENT)
    _pump(c, lambda: got_c == [b"c-before"], 10, "C's first message")

    # B: publishes with confirms to q0 while shard 0 is stopped: five unconfirmed publishes.
    b = RawClient(node.port, timeout=15)
    b.handshake()
    b.open_channel(1)
    b.send_method(1, C.Confirm.Select())
    b.expect(C.Confirm.SelectOk, channel=1)
    kill = _stop_then_kill_shard(node, 0)
    for i in range(5):
        _publish(b, 1, q0, b"unconfirmed-%d" % i)
    assert b.next_frame(timeout=0.3) is None
    kill()

    settled: dict[int, bool] = {}
    while len(settled) < 5:
        got = b.next_frame(timeout=10)
        assert got is not None, f"B got {settled} before EOF/timeout"
        _ch, frame = got
        assert isinstance(frame, C.Basic.Ack | C.Basic.Nack), frame  # not connection.close 320
        tags = range(1, frame.delivery_tag + 1) if frame.multiple else [frame.delivery_tag]
        for tag in tags:
            settled.setdefault(tag, isinstance(frame, C.Basic.Ack))
    assert settled == {i: False for i in range(1, 6)}, settled  # never stored: nacked, not acked

    # A: basic.cancel for its consumer, connection open; acking a tag of the dead shard is harmless.
    _pump(a, lambda: cancelled == [tag_a], 10, "basic.cancel to A")
    assert a.is_open and ach.is_open
    ach.basic_ack(got_a[0][0])
    # ...and it can consume again: the unacked messages come back (the store does not record
    # deliveries, so after a shard restart they are not flagged redelivered).
    again: list = []
    deadline = time.monotonic() + 15
    while True:
        try:
            ach.basic_consume(q0, lambda _ch, m, _p, body: again.append((m.redelivered, body)))
            break
        except pika.exceptions.ChannelClosedByBroker:
            raise
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    _pump(a, lambda: len(again) >= 3, 15, "redeliveries to A")
    assert sorted(body for _red, body in again[:3]) == [b"old-0", b"old-1", b"old-2"]

    # B is still connected and its next publish is confirmed by the restarted shard.
    _publish(b, 1, q0, b"after")
    ack = b.expect(C.Basic.Ack, channel=1, timeout=15)
    assert ack.delivery_tag == 6
    b.close()

    # C never noticed.
    cch.basic_publish("", q1, b"c-after", PERSISTENT)
    _pump(c, lambda: got_c == [b"c-before", b"c-after"], 10, "C's second message")
    assert c.is_open
    for conn in (a, c):
        conn.close()
    assert "CONNECTION_FORCED" not in node.log_text()


def test_shard_death_with_mqtt_sessions_on_the_frontend(node_factory):
    """MQTT sessions cannot be told of a lost subscription: one with state on the dead shard is
    closed (it reconnects and resumes), while AMQP connections on the same frontend get their
    basic.cancel as above (a session without shard_lost used to abort the whole settlement)."""
    from tests.harness import free_port
    from tests.raw_mqtt import RawMQTT

    node = node_factory(frontends=1, shards=1, mqtt_port=free_port())
    mqtt = RawMQTT(node.mqtt_port)
    assert mqtt.connect("sub-1", clean=True).return_code == 0
    mqtt.subscribe(1, [("t/#", 1)])
    a = node.connect()
    ach = a.channel()
    ach.queue_declare("amqp-side", durable=True)
    cancelled: list = []
    ach.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ach.basic_consume("amqp-side", lambda *_: None)
    old = node.worker_pid("shard", 0)
    frontend = node.worker_pid("frontend", 0)
    os.kill(old, signal.SIGKILL)
    _pump(a, lambda: cancelled == [tag], 10, "basic.cancel to the AMQP consumer")
    assert mqtt.closed_by_server(timeout=10)
    node.wait_worker_restarted("shard", 0, old)
    assert node.worker_pid("frontend", 0) == frontend
    assert "failed to handle node item" not in node.log_text()
    again = RawMQTT(node.mqtt_port)
    assert again.connect("sub-1", clean=True).return_code == 0
    again.close()
    a.close()
