"""MQTT under the broker's permissions, as RabbitMQ's MQTT plugin: publish needs write on amq.topic (and topic
write on the routing key), subscribe needs configure/write/read on the session queue and read on amq.topic."""

from __future__ import annotations

import time

import pytest

from broker.mqtt import codec as M
from tests.harness import free_port
from tests.mgmt_api import Api, q
from tests.raw_mqtt import RawMQTT

pytestmark = pytest.mark.integration

SESSION_QUEUES = "^mqtt-subscription-"


@pytest.fixture(scope="module")
def pnode(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("mqtt_perm_node"))
    try:
        node = factory(name="node", frontends=2, shards=2, mqtt_port=free_port())
        api = Api(node.http_port)
        api.add_user("reader", "pw", perms=(SESSION_QUEUES, SESSION_QUEUES, f"{SESSION_QUEUES}|^amq\\.topic$"))
        api.add_user("writer", "pw", perms=("^$", "^amq\\.topic$", "^$"))
        api.add_user("topical", "pw")
        api.put(f"/api/topic-permissions/{q('/')}/topical",
                {"exchange": "amq.topic", "write": "^{username}\\.", "read": "^public\\."})
        yield node
    finally:
        factory.cleanup()


def _client(node, user: str, client_id: str, clean: bool = True) -> tuple[RawMQTT, int]:
    raw = RawMQTT(node.mqtt_port)
    return raw, raw.connect(client_id, clean=clean, username=user, password=b"pw").return_code


def test_a_reader_subscribes_but_a_publish_closes_its_connection(pnode):
    guest = RawMQTT(pnode.mqtt_port)
    assert guest.connect("guest-pub").return_code == 0
    reader, rc = _client(pnode, "reader", "r1")
    assert rc == 0
    assert reader.subscribe(1, [("news/#", 1)]) == [1]
    guest.publish("news/a", b"for readers", qos=1, pid=1)
    assert guest.recv() == M.Ack(M.PUBACK, 1)
    p = reader.recv()
    assert (p.topic, p.payload) == ("news/a", b"for readers")
    reader.ack(M.PUBACK, p.packet_id)
    reader.publish("news/b", b"not allowed", qos=1, pid=2)
    assert reader.closed_by_server()
    assert reader.packets == []  # no PUBACK for the refused publish
    guest.disconnect()


def test_a_writer_publishes_but_gets_0x80_for_subscriptions(pnode):
    writer, rc = _client(pnode, "writer", "w1")
    assert rc == 0
    writer.publish("news/c", b"allowed", qos=1, pid=1)
    assert writer.recv() == M.Ack(M.PUBACK, 1)
    assert writer.subscribe(2, [("news/#", 1), ("other", 0)]) == [0x80, 0x80]  # no configure on its queue
    writer.disconnect()
    _raw, rc = _client(pnode, "writer", "w2", clean=False)  # a persistent session needs its durable queue
    assert rc == M.REFUSED_NOT_AUTHORIZED


def test_topic_permissions_apply_to_mqtt_topics(pnode):
    topical, rc = _client(pnode, "topical", "t1")
    assert rc == 0
    # binding key public.# matches read; private/# does not
    assert topical.subscribe(1, [("public/#", 0), ("private/#", 0)]) == [0, 0x80]
    topical.publish("topical/x", b"own prefix", qos=1, pid=3)  # routing key topical.x matches write
    assert topical.recv() == M.Ack(M.PUBACK, 3)
    topical.publish("other/x", b"refused", qos=1, pid=4)
    assert topical.closed_by_server()


def test_a_resource_alarm_blocks_mqtt_publishers_only_and_the_api_lists_mqtt_connections(node_factory):
    """As AMQP publishers: a publishing MQTT connection is not read while an alarm is on (no PUBACK);
    subscribers go on. The management API shows MQTT connections with their client id."""
    node = node_factory(name="alarm", frontends=1, shards=1, mqtt_port=free_port(),
                        extra_args=["--vm-memory-high-watermark", "1MB", "--stats-interval", "200"])
    api = Api(node.http_port)
    deadline = time.monotonic() + 10
    while api.call("GET", "/api/health/checks/alarms")[0] != 503:
        assert time.monotonic() < deadline, "the memory alarm did not fire"
        time.sleep(0.05)
    sub = RawMQTT(node.mqtt_port)
    assert sub.connect("alarm-sub").return_code == 0
    assert sub.subscribe(1, [("al/#", 1)]) == [1]
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect("alarm-pub").return_code == 0
    pub.publish("al/x", b"first", qos=1, pid=1)  # read: it makes the connection a publisher
    assert pub.recv() == M.Ack(M.PUBACK, 1)
    pub.publish("al/x", b"second", qos=1, pid=2)
    try:
        pub.recv(timeout=1.5)
        raise AssertionError("a blocked publisher was read")
    except AssertionError as exc:
        assert "no packet" in str(exc)
    p = sub.recv()
    assert p.payload == b"first"
    sub.ack(M.PUBACK, p.packet_id)
    sub.send(bytes((M.PINGREQ << 4, 0)))
    assert sub.recv() == M.Simple(M.PINGRESP)  # subscribers are still read
    conns = api.wait_for("/api/connections", lambda d: {"alarm-sub", "alarm-pub"} <= {
        (c.get("client_properties") or {}).get("client_id") for c in d})
    assert {c["user"] for c in conns} == {"guest"}
    sub.disconnect()
    pub.close()
