"""A transient message to an empty queue with a waiting no-ack consumer goes out without being stored.

The shard's publish path hands it straight to the consumer (shard/queue.py ``deliver_unstored``)
instead of appending it to the segment, reading it back and acking it. Shown on a real node: the
consumer gets every message in order with its properties, the queue's counters are the same as
through the store, no segment file is made for the queue, and a persistent message to the same
durable queue is still written to disk before it is delivered.
"""

from __future__ import annotations

import hashlib
import os
import time

import pika

from tests.helpers import uid
from tests.mgmt_api import Api


def _queue_dir(node, vhost: str, name: str) -> str:
    return os.path.join(str(node.data_dir), hashlib.sha1(vhost.encode()).hexdigest(),
                        hashlib.sha1(name.encode()).hexdigest())


def _segments(node, name: str) -> list[str]:
    path = _queue_dir(node, "/", name)
    return [f for f in os.listdir(path) if f.startswith("msgs.")] if os.path.isdir(path) else []


def test_transient_to_waiting_no_ack_consumer_is_not_stored(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "200"])
    qn = uid("unstored")
    consumer_conn = node.connect()
    cch = consumer_conn.channel()
    cch.queue_declare(qn, durable=True)
    got: list[tuple[bytes, bool, str | None]] = []
    # basic.consume-ok comes once the shard has the consumer: every publish below finds it waiting.
    cch.basic_consume(qn, lambda _ch, method, props, body: got.append((body, method.redelivered, props.message_id)),
                      auto_ack=True)
    pub_conn = node.connect()
    pch = pub_conn.channel()
    n = 200
    for i in range(n):
        pch.basic_publish("", qn, str(i).encode(), pika.BasicProperties(message_id=f"m{i}"))
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        consumer_conn.process_data_events(time_limit=0.05)
    assert got == [(str(i).encode(), False, f"m{i}") for i in range(n)]
    assert _segments(node, qn) == [], "transient messages to a waiting no-ack consumer were written to a segment"

    api = Api(node.http_port)
    deadline = time.monotonic() + 10
    while True:
        stats = api.get(f"/api/queues/%2F/{qn}").get("message_stats", {})
        counts = {k: stats.get(k) for k in ("publish", "deliver_no_ack", "deliver_get")}
        if counts == {"publish": n, "deliver_no_ack": n, "deliver_get": n}:
            break
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)

    # A persistent message to the durable queue is stored before it is delivered, consumer or not.
    pch.basic_publish("", qn, b"durable", pika.BasicProperties(delivery_mode=2))
    deadline = time.monotonic() + 10
    while len(got) < n + 1 and time.monotonic() < deadline:
        consumer_conn.process_data_events(time_limit=0.05)
    assert got[-1][0] == b"durable"
    assert _segments(node, qn), "a persistent message was delivered without being stored"
    pub_conn.close()
    consumer_conn.close()
