"""MQTT connections (TCP and WebSocket) report bytes received and sent in the management API as AMQP
ones do (recv_oct / send_oct and their rates, RabbitMQ's fields), through the frontends' STATS."""

from __future__ import annotations

import queue
import threading
import time
import urllib.request
import uuid

import paho.mqtt.client as mqtt
import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import free_port, wait_until
from tests.mgmt_api import Api

pytestmark = pytest.mark.integration

WAIT = 15.0
PAYLOAD = 1000
N = 200


def _client(port: int, transport: str, client_id: str) -> tuple[mqtt.Client, queue.Queue]:
    got: queue.Queue = queue.Queue()
    connected: queue.Queue = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                    transport=transport)
    if transport == "websockets":
        c.ws_set_options(path="/ws")
    c.username_pw_set("guest", "guest")
    c.on_message = lambda _c, _u, m: got.put(m.payload)
    c.on_connect = lambda _c, _u, _f, rc, _p: connected.put(rc.value)
    c.connect("127.0.0.1", port, 30)
    c.loop_start()
    assert connected.get(timeout=WAIT) == 0
    return c, got


def _row(api: Api, _client_id: str) -> dict | None:
    """The node's one MQTT connection (an MQTT row says which protocol it speaks)."""
    rows = [r for r in api.get("/api/connections") if r["protocol"].startswith("MQTT")]
    return rows[0] if len(rows) == 1 else None


def _prometheus_bytes(node) -> tuple[float, float]:
    """rabbitmq_connection_incoming/outgoing_bytes_total (every connection of the node)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return got["rabbitmq_connection_incoming_bytes_total"], got["rabbitmq_connection_outgoing_bytes_total"]


def _wait(check, what: str):
    return wait_until(check, WAIT, what, 0.05)


@pytest.mark.parametrize("transport", ["tcp", "websockets"])
def test_an_mqtt_connection_reports_its_bytes_and_rates(node_factory, transport):
    node = node_factory(name="node", frontends=1, shards=1, mqtt_port=free_port(), ws_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    port = node.mqtt_port if transport == "tcp" else node.ws_port
    cid = f"bytes-{uuid.uuid4().hex[:8]}"
    client, got = _client(port, transport, cid)
    try:
        done: queue.Queue = queue.Queue()
        client.on_subscribe = lambda *_a: done.put(True)
        client.subscribe("bytes/#", 0)
        done.get(timeout=WAIT)
        row = _wait(lambda: _row(api, cid), "the MQTT connection listed")
        assert row["protocol"] == "MQTT 3.1.1"
        recv0, send0 = row["recv_oct"], row["send_oct"]
        assert recv0 > 0 and send0 > 0  # CONNECT, SUBSCRIBE in; CONNACK, SUBACK out

        # The client publishes N messages to a topic it subscribes to: at least their payloads go
        # each way (plus topic names and packet headers).
        for i in range(N):
            client.publish("bytes/x", b"%06d" % i + b"p" * (PAYLOAD - 6), qos=0)
        for i in range(N):
            assert got.get(timeout=WAIT)[:6] == b"%06d" % i
        moved = N * PAYLOAD
        row = _wait(lambda: (r := _row(api, cid)) and r["recv_oct"] >= recv0 + moved
                    and r["send_oct"] >= send0 + moved and r, "the byte counters grew by what moved")
        assert row["recv_oct"] < recv0 + moved + N * 64, row  # and not much more: headers and topics
        assert row["send_oct"] < send0 + moved + N * 64, row
        # Prometheus sums the same rows (the MQTT connection is the node's only one).
        _wait(lambda: (b := _prometheus_bytes(node))[0] >= row["recv_oct"] and b[1] >= row["send_oct"],
              "Prometheus' connection byte totals include the MQTT connection's")

        # While bytes keep moving, the rates say so; once nothing moves they fall back to 0.
        stop = threading.Event()

        def keep_publishing() -> None:
            while not stop.is_set():
                client.publish("bytes/x", b"r" * PAYLOAD, qos=0)
                time.sleep(0.002)
        pub = threading.Thread(target=keep_publishing, daemon=True)
        pub.start()
        try:
            _wait(lambda: (r := _row(api, cid)) and r["recv_oct_details"]["rate"] > 0
                  and r["send_oct_details"]["rate"] > 0, "positive byte rates while publishing")
        finally:
            stop.set()
            pub.join()
        _wait(lambda: (r := _row(api, cid)) and r["recv_oct_details"]["rate"] == 0
              and r["send_oct_details"]["rate"] == 0, "the rates back at 0 once idle")
    finally:
        client.disconnect()
        client.loop_stop()


def test_amqp_connections_report_byte_rates_too(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    conn = pika.BlockingConnection(pika.URLParameters(node.url + "?heartbeat=0"))
    ch = conn.channel()
    ch.queue_declare("rates-q")
    try:
        deadline = time.monotonic() + WAIT
        while True:
            for _ in range(20):
                ch.basic_publish("", "rates-q", b"x" * 1000)
            conn.process_data_events(0)
            rows = api.get("/api/connections")
            if rows and rows[0]["protocol"] == "AMQP 0-9-1" and rows[0]["recv_oct_details"]["rate"] > 0:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.02)
    finally:
        conn.close()
