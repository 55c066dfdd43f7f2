"""Permissions are enforced on every AMQP operation, as RabbitMQ does (two users, real pika clients)."""

from __future__ import annotations

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from tests.helpers import channel_error, get_one, uid
from tests.mgmt_api import Api, connect, q

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mnode(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("perm_node"))
    try:
        yield factory(name="node", frontends=2, shards=2, extra_args=["--stats-interval", "200"])
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def api(mnode):
    return Api(mnode.http_port)


def test_user_with_no_permissions_cannot_touch_another_users_queue(mnode, api):
    """The hole the issue names: ^$ for configure/write/read declared, published, got and purged."""
    victim = uid("victim")
    api.add_user("mallory", "pw", perms=("^$", "^$", "^$"))
    owner = mnode.connect()
    och = owner.channel()
    och.confirm_delivery()
    och.queue_declare(victim)
    och.basic_publish("", victim, b"secret")
    conn = connect(mnode, "mallory", "pw")
    try:
        for action in (
            lambda c: c.queue_declare(uid("mine")),
            lambda c: c.queue_declare(""),  # a server-named queue needs configure on amq.gen-*
            lambda c: c.queue_delete(victim),
            lambda c: c.exchange_declare(uid("x"), "fanout"),
            lambda c: c.exchange_delete("amq.fanout"),
            lambda c: c.queue_bind(victim, "amq.fanout"),
            lambda c: c.basic_get(victim),
            lambda c: c.queue_purge(victim),
            lambda c: c.basic_consume(victim, lambda *a: None),
        ):
            code, text = channel_error(conn, action)
            assert code == 403, text
            assert text.startswith("ACCESS_REFUSED - access to ") and "refused for user 'mallory'" in text

        def publish(c):
            c.confirm_delivery()
            c.basic_publish("", victim, b"spam")
        code, text = channel_error(conn, publish)
        assert (code, text) == (403, "ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused "
                                     "for user 'mallory'")
        # A passive declare needs no permission (RabbitMQ), and nothing was taken or added.
        assert conn.channel().queue_declare(victim, passive=True).method.message_count == 1
    finally:
        conn.close()
    assert get_one(och, victim)[2] == b"secret"
    owner.close()


def test_permissions_match_resource_names_and_changes_apply_at_once(mnode, api):
    """read on ^ro- lets a user get from ro-* only; granting write later works on the open connection."""
    mine, other = uid("ro"), uid("other")
    api.add_user("reader", "pw", perms=("^ro-", "^$", "^ro-"))
    conn = connect(mnode, "reader", "pw")
    try:
        ch = conn.channel()
        ch.queue_declare(mine)  # configure on ^ro-
        assert ch.basic_get(mine) == (None, None, None)  # read on ^ro-
        code, _ = channel_error(conn, lambda c: c.queue_declare(other))
        assert code == 403
        code, _ = channel_error(conn, lambda c: (c.confirm_delivery(), c.basic_publish("", mine, b"x")))
        assert code == 403
        # Grant write on the default exchange: the same open connection may now publish.
        api.put(f"/api/permissions/{q('/')}/reader", {"configure": "^ro-", "write": "^amq\\.default$",
                                                      "read": "^ro-"})
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", mine, b"now allowed")
        assert get_one(ch, mine)[2] == b"now allowed"
        # bind = write on the queue and read on the exchange: write on ro- is missing
        code, text = channel_error(conn, lambda c: c.queue_bind(mine, "amq.direct"))
        assert code == 403 and "queue '" + mine in text
    finally:
        conn.close()


def test_topic_permissions_on_routing_keys(mnode, api):
    api.add_user("topical", "pw")
    api.put(f"/api/topic-permissions/{q('/')}/topical",
            {"exchange": "amq.topic", "write": "^{username}\\.", "read": "^public\\."})
    qn = uid("tq")
    conn = connect(mnode, "topical", "pw")
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(qn)
        ch.queue_bind(qn, "amq.topic", "public.#")  # binding key matches read
        ch.basic_publish("amq.topic", "topical.x", b"own prefix: allowed")
        ch.basic_publish("amq.direct", "anything", b"not a topic exchange: unrestricted")
        code, text = channel_error(conn, lambda c: c.queue_bind(qn, "amq.topic", "private.#"))
        assert code == 403 and "read access to topic 'private.#' in exchange 'amq.topic'" in text
        code, text = channel_error(conn, lambda c: (c.confirm_delivery(),
                                                    c.basic_publish("amq.topic", "other.x", b"no")))
        assert (code, text) == (403, "ACCESS_REFUSED - write access to topic 'other.x' in exchange 'amq.topic' "
                                     "in vhost '/' refused for user 'topical'")
    finally:
        conn.close()


def test_connection_to_vhost_without_permissions_is_refused(mnode, api):
    api.put(f"/api/vhosts/{q('private')}")
    api.add_user("outsider", "pw")  # permissions on / only
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as info:
        connect(mnode, "outsider", "pw", vhost="private")
    assert "(530) \"NOT_ALLOWED - access to vhost 'private' refused for user 'outsider'\"" in str(info.value)


def test_user_without_password_cannot_log_in(mnode, api):
    api.put("/api/users/nopass", {"tags": ""})
    api.put(f"/api/permissions/{q('/')}/nopass", {"configure": ".*", "write": ".*", "read": ".*"})
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        connect(mnode, "nopass", "")


def test_password_change_and_user_delete_close_open_connections(mnode, api):
    api.add_user("changer", "old")
    conn = connect(mnode, "changer", "old")
    api.put("/api/users/changer", {"password": "new", "tags": ""})
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        conn.process_data_events(time_limit=10)
        conn.channel()
    assert info.value.reply_code == 320
    conn = connect(mnode, "changer", "new")
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        connect(mnode, "changer", "old")
    api.delete("/api/users/changer")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker):
        conn.process_data_events(time_limit=10)
        conn.channel()


def test_channel_error_from_a_refusal_leaves_connection_usable(mnode, api):
    api.add_user("partial", "pw", perms=("^$", "^$", "^$"))
    conn = connect(mnode, "partial", "pw")
    try:
        ch = conn.channel()
        with pytest.raises(ChannelClosedByBroker):
            ch.queue_declare(uid("x"))
        assert conn.is_open
        assert conn.channel().is_open
    finally:
        conn.close()


def test_impersonator_may_publish_with_another_user_id(mnode, api):
    qn = uid("imp")
    api.add_user("plainuser", "pw")
    api.add_user("imp", "pw", tags="impersonator")
    for user, allowed in (("plainuser", False), ("imp", True)):
        conn = connect(mnode, user, "pw")
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(qn)
        if allowed:
            ch.basic_publish("", qn, b"as someone else", pika.BasicProperties(user_id="someone-else"))
            assert get_one(ch, qn)[1].user_id == "someone-else"
        else:
            with pytest.raises(ChannelClosedByBroker) as info:
                ch.basic_publish("", qn, b"x", pika.BasicProperties(user_id="someone-else"))
            assert info.value.reply_code == 406
        conn.close()


def test_mqtt_publish_and_subscribe_are_checked(tmp_path):
    """MQTT sessions use the same permissions: write on amq.topic (+ topic write), configure/write on the
    subscription queue and read on amq.topic (+ topic read) to subscribe."""
    from broker.mqtt import codec as M
    from tests.harness import NodeFactory, free_port
    from tests.raw_mqtt import RawMQTT

    factory = NodeFactory(tmp_path)
    try:
        node = factory(name="node", frontends=1, shards=1, mqtt_port=free_port())
        api = Api(node.http_port)
        api.add_user("mq-none", "pw", perms=(".*", "^$", ".*"))  # may not write anything
        api.add_user("mq-topic", "pw")
        api.put(f"/api/topic-permissions/{q('/')}/mq-topic",
                {"exchange": "amq.topic", "write": "^allowed\\.", "read": "^allowed\\."})
        c = RawMQTT(node.mqtt_port)
        assert c.connect("c-none", username="mq-none", password=b"pw").return_code == 0
        c.publish("any/thing", b"x", qos=1, pid=1)
        assert c.closed_by_server(), "a publish without write permission must close the connection"
        assert not any(isinstance(p, M.Ack) and p.type == M.PUBACK for p in c.packets)
        c = RawMQTT(node.mqtt_port)
        assert c.connect("c-topic", username="mq-topic", password=b"pw").return_code == 0
        assert c.subscribe(1, [("allowed/#", 1), ("other/#", 1)]) == [1, M.SUBACK_FAILURE]
        c.publish("allowed/x", b"ok", qos=1, pid=2)
        got = [c.recv(), c.recv()]
        assert any(isinstance(p, M.Ack) and p.type == M.PUBACK and p.packet_id == 2 for p in got), got
        assert any(isinstance(p, M.Publish) and p.payload == b"ok" for p in got), got
        c.publish("other/x", b"no", qos=1, pid=3)
        assert c.closed_by_server()
    finally:
        factory.cleanup()
