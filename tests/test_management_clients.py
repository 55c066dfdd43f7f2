"""A real third-party client of RabbitMQ's management API (amqpstorm.management) against ShardMQ, and the
RabbitMQ definitions format round trip: export -> import into an empty node -> same definitions, users log in."""

from __future__ import annotations

import base64
import hashlib

import pytest
from amqpstorm.management import ApiError, ManagementApi

from tests.harness import NodeFactory
from tests.helpers import uid
from tests.mgmt_api import Api, connect, q

pytestmark = pytest.mark.integration


def test_amqpstorm_management_client(node_factory):
    node = node_factory(name="node", extra_args=["--stats-interval", "200"])
    api = ManagementApi(f"http://127.0.0.1:{node.http_port}", "guest", "guest", timeout=10)
    assert api.aliveness_test("/") == {"status": "ok"}
    assert api.whoami()["name"] == "guest"
    assert api.overview()["product_name"] == "ShardMQ"
    api.virtual_host.create("storm")
    assert "storm" in [v["name"] for v in api.virtual_host.list()]
    api.user.create("stormy", "pw", tags="management")
    api.user.set_permission("stormy", "storm", configure_regex=".*", write_regex=".*", read_regex=".*")
    assert api.user.get_permission("stormy", "storm")["read"] == ".*"
    api.virtual_host.create("other")
    names = [uid("storm") for _ in range(3)]
    for n in names:
        api.queue.declare(n, virtual_host="storm", durable=True)
    api.exchange.declare("sx", "fanout", virtual_host="storm", durable=True)
    for n in names:
        api.queue.bind(n, "sx", routing_key="", virtual_host="storm")
    api.basic.publish("payload!", routing_key="", exchange="sx", virtual_host="storm",
                      properties={"content_type": "text/plain"})
    got = api.basic.get(names[0], virtual_host="storm", requeue=False)
    assert [m.body for m in got] == ["payload!"]
    listed = {x["name"] for x in api.queue.list(virtual_host="storm", page_size=2)}  # paged by the client
    assert listed == set(names)
    api.queue.purge(names[1], virtual_host="storm")
    assert api.queue.get(names[1], virtual_host="storm")["messages"] == 0
    api.queue.delete(names[2], virtual_host="storm")
    with pytest.raises(ApiError) as info:
        api.queue.get(names[2], virtual_host="storm")
    assert info.value.error_code == 404
    stormy = ManagementApi(f"http://127.0.0.1:{node.http_port}", "stormy", "pw", timeout=10)
    assert {x["name"] for x in stormy.queue.list(show_all=True)} == set(names[:2])
    with pytest.raises(ApiError) as info:
        stormy.user.create("evil", "x", tags="administrator")
    assert info.value.error_code == 401
    api.virtual_host.delete("other")
    api.user.delete("stormy")
    assert "stormy" not in [u["name"] for u in api.user.list()]


def _rabbit_hash(password: str, salt: bytes = b"\x90\x8d\xc6\x0a") -> str:
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def _normalized(defs: dict) -> dict:
    out = {k: v for k, v in defs.items() if k not in ("rabbit_version", "rabbitmq_version", "product_version")}
    for key, value in out.items():
        if isinstance(value, list):
            out[key] = sorted(value, key=lambda d: repr(sorted(d.items())) if isinstance(d, dict) else repr(d))
    return out


def test_definitions_round_trip_into_an_empty_node(tmp_path):
    factory = NodeFactory(tmp_path)
    try:
        a = factory(name="a")
        api_a = Api(a.http_port)
        # A RabbitMQ export (its hash format and field names) imports as is.
        rabbit_export = {
            "rabbit_version": "3.13.7",
            "users": [{"name": "fromrabbit", "password_hash": _rabbit_hash("test12"),
                       "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["management"], "limits": {}}],
            "vhosts": [{"name": "orders", "description": "orders vhost", "tags": [], "metadata": {}}],
            "permissions": [{"user": "fromrabbit", "vhost": "orders", "configure": "^o-", "write": ".*",
                             "read": ".*"}],
            "topic_permissions": [{"user": "fromrabbit", "vhost": "orders", "exchange": "amq.topic",
                                   "write": "^orders\\.", "read": ".*"}],
            "parameters": [{"vhost": "orders", "component": "vhost-limits", "name": "limits",
                            "value": {"max-connections": 50}}],
            "global_parameters": [{"name": "cluster_name", "value": "rabbit@x"}],
            "policies": [{"vhost": "orders", "name": "cap", "pattern": "^o-", "apply-to": "queues",
                          "definition": {"max-length": 1000}, "priority": 1}],
            "queues": [{"name": "o-new", "vhost": "orders", "durable": True, "auto_delete": False,
                        "arguments": {"x-queue-type": "classic"}}],
            "exchanges": [{"name": "o-events", "vhost": "orders", "type": "topic", "durable": True,
                           "auto_delete": False, "internal": False, "arguments": {}}],
            "bindings": [{"source": "o-events", "vhost": "orders", "destination": "o-new",
                          "destination_type": "queue", "routing_key": "order.*", "arguments": {}}],
        }
        status, body = api_a.call("POST", "/api/definitions", rabbit_export)
        assert status == 204, body
        conn = connect(a, "fromrabbit", "test12", vhost="orders")
        conn.close()
        exported = api_a.get("/api/definitions")
        assert {u["name"] for u in exported["users"]} == {"guest", "fromrabbit"}
        assert {"source": "o-events", "vhost": "orders", "destination": "o-new", "destination_type": "queue",
                "routing_key": "order.*", "arguments": {}} in exported["bindings"]
        only_orders = api_a.get(f"/api/definitions/{q('orders')}")
        assert "users" not in only_orders and [x["name"] for x in only_orders["queues"]] == ["o-new"]
        # A bad entry fails the whole import with a message that names it, and applies nothing.
        status, body = api_a.call("POST", "/api/definitions", {
            "vhosts": [{"name": "half"}],
            "queues": [{"name": "bad", "vhost": "/", "durable": True, "arguments": {"x-max-length": "x"}}]})
        assert status == 400 and "queue 'bad'" in body["reason"]
        assert "half" not in [v["name"] for v in api_a.get("/api/vhosts")]

        b = factory(name="b")
        api_b = Api(b.http_port)
        assert api_b.call("POST", "/api/definitions", exported)[0] == 204
        assert _normalized(api_b.get("/api/definitions")) == _normalized(exported)
        conn = connect(b, "fromrabbit", "test12", vhost="orders")  # the hash travelled: same password works
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("o-events", "order.1", b"routed through the imported binding")
        assert ch.queue_declare("o-new", passive=True).method.message_count == 1
        conn.close()
    finally:
        factory.cleanup()
