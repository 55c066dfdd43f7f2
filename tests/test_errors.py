"""Every AMQP error code the node raises, triggered for real, with RabbitMQ's code, level and ids.

Channel errors (4xx) close one channel and leave the connection usable; connection errors
(5xx) close the connection. After each one a bystander connection that was open all along
must still work.
"""

from __future__ import annotations

import struct
import time

import pika
import pika.exceptions
import pytest
from pamqp import commands as C

from tests.raw_amqp import RawClient, frame, method_payload


def _uid(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"


@pytest.fixture(scope="module")
def bystander(shared_node):
    conn = shared_node.connect()
    yield conn
    if conn.is_open:
        conn.close()


@pytest.fixture
def conn(shared_node, bystander):
    c = shared_node.connect()
    yield c
    if c.is_open:
        c.close()
    _bystander_still_works(bystander)


def _bystander_still_works(bystander) -> None:
    assert bystander.is_open, "an error on another connection closed the bystander"
    ch = bystander.channel()
    q = ch.queue_declare(_uid("bystander"), auto_delete=True).method.queue
    ch.basic_publish("", q, b"ok")
    method, _props, body = ch.basic_get(q, auto_ack=True)
    assert method is not None and body == b"ok"
    ch.close()


def _channel_error(conn, action) -> pika.exceptions.ChannelClosedByBroker:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        action(ch)
    assert ch.is_closed
    # a channel error leaves the connection (and its other channels) usable
    assert conn.is_open
    conn.channel().queue_declare(_uid("after"), auto_delete=True)
    return info.value


def _connection_error(conn, action) -> pika.exceptions.ConnectionClosedByBroker:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        action(ch)
    assert conn.is_closed
    return info.value


def _raw_connection_error(node, payload: bytes, *, open_channel: bool = True,
                          frame_max: int = 131072) -> C.Connection.Close:
    raw = RawClient(node.port)
    try:
        raw.handshake(frame_max=frame_max)
        if open_channel:
            raw.open_channel(1)
        raw.send(payload)
        close = raw.connection_close()
        assert raw.read_until_eof(5.0), "node did not close the socket after close-ok"
        return close
    finally:
        raw.close()


# ------------------------------------------------------------------ 404 NOT_FOUND
def test_404_missing_queue(conn):
    err = _channel_error(conn, lambda ch: ch.queue_declare("no-such-queue-404", passive=True))
    assert err.reply_code == 404
    assert err.reply_text == "NOT_FOUND - no queue 'no-such-queue-404' in vhost '/'"


def test_404_missing_exchange(conn):
    err = _channel_error(conn, lambda ch: ch.exchange_declare("no-such-ex-404", passive=True))
    assert err.reply_code == 404
    assert err.reply_text == "NOT_FOUND - no exchange 'no-such-ex-404' in vhost '/'"


def test_404_publish_to_missing_exchange(conn):
    def publish_then_sync(ch):
        ch.basic_publish("no-such-ex-pub", "rk", b"x")
        ch.queue_declare(_uid("sync"), auto_delete=True)  # the close arrives before this reply

    err = _channel_error(conn, publish_then_sync)
    assert err.reply_code == 404 and "no-such-ex-pub" in err.reply_text


def test_404_bind_to_missing_queue(conn):
    err = _channel_error(conn, lambda ch: ch.queue_bind("no-such-queue-bind", "amq.direct", "rk"))
    assert err.reply_code == 404


# ------------------------------------------------------------------ 403 ACCESS_REFUSED
def test_403_declare_with_amq_prefix(conn):
    err = _channel_error(conn, lambda ch: ch.exchange_declare("amq.mine", "direct"))
    assert err.reply_code == 403
    assert "amq.mine" in err.reply_text and err.reply_text.startswith("ACCESS_REFUSED - ")


def test_403_queue_with_amq_prefix(conn):
    err = _channel_error(conn, lambda ch: ch.queue_declare("amq.q-403"))
    assert err.reply_code == 403


def test_403_publish_to_internal_exchange(conn):
    name = _uid("internal")
    setup = conn.channel()
    setup.exchange_declare(name, "fanout", internal=True, auto_delete=False)

    def publish_then_sync(ch):
        ch.basic_publish(name, "", b"x")
        ch.queue_declare(_uid("sync"), auto_delete=True)

    err = _channel_error(conn, publish_then_sync)
    assert err.reply_code == 403 and "internal exchange" in err.reply_text
    conn.channel().exchange_delete(name)


# ------------------------------------------------------------------ 405 RESOURCE_LOCKED
def test_405_exclusive_queue_from_another_connection(shared_node, conn):
    owner = shared_node.connect()
    try:
        q = owner.channel().queue_declare(_uid("excl"), exclusive=True).method.queue
        err = _channel_error(conn, lambda ch: ch.basic_consume(q, lambda *a: None))
        assert err.reply_code == 405 and "exclusive" in err.reply_text
        err = _channel_error(conn, lambda ch: ch.queue_declare(q, passive=True))
        assert err.reply_code == 405
        err = _channel_error(conn, lambda ch: ch.queue_declare(q, exclusive=True))
        assert err.reply_code == 405
    finally:
        owner.close()
    # the owner is gone, so is its exclusive queue
    err = _channel_error(conn, lambda ch: ch.queue_declare(q, passive=True))
    assert err.reply_code == 404


# ------------------------------------------------------------------ 406 PRECONDITION_FAILED
def test_406_inequivalent_queue_redeclare(conn):
    q = _uid("ineq")
    conn.channel().queue_declare(q, durable=False, auto_delete=True)
    err = _channel_error(conn, lambda ch: ch.queue_declare(q, durable=True, auto_delete=True))
    assert err.reply_code == 406
    assert "inequivalent arg 'durable'" in err.reply_text


def test_406_inequivalent_exchange_redeclare(conn):
    name = _uid("ineq-ex")
    conn.channel().exchange_declare(name, "direct", auto_delete=True)
    err = _channel_error(conn, lambda ch: ch.exchange_declare(name, "fanout", auto_delete=True))
    assert err.reply_code == 406 and "inequivalent arg 'type'" in err.reply_text
    conn.channel().exchange_delete(name)


def test_406_unknown_delivery_tag(conn):
    def ack_unknown(ch):
        ch.basic_ack(delivery_tag=4242)
        ch.queue_declare(_uid("sync"), auto_delete=True)

    err = _channel_error(conn, ack_unknown)
    assert err.reply_code == 406 and "unknown delivery tag 4242" in err.reply_text


def test_406_double_ack(conn):
    ch = conn.channel()
    q = ch.queue_declare(_uid("dbl"), auto_delete=True).method.queue
    ch.basic_publish("", q, b"m")
    method, _p, _b = ch.basic_get(q)
    ch.basic_ack(method.delivery_tag)
    ch.basic_ack(method.delivery_tag)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        ch.queue_declare(_uid("sync"), auto_delete=True)
    assert info.value.reply_code == 406


# ------------------------------------------------------------------ 501 FRAME_ERROR
def test_501_bad_frame_end(shared_node, bystander):
    payload = method_payload(20, 10, b"\x00")  # channel.open on channel 2, wrong end octet
    close = _raw_connection_error(shared_node, frame(1, 2, payload, end=0xCD))
    assert close.reply_code == 501 and close.reply_text.startswith("FRAME_ERROR - ")
    _bystander_still_works(bystander)


def test_501_frame_over_negotiated_frame_max(shared_node, bystander):
    big = frame(3, 1, b"z" * 5000)
    close = _raw_connection_error(shared_node, big, frame_max=4096)
    assert close.reply_code == 501 and "frame_max" in close.reply_text
    _bystander_still_works(bystander)


def test_501_frame_header_claiming_4gb_is_refused_without_buffering(shared_node, bystander):
    raw = RawClient(shared_node.port)
    try:
        raw.handshake()
        raw.send(struct.pack(">BHI", 3, 1, 0xFFFFFFF0) + b"\x00" * 1024)
        close = raw.connection_close()
        assert close.reply_code == 501
        # The node stops reading after the error: pushing more must not be buffered by it forever.
        assert raw.read_until_eof(5.0)
    finally:
        raw.close()
    # the same before the handshake is finished (no tune yet)
    raw = RawClient(shared_node.port)
    try:
        raw.send_header()
        raw.expect(C.Connection.Start)
        raw.send(struct.pack(">BHI", 1, 0, 0xFFFFFFFF))
        assert raw.connection_close().reply_code == 501
    finally:
        raw.close()
    _bystander_still_works(bystander)


def test_501_unknown_frame_type_and_heartbeat_with_payload(shared_node):
    assert _raw_connection_error(shared_node, frame(9, 1, b"abc")).reply_code == 501
    assert _raw_connection_error(shared_node, frame(8, 0, b"abc")).reply_code == 501


# ------------------------------------------------------------------ 502 SYNTAX_ERROR
def test_502_garbage_method_arguments(shared_node, bystander):
    # queue.declare whose queue-name shortstr claims 200 bytes but only 3 follow
    close = _raw_connection_error(shared_node, frame(1, 1, method_payload(50, 10, b"\x00\x00\xc8abc")))
    assert (close.reply_code, close.class_id, close.method_id) == (502, 50, 10)
    # basic.ack with a short payload
    close = _raw_connection_error(shared_node, frame(1, 1, method_payload(60, 80, b"\x00\x01")))
    assert (close.reply_code, close.class_id, close.method_id) == (502, 60, 80)
    _bystander_still_works(bystander)


@pytest.mark.parametrize("props", [
    # flags say "headers, delivery-mode" but the headers table's length runs past the frame
    struct.pack(">H", 0x3000) + b"\xff\xff\xff\xff",
    # flags say "delivery-mode" only, and its octet is missing (the publish checks' shortcut for
    # empty and delivery-mode-only properties must not take it)
    struct.pack(">H", 0x1000),
], ids=["headers-past-the-frame", "delivery-mode-missing"])
def test_502_malformed_content_properties(shared_node, props):
    raw = RawClient(shared_node.port)
    try:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(1, C.Basic.Publish(exchange="", routing_key="nowhere"))
        raw.send(frame(2, 1, struct.pack(">HHQ", 60, 0, 0) + props))
        close = raw.connection_close()
        assert close.reply_code == 502
    finally:
        raw.close()


# ------------------------------------------------------------------ 503 COMMAND_INVALID
def test_503_invalid_exchange_type(conn):
    err = _connection_error(conn, lambda ch: ch.exchange_declare(_uid("badtype"), "no-such-type"))
    assert err.reply_code == 503
    # RabbitMQ 3.x (rabbit_exchange:check_type): command_invalid "unknown exchange type 'T'";
    # RabbitMQ 4.1 made it a 406 channel error. The issue asks for the 3.x behaviour.
    assert err.reply_text == "COMMAND_INVALID - unknown exchange type 'no-such-type'"


# ------------------------------------------------------------------ 504 CHANNEL_ERROR
def test_504_method_on_a_channel_never_opened(shared_node, bystander):
    close = _raw_connection_error(shared_node, frame(1, 9, method_payload(50, 10, b"\x00\x00\x01q\x00\x00\x00\x00\x00")))
    assert (close.reply_code, close.class_id, close.method_id) == (504, 50, 10)
    assert "expected 'channel.open'" in close.reply_text
    _bystander_still_works(bystander)


def test_504_content_method_on_channel_zero(shared_node):
    close = _raw_connection_error(shared_node, frame(1, 0, method_payload(60, 40, b"\x00\x00\x00\x00\x00")))
    assert close.reply_code == 504


# ------------------------------------------------------------------ 505 UNEXPECTED_FRAME
def test_505_body_frame_without_header(shared_node, bystander):
    close = _raw_connection_error(shared_node, frame(3, 1, b"orphan body"))
    assert close.reply_code == 505 and close.reply_text.startswith("UNEXPECTED_FRAME - ")
    _bystander_still_works(bystander)


def test_505_header_frame_without_publish(shared_node):
    header = frame(2, 1, struct.pack(">HHQH", 60, 0, 5, 0))
    assert _raw_connection_error(shared_node, header).reply_code == 505


def test_505_method_in_the_middle_of_content(shared_node):
    raw_publish = method_payload(60, 40, b"\x00\x00\x00\x01q\x00")
    header = struct.pack(">HHQH", 60, 0, 10, 0)
    data = frame(1, 1, raw_publish) + frame(2, 1, header) + frame(1, 1, method_payload(20, 40, b""))
    close = _raw_connection_error(shared_node, data)
    assert close.reply_code == 505


# ------------------------------------------------------------------ 530 NOT_ALLOWED
def test_530_consumer_tag_reuse(shared_node, bystander):
    # pika refuses a duplicate tag itself, so the second basic.consume goes out by raw socket
    raw = RawClient(shared_node.port)
    try:
        raw.handshake()
        raw.open_channel(1)
        q = _uid("tag")
        raw.send_method(1, C.Queue.Declare(queue=q, auto_delete=True))
        raw.expect(C.Queue.DeclareOk)
        raw.send_method(1, C.Basic.Consume(queue=q, consumer_tag="same-tag"))
        raw.expect(C.Basic.ConsumeOk)
        raw.send_method(1, C.Basic.Consume(queue=q, consumer_tag="same-tag"))
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (530, 60, 20)
        assert close.reply_text == "NOT_ALLOWED - attempt to reuse consumer tag 'same-tag'"
    finally:
        raw.close()
    _bystander_still_works(bystander)


def test_530_unknown_vhost(shared_node, bystander):
    params = pika.ConnectionParameters("127.0.0.1", shared_node.port, connection_attempts=1, virtual_host="nope",
                                       credentials=pika.PlainCredentials("guest", "guest"))
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as info:
        pika.BlockingConnection(params)
    assert "530" in str(info.value)
    _bystander_still_works(bystander)


# ------------------------------------------------------------------ 540 NOT_IMPLEMENTED
def test_540_qos_prefetch_size(conn):
    err = _connection_error(conn, lambda ch: ch.basic_qos(prefetch_size=1024))
    assert err.reply_code == 540 and err.reply_text.startswith("NOT_IMPLEMENTED - ")


def test_540_unknown_method(shared_node, bystander):
    close = _raw_connection_error(shared_node, frame(1, 1, method_payload(60, 999)))
    assert (close.reply_code, close.class_id, close.method_id) == (540, 60, 999)
    close = _raw_connection_error(shared_node, frame(1, 1, method_payload(77, 1)))
    assert close.reply_code == 540
    _bystander_still_works(bystander)


def test_540_publish_immediate(shared_node):
    raw = RawClient(shared_node.port)
    try:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(1, C.Basic.Publish(exchange="", routing_key="x", immediate=True))
        raw.send(frame(2, 1, struct.pack(">HHQH", 60, 0, 0, 0)))
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (540, 60, 40)
    finally:
        raw.close()


# ------------------------------------------------------------------ 541 INTERNAL_ERROR
# 541 is what the node sends when its own code fails (frontend AMQPConnection.internal_error, the
# parser's catch-all). No valid or invalid client input should reach it, so there is no legitimate
# way to trigger it here; tests/test_fuzz.py checks the opposite: hostile input never produces 541.


def test_malformed_headers_table_is_refused_at_publish(shared_node):
    raw = RawClient(shared_node.port)
    try:
        raw.handshake()
        raw.open_channel(1)
        q = _uid("poison")
        raw.send_method(1, C.Queue.Declare(queue=q, auto_delete=True))
        raw.expect(C.Queue.DeclareOk)
        raw.send_method(1, C.Basic.Publish(exchange="", routing_key=q))
        props = struct.pack(">HI", 0x2000, 3) + b"\x01Z\xff"  # headers: one entry of field kind 0xff
        raw.send(frame(2, 1, struct.pack(">HHQ", 60, 0, 1) + props) + frame(3, 1, b"x"))
        raw.send_method(1, C.Basic.Get(queue=q, no_ack=True))
        got = raw.next_frame(5.0)
        assert got is not None and isinstance(got[1], C.Connection.Close), f"node accepted it: {got!r}"
    finally:
        raw.close()
