"""A consumer whose client stops reading has its unspent delivery credit taken back by the frontend
(frontend/paused_credit.py): once its connection's writes pause, its shard sends nothing more, so a
publisher flooding its queue fills the queue, not the frontend's memory (before, the shard went on
until the consumer's whole credit window, about 8 MiB, sat in the frontend's transport buffer).
When the client reads again it gets every message, in order, nothing twice. Over WebSocket (AMQP
and MQTT) and over plain TCP."""

from __future__ import annotations

import socket
import time

import pika
import pytest
from pamqp import commands, frame
from pamqp import heartbeat as pamqp_heartbeat

from broker import contract
from broker.mqtt import codec as M
from frontend.mqtt.messages import session_queue
from frontend.ws import HIGH_WATER
from tests.harness import free_port
from tests.mgmt_api import Api
from tests.raw_mqtt import RawMQTT
from tests.test_frontend_stats_delta import reports_after
from tests.test_ws_backpressure import WSAMQP, WSClient

pytestmark = pytest.mark.integration

BODY = 64 << 10
FLOOD = 160  # 10 MiB published after the client's connection paused: more than a credit window
WINDOW_BYTES = contract.CREDIT_WINDOW << contract.CREDIT_BYTES_SHIFT
# What the frontend may hold for the paused client: its transport's buffer (the high-water mark
# plus the turn's write that crossed it) and, for a WebSocket, the one send in progress below it,
# each a couple of messages here (the messages before the pause were published one at a time).
BOUND = 4 * (HIGH_WATER + BODY + 1024)
assert BOUND < WINDOW_BYTES // 4


class TCPAMQP:
    """AMQP 0-9-1 over a plain socket that is read only when the test asks (pamqp frames)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.buf = b""

    def send(self, channel: int, value) -> None:
        self.sock.sendall(frame.marshal(value, channel))

    def read(self):
        while True:
            if len(self.buf) >= 8 and len(self.buf) >= 8 + int.from_bytes(self.buf[3:7], "big"):
                used, _channel, value = frame.unmarshal(self.buf)  # a whole frame (pamqp wants one)
                if used:
                    self.buf = self.buf[used:]
                    if not isinstance(value, pamqp_heartbeat.Heartbeat):
                        return value
                    continue
            data = self.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            self.buf += data

    def send_binary(self, data: bytes) -> None:
        self.sock.sendall(data)

    open = WSAMQP.open


def _ready(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def _send_pend(api: Api) -> int:
    """The largest send_pend of the node's connections (the paused client's: the others read)."""
    return max(r["send_pend"] for r in api.get("/api/connections"))


def _until_paused(publish, ch, queue: str) -> int:
    """Publish one message at a time until one stays in the queue: the client's connection paused
    (its socket buffers are full) and its credit was taken back. Returns how many were published."""
    n = 0
    while True:
        publish(n)
        n += 1
        if _ready(ch, queue):
            return n
        assert n < 2000, "the consumer's connection never paused"


def _flood_and_check(node, publish, ch, queue: str, paused_at: int) -> int:
    """Flood the queue of the paused consumer; nothing more reaches the frontend for it."""
    api = Api(node.http_port)
    delivered = paused_at - _ready(ch, queue)
    for i in range(paused_at, paused_at + FLOOD):
        publish(i)
    total = paused_at + FLOOD
    # Every message published since the pause stays queued (before: a window's worth went on).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert _ready(ch, queue) == total - delivered, (total, delivered, _ready(ch, queue))
        time.sleep(0.1)
    # Two stats reports later the frontend's buffer for the client is within the bound.
    reports_after(node, 2)
    pend = _send_pend(api)
    assert pend <= BOUND, f"the frontend holds {pend} bytes for a paused consumer (bound {BOUND})"
    return total


def _read_in_order(client, total: int) -> None:
    """Read `total` deliveries of BODY-byte messages: numbered 0.. in order, each once."""
    for i in range(total):
        deliver = client.read()
        assert isinstance(deliver, commands.Basic.Deliver), deliver
        client.read()  # content header
        body = b""
        while len(body) < BODY:
            body += client.read().value
        assert body[:8] == b"%08d" % i, (i, body[:8])


def _amqp_case(node, client) -> None:
    queue = "paused"
    client.open()
    client.send(1, commands.Queue.Declare(queue=queue))
    assert isinstance(client.read(), commands.Queue.DeclareOk)
    client.send(1, commands.Basic.Consume(queue=queue, consumer_tag="slow", no_ack=True))
    assert isinstance(client.read(), commands.Basic.ConsumeOk)
    # From here on the client reads nothing until every message is published.
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()

    def publish(i: int) -> None:
        ch.basic_publish("", queue, b"%08d" % i + b"x" * (BODY - 8))

    paused_at = _until_paused(publish, ch, queue)
    total = _flood_and_check(node, publish, ch, queue, paused_at)

    # The client reads again: everything arrives, in order, once.
    _read_in_order(client, total)
    assert _ready(ch, queue) == 0
    conn.close()
    client.sock.close()


def test_a_websocket_amqp_consumer_that_stops_reading_holds_no_credit_window_in_the_frontend(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, ws_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    client = WSAMQP(node.ws_port)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    _amqp_case(node, client)


def test_a_tcp_amqp_consumer_that_stops_reading_holds_no_credit_window_in_the_frontend(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    _amqp_case(node, TCPAMQP(node.port))


@pytest.mark.parametrize("transport", ["websocket", "tcp"])
def test_an_mqtt_subscriber_that_stops_reading_holds_no_credit_window_in_the_frontend(node_factory, transport):
    # A persistent session's QoS 0 subscription: its messages come through its queue on the shard,
    # paced by credit.
    node = node_factory(name="node", frontends=1, shards=1, ws_port=free_port(), mqtt_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    if transport == "websocket":
        client = WSClient(node.ws_port, "/ws", "mqtt")
        parser = M.MQTTParser(server=False)
        packets: list = []

        def read():
            while not packets:
                packets.extend(parser.feed(client.recv_message()))
            return packets.pop(0)
        send = client.send_binary
    else:
        client = RawMQTT(node.mqtt_port)
        read = client.recv
        send = client.send
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)

    send(M.encode_connect("ws-paused", clean_session=False, username="guest", password=b"guest"))
    assert isinstance(read(), M.ConnAck)
    send(M.encode_subscribe(1, [("paused/#", 0)]))
    assert isinstance(read(), M.SubAck)
    publisher = RawMQTT(node.mqtt_port)
    publisher.connect("ws-paused-publisher")
    pid = [0]

    def publish(i: int) -> None:
        # QoS 1, one at a time: PUBACK once the message is in the session queue.
        pid[0] = pid[0] % 65535 + 1
        publisher.publish("paused/x", b"%08d" % i + b"x" * (BODY - 8), qos=1, pid=pid[0])
        assert publisher.recv(timeout=30) == M.Ack(M.PUBACK, pid[0])

    conn = node.connect()
    ch = conn.channel()
    queue = session_queue("ws-paused")
    paused_at = _until_paused(publish, ch, queue)
    total = _flood_and_check(node, publish, ch, queue, paused_at)

    for i in range(total):
        p = read()
        assert isinstance(p, M.Publish) and p.payload[:8] == b"%08d" % i, (i, p)
    assert _ready(ch, queue) == 0
    conn.close()
    publisher.disconnect()
    client.sock.close()


def test_every_consumer_of_a_paused_connection_gives_its_credit_back(node_factory):
    """Four consumers on one TCP connection whose client stops reading: once the connection pauses,
    none of the four queues sends anything more (before, each consumer's window, 8 MiB, could go to
    the frontend: four windows for one connection). Afterwards each consumer gets its queue in order."""
    node = node_factory(name="node", frontends=1, shards=2, extra_args=["--stats-interval", "100"])
    client = TCPAMQP(node.port)
    client.open()
    queues = [f"many-{i}" for i in range(4)]
    for q in queues:
        client.send(1, commands.Queue.Declare(queue=q))
        assert isinstance(client.read(), commands.Queue.DeclareOk)
        client.send(1, commands.Basic.Consume(queue=q, consumer_tag=q, no_ack=True))
        assert isinstance(client.read(), commands.Basic.ConsumeOk)
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()
    sent = dict.fromkeys(queues, 0)

    def publish(q: str) -> None:
        ch.basic_publish("", q, q.encode() + b"%08d" % sent[q] + b"x" * (BODY - 16))
        sent[q] += 1

    while not _ready(ch, queues[0]):  # the first queue fills the client's socket buffers
        publish(queues[0])
        assert sent[queues[0]] < 2000, "the consumer's connection never paused"
    before = {q: sent[q] - _ready(ch, q) for q in queues}
    for _ in range(FLOOD // 4):
        for q in queues:
            publish(q)
    # A fifth consumer starts on the paused connection, on a queue that already holds messages: it
    # gets no window either.
    late = "many-late"
    ch.queue_declare(late)
    sent[late] = before[late] = 0
    for _ in range(FLOOD // 4):
        publish(late)
    client.send(1, commands.Basic.Consume(queue=late, consumer_tag=late, no_ack=True))
    queues.append(late)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for q in queues:
            assert _ready(ch, q) == sent[q] - before[q], (q, sent, before, _ready(ch, q))
        time.sleep(0.1)
    reports_after(node, 2)  # the frontend's reports since the flood
    pend = _send_pend(Api(node.http_port))
    assert pend <= BOUND, f"the frontend holds {pend} bytes for a paused connection (bound {BOUND})"

    got = dict.fromkeys(queues, 0)
    for _ in range(sum(sent.values())):
        deliver = client.read()
        if isinstance(deliver, commands.Basic.ConsumeOk):  # the late consumer's, behind what was written
            deliver = client.read()
        assert isinstance(deliver, commands.Basic.Deliver), deliver
        size = client.read().body_size  # content header
        body = b""
        while len(body) < size:
            body += client.read().value
        q = deliver.consumer_tag
        assert body[:len(q) + 8] == q.encode() + b"%08d" % got[q], (q, got[q], body[:16])
        got[q] += 1
    assert got == sent
    conn.close()
    client.sock.close()


def _until_still(ch, queue: str, quiet: float = 1.0, timeout: float = 20.0) -> int:
    """The queue's ready count once it has not changed for ``quiet`` seconds."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while True:
        ready = _ready(ch, queue)
        if ready != last:
            last, since = ready, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return ready
        assert time.monotonic() < deadline, "the queue never settled"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_consumer_that_never_reads_starting_on_a_full_queue_is_sent_no_window(node_factory, transport):
    """The worst case of the paused consumer: its queue holds more than a window when it starts, so
    the shard could send a whole window (8 MiB) before the frontend sees the connection pause. It
    starts with START_WINDOW and grows only while the client takes what is written, so what the
    frontend holds for it stays within the paused bound (on main: ~4 MB in send_pend)."""
    node = node_factory(name="node", frontends=1, shards=1, ws_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    queue = "full"
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue)
    total = WINDOW_BYTES * 3 // 2 // BODY
    for i in range(total):
        ch.basic_publish("", queue, b"%08d" % i + b"x" * (BODY - 8))
    client = TCPAMQP(node.port) if transport == "tcp" else WSAMQP(node.ws_port)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    client.open()
    client.send(1, commands.Basic.Consume(queue=queue, consumer_tag="never", no_ack=True))
    left = total - _until_still(ch, queue)
    reports_after(node, 2)  # the frontend's reports since the queue settled
    pend = _send_pend(Api(node.http_port))
    assert pend <= BOUND, f"the frontend holds {pend} bytes for a consumer that never read (bound {BOUND})"
    assert left < total, "nothing was delivered"

    assert isinstance(client.read(), commands.Basic.ConsumeOk)
    _read_in_order(client, total)  # reading, it gets everything, in order, once
    assert _ready(ch, queue) == 0
    conn.close()
    client.sock.close()
