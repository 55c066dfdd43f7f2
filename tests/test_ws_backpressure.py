"""WebSocket write back-pressure: a WebSocket client that stops reading pauses its deliveries, as a
TCP client does (frontend/ws.py HIGH_WATER -> the session's pause_writing -> no credit back to the
shard), instead of the frontend buffering everything published to it. Nothing is lost: when the
client reads again, every message arrives, in order."""

from __future__ import annotations

import socket
import time

from pamqp import commands, frame
from pamqp import heartbeat as pamqp_heartbeat
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from broker import contract
from broker.mqtt import codec as M
from frontend.mqtt.messages import session_queue
from frontend.ws import HIGH_WATER
from tests.harness import free_port
from tests.mgmt_api import Api
from tests.raw_mqtt import RawMQTT

BODY = 16 << 10
N = 4096  # 64 MiB published to a client that reads nothing
# What may leave the queue while the client reads nothing: the frontend's high-water mark, the
# consumer's credit window (contract.CREDIT_WINDOW, a credit per 512 B of body), the loopback
# socket buffers (a few MiB each way) and the two WebSocket messages the client library queues.
CREDIT_BYTES = contract.CREDIT_WINDOW * (1 << contract.CREDIT_BYTES_SHIFT)
FRONTEND_BOUND = HIGH_WATER + CREDIT_BYTES + (1 << 20)
LEFT_QUEUE_BOUND = FRONTEND_BOUND + (24 << 20)


class WSClient:
    """A WebSocket whose socket is read only when the test asks for a message (websockets' sans-I/O
    protocol over a plain socket: its threaded clients read ahead into their own queues)."""

    def __init__(self, port: int, path: str, subprotocol: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.ws = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}{path}"), subprotocols=[Subprotocol(subprotocol)],
                                 max_size=None)
        self.ws.send_request(self.ws.connect())
        self._flush()
        self.messages: list[bytes] = []
        while not self.ws.handshake_exc and self.ws.state is not State.OPEN:
            self._pump()
        assert self.ws.handshake_exc is None, self.ws.handshake_exc

    def _flush(self) -> None:
        for data in self.ws.data_to_send():
            if data:
                self.sock.sendall(data)

    def _pump(self) -> None:
        data = self.sock.recv(1 << 20)
        assert data, "the server closed the WebSocket"
        self.ws.receive_data(data)
        for event in self.ws.events_received():
            if isinstance(event, Frame) and event.opcode is Opcode.BINARY:
                self.messages.append(event.data)
        self._flush()  # pongs

    def recv_message(self) -> bytes:
        while not self.messages:
            self._pump()
        return self.messages.pop(0)

    def send_binary(self, data: bytes) -> None:
        self.ws.send_binary(data)
        self._flush()


class WSAMQP(WSClient):
    def __init__(self, port: int) -> None:
        super().__init__(port, "/amqp", "amqp")
        self.buf = b""

    def read(self):
        while True:
            if self.buf:
                used, _channel, value = frame.unmarshal(self.buf)
                if used:
                    self.buf = self.buf[used:]
                    if not isinstance(value, pamqp_heartbeat.Heartbeat):
                        return value
                    continue
            self.buf += self.recv_message()

    def send(self, channel: int, value) -> None:
        self.send_binary(frame.marshal(value, channel))

    def open(self) -> None:
        self.send_binary(b"AMQP\x00\x00\x09\x01")
        assert isinstance(self.read(), commands.Connection.Start)
        self.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest", locale="en_US"))
        tune = self.read()
        self.send(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        self.send(0, commands.Connection.Open("/"))
        assert isinstance(self.read(), commands.Connection.OpenOk)
        self.send(1, commands.Channel.Open())
        assert isinstance(self.read(), commands.Channel.OpenOk)


def _ready(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def test_a_websocket_client_that_stops_reading_pauses_its_deliveries(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, ws_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    queue = "ws-slow"
    client = WSAMQP(node.ws_port)
    client.open()
    client.send(1, commands.Queue.Declare(queue=queue))
    assert isinstance(client.read(), commands.Queue.DeclareOk)
    client.send(1, commands.Basic.Consume(queue=queue, consumer_tag="slow", no_ack=True))
    assert isinstance(client.read(), commands.Basic.ConsumeOk)
    # From here on the client reads nothing until every message is published.

    conn = node.connect()
    ch = conn.channel()
    for i in range(N):
        ch.basic_publish("", queue, b"%08d" % i + b"x" * (BODY - 8))
    # Deliveries stop once the frontend holds its bound for this client: the rest stays queued. Without
    # back-pressure the shard delivers as it stores (the queue empties into the frontend's memory).
    deadline = time.monotonic() + 60
    while (ready := _ready(ch, queue)) < N - LEFT_QUEUE_BOUND // BODY:
        assert time.monotonic() < deadline, f"only {ready} of {N} messages still queued: deliveries did not pause"
        time.sleep(0.1)
    api = Api(node.http_port)
    rows = api.wait_for("/api/connections", lambda rows: len(rows) == 2, timeout=10)
    ws_row = max(rows, key=lambda r: r["send_oct"])
    assert ws_row["send_pend"] <= FRONTEND_BOUND, ws_row["send_pend"]
    assert _ready(ch, queue) >= N - LEFT_QUEUE_BOUND // BODY

    # The client reads again: everything arrives, in order, and the queue empties.
    got = 0
    while got < N:
        deliver = client.read()
        assert isinstance(deliver, commands.Basic.Deliver), deliver
        client.read()  # content header
        body = client.read().value
        assert len(body) == BODY and body[:8] == b"%08d" % got, (got, body[:8])
        got += 1
    assert _ready(ch, queue) == 0
    conn.close()
    client.sock.close()


def test_an_mqtt_websocket_subscriber_that_stops_reading_pauses_its_deliveries(node_factory):
    # A persistent session's QoS 0 subscription: its messages come through its queue on the shard,
    # paced by credit (a QoS 1 one would be held by its in-flight window anyway).
    node = node_factory(name="node", frontends=1, shards=1, ws_port=free_port(), mqtt_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    client = WSClient(node.ws_port, "/ws", "mqtt")
    parser = M.MQTTParser(server=False)
    packets: list = []

    def read():
        while not packets:
            packets.extend(parser.feed(client.recv_message()))
        return packets.pop(0)

    client.send_binary(M.encode_connect("ws-slow", clean_session=False, username="guest", password=b"guest"))
    assert isinstance(read(), M.ConnAck)
    client.send_binary(M.encode_subscribe(1, [("slow/#", 0)]))
    assert isinstance(read(), M.SubAck)
    # From here on the client reads nothing until every message is published.
    publisher = RawMQTT(node.mqtt_port)
    publisher.connect("ws-slow-publisher")
    for i in range(N):
        publisher.publish("slow/x", b"%08d" % i + b"x" * (BODY - 8))
    publisher.publish("slow/x", b"end", qos=1, pid=1)
    assert publisher.recv(timeout=60) == M.Ack(M.PUBACK, 1)
    conn = node.connect()
    ch = conn.channel()
    queue = session_queue("ws-slow")
    deadline = time.monotonic() + 60
    while (ready := _ready(ch, queue)) < N - LEFT_QUEUE_BOUND // BODY:
        assert time.monotonic() < deadline, f"only {ready} of {N + 1} messages still queued: deliveries did not pause"
        time.sleep(0.1)
    # The WebSocket session and the publisher: the largest send_pend is the WebSocket's.
    rows = Api(node.http_port).wait_for("/api/connections", lambda rows: len(rows) >= 2, timeout=10)
    assert max(r["send_pend"] for r in rows) <= FRONTEND_BOUND, rows

    for i in range(N):
        p = read()
        assert isinstance(p, M.Publish) and p.payload[:8] == b"%08d" % i, (i, p)
    assert read().payload == b"end"
    assert _ready(ch, queue) == 0
    conn.close()
    publisher.disconnect()
    client.sock.close()
