"""The definitions fence (broker/defs_fence.py): bind-ok without waiting for the workers' APPLIED.

Frontend 1 and both shards of this module's node hold what they read on their control plane 300 ms
before handling it (the test-only SHARDMQ_TEST_CONTROL_DELAY_MS), as workers the scheduler does not
run for a while; frontend 0 does not, so what a client asks there is answered at once. The node
answers binds, unbinds and exchange declares/deletes without waiting for the workers, so only the
fence makes a late worker apply them before it acts on its next input: a publish on frontend 1 right
after bind-ok on frontend 0 (AMQP, MQTT, MQTT over WebSocket, a binding made over the HTTP API), a
dead letter (by a reject from frontend 1, and by TTL, which no input triggers), binds while frontend 1
restarts. Without the fence each of these tests but the first fails (checked by disabling
catch_up_defs): the late worker would still route with the definitions of 300 ms ago.
"""

from __future__ import annotations

import contextlib
import os
import time

import pika
import pytest

from broker.mqtt import codec as M
from tests.conftest import module_node_args
from tests.harness import NodeFactory, free_port
from tests.helpers import get_one, uid
from tests.mgmt_api import Api
from tests.test_feature_dlx import uid_on
from tests.test_mqtt import Paho, topic
from tests.test_ws import WSMQTT, ws_connect

QUEUE_PLACEMENT = "hash"  # uid_on picks names by their crc32 (tests/conftest.py)
DELAY_MS = 300
WAIT = 10.0


@pytest.fixture(scope="module")
def fenced_node(tmp_path_factory, request):
    factory = NodeFactory(tmp_path_factory.mktemp("fence_node"), module_node_args(request.module))
    try:
        yield factory(name="node", frontends=2, shards=2, mqtt_port=free_port(), ws_port=free_port(),
                      env={"SHARDMQ_TEST_CONTROL_DELAY_MS": f"fe-1:{DELAY_MS},shard:{DELAY_MS}"})
    finally:
        factory.cleanup()


def _amqp_on(node, frontend: int, attempts: int = 40) -> pika.BlockingConnection:
    """A pika connection served by that frontend process (SO_REUSEPORT spreads them)."""
    for _ in range(attempts):
        conn = node.connect()
        if conn._impl.server_properties["shardmq_frontend"] == frontend:
            return conn
        conn.close()
    pytest.fail(f"{attempts} connections, none on frontend {frontend}")


def _frontend_of(node, server_port: int, client_port: int) -> int:
    """The index of the frontend process holding the server end of a local TCP connection."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
                inode = fields[9]
    assert inode is not None, f"no server end of 127.0.0.1:{client_port} -> {server_port}"
    for index, pid in node.pids()["frontend"].items():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(index)
            except OSError:
                continue
    pytest.fail(f"no frontend holds socket inode {inode}")


def _mqtt_on(node, frontend: int, attempts: int = 40) -> Paho:
    for _ in range(attempts):
        client = Paho(node.mqtt_port)
        if _frontend_of(node, node.mqtt_port, client.client.socket().getsockname()[1]) == frontend:
            return client
        client.close()
    pytest.fail(f"{attempts} MQTT connections, none on frontend {frontend}")


def test_the_control_delay_is_in_effect(fenced_node):
    """What makes the other tests mean something: a queue.declare, which still waits for every
    other worker's APPLIED, takes the late workers' delay."""
    conn = _amqp_on(fenced_node, 0)
    try:
        ch = conn.channel()
        start = time.monotonic()
        q = ch.queue_declare(uid("fdelay")).method.queue
        assert time.monotonic() - start >= DELAY_MS / 1000 * 0.9
        ch.queue_delete(q)
    finally:
        conn.close()


def test_publish_on_the_late_frontend_right_after_bind_ok_and_unbind_ok(fenced_node):
    a, b = _amqp_on(fenced_node, 0), _amqp_on(fenced_node, 1)
    try:
        binder = a.channel()
        publisher = b.channel()
        publisher.confirm_delivery()
        x = uid("fx")
        binder.exchange_declare(x, "direct")
        q = binder.queue_declare(uid("fq")).method.queue
        for i in range(5):
            key = f"k{i}"
            binder.queue_bind(q, x, key)
            # mandatory + confirms: an unroutable publish raises UnroutableError here.
            publisher.basic_publish(x, key, b"m%d" % i, mandatory=True)
            assert get_one(binder, q)[2] == b"m%d" % i
            binder.queue_unbind(q, x, key)
            with pytest.raises(pika.exceptions.UnroutableError):
                publisher.basic_publish(x, key, b"after unbind", mandatory=True)
        # An exchange declared on frontend 0 exists on frontend 1 at once (no 404), and a deleted one
        # is gone at once.
        for _ in range(3):
            x2 = uid("fx2")
            binder.exchange_declare(x2, "fanout")
            with pytest.raises(pika.exceptions.UnroutableError):
                publisher.basic_publish(x2, "", b"nobody bound", mandatory=True)
            binder.exchange_delete(x2)
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
                publisher.basic_publish(x2, "", b"deleted", mandatory=True)
            assert closed.value.reply_code == 404
            publisher = b.channel()
            publisher.confirm_delivery()
        binder.queue_delete(q)
        binder.exchange_delete(x)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("source_shard", [0, 1])
def test_reject_right_after_bind_ok_dead_letters_through_the_binding(fenced_node, source_shard):
    a, b = _amqp_on(fenced_node, 0), _amqp_on(fenced_node, 1)
    try:
        binder = a.channel()
        consumer = b.channel()
        dlx = uid("fdlx")
        binder.exchange_declare(dlx, "direct")
        dlq = binder.queue_declare(uid_on(1 - source_shard, "fdlq")).method.queue
        src = binder.queue_declare(uid_on(source_shard, "fsrc"),
                                   arguments={"x-dead-letter-exchange": dlx,
                                              "x-dead-letter-routing-key": "dl"}).method.queue
        for n in range(3):
            consumer.basic_publish("", src, b"r%d" % n)
            method = get_one(consumer, src, auto_ack=False)[0]
            binder.queue_bind(dlq, dlx, "dl")
            # The reject reaches the source's shard (late) right after bind-ok.
            consumer.basic_reject(method.delivery_tag, requeue=False)
            assert get_one(binder, dlq)[2] == b"r%d" % n
            binder.queue_unbind(dlq, dlx, "dl")
        binder.queue_delete(src)
        binder.queue_delete(dlq)
        binder.exchange_delete(dlx)
    finally:
        a.close()
        b.close()


def test_ttl_dead_letter_right_after_bind_ok_routes_through_the_binding(fenced_node):
    """A message expiring 200 ms after it was stored, bound to its dead-letter queue just after: the
    shard dead-letters it from a timer, no input of anyone wakes it, and its control plane holds
    the binding 300 ms. The fence check before the dead letter is routed applies it."""
    ttl_ms = 200
    conn = _amqp_on(fenced_node, 0)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        dlx = uid("fttlx")
        ch.exchange_declare(dlx, "direct")
        dlq = ch.queue_declare(uid_on(1, "fttldlq")).method.queue
        src = ch.queue_declare(uid_on(0, "fttlsrc"),
                               arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dl"}
                               ).method.queue
        checked = 0
        for n in range(6):
            stored = time.monotonic()
            ch.basic_publish("", src, b"t%d" % n, pika.BasicProperties(expiration=str(ttl_ms)))
            ch.queue_bind(dlq, dlx, "dl")
            if time.monotonic() - stored < ttl_ms / 1000 * 0.75:
                # bind-ok came well before the expiry: the dead letter must go through the binding.
                assert get_one(ch, dlq)[2] == b"t%d" % n
                checked += 1
            else:
                # A crowded machine answered too late to tell: the message may have expired before the
                # bind. Drain it (if it was routed) and try again.
                time.sleep(ttl_ms / 1000)
                ch.queue_purge(dlq)
            ch.queue_unbind(dlq, dlx, "dl")
            if checked >= 3:
                break
        assert checked >= 1, "every bind-ok came later than the message's TTL: nothing was checked"
        ch.queue_delete(src)
        ch.queue_delete(dlq)
        ch.exchange_delete(dlx)
    finally:
        conn.close()


def test_mqtt_publish_on_the_late_frontend_right_after_suback(fenced_node):
    sub, pub = _mqtt_on(fenced_node, 0), _mqtt_on(fenced_node, 1)
    try:
        for i in range(3):
            t = topic("fence/")
            assert sub.subscribe((t, 1)) == [1]
            pub.publish(t, b"p%d" % i, qos=1)
            assert sub.get(timeout=WAIT)[:2] == (t, b"p%d" % i)
    finally:
        sub.close()
        pub.close()


def test_mqtt_over_websocket_publish_on_the_late_frontend_right_after_suback(fenced_node):
    """A WebSocket connection's input goes through the same session data_received: fenced too."""
    sub = _mqtt_on(fenced_node, 0)
    for _ in range(40):
        opened = contextlib.ExitStack()  # websockets wants its connections entered as a context
        ws = opened.enter_context(ws_connect(fenced_node.ws_port))
        if _frontend_of(fenced_node, fenced_node.ws_port, ws.socket.getsockname()[1]) == 1:
            break
        opened.close()
    else:
        pytest.fail("40 WebSocket connections, none on frontend 1")
    try:
        w = WSMQTT(ws)
        w.send(M.encode_connect(uid("fws"), username="guest", password=b"guest"))
        assert w.recv() == M.ConnAck(False, 0)
        for i in range(3):
            t = topic("fencews/")
            assert sub.subscribe((t, 1)) == [1]
            w.send(M.encode_publish(t.encode(), b"w%d" % i))
            assert sub.get(timeout=WAIT)[:2] == (t, b"w%d" % i)
        w.send(bytes((M.DISCONNECT << 4, 0)))
    finally:
        opened.close()
        sub.close()


def test_a_binding_made_over_the_http_api_routes_on_the_late_frontend_at_once(fenced_node):
    """The management API's binds take the node's other path (Node._commit, fenced): the same promise."""
    api = Api(fenced_node.http_port)
    b = _amqp_on(fenced_node, 1)
    try:
        publisher = b.channel()
        publisher.confirm_delivery()
        x = uid("fhx")
        publisher.exchange_declare(x, "direct")
        q = publisher.queue_declare(uid("fhq")).method.queue
        for i in range(3):
            status, _ = api.call("POST", f"/api/bindings/%2F/e/{x}/q/{q}", {"routing_key": f"h{i}"})
            assert status == 201
            publisher.basic_publish(x, f"h{i}", b"h%d" % i, mandatory=True)
            assert get_one(publisher, q)[2] == b"h%d" % i
            api.delete(f"/api/bindings/%2F/e/{x}/q/{q}/h{i}")
            with pytest.raises(pika.exceptions.UnroutableError):
                publisher.basic_publish(x, f"h{i}", b"after unbind", mandatory=True)
        publisher.queue_delete(q)
        publisher.exchange_delete(x)
    finally:
        b.close()


def test_binds_while_the_late_frontend_restarts_route_on_it_once_it_is_back(fenced_node):
    """Binds made while frontend 1 is down, starting (its SNAPSHOT sent and, by the delay, not
    applied for 300 ms: those binds wait for its APPLIED, as before the fence) and up again: a
    publish on it afterwards routes through every one of them, and none after the unbinds."""
    a = _amqp_on(fenced_node, 0)
    try:
        ch = a.channel()
        x = uid("frx")
        ch.exchange_declare(x, "direct")
        q = ch.queue_declare(uid("frq")).method.queue
        old = fenced_node.kill_worker("frontend", 1)
        keys: list[str] = []

        def bind() -> None:
            key = f"r{len(keys)}"
            ch.queue_bind(q, x, key)
            keys.append(key)

        bind()  # frontend 1 down (or not yet noticed)
        fenced_node.wait_worker_restarted("frontend", 1, old)
        back: list[pika.BlockingConnection] = []
        deadline = time.monotonic() + WAIT
        while not back:
            bind()  # frontend 1 starting: interpreter, HELLO, its SNAPSHOT held 300 ms
            assert time.monotonic() < deadline, "frontend 1 did not listen again"
            conn = fenced_node.connect()
            if conn._impl.server_properties["shardmq_frontend"] == 1:
                back.append(conn)
            else:
                conn.close()
        b = back[0]
        try:
            bind()  # frontend 1 up
            publisher = b.channel()
            publisher.confirm_delivery()
            for key in keys:
                publisher.basic_publish(x, key, key.encode(), mandatory=True)
            assert sorted(get_one(ch, q)[2] for _ in keys) == sorted(k.encode() for k in keys)
            for key in keys:
                ch.queue_unbind(q, x, key)
            for key in keys:
                with pytest.raises(pika.exceptions.UnroutableError):
                    publisher.basic_publish(x, key, b"after unbind", mandatory=True)
        finally:
            b.close()
        ch.queue_delete(q)
        ch.exchange_delete(x)
    finally:
        a.close()
