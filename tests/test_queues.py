"""Queues on a real node with pika: declare flavours, exclusivity, auto-delete, bind, purge, delete.

Publishing channels use confirms, so a queue's count is settled when publish returns.
Things the node does on its own after an event (auto-delete, exclusive cleanup) are
awaited with a bounded poll.
"""

from __future__ import annotations

import time

import pika
import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pika.exceptions import ChannelClosedByBroker

from tests.harness import wait_until
from tests.helpers import WAIT, channel_error, uid
from tests.raw_amqp import FrameClient


def exists(conn, name: str) -> bool:
    channel = conn.channel()
    try:
        channel.queue_declare(name, passive=True)
    except ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return False
    channel.close()
    return True


def wait_gone(conn, name: str) -> None:
    wait_until(lambda: not exists(conn, name), WAIT, f"queue {name} to go", 0.05)


def publish(ch, queue: str, n: int, persistent: bool = False) -> None:
    props = pika.BasicProperties(delivery_mode=2 if persistent else 1)
    for i in range(n):
        ch.basic_publish("", queue, f"m{i}".encode(), props)


def message_count(ch, name: str) -> int:
    return ch.queue_declare(name, passive=True).method.message_count


# --------------------------------------------------------------------- declare
def test_server_named_queue(ch):
    first = ch.queue_declare("", exclusive=True).method.queue
    second = ch.queue_declare("", exclusive=True).method.queue
    assert first.startswith("amq.gen-") and second.startswith("amq.gen-") and first != second
    ch.basic_publish("", first, b"to-generated")
    assert ch.basic_get(first, auto_ack=True)[2] == b"to-generated"


def test_empty_name_refers_to_last_declared_queue(ch):
    name = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind("", "amq.direct", "last-q-" + name)  # "" = the channel's last declared queue
    ch.basic_publish("amq.direct", "last-q-" + name, b"x")
    assert ch.queue_purge("").method.message_count == 1


def test_declare_ok_counts_and_passive(conn, ch):
    name = uid()
    ok = ch.queue_declare(name, auto_delete=False).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (name, 0, 0)
    publish(ch, name, 3)
    consumer_ch = conn.channel()
    consumer_ch.basic_qos(prefetch_count=1)
    consumer_ch.basic_consume(name, lambda *a: None)
    conn.process_data_events(0)
    ok = ch.queue_declare(name, passive=True).method
    # One message went to the consumer (prefetch 1): ready count excludes it, as in RabbitMQ.
    deadline = time.monotonic() + WAIT
    while ok.message_count != 2 and time.monotonic() < deadline:
        conn.process_data_events(0.02)
        ok = ch.queue_declare(name, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (2, 1)
    ok = ch.queue_declare(name).method  # an active redeclare reports the same
    assert (ok.message_count, ok.consumer_count) == (2, 1)
    ch.queue_delete(name)


def test_passive_declare_of_missing_queue_is_404(conn):
    code, text = channel_error(conn, lambda c: c.queue_declare(uid("missing"), passive=True))
    assert code == 404 and text.startswith("NOT_FOUND - no queue")


def test_amq_prefix_is_reserved(conn):
    code, text = channel_error(conn, lambda c: c.queue_declare("amq.mine"))
    assert code == 403 and "reserved prefix 'amq.*'" in text


@pytest.mark.parametrize("first,second,field", [
    ({"durable": True}, {"durable": False}, "durable"),
    ({"auto_delete": True}, {"auto_delete": False}, "auto_delete"),
    ({"arguments": {"x-message-ttl": 1000}}, {"arguments": {"x-message-ttl": 2000}}, "x-message-ttl"),
    ({"arguments": {"x-max-length": 5}}, {}, "x-max-length"),
])
def test_redeclare_inequivalent_is_precondition_failed(conn, ch, first, second, field):
    name = uid()
    ch.queue_declare(name, **first)
    ch.queue_declare(name, **first)  # identical redeclare is fine
    code, text = channel_error(conn, lambda c: c.queue_declare(name, **second))
    assert code == 406 and text.startswith(f"PRECONDITION_FAILED - inequivalent arg '{field}'"), text
    ch.queue_delete(name)


def test_invalid_queue_argument_is_precondition_failed(conn):
    code, text = channel_error(conn, lambda c: c.queue_declare(uid(), arguments={"x-max-length": "lots"}))
    assert code == 406 and "invalid arg 'x-max-length'" in text


def test_queue_arguments_are_kept(conn, ch):
    name = uid()
    args = {"x-message-ttl": 60000, "x-custom": "kept"}
    ch.queue_declare(name, arguments=args)
    ch.queue_declare(name, arguments=args)
    code, _ = channel_error(conn, lambda c: c.queue_declare(name, arguments={"x-message-ttl": 1}))
    assert code == 406
    ch.queue_delete(name)


def test_durable_queue_and_persistent_messages_survive_restart(node):
    durable, transient = uid("durable"), uid("transient")
    connection = node.connect()
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare(durable, durable=True)
    channel.queue_declare(transient, durable=False)
    publish(channel, durable, 5, persistent=True)
    publish(channel, transient, 2, persistent=True)
    connection.close()
    node.restart()
    connection = node.connect()
    channel = connection.channel()
    assert message_count(channel, durable) == 5
    bodies = [channel.basic_get(durable, auto_ack=True)[2] for _ in range(5)]
    assert bodies == [f"m{i}".encode() for i in range(5)]
    assert not exists(connection, transient)
    connection.close()


# ------------------------------------------------------------------- exclusive
def test_exclusive_queue_is_locked_to_its_connection(shared_node, conn, ch):
    name = uid("excl")
    ch.queue_declare(name, exclusive=True)
    ch.basic_publish("", name, b"mine")  # the default exchange may route to it from anywhere
    other = shared_node.connect()
    try:
        actions = {
            "declare": lambda c: c.queue_declare(name, exclusive=True),
            "passive": lambda c: c.queue_declare(name, passive=True),
            "consume": lambda c: c.basic_consume(name, lambda *a: None),
            "get": lambda c: c.basic_get(name),
            "purge": lambda c: c.queue_purge(name),
            "delete": lambda c: c.queue_delete(name),
            "bind": lambda c: c.queue_bind(name, "amq.fanout"),
        }
        for what, action in actions.items():
            code, text = channel_error(other, action)
            assert code == 405, what
            assert text.startswith("RESOURCE_LOCKED - cannot obtain exclusive access to locked queue"), what
        # The owner keeps full use of it.
        assert ch.basic_get(name, auto_ack=True)[2] == b"mine"
    finally:
        other.close()


def test_redeclaring_own_exclusive_queue_as_shared_is_405(conn, ch):
    name = uid("excl")
    ch.queue_declare(name, exclusive=True)
    code, _ = channel_error(conn, lambda c: c.queue_declare(name, exclusive=False))
    assert code == 405


def test_exclusive_queue_is_deleted_with_its_connection(shared_node, conn):
    owner = shared_node.connect()
    name = owner.channel().queue_declare(uid("excl"), exclusive=True).method.queue
    code, _ = channel_error(conn, lambda c: c.queue_declare(name, passive=True))
    assert code == 405
    owner.close()
    wait_gone(conn, name)
    conn.channel().queue_declare(name, exclusive=True)  # the name is free again


def test_exclusive_queue_is_not_durable(node):
    name = uid("excl")
    connection = node.connect()
    connection.channel().queue_declare(name, durable=True, exclusive=True)
    node.restart()
    connection = node.connect()
    assert not exists(connection, name)
    connection.close()


# ----------------------------------------------------------------- auto-delete
def test_auto_delete_queue_goes_when_last_consumer_cancels(conn, ch):
    name = uid("ad")
    ch.queue_declare(name, auto_delete=True)
    assert exists(conn, name)  # no consumer ever: stays
    c1 = ch.basic_consume(name, lambda *a: None)
    c2 = ch.basic_consume(name, lambda *a: None)
    ch.basic_cancel(c1)
    assert exists(conn, name)  # one consumer left
    ch.basic_cancel(c2)
    wait_gone(conn, name)


def test_auto_delete_queue_goes_when_consumer_channel_closes(conn, ch):
    name = uid("ad")
    ch.queue_declare(name, auto_delete=True)
    consumer_ch = conn.channel()
    consumer_ch.basic_consume(name, lambda *a: None)
    consumer_ch.close()
    wait_gone(conn, name)


# ------------------------------------------------------------------ bind/unbind
def test_bind_unbind(conn, ch):
    name = ch.queue_declare(uid(), exclusive=True).method.queue
    ch.queue_bind(name, "amq.direct", "k1")
    ch.queue_bind(name, "amq.direct", "k1")  # binding twice is idempotent
    ch.basic_publish("amq.direct", "k1", b"1")
    assert message_count(ch, name) == 1
    ch.queue_unbind(name, "amq.direct", "k1")
    ch.queue_unbind(name, "amq.direct", "k1")  # unbinding a missing binding is unbind-ok
    ch.basic_publish("amq.direct", "k1", b"2")
    assert message_count(ch, name) == 1


def test_bind_errors(conn, ch):
    name = ch.queue_declare(uid(), exclusive=True).method.queue
    code, text = channel_error(conn, lambda c: c.queue_bind(uid("missing"), "amq.direct", "k"))
    assert code == 404 and "no queue" in text
    code, text = channel_error(conn, lambda c: c.queue_bind(name, uid("missing-x"), "k"))
    assert code == 404 and "no exchange" in text


# ------------------------------------------------------------------------ purge
def test_purge_returns_count_and_empties(ch):
    name = ch.queue_declare(uid(), exclusive=True).method.queue
    publish(ch, name, 7)
    assert ch.queue_purge(name).method.message_count == 7
    assert message_count(ch, name) == 0
    assert ch.queue_purge(name).method.message_count == 0
    publish(ch, name, 1)
    assert ch.basic_get(name, auto_ack=True)[2] == b"m0"  # the queue works on after a purge


def test_purge_keeps_unacked_messages(conn, ch):
    name = ch.queue_declare(uid(), exclusive=True).method.queue
    publish(ch, name, 3)
    method, _, _ = ch.basic_get(name, auto_ack=False)
    assert ch.queue_purge(name).method.message_count == 2
    ch.basic_reject(method.delivery_tag, requeue=True)
    got = ch.basic_get(name, auto_ack=True)
    assert got[2] == b"m0" and got[0].redelivered


def test_purge_missing_queue_is_404(conn):
    code, _ = channel_error(conn, lambda c: c.queue_purge(uid("missing")))
    assert code == 404


# ----------------------------------------------------------------------- delete
def test_delete_ok_carries_message_count(conn, ch):
    name = uid()
    ch.queue_declare(name)
    publish(ch, name, 4)
    assert ch.queue_delete(name).method.message_count == 4
    assert not exists(conn, name)
    assert ch.queue_delete(name).method.message_count == 0  # missing queue: delete-ok, 0


def test_delete_if_empty(conn, ch):
    name = uid()
    ch.queue_declare(name)
    publish(ch, name, 1)
    code, text = channel_error(conn, lambda c: c.queue_delete(name, if_empty=True))
    assert code == 406 and text.endswith("not empty")
    ch.basic_get(name, auto_ack=True)
    assert ch.queue_delete(name, if_empty=True).method.message_count == 0
    assert not exists(conn, name)


def test_delete_if_unused(conn, ch):
    name = uid()
    ch.queue_declare(name)
    tag = ch.basic_consume(name, lambda *a: None)
    code, text = channel_error(conn, lambda c: c.queue_delete(name, if_unused=True))
    assert code == 406 and text.endswith("in use")
    ch.basic_cancel(tag)
    ch.queue_delete(name, if_unused=True)
    assert not exists(conn, name)


def test_deleted_queue_loses_messages_and_bindings(conn, ch):
    name = uid()
    ch.queue_declare(name)
    ch.queue_bind(name, "amq.fanout")
    publish(ch, name, 2)
    ch.queue_delete(name)
    ch.queue_declare(name)
    ch.basic_publish("amq.fanout", "", b"after")
    assert message_count(ch, name) == 0
    ch.queue_delete(name)


# ---------------------------------------------------------------------- limits
def test_max_length_drops_from_the_head(ch):
    name = ch.queue_declare(uid(), exclusive=True, arguments={"x-max-length": 3}).method.queue
    publish(ch, name, 5)
    assert message_count(ch, name) == 3
    assert [ch.basic_get(name, auto_ack=True)[2] for _ in range(3)] == [b"m2", b"m3", b"m4"]


def test_max_length_counts_ready_messages_only(ch):
    name = ch.queue_declare(uid(), exclusive=True, arguments={"x-max-length": 2}).method.queue
    publish(ch, name, 2)
    held = ch.basic_get(name, auto_ack=False)[0]  # unacked: no longer counted
    ch.basic_publish("", name, b"m2")
    assert message_count(ch, name) == 2
    ch.basic_ack(held.delivery_tag)
    assert [ch.basic_get(name, auto_ack=True)[2] for _ in range(2)] == [b"m1", b"m2"]


def test_max_length_bytes_drops_from_the_head(ch):
    name = ch.queue_declare(uid(), exclusive=True, arguments={"x-max-length-bytes": 10}).method.queue
    for body in (b"aaaa", b"bbbb", b"cccc"):
        ch.basic_publish("", name, body)
    assert message_count(ch, name) == 2
    assert ch.basic_get(name, auto_ack=True)[2] == b"bbbb"


def test_reject_publish_keeps_the_oldest(ch):
    args = {"x-max-length": 2, "x-overflow": "reject-publish"}
    name = ch.queue_declare(uid(), exclusive=True, arguments=args).method.queue
    publish(ch, name, 2)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", name, b"refused")
    assert [ch.basic_get(name, auto_ack=True)[2] for _ in range(2)] == [b"m0", b"m1"]


# ------------------------------------------------------------------ raw wire
def test_nowait_declare_bind_then_publish_in_one_write(shared_node):
    """A pipelined declare(nowait) + bind(nowait) + publish + get: each waits for the one before."""
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        name, x = uid("nowait"), uid("nowait-x")
        raw.sock.sendall(b"".join((
            pframe.marshal(C.Exchange.Declare(exchange=x, exchange_type="direct", auto_delete=True,
                                              nowait=True), 1),
            pframe.marshal(C.Queue.Declare(queue=name, exclusive=True, nowait=True), 1),
            pframe.marshal(C.Queue.Bind(queue=name, exchange=x, routing_key="k", nowait=True), 1),
            raw.publish_frames(1, x, "k", b"pipelined"),
            pframe.marshal(C.Basic.Get(queue=name, no_ack=True), 1),
        )))
        raw.expect(1, C.Basic.GetOk)
        raw.expect(1, pheader.ContentHeader)
        assert raw.expect(1, pbody.ContentBody).value == b"pipelined"
    finally:
        raw.close()


@pytest.mark.parametrize("kind", ["exclusive", "auto_delete"])
def test_queue_goes_when_its_connection_drops_without_close(shared_node, conn, kind):
    raw = FrameClient(shared_node.port)
    raw.open_channel(1)
    name = uid(kind)
    if kind == "exclusive":
        raw.send(1, C.Queue.Declare(queue=name, exclusive=True))
    else:
        raw.send(1, C.Queue.Declare(queue=name, auto_delete=True))
    raw.expect(1, C.Queue.DeclareOk)
    raw.send(1, C.Basic.Consume(queue=name, consumer_tag="c"))
    raw.expect(1, C.Basic.ConsumeOk)
    raw.sock.close()  # no connection.close: the frontend sees EOF
    wait_gone(conn, name)
