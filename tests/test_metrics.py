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
        if (value(m["rabbitmq_queue_messages_ready"]) == 5 and value(m["rabbitmq_connections"]) >= 1
                and value(m["rabbitmq_connections_opened"]) >= 2):  # wait_ready's probe and ours
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
