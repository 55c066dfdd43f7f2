"""MQTT under the broker's permissions, as RabbitMQ's MQTT plugin: publish needs write on amq.topic (and topic
write on the routing key), subscribe needs configure/write/read on the session queue and read on amq.topic."""

from __future__ import annotations

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
