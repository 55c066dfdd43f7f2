"""Protocol behaviour of the frontend against a real node: handshake, errors, ordering, confirms, qos.

Raw-socket tests speak AMQP with pamqp frames so they can do what client libraries
refuse to (bad headers, garbage, nowait methods, odd tune values); the rest uses pika.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pika
import pika.exceptions
import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp import heartbeat as pheartbeat

from broker.definitions import queue_shard

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


class RawClient:
    """A minimal blocking AMQP client over a socket: send frames, read frames, nothing hidden."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, channel: int, *frames) -> None:
        self.sock.sendall(b"".join(pframe.marshal(f, channel) for f in frames))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frame(self):
        """(channel, frame) or None on EOF."""
        while True:
            if len(self.buf) >= 7:
                size = int.from_bytes(self.buf[3:7], "big")
                if len(self.buf) >= size + 8:
                    consumed, channel, frame = pframe.unmarshal(self.buf)
                    self.buf = self.buf[consumed:]
                    return channel, frame
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buf += data

    def expect(self, cls, skip_heartbeats: bool = True):
        while True:
            got = self.recv_frame()
            assert got is not None, f"connection closed while waiting for {cls.__name__}"
            channel, frame = got
            if skip_heartbeats and isinstance(frame, pheartbeat.Heartbeat):
                continue
            assert isinstance(frame, cls), f"expected {cls.__name__}, got {frame!r}"
            return channel, frame

    def handshake(self, vhost: str = "/", frame_max: int | None = None, heartbeat: int = 0,
                  channel_max: int | None = None) -> C.Connection.Tune:
        self.send_raw(PROTOCOL_HEADER)
        _, start = self.expect(C.Connection.Start)
        self.start = start
        self.send(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                          response="\0guest\0guest"))
        _, tune = self.expect(C.Connection.Tune)
        self.send(0, C.Connection.TuneOk(channel_max if channel_max is not None else tune.channel_max,
                                         frame_max if frame_max is not None else tune.frame_max, heartbeat))
        self.send(0, C.Connection.Open(vhost))
        return tune

    def open(self, vhost: str = "/", **kw) -> RawClient:
        self.handshake(vhost, **kw)
        self.expect(C.Connection.OpenOk)
        return self

    def publish(self, channel: int, exchange: str, routing_key: str, payload: bytes,
                mandatory: bool = False) -> None:
        self.send(channel, C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
                  pheader.ContentHeader(0, len(payload), C.Basic.Properties()), pbody.ContentBody(payload))

    def closed_by_peer(self) -> bool:
        """Read until EOF (bounded by the socket timeout); True when the server closed the socket."""
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(shared_node):
    clients = []

    def make(timeout: float = 5.0) -> RawClient:
        c = RawClient(shared_node.port, timeout)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def _name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"


# ----------------------------------------------------------------- handshake


def test_bad_protocol_header_gets_ours_back_and_a_close(raw):
    c = raw()
    c.send_raw(b"HTTP/1.1")
    data = b""
    while True:
        chunk = c.sock.recv(64)
        if not chunk:
            break
        data += chunk
    assert data == PROTOCOL_HEADER


def test_connection_start_describes_the_server(raw):
    c = raw()
    c.open()
    props = c.start.server_properties
    assert props["product"] == "ShardMQ"
    assert props["capabilities"]["publisher_confirms"] is True
    assert props["capabilities"]["consumer_cancel_notify"] is True
    assert isinstance(props["shardmq_frontend"], int)
    assert "PLAIN" in c.start.mechanisms.split() and "AMQPLAIN" in c.start.mechanisms.split()


def test_wrong_password_is_403_access_refused(shared_node):
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as err:
        pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", shared_node.port, credentials=pika.PlainCredentials("guest", "wrong"),
            connection_attempts=1))
    assert "403" in str(err.value) or "ACCESS_REFUSED" in str(err.value)


def test_unknown_vhost_is_530_not_allowed(raw):
    c = raw()
    c.handshake("no-such-vhost")
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 530
    assert close.reply_text.startswith("NOT_ALLOWED - ")
    assert "no-such-vhost" in close.reply_text


def test_tune_ok_frame_max_above_ours_is_530(raw):
    c = raw()
    tune = c.handshake(frame_max=10_000_000)
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 530
    assert close.reply_text == (f"NOT_ALLOWED - negotiated frame_max = 10000000 is higher than the maximum "
                                f"allowed value ({tune.frame_max})")


def test_tune_ok_frame_max_below_minimum_is_530(raw):
    c = raw()
    c.handshake(frame_max=1000)
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 530 and "lower than the minimum allowed value (4096)" in close.reply_text


def test_channel_frame_before_open_is_a_connection_error(raw):
    c = raw()
    c.send_raw(PROTOCOL_HEADER)
    c.expect(C.Connection.Start)
    c.send(1, C.Channel.Open())
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code in (504, 505)


def test_close_handshake_both_ways(raw):
    c = raw()
    c.open()
    c.send(0, C.Connection.Close(200, "bye", 0, 0))
    c.expect(C.Connection.CloseOk)
    assert c.closed_by_peer()


def test_garbage_after_open_closes_only_that_connection(raw, shared_node):
    c = raw()
    c.open()
    c.send_raw(os.urandom(4096))
    got = c.recv_frame()
    if got is not None:
        assert isinstance(got[1], C.Connection.Close)
        assert got[1].reply_code in (501, 502, 503, 504, 505, 540)
    # the frontend that served it is still up
    conn = shared_node.connect()
    conn.channel().queue_declare(_name("alive"), auto_delete=True)
    conn.close()


def test_server_sends_heartbeats_and_drops_a_silent_client(raw):
    c = raw(timeout=15.0)
    c.open(heartbeat=1)
    channel, frame = c.recv_frame()  # we send nothing: the server's heartbeat comes first
    assert isinstance(frame, pheartbeat.Heartbeat) and channel == 0
    assert c.closed_by_peer()


# ------------------------------------------------------------------ channels


def test_second_channel_open_is_504(raw):
    c = raw().open()
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)
    c.send(1, C.Channel.Open())
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 504 and close.reply_text == "CHANNEL_ERROR - second 'channel.open' seen"


def test_method_on_unopened_channel_is_504(raw):
    c = raw().open()
    c.send(3, C.Queue.Declare(queue=_name("x")))
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 504


def test_more_channels_than_channel_max_are_refused(raw):
    c = raw().open(channel_max=2)
    for number in (3, 900):  # numbers above channel_max are fine (RabbitMQ counts open channels)
        c.send(number, C.Channel.Open())
        c.expect(C.Channel.OpenOk)
    c.send(1, C.Channel.Open())
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 530


def test_after_channel_error_only_close_ok_matters(raw):
    c = raw().open()
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)
    c.publish(1, "no-such-exchange", "k", b"x")
    ch, close = c.expect(C.Channel.Close)
    assert ch == 1 and close.reply_code == 404
    assert close.reply_text == "NOT_FOUND - no exchange 'no-such-exchange' in vhost '/'"
    c.send(1, C.Queue.Declare(queue=_name("ignored")))  # ignored until close-ok
    c.send(1, C.Channel.CloseOk())
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)


def test_nowait_bind_then_publish_routes_through_the_binding(raw):
    q, x = _name("q"), _name("x")
    c = raw().open()
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)
    c.send(1, C.Exchange.Declare(exchange=x, exchange_type="direct", auto_delete=False, nowait=True),
           C.Queue.Declare(queue=q, exclusive=True, nowait=True),
           C.Queue.Bind(queue=q, exchange=x, routing_key="k", nowait=True))
    c.publish(1, x, "k", b"routed")
    c.send(1, C.Basic.Get(queue=q, no_ack=True))
    _, get_ok = c.expect(C.Basic.GetOk)
    assert get_ok.message_count == 0
    _, hdr = c.expect(pheader.ContentHeader)
    _, body = c.expect(pbody.ContentBody)
    assert body.value == b"routed"
    c.send(1, C.Exchange.Delete(exchange=x))
    c.expect(C.Exchange.DeleteOk)


# --------------------------------------------------------------- with pika


def test_unknown_delivery_tag_is_406(conn):
    ch = conn.channel()
    ch.basic_ack(42)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(_name("q"), auto_delete=True)
    assert err.value.reply_code == 406 and err.value.reply_text == "PRECONDITION_FAILED - unknown delivery tag 42"


def test_missing_queue_is_404(conn):
    ch = conn.channel()
    name = _name("missing")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.basic_get(name)
    assert err.value.reply_code == 404 and err.value.reply_text == f"NOT_FOUND - no queue '{name}' in vhost '/'"


def test_exclusive_queue_of_another_connection_is_405(conn, shared_node):
    q = _name("excl")
    conn.channel().queue_declare(q, exclusive=True)
    other = shared_node.connect()
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            other.channel().basic_consume(q, lambda *a: None)
        assert err.value.reply_code == 405
    finally:
        other.close()


def test_reused_consumer_tag_is_530_and_server_names_tags(raw):
    c = raw().open()
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)
    c.send(1, C.Queue.Declare(queue="", exclusive=True))
    _, ok = c.expect(C.Queue.DeclareOk)
    c.send(1, C.Basic.Consume(queue=ok.queue))
    _, consume_ok = c.expect(C.Basic.ConsumeOk)
    assert consume_ok.consumer_tag.startswith("amq.ctag-")
    c.send(1, C.Basic.Consume(queue=ok.queue, consumer_tag=consume_ok.consumer_tag))
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 530
    assert close.reply_text == f"NOT_ALLOWED - attempt to reuse consumer tag '{consume_ok.consumer_tag}'"


def test_confirms_for_many_publishes_and_unroutable_mandatory_returns(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("", exclusive=True).method.queue
    for i in range(500):
        ch.basic_publish("", q, b"%d" % i)  # pika raises if nacked
    assert ch.queue_declare(q, passive=True).method.message_count == 500
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", _name("nobody"), b"lost", mandatory=True)


def test_consume_ack_multiple_and_cancel_notify_on_delete(conn):
    ch = conn.channel()
    q = ch.queue_declare(_name("cq")).method.queue
    for i in range(10):
        ch.basic_publish("", q, b"%d" % i)
    got = []

    def on_msg(chx, method, props, body):
        got.append((method.delivery_tag, body))
        if len(got) == 10:
            chx.basic_ack(method.delivery_tag, multiple=True)
            chx.stop_consuming()

    ch.basic_consume(q, on_msg)
    ch.start_consuming()
    assert [b for _, b in got] == [b"%d" % i for i in range(10)]
    assert [t for t, _ in got] == list(range(1, 11))
    cancelled = []
    ch2 = conn.channel()
    ch2.basic_consume(q, lambda *a: None, consumer_tag="watch")
    ch2.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    ch.queue_delete(q)
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        conn.process_data_events(0.05)
    assert cancelled == ["watch"]


def test_nack_requeue_redelivers(conn):
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"again")
    m1 = ch.basic_get(q)
    assert m1[0].redelivered is False
    ch.basic_nack(m1[0].delivery_tag, requeue=True)
    m2 = ch.basic_get(q)
    assert m2[2] == b"again" and m2[0].redelivered is True
    ch.basic_reject(m2[0].delivery_tag, requeue=False)
    assert ch.basic_get(q) == (None, None, None)


def test_global_qos_bounds_unacked_across_shards(shared_node, conn):
    shards = shared_node.shards
    names = {}
    i = 0
    while len(names) < min(2, shards):
        name = f"gq-{os.getpid()}-{i}"
        names.setdefault(queue_shard("/", name, shards), name)
        i += 1
    ch = conn.channel()
    for name in names.values():
        ch.queue_declare(name, exclusive=True)
        for k in range(5):
            ch.basic_publish("", name, b"%d" % k)
    ch.basic_qos(prefetch_count=3, global_qos=True)
    got = []
    for name in names.values():
        ch.basic_consume(name, lambda chx, m, p, b: got.append(m.delivery_tag))
    deadline = time.monotonic() + 3
    while len(got) < 3 and time.monotonic() < deadline:
        conn.process_data_events(0.05)
    conn.process_data_events(0.3)
    assert len(got) == 3
    ch.basic_ack(got[-1], multiple=True)
    acked = len(got)
    total = 5 * len(names)
    deadline = time.monotonic() + 5
    while len(got) < total and time.monotonic() < deadline:
        conn.process_data_events(0.05)
        if len(got) > acked:  # a tag acked twice is a 406 (unknown delivery tag), as in RabbitMQ
            acked = len(got)
            ch.basic_ack(got[-1], multiple=True)
    assert len(got) == total


def test_prefetch_size_is_540(conn):
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
        ch.basic_qos(prefetch_size=10)
    assert err.value.reply_code == 540


def test_tx_commit_and_rollback(conn):
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.tx_select()
    ch.basic_publish("", q, b"rolled-back")
    ch.tx_rollback()
    ch.basic_publish("", q, b"committed")
    ch.tx_commit()
    m = ch.basic_get(q, auto_ack=True)
    assert m[2] == b"committed"
    assert ch.basic_get(q) == (None, None, None)


def test_channel_close_requeues_unacked(conn):
    ch = conn.channel()
    q = ch.queue_declare(_name("rq"), auto_delete=False).method.queue
    ch.basic_publish("", q, b"m")
    assert ch.basic_get(q)[2] == b"m"
    ch.close()
    ch2 = conn.channel()
    m = ch2.basic_get(q, auto_ack=True)
    assert m[2] == b"m" and m[0].redelivered
    ch2.queue_delete(q)


def test_method_a_client_may_not_send_is_503(raw):
    c = raw().open()
    c.send(1, C.Channel.Open())
    c.expect(C.Channel.OpenOk)
    c.send(1, C.Basic.ConsumeOk(consumer_tag="x"))
    _, close = c.expect(C.Connection.Close)
    assert close.reply_code == 503


# ------------------------------------------------------ node and shard events


def test_shard_restart_cancels_consumers_and_keeps_every_connection(node_factory):
    """A shard's death closes no connection (issue #9): its consumers get basic.cancel."""
    # --colocate off: shard 0's death would take frontend 0 (a pair) and the connections with it.
    node = node_factory(name="restart", frontends=1, shards=2, extra_args=["--colocate", "off"])
    q0 = next(f"k{i}" for i in range(100) if queue_shard("/", f"k{i}", 2) == 0)
    q1 = next(f"k{i}" for i in range(100) if queue_shard("/", f"k{i}", 2) == 1)
    consumer = node.connect()
    cch = consumer.channel()
    cch.queue_declare(q0, durable=True)
    cancelled: list[str] = []
    cch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = cch.basic_consume(q0, lambda *a: None)
    bystander = node.connect()
    ch = bystander.channel()
    ch.queue_declare(q1, durable=True)
    pids = json.loads((node.data_dir / "run" / "pids.json").read_text())
    os.kill(int(pids["shard"]["0"]), signal.SIGKILL)
    deadline = time.monotonic() + 15
    while not cancelled:
        assert time.monotonic() < deadline, "no basic.cancel after the shard's death"
        consumer.process_data_events(0.1)
    assert cancelled == [tag] and consumer.is_open
    ch.basic_publish("", q1, b"x")
    assert ch.queue_declare(q1, passive=True).method.message_count == 1
    bystander.close()
    consumer.close()


def test_node_stop_closes_clients_with_320(node_factory):
    node = node_factory(name="stop", frontends=1, shards=1)
    conn = node.connect()
    conn.channel()
    node.stop()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
        conn.process_data_events(2)
    assert err.value.reply_code == 320
    assert err.value.reply_text == "CONNECTION_FORCED - broker shutdown"
