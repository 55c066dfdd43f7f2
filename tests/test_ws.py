"""MQTT and AMQP over WebSocket (--ws-port), with a Python WebSocket client carrying real protocol traffic."""

from __future__ import annotations

import pytest
from pamqp import body as pamqp_body
from pamqp import commands, frame, header
from pamqp import heartbeat as pamqp_heartbeat
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from broker.mqtt import codec as M
from tests.harness import free_port
from tests.raw_mqtt import RawMQTT


@pytest.fixture(scope="module")
def ws_node(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("ws_node"))
    try:
        yield factory(name="node", frontends=2, shards=1, mqtt_port=free_port(), ws_port=free_port())
    finally:
        factory.cleanup()


def ws_connect(port: int, path: str = "/ws", subprotocols=("mqtt",)):
    return connect(f"ws://127.0.0.1:{port}{path}", subprotocols=list(subprotocols) or None, open_timeout=5)


class WSMQTT:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.parser = M.MQTTParser(server=False)
        self.packets: list = []

    def send(self, data: bytes) -> None:
        # Split a packet over two WebSocket messages now and then: the codec must not care.
        if len(data) > 4:
            self.ws.send(data[:3])
            self.ws.send(data[3:])
        else:
            self.ws.send(data)

    def recv(self):
        while not self.packets:
            self.packets.extend(self.parser.feed(self.ws.recv(timeout=5)))
        return self.packets.pop(0)


def test_mqtt_over_websocket_interoperates_with_plain_mqtt(ws_node):
    with ws_connect(ws_node.ws_port) as ws:
        _browser_session(ws_node, WSMQTT(ws))


def _browser_session(ws_node, w: WSMQTT) -> None:
    assert w.ws.subprotocol == "mqtt"
    w.send(M.encode_connect("browser", username="guest", password=b"guest"))
    assert w.recv() == M.ConnAck(False, 0)
    w.send(M.encode_subscribe(1, [("web/#", 1)]))
    assert w.recv() == M.SubAck(1, [1])
    tcp = RawMQTT(ws_node.mqtt_port)
    assert tcp.connect("tcp-side").return_code == 0
    tcp.publish("web/a", b"to the browser", qos=1, pid=7)
    assert tcp.recv() == M.Ack(M.PUBACK, 7)
    p = w.recv()
    assert (p.topic, p.payload, p.qos) == ("web/a", b"to the browser", 1)
    w.send(M.encode_ack(M.PUBACK, p.packet_id))
    assert tcp.subscribe(2, [("back/#", 0)]) == [0]
    w.send(M.encode_publish(b"back/x", b"from the browser"))
    p = tcp.recv()
    assert (p.topic, p.payload) == ("back/x", b"from the browser")
    w.send(bytes((M.DISCONNECT << 4, 0)))
    tcp.disconnect()


def test_amqp_over_websocket(ws_node):
    with ws_connect(ws_node.ws_port, "/amqp", ["amqp"]) as ws:
        _amqp_session(ws)


def _amqp_session(ws) -> None:
    assert ws.subprotocol == "amqp"
    buf = b""

    def read():
        nonlocal buf
        while True:
            if buf:
                used, _channel, value = frame.unmarshal(buf)
                if used:
                    buf = buf[used:]
                    if isinstance(value, pamqp_heartbeat.Heartbeat):
                        continue
                    return value
            buf += ws.recv(timeout=5)

    def send(channel: int, value) -> None:
        ws.send(frame.marshal(value, channel))

    ws.send(b"AMQP\x00\x00\x09\x01")
    assert isinstance(read(), commands.Connection.Start)
    send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest", locale="en_US"))
    tune = read()
    send(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
    send(0, commands.Connection.Open("/"))
    assert isinstance(read(), commands.Connection.OpenOk)
    send(1, commands.Channel.Open())
    assert isinstance(read(), commands.Channel.OpenOk)
    send(1, commands.Queue.Declare(queue="ws-q", auto_delete=True))
    assert read().queue == "ws-q"
    send(1, commands.Basic.Publish(exchange="", routing_key="ws-q"))
    body = b"over websocket"
    ws.send(frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1)
            + frame.marshal(pamqp_body.ContentBody(body), 1))
    send(1, commands.Basic.Get(queue="ws-q", no_ack=True))
    assert isinstance(read(), commands.Basic.GetOk)
    assert isinstance(read(), header.ContentHeader)
    assert read().value == body
    send(0, commands.Connection.Close(200, "bye", 0, 0))
    assert isinstance(read(), commands.Connection.CloseOk)


def test_path_picks_the_protocol_without_a_subprotocol(ws_node):
    with ws_connect(ws_node.ws_port, "/ws", subprotocols=()) as ws:
        w = WSMQTT(ws)
        w.send(M.encode_connect("no-subprotocol", username="guest", password=b"guest"))
        assert w.recv() == M.ConnAck(False, 0)


def test_a_malformed_packet_over_websocket_closes_that_socket_only(ws_node):
    with ws_connect(ws_node.ws_port) as ws:
        w = WSMQTT(ws)
        w.send(M.encode_connect("bad-ws", username="guest", password=b"guest"))
        assert w.recv() == M.ConnAck(False, 0)
        w.ws.send(bytes((0xF0, 0)))
        with pytest.raises(ConnectionClosed):  # the server closes it (not a timeout)
            while True:
                w.ws.recv(timeout=5)
    with ws_connect(ws_node.ws_port) as ws:
        good = WSMQTT(ws)
        good.send(M.encode_connect("good-ws", username="guest", password=b"guest"))
        assert good.recv() == M.ConnAck(False, 0)


def test_amqp_over_websocket_close_leaves_the_frontend_alive(ws_node):
    # close-ok is followed by a half-close on TCP (write_eof); a WebSocket has no half-close, and the
    # frontend must not trip over that: same frontend processes, later sessions work, no traceback.
    before = {k: v for k, v in ws_node.pids().items() if k.startswith("frontend")}
    tracebacks = ws_node.log_text().count("Traceback")
    for _ in range(2):
        with ws_connect(ws_node.ws_port, "/amqp", ["amqp"]) as ws:
            _amqp_session(ws)
    with ws_connect(ws_node.ws_port, "/amqp", ["amqp"]) as ws:  # one more round trip after the closes
        _amqp_session(ws)
    after = {k: v for k, v in ws_node.pids().items() if k.startswith("frontend")}
    assert after == before
    assert ws_node.log_text().count("Traceback") == tracebacks
