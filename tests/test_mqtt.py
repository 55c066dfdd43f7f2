"""MQTT 3.1.1 against a real node: paho-mqtt and aiomqtt clients, raw packets for the error paths."""

from __future__ import annotations

import asyncio
import queue
import time
import uuid

import aiomqtt
import paho.mqtt.client as mqtt
import pika
import pytest

from broker.mqtt import codec as M
from tests.harness import NodeFactory, free_port
from tests.raw_mqtt import RawMQTT

WAIT = 10.0


@pytest.fixture(scope="module")
def mq(tmp_path_factory):
    factory = NodeFactory(tmp_path_factory.mktemp("mqtt_node"))
    try:
        yield factory(name="node", frontends=2, shards=2, mqtt_port=free_port(),
                      extra_args=["--mqtt-max-packet-size", "65536", "--mqtt-max-inflight", "100"])
    finally:
        factory.cleanup()


def cid(prefix: str = "c") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def topic(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


class Paho:
    """A paho-mqtt client on its network thread, collecting (topic, payload, qos, retain)."""

    def __init__(self, port: int, client_id: str | None = None, clean: bool = True, user: str = "guest",
                 will: tuple | None = None, keepalive: int = 30) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.connack: queue.Queue = queue.Queue()
        self.disconnects: queue.Queue = queue.Queue()
        c = self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or cid(),
                                      clean_session=clean, protocol=mqtt.MQTTv311)
        c.username_pw_set(user, "guest")
        if will is not None:
            c.will_set(*will)
        c.on_message = lambda _c, _u, m: self.messages.put((m.topic, m.payload, m.qos, m.retain))
        c.on_connect = lambda _c, _u, flags, rc, _p: self.connack.put((flags.session_present, rc.value))
        c.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc)
        c.connect("127.0.0.1", port, keepalive)
        c.loop_start()
        self.session_present, self.rc = self.connack.get(timeout=WAIT)

    def subscribe(self, *topics: tuple[str, int]) -> list[int]:
        done: queue.Queue = queue.Queue()
        self.client.on_subscribe = lambda _c, _u, _mid, codes, _p: done.put([c.value for c in codes])
        self.client.subscribe(list(topics))
        return done.get(timeout=WAIT)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain).wait_for_publish(WAIT)

    def get(self, timeout: float = WAIT):
        return self.messages.get(timeout=timeout)

    def nothing_more(self, marker_topic: str, publisher: Paho) -> None:
        """Publish a marker and check that it is the next message: nothing else was on its way."""
        publisher.publish(marker_topic, b"marker", qos=1)
        assert self.get()[:2] == (marker_topic, b"marker")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def clients(mq):
    made: list[Paho] = []

    def make(**kw) -> Paho:
        p = Paho(mq.mqtt_port, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        try:
            p.close()
        except Exception:
            pass


# ------------------------------------------------------------------ publish / subscribe
def test_publish_subscribe_at_each_qos_gets_the_lower_of_publish_and_granted_qos(clients):
    t = topic()
    sub = clients()
    assert sub.subscribe((f"{t}/q0", 0), (f"{t}/q1", 1), (f"{t}/q2", 2)) == [0, 1, 2]
    pub = clients()
    for sub_qos in (0, 1, 2):
        for pub_qos in (0, 1, 2):
            pub.publish(f"{t}/q{sub_qos}", b"%d%d" % (sub_qos, pub_qos), qos=pub_qos)
            got = sub.get()
            assert got == (f"{t}/q{sub_qos}", b"%d%d" % (sub_qos, pub_qos), min(sub_qos, pub_qos), False)


def test_overlapping_subscriptions_deliver_one_copy_at_the_highest_qos(clients):
    t = topic()
    sub = clients()
    assert sub.subscribe((f"{t}/+", 0), (f"{t}/#", 2), (f"{t}/a", 1)) == [0, 2, 1]
    pub = clients()
    pub.publish(f"{t}/a", b"x", qos=2)
    assert sub.get() == (f"{t}/a", b"x", 2, False)
    sub.nothing_more(f"{t}/a", pub)


def test_wildcards_and_dollar_topics(clients):
    t = topic()
    sub = clients()
    sub.subscribe(("#", 0), (f"+/{t}", 0))
    dollar = clients()
    dollar.subscribe((f"$SYS/{t}/#", 1))
    pub = clients()
    pub.publish(f"$SYS/{t}/x", b"sys", qos=1)
    assert dollar.get() == (f"$SYS/{t}/x", b"sys", 1, False)
    pub.publish(f"$other/{t}", b"nope", qos=1)
    pub.publish(f"a/{t}", b"yes", qos=1)
    # '#' and '+/t' match a/t once; $-topics are not matched by a first-level wildcard [MQTT-4.7.2-1]
    got = [sub.get() for _ in range(1)]
    assert got == [(f"a/{t}", b"yes", 0, False)]
    sub.nothing_more(f"z/{t}", pub)


def test_unsubscribe_stops_deliveries(clients):
    t = topic()
    sub = clients()
    sub.subscribe((f"{t}/a", 1), (f"{t}/b", 1))
    done: queue.Queue = queue.Queue()
    sub.client.on_unsubscribe = lambda *a: done.put(True)
    sub.client.unsubscribe(f"{t}/a")
    done.get(timeout=WAIT)
    pub = clients()
    pub.publish(f"{t}/a", b"gone", qos=1)
    pub.publish(f"{t}/b", b"kept", qos=1)
    assert sub.get()[:2] == (f"{t}/b", b"kept")


def test_aiomqtt_round_trip(mq):
    t = topic()

    async def main() -> list:
        async with aiomqtt.Client("127.0.0.1", mq.mqtt_port, username="guest", password="guest",
                                  identifier=cid("aio")) as client:
            await client.subscribe(f"{t}/#", qos=1)
            for i in range(5):
                await client.publish(f"{t}/{i}", b"m%d" % i, qos=1)
            got = []
            async with asyncio.timeout(WAIT):
                async for message in client.messages:
                    got.append((str(message.topic), message.payload, message.qos))
                    if len(got) == 5:
                        break
            return got

    assert asyncio.run(main()) == [(f"{t}/{i}", b"m%d" % i, 1) for i in range(5)]


def test_paho_manual_loop_without_a_network_thread(mq):
    """paho's synchronous loop() driven by hand, the other way of running it."""
    t = topic()
    got = []
    subscribed = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid(), protocol=mqtt.MQTTv311)
    c.username_pw_set("guest", "guest")
    c.on_message = lambda _c, _u, m: got.append(m.payload)
    c.on_subscribe = lambda *_a: subscribed.append(True)
    c.on_connect = lambda *_a: c.subscribe(t, 2)
    c.connect("127.0.0.1", mq.mqtt_port)
    deadline = time.monotonic() + WAIT
    published = False
    while len(got) < 3 and time.monotonic() < deadline:
        c.loop(0.05)
        if subscribed and not published:
            published = True
            for i in range(3):
                c.publish(t, b"p%d" % i, qos=2)
    c.disconnect()
    assert got == [b"p0", b"p1", b"p2"]


# ------------------------------------------------------------------ interop with AMQP
def test_mqtt_and_amqp_interoperate_through_amq_topic(mq, clients):
    t = topic()
    conn = pika.BlockingConnection(pika.URLParameters(mq.url))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(q, "amq.topic", f"{t}.*.c")
        pub = clients()
        pub.publish(f"{t}/b/c", b"from mqtt", qos=1)
        for _ in range(100):
            method, props, body = ch.basic_get(q, auto_ack=True)
            if method is not None:
                break
            time.sleep(0.05)
        assert (method.routing_key, body, props.delivery_mode) == (f"{t}.b.c", b"from mqtt", 2)
        sub = clients()
        sub.subscribe((f"{t}/+/x", 2))
        ch.basic_publish("amq.topic", f"{t}.y.x", b"persistent", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("amq.topic", f"{t}.y.x", b"transient")
        assert sub.get() == (f"{t}/y/x", b"persistent", 1, False)
        assert sub.get() == (f"{t}/y/x", b"transient", 0, False)
    finally:
        conn.close()


# ------------------------------------------------------------------ retained
def test_retained_message_is_delivered_on_subscribe_replaced_and_deleted(clients):
    t = topic()
    pub = clients()
    pub.publish(f"{t}/r", b"first", qos=1, retain=True)
    pub.publish(f"{t}/r", b"second", qos=1, retain=True)
    pub.publish(f"{t}/s", b"other", qos=0, retain=True)
    sub = clients()
    sub.subscribe((f"{t}/r", 2))
    assert sub.get() == (f"{t}/r", b"second", 1, True)
    sub2 = clients()
    sub2.subscribe((f"{t}/+", 1))
    assert sorted([sub2.get(), sub2.get()]) == [(f"{t}/r", b"second", 1, True), (f"{t}/s", b"other", 0, True)]
    # live subscribers get it with retain 0 [MQTT-3.3.1-9]; an empty retained payload deletes
    pub.publish(f"{t}/r", b"", qos=1, retain=True)
    assert sub.get() == (f"{t}/r", b"", 1, False)
    sub3 = clients()
    sub3.subscribe((f"{t}/#", 1))
    assert sub3.get() == (f"{t}/s", b"other", 0, True)
    sub3.nothing_more(f"{t}/end", pub)


# ------------------------------------------------------------------ wills, keep-alive, takeover
def test_will_is_published_when_the_socket_drops_but_not_after_disconnect(mq, clients):
    t = topic()
    watcher = clients()
    watcher.subscribe((f"{t}/#", 1))
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid(), will=M.Publish(f"{t}/will", b"gone", 1, False)).return_code == 0
    raw.close()
    assert watcher.get() == (f"{t}/will", b"gone", 1, False)
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid(), will=M.Publish(f"{t}/will", b"not sent", 1, False)).return_code == 0
    raw.disconnect()
    pub = clients()
    watcher.nothing_more(f"{t}/marker", pub)


def test_keep_alive_timeout_closes_and_publishes_the_will(mq, clients):
    t = topic()
    watcher = clients()
    watcher.subscribe((f"{t}/#", 1))
    raw = RawMQTT(mq.mqtt_port)
    start = time.monotonic()
    assert raw.connect(cid(), keep_alive=1, will=M.Publish(f"{t}/will", b"timeout", 0, True)).return_code == 0
    assert raw.closed_by_server(timeout=6)
    assert 1.4 <= time.monotonic() - start < 4.5  # 1.5 x keep-alive [MQTT-3.1.2-24]
    assert watcher.get() == (f"{t}/will", b"timeout", 0, False)
    late = clients()
    late.subscribe((f"{t}/will", 0))
    assert late.get() == (f"{t}/will", b"timeout", 0, True)  # the will was retained


def test_keep_alive_is_kept_by_pings(mq):
    """Pings every 0.2 s hold a 2 s keep-alive open past its 3 s limit (1.5 x keep-alive), which closes a
    silent connection (test above): only a 2.8 s stall between two pings could close this one."""
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid(), keep_alive=2).return_code == 0
    start = time.monotonic()
    while time.monotonic() - start < 4.0:  # past the broker's first check at 3 s, with 1 s to spare
        time.sleep(0.2)
        raw.send(bytes((M.PINGREQ << 4, 0)))
        assert raw.recv() == M.Simple(M.PINGRESP)
    raw.disconnect()


def _frontend_of(node, raw: RawMQTT, client_id: str) -> str:
    """Which frontend logged this connection's CONNECT (SO_REUSEPORT picks one)."""
    needle = f"('127.0.0.1', {raw.sock.getsockname()[1]})): client '{client_id}'"
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        for line in node.log_text().splitlines():
            if needle in line:
                return line.split("[", 1)[1].split("]", 1)[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line for {needle}")


def test_second_connection_with_the_same_client_id_takes_over(mq, clients):
    """On the same frontend and across frontends (the takeover is forwarded through the node)."""
    t = topic()
    watcher = clients()
    watcher.subscribe((f"{t}/#", 1))
    name = cid("dup")
    old = RawMQTT(mq.mqtt_port)
    assert old.connect(name, will=M.Publish(f"{t}/will", b"taken over 0", 1, False)).return_code == 0
    old_fe = _frontend_of(mq, old, name)
    seen = set()
    for i in range(1, 30):
        new = RawMQTT(mq.mqtt_port)
        assert new.connect(name, will=M.Publish(f"{t}/will", b"taken over %d" % i, 1, False)).return_code == 0
        new_fe = _frontend_of(mq, new, name)
        assert old.closed_by_server()
        assert watcher.get() == (f"{t}/will", b"taken over %d" % (i - 1), 1, False)
        seen.add(old_fe == new_fe)
        old, old_fe = new, new_fe
        if seen == {True, False}:
            break
    assert seen == {True, False}
    old.send(bytes((M.PINGREQ << 4, 0)))
    assert old.recv() == M.Simple(M.PINGRESP)
    old.disconnect()


# ------------------------------------------------------------------ CONNECT validation and errors
def test_connack_return_codes(mq):
    cases = [
        (dict(protocol_level=3), M.REFUSED_PROTOCOL_VERSION),
        (dict(clean=False, client_id=""), M.REFUSED_IDENTIFIER),
        (dict(password=b"wrong"), M.REFUSED_BAD_CREDENTIALS),
        (dict(username="nobody"), M.REFUSED_BAD_CREDENTIALS),
        (dict(username="no-such-vhost:guest"), M.REFUSED_NOT_AUTHORIZED),
        (dict(username=None, password=None), M.REFUSED_NOT_AUTHORIZED),
    ]
    for kw, code in cases:
        raw = RawMQTT(mq.mqtt_port)
        kw.setdefault("client_id", cid())
        ack = raw.connect(**kw)
        assert (ack.session_present, ack.return_code) == (False, code), kw
        assert raw.closed_by_server(), kw
    raw = RawMQTT(mq.mqtt_port)
    ack = raw.connect("", clean=True, username="/:guest")  # empty id with clean session: assigned
    assert ack.return_code == 0
    raw.disconnect()


@pytest.mark.parametrize("packet", [
    M.encode_connect("x", protocol_name="AMQP"),  # unknown protocol name: no CONNACK [MQTT-3.1.2-1]
    M.encode_connect("x", reserved=True),  # reserved flag [MQTT-3.1.2-3]
    M.encode_subscribe(1, [("a", 0)]),  # first packet not CONNECT
    bytes((0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F)),  # remaining length of 5 bytes
    bytes((0xF0, 0)),  # reserved packet type 15
], ids=["protocol-name", "reserved-flag", "not-connect-first", "length-too-long", "type-15"])
def test_malformed_or_early_packets_close_without_connack(mq, packet):
    raw = RawMQTT(mq.mqtt_port)
    raw.send(packet)
    assert raw.closed_by_server()
    assert raw.packets == []


@pytest.mark.parametrize("packet", [
    M.encode_connect("again"),  # second CONNECT [MQTT-3.1.0-2]
    M.encode_publish(b"a/+", b"x"),  # wildcard in a topic name [MQTT-3.3.2-2]
    bytes((0x36, 5, 0, 1, 0x61, 0, 1)),  # PUBLISH QoS 3
    bytes((0x38, 3, 0, 1, 0x61)),  # DUP on QoS 0
    bytes((0x82, 2, 0, 1)),  # SUBSCRIBE without a filter
    bytes((0x80, 6, 0, 1, 0, 1, 0x61, 0)),  # SUBSCRIBE with wrong fixed-header flags
    bytes((0x62, 2, 0, 1))[:1] + bytes((3, 0, 1, 0)),  # PUBREL with a wrong length
    M.encode_publish(b"a\xff", b"x"),  # topic that is not UTF-8
    M.encode_publish(b"big", b"x" * 70000),  # above --mqtt-max-packet-size
], ids=["second-connect", "wildcard-topic", "qos3", "dup-qos0", "empty-subscribe", "subscribe-flags",
        "pubrel-length", "bad-utf8", "too-big"])
def test_protocol_errors_after_connect_close_that_connection_only(mq, clients, packet):
    t = topic()
    watcher = clients()
    watcher.subscribe((f"{t}/#", 0))
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid(), will=M.Publish(f"{t}/will", b"broken", 0, False)).return_code == 0
    raw.send(packet)
    assert raw.closed_by_server()
    assert watcher.get() == (f"{t}/will", b"broken", 0, False)  # an error is not a DISCONNECT
    pub = clients()
    watcher.nothing_more(f"{t}/still-fine", pub)


def test_anonymous_login_only_when_configured(node_factory):
    node = node_factory(name="anon", frontends=1, shards=1, mqtt_port=free_port(),
                        extra_args=["--mqtt-allow-anonymous", "1"])
    raw = RawMQTT(node.mqtt_port)
    assert raw.connect(cid(), username=None, password=None).return_code == 0  # as --default-user
    assert raw.subscribe(1, [("anon/#", 0)]) == [0]
    raw.disconnect()
    raw = RawMQTT(node.mqtt_port)
    assert raw.connect(cid(), password=b"wrong").return_code == M.REFUSED_BAD_CREDENTIALS  # names still checked
    raw.close()


def test_invalid_filters_are_refused_in_suback_and_valid_ones_granted(mq):
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid()).return_code == 0
    codes = raw.subscribe(1, [("a/#/b", 1), ("ok/+", 2), ("a+", 0), ("#", 1), ("", 0)])
    assert codes == [0x80, 2, 0x80, 1, 0x80]
    raw.disconnect()


# ------------------------------------------------------------------ persistent sessions
def test_persistent_session_keeps_subscriptions_and_queues_messages_while_away(mq, clients):
    t = topic()
    name = cid("persist")
    sub = clients(client_id=name, clean=False)
    assert sub.session_present is False
    sub.subscribe((f"{t}/q1", 1), (f"{t}/q0", 0))
    sub.close()
    pub = clients()
    for i in range(5):
        pub.publish(f"{t}/q1", b"%d" % i, qos=1)
    back = clients(client_id=name, clean=False)
    assert back.session_present is True
    assert [back.get()[1] for _ in range(5)] == [b"%d" % i for i in range(5)]
    back.close()
    clean = clients(client_id=name, clean=True)  # discards the session [MQTT-3.1.2-6]
    assert clean.session_present is False
    clean.close()
    again = clients(client_id=name, clean=False)
    assert again.session_present is False
    again.subscribe((f"{t}/marker", 1))
    pub.publish(f"{t}/q1", b"after clean", qos=1)  # the old subscription is gone with the session
    again.nothing_more(f"{t}/marker", pub)


def test_max_inflight_bounds_unacknowledged_deliveries(mq, clients):
    """A raw subscriber that never acknowledges gets at most --mqtt-max-inflight (100) QoS 1 messages."""
    t = topic()
    raw = RawMQTT(mq.mqtt_port)
    assert raw.connect(cid()).return_code == 0
    assert raw.subscribe(1, [(t, 1)]) == [1]
    pub = clients()
    for i in range(150):
        pub.client.publish(t, b"%d" % i, qos=1)
    pub.publish(t, b"last", qos=1)
    got = []
    while True:
        try:
            got.append(raw.recv(timeout=1.0))
        except AssertionError:
            break
    assert len(got) == 100
    raw.ack(M.PUBACK, got[0].packet_id)
    assert raw.recv().payload == b"100"
    raw.disconnect()
