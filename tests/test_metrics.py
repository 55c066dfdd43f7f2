"""Prometheus metrics on --prometheus-port: RabbitMQ's names, aggregated by default, per queue on request."""

from __future__ import annotations

import time
import urllib.request

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import uid

pytestmark = pytest.mark.integration


def scrape(node, path: str = "/metrics") -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}{path}", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, **labels) -> float:
    for s in samples:
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample with {labels} in {samples}")


def test_aggregated_and_per_object_metrics(node_factory):
    node = node_factory(name="node", extra_args=["--stats-interval", "200"])
    qn = uid("metric")
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn, durable=True)
    for _ in range(5):  # persistent into a durable queue, confirmed: each waits for a group sync
        ch.basic_publish("", qn, b"x" * 10, pika.BasicProperties(delivery_mode=2))
    deadline = time.monotonic() + 10
    while True:
        m = scrape(node)
        # the routed count is the frontend's, on its own stats timer: it may come after the shard's ready count
        if (value(m["rabbitmq_queue_messages_ready"]) == 5 and value(m["rabbitmq_connections"]) >= 1
                and value(m["rabbitmq_connections_opened"]) >= 2  # wait_ready's probe and ours
                and value(m["rabbitmq_global_messages_routed"]) == 5):
            break
        assert time.monotonic() < deadline, m.get("rabbitmq_queue_messages_ready")
        time.sleep(0.05)
    assert value(m["rabbitmq_queues"]) == 1
    assert value(m["rabbitmq_connections_closed"]) >= 1  # wait_ready's probe
    assert value(m["rabbitmq_global_messages_routed"]) == 5  # the parser drops the _total suffix
    assert value(m["rabbitmq_channels"]) >= 1
    assert value(m["rabbitmq_queue_messages_ready_bytes"]) == 50
    assert value(m["rabbitmq_alarms_free_disk_space_watermark"]) == 0
    assert value(m["rabbitmq_process_resident_memory_bytes"]) > 10 << 20
    assert {s.labels["process"] for s in m["shardmq_process_resident_memory_bytes"]} >= {"node"}
    assert sum(s.value for s in m["shardmq_shard_queues"]) == 1
    assert sum(s.value for s in m["shardmq_shard_segment_bytes"]) > 50  # 5 records of 10-byte bodies
    syncs = [s for s in m["shardmq_shard_fsync_seconds"] if s.name.endswith("_count")]
    assert sum(s.value for s in syncs) >= 1
    assert value(m["shardmq_damaged_records"]) == 0  # storage damage (tests/test_safety_stream.py has some)
    assert value(m["shardmq_damaged_ack_entries"]) == 0
    assert all(not s.labels for s in m["rabbitmq_queue_messages_ready"])  # aggregate: no per-queue labels
    per = scrape(node, "/metrics/per-object")
    assert value(per["rabbitmq_queue_messages_ready"], vhost="/", queue=qn) == 5
    assert value(per["rabbitmq_queue_consumers"], vhost="/", queue=qn) == 0
    assert value(per["rabbitmq_queue_messages_published"], vhost="/", queue=qn) == 5
    conn.close()


def test_prometheus_port_zero_is_off(node_factory):
    node = node_factory(name="node", extra_args=["--prometheus-port", "0"])
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=2)


def test_global_message_counters_and_message_stats(node_factory):
    """rabbitmq_global_messages_* and the API's message_stats split by kind, from the batched STATS."""
    from tests.helpers import get_one
    from tests.mgmt_api import Api

    node = node_factory(name="node", extra_args=["--stats-interval", "200"])
    qn = uid("glob")
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn)
    for _ in range(6):
        ch.basic_publish("", qn, b"m")
    plain = conn.channel()  # no confirms: an unroutable mandatory publish comes back as basic.return
    plain.basic_publish("", uid("nowhere"), b"r", mandatory=True)
    plain.basic_publish("", uid("nowhere"), b"d")
    get_one(ch, qn, auto_ack=True)
    method = get_one(ch, qn, auto_ack=False)[0]
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, _props, _body = get_one(ch, qn, auto_ack=False)
    assert method.redelivered
    ch.basic_ack(method.delivery_tag)
    consumer = conn.channel()
    taken = 0
    for method, _props, _body in consumer.consume(qn, auto_ack=True, inactivity_timeout=10):
        assert method is not None, "the auto-ack consumer did not get the 4 remaining messages"
        taken += 1
        if taken == 4:
            break
    consumer.cancel()
    ch.basic_publish("", qn, b"last")
    for method, _props, _body in consumer.consume(qn, inactivity_timeout=10):
        assert method is not None
        consumer.basic_ack(method.delivery_tag)
        break
    consumer.cancel()
    want = {"received": 9, "received_confirm": 7, "confirmed": 7, "routed": 7, "unroutable_returned": 1,
            "unroutable_dropped": 1, "delivered": 8, "delivered_consume_auto_ack": 4,
            "delivered_consume_manual_ack": 1, "delivered_get_auto_ack": 1, "delivered_get_manual_ack": 2,
            "redelivered": 1, "acknowledged": 2}
    deadline = time.monotonic() + 10
    while True:
        m = scrape(node)
        got = {k: value(m[f"rabbitmq_global_messages_{k}"]) for k in want}
        if got == want:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert value(m["rabbitmq_global_publishers"]) == 1
    api = Api(node.http_port)
    stats = api.get(f"/api/queues/%2F/{qn}")["message_stats"]
    assert {k: stats[k] for k in ("publish", "deliver_get", "deliver", "deliver_no_ack", "get", "get_no_ack",
                                  "redeliver", "ack")} == {
        "publish": 7, "deliver_get": 8, "deliver": 1, "deliver_no_ack": 4, "get": 2, "get_no_ack": 1,
        "redeliver": 1, "ack": 2}
    assert all(set(stats[k + "_details"]) == {"rate"} for k in ("deliver", "get_no_ack", "redeliver"))
    ov = api.get("/api/overview")["message_stats"]
    assert (ov["publish"], ov["confirm"], ov["return_unroutable"], ov["drop_unroutable"]) == (9, 7, 1, 1)
    assert ov["deliver_no_ack"] == 4 and "rate" in ov["confirm_details"]
    assert api.get("/api/vhosts/%2F")["message_stats"]["get"] == 2
    conn.close()
