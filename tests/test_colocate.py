"""--colocate: frontend K and shard K in one process, talking through the in-process link.

Real nodes, real clients (pika). A pair is one OS process (shard/pair_main.py) that the node treats
as both workers: one pid for both in pids.json, a kill -9 restarts both roles, memory counted once.
Between the pair's frontend and shard no socket carries data (broker/local_link.py); links to the
other pair's shard, shard-to-shard forwards and the control plane stay sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pika
import pytest

from broker.config import load_settings
from broker.contract import FRONTEND_STOP_SIGNAL
from broker.cpus import colocated_pairs
from tests.harness import REPO_ROOT, pid_alive, wait_until
from tests.helpers import connections_on_two_frontends, names_on_different_shards, uid

QUEUE_PLACEMENT = "hash"  # queue names picked per shard (names_on_different_shards)
ON = ["--colocate", "on"]

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def connected_streams(path: str) -> int:
    """Connected unix stream sockets bound to ``path`` (a listener's accepted connections)."""
    with open("/proc/net/unix") as fh:
        return sum(1 for line in fh.readlines()[1:]
                   if line.split()[-1] == path and line.split()[5] == "03")


def paired_pid(node, index: int) -> int:
    pids = node.pids()
    assert pids["frontend"][str(index)] == pids["shard"][str(index)], pids
    return int(pids["shard"][str(index)])


def consume_bodies(ch, queue: str, n: int, auto_ack: bool = True, ack: bool = False) -> list[tuple]:
    """``n`` deliveries of a consumer on ``queue``; ``ack``: acked (multiple) before the cancel."""
    got = []
    deadline = time.monotonic() + 15
    for method, props, body in ch.consume(queue, auto_ack=auto_ack, inactivity_timeout=0.5):
        if method is not None:
            got.append((method, props, body))
            if len(got) == n:
                break
        assert time.monotonic() < deadline, f"{len(got)} of {n} arrived"
    if ack:
        ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    ch.cancel()
    return got


def test_one_pair_serves_through_the_in_process_link(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=ON)
    pid = paired_pid(node, 0)
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        assert b"shard.pair_main" in fh.read()
    # The frontend's two lanes to its own shard are in-process: nothing connected to the shard's socket.
    assert connected_streams(str(node.data_dir / "run" / "shard-0.stream")) == 0

    conn = node.connect()
    ch = conn.channel()
    # No-ack: order kept across the link.
    q = uid("noack")
    ch.queue_declare(q)
    for i in range(300):
        ch.basic_publish("", q, str(i).encode())
    got = consume_bodies(ch, q, 300)
    assert [b for _m, _p, b in got] == [str(i).encode() for i in range(300)]

    # Manual ack, a nack with requeue: the message comes back redelivered, then the ack removes it.
    q2 = uid("ack")
    ch.queue_declare(q2)
    ch.basic_publish("", q2, b"once")
    (method, _p, body), = consume_bodies(ch, q2, 1, auto_ack=False)
    ch.basic_nack(method.delivery_tag, requeue=True)
    (method, _p, body), = consume_bodies(ch, q2, 1, auto_ack=False)
    assert body == b"once" and method.redelivered
    ch.basic_ack(method.delivery_tag)
    wait_until(lambda: ch.queue_declare(q2, passive=True).method.message_count == 0, 10, "ack handled")

    # Confirms of persistent messages, kept across a clean restart.
    q3 = uid("durable")
    ch.queue_declare(q3, durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", q3, f"p{i}".encode(), properties=PERSISTENT)  # raises if nacked
    conn.close()
    assert node.stop() == 0
    node.start()
    ch = node.connect().channel()
    got = consume_bodies(ch, q3, 50)
    assert [b for _m, _p, b in got] == [f"p{i}".encode() for i in range(50)]

    # One process, one row: its memory is counted once.
    pid = paired_pid(node, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        rows = [line for line in resp.read().decode().splitlines()
                if line.startswith("shardmq_process_resident_memory_bytes{")]
    assert len(rows) == 2 and any('process="shard 0+frontend 0"' in r for r in rows), rows

    # SIGUSR1: both workers log their state.
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: "shardmq.frontend: state:" in node.log_text() and "shardmq.shard: state:" in node.log_text(),
               10, "both workers' state logged")


@pytest.mark.parametrize("transport", ["unix", "zmq"])
def test_two_pairs_cross_to_the_other_pairs_shard(node_factory, transport):
    """Within a pair the link is in-process; to the other pair's shard it is the --ipc-transport's socket."""
    node = node_factory(frontends=2, shards=2, extra_args=[*ON, "--ipc-transport", transport])
    assert paired_pid(node, 0) != paired_pid(node, 1)
    on0, on1 = names_on_different_shards(uid("x"))
    a, b = sorted(connections_on_two_frontends(node), key=lambda c: c._impl.server_properties["shardmq_frontend"])
    cha, chb = a.channel(), b.channel()
    for q in (on0, on1):
        cha.queue_declare(q)
    # Each connection publishes to both shards: one through its pair's link, one through a socket.
    for i in range(100):
        cha.basic_publish("", on0, b"a%d" % i)
        cha.basic_publish("", on1, b"a%d" % i)
        chb.basic_publish("", on0, b"b%d" % i)
        chb.basic_publish("", on1, b"b%d" % i)
    for ch, q in ((cha, on1), (chb, on0)):  # a on frontend 0, b on 1: each consumes from the other pair
        got = [body for _m, _p, body in consume_bodies(ch, q, 200, auto_ack=False, ack=True)]
        assert [x for x in got if x[:1] == b"a"] == [b"a%d" % i for i in range(100)]
        assert [x for x in got if x[:1] == b"b"] == [b"b%d" % i for i in range(100)]
    a.close()
    b.close()


def test_kill_9_of_a_pair_keeps_confirmed_messages_and_restarts_both(node_factory):
    node = node_factory(frontends=2, shards=2, extra_args=ON)
    on0, on1 = names_on_different_shards(uid("k"))
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for q in (on0, on1):
        ch.queue_declare(q, durable=True)
        for i in range(200):
            ch.basic_publish("", q, f"{q}-{i}".encode(), properties=PERSISTENT)
    old = paired_pid(node, 0)
    other = paired_pid(node, 1)
    node.kill_worker("shard", 0)
    new = node.wait_worker_restarted("shard", 0, old)
    wait_until(lambda: node.pids()["frontend"]["0"] == new, 15, "frontend 0 in the restarted pair")
    assert paired_pid(node, 0) == new and not pid_alive(old)
    assert paired_pid(node, 1) == other  # the other pair lived on
    # Clients reconnect (either frontend) and consume everything that was confirmed.
    deadline = time.monotonic() + 30
    while True:
        try:
            ch = node.connect().channel()
            got = consume_bodies(ch, on0, 200)
            break
        except (pika.exceptions.AMQPError, AssertionError):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
    assert [b for _m, _p, b in got] == [f"{on0}-{i}".encode() for i in range(200)]
    assert len(consume_bodies(ch, on1, 200)) == 200
    log = node.log_text()
    assert "frontend 0 runs in shard 0's process" in log


def test_clean_stop_stops_the_frontend_part_first(node_factory):
    node = node_factory(frontends=2, shards=2, extra_args=ON)
    started = time.monotonic()
    assert node.stop() == 0
    assert time.monotonic() - started < 10
    log = node.log_text()
    assert "did not stop" not in log
    for i in range(2):
        assert log.index(f"frontend {i} stopped") < log.index(f"shard {i} stopped"), log


def test_setting_from_flag_ini_env_and_bad_values(tmp_path, node_factory):
    ini = tmp_path / "shardmq.ini"
    ini.write_text("[main]\ncolocate = on\n")
    assert load_settings(["--config", str(ini)], {}).colocate == "on"
    assert load_settings([], {"SHARDMQ_COLOCATE": "auto"}).colocate == "auto"
    assert load_settings(["--colocate", "off"], {"SHARDMQ_COLOCATE": "on"}).colocate == "off"
    assert colocated_pairs("on", 2, 3) == 2 and colocated_pairs("off", 2, 2) == 0
    assert colocated_pairs("auto", 2, 2, cores=2) == 2 and colocated_pairs("auto", 2, 2, cores=4) == 0
    # A cluster member pairs too (a fenced leader stops a pair's frontend part alone: tests/test_cluster_pairs.py).
    cluster_env = {"SHARDMQ_CLUSTER_SECRET": "s"}
    assert load_settings(["--colocate", "on", "--cluster"], cluster_env).colocate == "on"
    assert load_settings(["--cluster"], {**cluster_env, "SHARDMQ_COLOCATE": "on"}).colocate == "on"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_")}
    run = subprocess.run([sys.executable, "-m", "broker.cli", "--data-dir", str(tmp_path / "d"), "--colocate",
                          "sometimes"], cwd=REPO_ROOT, env={**env, **cluster_env}, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2 and "--colocate" in run.stderr, run.stderr
    # The variable reaches a real node: frontends 2, shards 1 -> one pair, frontend 1 alone.
    node = node_factory(frontends=2, shards=1, env={"SHARDMQ_COLOCATE": "on"})
    pids = node.pids()
    assert pids["frontend"]["0"] == pids["shard"]["0"] != pids["frontend"]["1"]


def test_sigterm_to_a_pair_stops_its_frontend_then_its_shard_and_both_come_back(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=ON)
    old = paired_pid(node, 0)
    os.kill(old, signal.SIGTERM)
    new = node.wait_worker_restarted("shard", 0, old)
    wait_until(lambda: node.pids()["frontend"]["0"] == new, 15, "frontend 0 in the restarted pair")
    log = node.log_text()
    assert log.index("frontend 0 stopped") < log.index("shard 0 stopped") < log.index("exited with status 0"), log
    node.wait_ready()
    ch = node.connect().channel()
    q = uid("after")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"back")
    assert [b for _m, _p, b in consume_bodies(ch, q, 1)] == [b"back"]


def test_kill_9_of_a_pair_under_confirmed_load_loses_no_confirmed_message(node_factory):
    """A publisher on the pair's own frontend, confirming each persistent message into a queue of the
    pair's shard (the in-process link both ways), when the pair is killed: every message it saw
    confirmed is there after both roles came back (unconfirmed ones may be there too)."""
    node = node_factory(frontends=1, shards=1, extra_args=ON)
    q = uid("crash")
    setup = node.connect()
    setup.channel().queue_declare(q, durable=True)
    setup.close()
    confirmed: list[int] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            ch = node.connect().channel()
            ch.confirm_delivery()
            for i in range(10**6):
                ch.basic_publish("", q, str(i).encode(), properties=PERSISTENT)  # returns once confirmed
                confirmed.append(i)
        except pika.exceptions.AMQPError as exc:
            errors.append(exc)  # the connection went with the pair

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    wait_until(lambda: len(confirmed) >= 300, 30, "300 confirms before the kill")
    old = node.kill_worker("shard", 0)
    publisher.join(15)
    assert not publisher.is_alive() and errors, "the publisher's connection did not end with the pair"
    new = node.wait_worker_restarted("shard", 0, old)
    wait_until(lambda: node.pids()["frontend"]["0"] == new, 15, "frontend 0 in the restarted pair")
    deadline = time.monotonic() + 30
    while True:
        try:
            ch = node.connect().channel()
            count = ch.queue_declare(q, durable=True, passive=True).method.message_count
            break
        except pika.exceptions.AMQPError:
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
    assert count >= len(confirmed)
    got = {int(b) for _m, _p, b in consume_bodies(ch, q, count)}
    assert set(confirmed) <= got, sorted(set(confirmed) - got)[:10]


def test_bodies_cross_the_link_as_the_clients_sent_them(node_factory):
    """The pair's link hands bodies over without packing them (broker/local_link.py): every body, big,
    split into frames and across reads, stored or held in memory for a waiting consumer, nacked and
    requeued, from AMQP or MQTT, arrives as the client sent it. The harness's SHARDMQ_TEST_LINK_CHECK
    compares every batch with its packing and looks for changes after the handover (tests/conftest.py
    fails the test on one)."""
    from broker.mqtt import codec as M
    from tests.harness import free_port
    from tests.raw_mqtt import RawMQTT

    node = node_factory(frontends=1, shards=1, extra_args=ON, mqtt_port=free_port())
    paired_pid(node, 0)
    bodies = [b"", b"x", os.urandom(100), os.urandom(4096), os.urandom(70_000), os.urandom(2_000_000), b"last"]
    conn = node.connect(frame_max=4096)  # bodies over 4 KB come in several frames, the big one in many reads
    ch = conn.channel()
    ch.confirm_delivery()

    # Stored: published (persistent ones too) before any consumer, then read back from the store.
    q = uid("stored")
    ch.queue_declare(q, durable=True)
    for i, body in enumerate(bodies):
        ch.basic_publish("", q, body, properties=PERSISTENT if i % 2 else None)
    got = consume_bodies(ch, q, len(bodies), auto_ack=False)
    assert [b for _m, _p, b in got] == bodies
    ch.basic_nack(got[-1][0].delivery_tag, multiple=True, requeue=True)
    again = consume_bodies(ch, q, len(bodies), auto_ack=False, ack=True)
    assert [b for _m, _p, b in again] == bodies and all(m.redelivered for m, _p, _b in again)
    wait_until(lambda: ch.queue_declare(q, passive=True).method.message_count == 0, 10, "acks handled")

    # Held: a consumer waits, so transient messages go to it from memory (shard/queue.py deliver_unstored),
    # each held until acked; nacked, they come back from there.
    q2 = uid("held")
    ch.queue_declare(q2)
    consumer = node.connect()
    cch = consumer.channel()
    cch.basic_qos(prefetch_count=100)
    received: list = []
    cch.basic_consume(q2, lambda _c, m, _p, body: received.append((m, body)))
    for body in bodies:
        ch.basic_publish("", q2, body)
    deadline = time.monotonic() + 15
    while len(received) < len(bodies):
        assert time.monotonic() < deadline, f"{len(received)} of {len(bodies)} delivered"
        consumer.process_data_events(time_limit=0.2)
    assert [b for _m, b in received] == bodies
    cch.basic_nack(received[-1][0].delivery_tag, multiple=True, requeue=True)
    deadline = time.monotonic() + 15
    while len(received) < 2 * len(bodies):
        assert time.monotonic() < deadline, f"{len(received) - len(bodies)} of {len(bodies)} redelivered"
        consumer.process_data_events(time_limit=0.2)
    assert [b for _m, b in received[len(bodies):]] == bodies and all(m.redelivered for m, _b in received[len(bodies):])
    cch.basic_ack(received[-1][0].delivery_tag, multiple=True)
    consumer.close()
    wait_until(lambda: ch.queue_declare(q2, passive=True).method.message_count == 0, 10, "acks handled")

    # MQTT through the pair: a QoS 1 publish (written in two parts) into a queue bound to amq.topic...
    q3 = uid("from-mqtt")
    ch.queue_declare(q3)
    ch.queue_bind(q3, "amq.topic", "link.in")
    payload = os.urandom(300_000)
    pub = RawMQTT(node.mqtt_port)
    pub.connect(uid("pub"))
    packet = M.encode_publish(b"link/in", payload, 1, False, False, 7)
    pub.send(packet[:1000])
    pub.send(packet[1000:])
    ack = pub.recv(10)
    assert isinstance(ack, M.Ack) and ack.type == M.PUBACK and ack.packet_id == 7, ack
    (_m, _p, body), = consume_bodies(ch, q3, 1)
    assert body == payload
    # ...and an AMQP publish to a QoS 1 subscription of a persistent session (a queue on the pair's shard).
    sub = RawMQTT(node.mqtt_port)
    sub.connect(uid("sub"), clean=False)
    assert sub.subscribe(1, [("link/out", 1)]) == [1]
    out = os.urandom(100_000)
    ch.basic_publish("amq.topic", "link.out", out, properties=PERSISTENT)  # persistent: delivered at QoS 1
    delivered = sub.recv(10)
    assert isinstance(delivered, M.Publish) and delivered.payload == out and delivered.qos == 1, delivered
    sub.ack(M.PUBACK, delivered.packet_id)
    pub.disconnect()
    sub.disconnect()
    conn.close()


def wait_connection_lost(conn: pika.BlockingConnection, timeout: float = 15.0) -> BaseException:
    """Serve ``conn`` until it breaks; returns what pika raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn.process_data_events(time_limit=0.2)
        except pika.exceptions.AMQPError as exc:
            return exc
    raise AssertionError(f"the connection stayed open for {timeout} s")


@pytest.mark.parametrize("how", ["pair-frontend-stop", "lone-frontend-kill"])
def test_frontend_stop_signal_cuts_clients_as_a_killed_frontend_does_and_the_pair_restarts(node_factory, how):
    """contract.FRONTEND_STOP_SIGNAL stops a pair's frontend part alone (what a fenced cluster leader
    sends its pairs: tests/test_cluster_pairs.py). Its clients see what a SIGKILLed frontend process
    (``lone-frontend-kill``, --colocate off: what the fence does to a frontend of its own) shows them:
    the connection is cut, no connection.close from the broker. Sent from outside, the node sees the
    frontend part leave while the pair runs on, stops the pair (the shard part cleanly) and restarts it."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from broker.mqtt import codec as M
    from tests.harness import free_port

    paired = how == "pair-frontend-stop"
    node = node_factory(frontends=1, shards=1, extra_args=ON if paired else ["--colocate", "off"],
                        ws_port=free_port())
    q = uid("cut")
    conn = node.connect(heartbeat=0)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"kept", properties=PERSISTENT)
    with connect(f"ws://127.0.0.1:{node.ws_port}/ws", subprotocols=["mqtt"], open_timeout=10) as ws:  # MQTT/WS
        ws.send(M.encode_connect(uid("ws"), username="guest", password=b"guest"))
        assert M.MQTTParser(server=False).feed(ws.recv(timeout=10)) == [M.ConnAck(False, 0)]
        old = node.worker_pid("frontend", 0)
        if paired:
            os.kill(old, FRONTEND_STOP_SIGNAL)
        else:
            node.kill_worker("frontend", 0)
        lost = wait_connection_lost(conn)
        assert isinstance(lost, pika.exceptions.StreamLostError), repr(lost)  # not ConnectionClosedByBroker
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=15)
        assert closed.value.rcvd is None, closed.value  # the TCP connection cut under it: no close frame
    new = node.wait_worker_restarted("frontend", 0, old)
    if paired:
        assert paired_pid(node, 0) == new
        log = node.log_text()
        assert f"frontend 0 (pid {old}) stopped at the node's request" in log, node.log_tail()
        assert "frontend 0 left while its pair" in log, node.log_tail()
        # The shard part stopped cleanly (STOP from the node), after the frontend part.
        assert log.index("stopped at the node's request") < log.index("shard 0 stopped") < log.index(
            "exited with status 0"), node.log_tail()
    node.wait_ready()
    with node.connect() as conn:
        assert conn.channel().queue_declare(q, durable=True, passive=True).method.message_count == 1
