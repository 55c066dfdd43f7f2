"""TLS listeners (AMQPS, MQTTS) with a CA and certificates made in the test (the `cryptography` package)."""

from __future__ import annotations

import queue
import socket
import ssl
import subprocess
import sys

import paho.mqtt.client as mqtt
import pika
import pytest

from tests.harness import REPO_ROOT, free_port
from tests.pki import issue_cert, make_pki, write_pem


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_args(pki, verify: bool = False) -> list[str]:
    cert, key = pki["server"]
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"], "--amqps-port", str(free_port()),
            "--mqtts-port", str(free_port()), *(["--tls-verify-peer", "1"] if verify else [])]


def _port(node, flag: str) -> int:
    return int(node.extra_args[node.extra_args.index(flag) + 1])


def _client_ctx(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory, pki):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("tls_node"))
    try:
        yield factory(name="node", frontends=2, shards=1, mqtt_port=free_port(), extra_args=_tls_args(pki))
    finally:
        factory.cleanup()


def _amqps_round_trip(port: int, ctx: ssl.SSLContext) -> bytes:
    params = pika.ConnectionParameters("127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest"),
                                       ssl_options=pika.SSLOptions(ctx, "localhost"))
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.confirm_delivery()
        ch.basic_publish("", q, b"over tls")
        return ch.basic_get(q, auto_ack=True)[2]
    finally:
        conn.close()


def test_pika_over_tls(tls_node, pki):
    assert _amqps_round_trip(_port(tls_node, "--amqps-port"), _client_ctx(pki["ca"])) == b"over tls"


def test_aio_pika_over_tls(tls_node, pki):
    import asyncio

    import aio_pika

    async def main() -> bytes:
        conn = await aio_pika.connect(host="127.0.0.1", port=_port(tls_node, "--amqps-port"), login="guest",
                                      password="guest", ssl=True, ssl_context=_client_ctx(pki["ca"]),
                                      server_hostname="localhost")
        async with conn:
            ch = await conn.channel()
            q = await ch.declare_queue("", exclusive=True)
            await ch.default_exchange.publish(aio_pika.Message(b"aio over tls"), routing_key=q.name)
            msg = await q.get(timeout=5)
            await msg.ack()
            return msg.body

    assert asyncio.run(main()) == b"aio over tls"


def test_paho_over_tls(tls_node, pki):
    got: queue.Queue = queue.Queue()
    subscribed: queue.Queue = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="tls-client", protocol=mqtt.MQTTv311)
    c.username_pw_set("guest", "guest")
    c.tls_set_context(_client_ctx(pki["ca"]))
    c.on_message = lambda _c, _u, m: got.put((m.topic, m.payload))
    c.on_subscribe = lambda *_a: subscribed.put(True)
    c.on_connect = lambda *_a: c.subscribe("secure/#", 1)
    c.connect("localhost", _port(tls_node, "--mqtts-port"))
    c.loop_start()
    try:
        subscribed.get(timeout=10)
        c.publish("secure/x", b"encrypted", qos=1)
        assert got.get(timeout=10) == ("secure/x", b"encrypted")
    finally:
        c.disconnect()
        c.loop_stop()


def test_a_client_trusting_another_ca_refuses_the_server(tls_node, pki):
    with pytest.raises(ssl.SSLCertVerificationError):
        _amqps_round_trip(_port(tls_node, "--amqps-port"), _client_ctx(pki["other_ca"]))


@pytest.mark.parametrize("flag,greeting", [("--amqps-port", b"AMQP\x00\x00\x09\x01"),
                                           ("--mqtts-port", b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")])
def test_plain_bytes_to_a_tls_port_get_no_protocol_answer(tls_node, flag, greeting):
    with socket.create_connection(("127.0.0.1", _port(tls_node, flag)), timeout=5) as s:
        s.sendall(greeting)
        data = b""
        try:
            while chunk := s.recv(4096):
                data += chunk
        except ConnectionResetError:
            pass
    assert not data.startswith(b"AMQP") and b"\x20\x02" not in data[:2]  # no AMQP or CONNACK reply
    assert _amqps_round_trip(_port(tls_node, "--amqps-port"), _client_ctx(pki_ca(tls_node))) == b"over tls"


def pki_ca(node) -> str:
    return node.extra_args[node.extra_args.index("--tls-ca") + 1]


def test_tls_below_1_2_is_refused(tls_node, pki):
    ctx = _client_ctx(pki["ca"])
    ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError):
        _amqps_round_trip(_port(tls_node, "--amqps-port"), ctx)


def test_verify_peer_requires_a_valid_client_certificate(node_factory, pki):
    node = node_factory(name="verify", frontends=1, shards=1, extra_args=_tls_args(pki, verify=True))
    port = _port(node, "--amqps-port")
    assert _amqps_round_trip(port, _client_ctx(pki["ca"], pki["client"])) == b"over tls"
    for cert in (None, pki["expired_client"], pki["stranger"]):
        with pytest.raises((ssl.SSLError, ConnectionError, pika.exceptions.AMQPConnectionError)):
            _amqps_round_trip(port, _client_ctx(pki["ca"], cert))
    assert node.running()


def test_client_certificate_cn_is_the_user_for_amqp_external_and_mqtt(node_factory, pki):
    node = node_factory(name="verify", frontends=1, shards=1, extra_args=_tls_args(pki, verify=True))
    # AMQP: the EXTERNAL mechanism logs in as the certificate's CN (guest)
    params = pika.ConnectionParameters("127.0.0.1", _port(node, "--amqps-port"),
                                       credentials=pika.credentials.ExternalCredentials(),
                                       ssl_options=pika.SSLOptions(_client_ctx(pki["ca"], pki["client"]), "localhost"))
    conn = pika.BlockingConnection(params)
    assert conn.channel().queue_declare("", exclusive=True).method.queue
    conn.close()
    connacks: queue.Queue = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="by-cert", protocol=mqtt.MQTTv311)
    c.tls_set_context(_client_ctx(pki["ca"], pki["client"]))  # CN=guest, no user name sent
    c.on_connect = lambda _c, _u, _f, rc, _p: connacks.put(rc.value)
    c.connect("localhost", _port(node, "--mqtts-port"))
    c.loop_start()
    try:
        assert connacks.get(timeout=10) == 0
    finally:
        c.disconnect()
        c.loop_stop()


def test_sighup_reloads_the_certificate_and_keeps_established_connections(node_factory, pki, tmp_path):
    import os
    import shutil
    import signal
    import time

    cert, key = str(tmp_path / "live.pem"), str(tmp_path / "live.key")
    shutil.copy(pki["server"][0], cert)
    shutil.copy(pki["server"][1], key)
    amqps = free_port()
    node = node_factory(name="reload", frontends=2, shards=1, extra_args=[
        "--tls-cert", cert, "--tls-key", key, "--amqps-port", str(amqps), "--mqtts-port", "0"])
    params = pika.ConnectionParameters("127.0.0.1", amqps, ssl_options=pika.SSLOptions(_client_ctx(pki["ca"]),
                                                                                         "localhost"))
    established = pika.BlockingConnection(params)
    ch = established.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    # A new CA and a server certificate from it, written over the files the node was started with.
    new_ca_key, new_ca = issue_cert("Renewed CA", None, None, ca=True)
    new_ca_path = write_pem(tmp_path / "newca", new_ca_key, new_ca)[0]
    write_pem(tmp_path / "live", *issue_cert("localhost", new_ca_key, new_ca.subject, server=True))
    os.kill(node.pid, signal.SIGHUP)
    deadline = time.monotonic() + 15
    while node.log_text().count("TLS certificate reloaded") < 2:  # both frontends
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.05)
    for _ in range(6):  # whichever frontend takes the connection serves the renewed certificate
        assert _amqps_round_trip(amqps, _client_ctx(new_ca_path)) == b"over tls"
    ch.confirm_delivery()
    ch.basic_publish("", q, b"still here")  # the connection made before the reload goes on
    assert ch.basic_get(q, auto_ack=True)[2] == b"still here"
    established.close()
    assert node.running()


def test_mqtt_over_websocket_over_tls(node_factory, pki):
    from websockets.sync.client import connect

    from broker.mqtt import codec as M

    wss = free_port()
    node = node_factory(name="wss", frontends=1, shards=1, ws_port=free_port(),
                        extra_args=[*_tls_args(pki), "--wss-port", str(wss)])
    with connect(f"wss://localhost:{wss}/ws", subprotocols=["mqtt"], ssl=_client_ctx(pki["ca"]),
                 open_timeout=5) as ws:
        ws.send(M.encode_connect("wss-client", username="guest", password=b"guest"))
        assert M.MQTTParser(server=False).feed(ws.recv(timeout=5)) == [M.ConnAck(False, 0)]
    assert node.running()


def test_management_api_and_health_over_https(node_factory, pki):
    import json
    import urllib.request

    https = free_port()
    node_factory(name="https", frontends=1, shards=1, extra_args=[*_tls_args(pki), "--https-port", str(https)])
    with urllib.request.urlopen(f"https://localhost:{https}/api/health/checks/alarms",
                                context=_client_ctx(pki["ca"]), timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_bad_tls_settings_stop_the_cli_naming_the_flag(tmp_path, pki):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "broker.cli", "--data-dir", str(tmp_path / "d"), *args],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)

    r = run("--tls-cert", pki["server"][0])
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr
    r = run("--tls-cert", pki["server"][0], "--tls-key", pki["client"][1])
    assert r.returncode == 2 and "--tls-cert/--tls-key: cannot load" in r.stderr
    r = run("--tls-cert", pki["server"][0], "--tls-key", pki["server"][1], "--tls-verify-peer", "1")
    assert r.returncode == 2 and "--tls-verify-peer needs --tls-ca" in r.stderr


def test_prometheus_metrics_over_https(node_factory, pki):
    import urllib.error
    import urllib.request

    port = free_port()
    node = node_factory(name="prom-tls", frontends=1, shards=1,
                        extra_args=[*_tls_args(pki), "--prometheus-tls-port", str(port)])
    with urllib.request.urlopen(f"https://localhost:{port}/metrics", context=_client_ctx(pki["ca"]),
                                timeout=10) as resp:
        assert resp.status == 200 and b"rabbitmq_queues" in resp.read()
    with pytest.raises(urllib.error.URLError):  # a client that trusts another CA refuses the server
        urllib.request.urlopen(f"https://localhost:{port}/metrics", context=_client_ctx(pki["other_ca"]), timeout=10)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # plain HTTP gets no metrics
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert b"rabbitmq_" not in sock.recv(65536)
    # the plain port still serves as before
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=10) as resp:
        assert resp.status == 200
