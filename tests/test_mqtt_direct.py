"""Clean MQTT sessions served in the frontend (frontend/mqtt/direct.py): a publish on the same frontend is
written straight to the subscriber's connection. One frontend, so every pair here takes that path.

What the queue did must still hold: the lower of publish and granted QoS, the in-flight window of QoS 1
deliveries with messages beyond it kept in order, no $-topic through a first-level wildcard, a QoS 2
resend delivered once, and a client that does not keep up holds its publishers (nothing lost) until it
stops reading altogether, when it stops holding them.
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest

from broker.mqtt import codec as M
from frontend.mqtt.direct import SLOW_AFTER
from tests.harness import NodeFactory, free_port
from tests.raw_mqtt import RawMQTT

INFLIGHT = 5


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    factory = NodeFactory(tmp_path_factory.mktemp("mqtt_direct"))
    try:
        yield factory(name="node", frontends=1, shards=1, mqtt_port=free_port(),
                      extra_args=["--mqtt-max-inflight", str(INFLIGHT)])
    finally:
        factory.cleanup()


def _t() -> str:
    return f"d{uuid.uuid4().hex[:8]}"


def _client(node, clean: bool = True, name: str | None = None) -> RawMQTT:
    raw = RawMQTT(node.mqtt_port)
    assert raw.connect(name or f"c-{uuid.uuid4().hex[:8]}", clean=clean).return_code == 0
    return raw


def test_qos_is_the_lower_of_publish_and_granted_and_dollar_topics_skip_wildcards(one):
    t = _t()
    sub0, sub1, pub = _client(one), _client(one), _client(one)
    assert sub0.subscribe(1, [("#", 0)]) == [0]
    assert sub1.subscribe(1, [(f"{t}/+", 1)]) == [1]
    pub.publish(f"$sys{t}/x", b"dollar", qos=1, pid=1)  # '#' does not match it [MQTT-4.7.2-1]
    assert pub.recv() == M.Ack(M.PUBACK, 1)
    pub.publish(f"{t}/a", b"one", qos=1, pid=2)
    assert pub.recv() == M.Ack(M.PUBACK, 2)
    pub.publish(f"{t}/a", b"zero", qos=0)
    got0 = [sub0.recv(), sub0.recv()]
    assert [(p.topic, p.payload, p.qos) for p in got0] == [(f"{t}/a", b"one", 0), (f"{t}/a", b"zero", 0)]
    first = sub1.recv()
    assert (first.topic, first.payload, first.qos) == (f"{t}/a", b"one", 1)
    sub1.ack(M.PUBACK, first.packet_id)
    second = sub1.recv()
    assert (second.payload, second.qos) == (b"zero", 0)
    for c in (sub0, sub1, pub):
        c.disconnect()


def test_qos1_beyond_the_in_flight_window_waits_in_order(one):
    t = _t()
    sub, pub = _client(one), _client(one)
    assert sub.subscribe(1, [(t, 1)]) == [1]
    n = 4 * INFLIGHT
    for i in range(n):
        pub.publish(t, b"%d" % i, qos=1, pid=i + 1)
    window = [sub.recv() for _ in range(INFLIGHT)]
    with pytest.raises(AssertionError):  # nothing beyond the window before an acknowledgement
        sub.recv(timeout=0.3)
    got = list(window)
    for p in window:
        sub.ack(M.PUBACK, p.packet_id)
    while len(got) < n:
        p = sub.recv()
        got.append(p)
        sub.ack(M.PUBACK, p.packet_id)
    assert [p.payload for p in got] == [b"%d" % i for i in range(n)]
    assert all(p.qos == 1 for p in got)
    # The publisher was held while messages waited (not read, so some PUBACKs came late), never refused.
    assert sorted(pub.recv().packet_id for _ in range(n)) == list(range(1, n + 1))
    sub.disconnect()
    pub.disconnect()


def test_a_qos2_resend_after_a_reconnect_reaches_a_directly_served_subscriber_once(one):
    t = _t()
    sub = _client(one)
    assert sub.subscribe(1, [(t, 0)]) == [0]
    name = f"p2-{uuid.uuid4().hex[:8]}"
    pub = _client(one, clean=False, name=name)
    pub.publish(t, b"exactly once", qos=2, pid=7)
    assert pub.recv() == M.Ack(M.PUBREC, 7)
    pub.close()  # no PUBREL: the client does not know its PUBREC came, so it sends the PUBLISH again
    pub = _client(one, clean=False, name=name)
    pub.publish(t, b"exactly once", qos=2, pid=7, dup=True)
    assert pub.recv() == M.Ack(M.PUBREC, 7)
    pub.ack(M.PUBREL, 7)
    assert pub.recv() == M.Ack(M.PUBCOMP, 7)
    pub.publish(t, b"marker", qos=0)
    assert [sub.recv().payload, sub.recv().payload] == [b"exactly once", b"marker"]
    pub.disconnect()
    sub.disconnect()


def _slow_subscriber(node, t: str, qos: int) -> RawMQTT:
    raw = RawMQTT.__new__(RawMQTT)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.settimeout(5)
    sock.connect(("127.0.0.1", node.mqtt_port))
    raw.sock, raw.parser, raw.packets = sock, M.MQTTParser(server=False), []
    assert raw.connect(f"slow-{uuid.uuid4().hex[:8]}").return_code == 0
    assert raw.subscribe(1, [(t, qos)]) == [qos]
    return raw


def test_a_subscriber_that_falls_behind_holds_the_publisher_and_loses_nothing(one):
    t = _t()
    sub = _slow_subscriber(one, t, 0)
    pub = _client(one)
    n = 40_000  # ~1 MB of QoS 0 PUBLISH packets at once: far more than the subscriber's window
    pub.send(b"".join(M.encode_publish(t.encode(), b"%06d" % i) for i in range(n)))
    pub.publish(t, b"end", qos=1, pid=1)
    got = []
    while len(got) < n + 1:
        got.append(sub.recv().payload)
    assert got == [b"%06d" % i for i in range(n)] + [b"end"]
    assert pub.recv() == M.Ack(M.PUBACK, 1)
    sub.disconnect()
    pub.disconnect()


def test_a_subscriber_that_stops_reading_holds_publishers_only_for_a_while(one):
    t = _t()
    stuck = _slow_subscriber(one, t, 0)
    pub = _client(one)
    burst = b"".join(M.encode_publish(t.encode(), b"x" * 100) for _ in range(80_000))  # ~9 MB
    pub.sock.settimeout(60)
    started = time.monotonic()
    pub.send(burst)  # completes once the frontend reads the publisher again
    pub.publish(t, b"end", qos=1, pid=1)
    assert pub.recv(timeout=30) == M.Ack(M.PUBACK, 1)
    held = time.monotonic() - started
    assert held >= SLOW_AFTER * 0.9, f"the publisher was not held ({held:.1f}s)"
    stuck.close()
    # The publisher goes on at full speed once the stuck client no longer holds it.
    pub.publish(t, b"after", qos=1, pid=2)
    assert pub.recv(timeout=10) == M.Ack(M.PUBACK, 2)
    pub.disconnect()


def test_a_session_publishing_to_its_own_qos1_subscription_beyond_the_window_is_not_held(one):
    """A connection is never held while it has subscriptions: it must be read for its acknowledgements."""
    t = _t()
    me = _client(one)
    assert me.subscribe(1, [(t, 1)]) == [1]
    n = 4 * INFLIGHT
    for i in range(n):
        me.publish(t, b"%d" % i, qos=1, pid=i + 1)
    got, pubacks = [], 0
    while len(got) < n or pubacks < n:
        p = me.recv(timeout=3)  # a held connection would wait for the stuck-client timer (5-10 s)
        if isinstance(p, M.Ack):
            assert p.type == M.PUBACK
            pubacks += 1
        else:
            got.append(p.payload)
            me.ack(M.PUBACK, p.packet_id)
    assert got == [b"%d" % i for i in range(n)]
    me.disconnect()
