"""A stream consumer near the tail keeps receiving while a publisher floods the stream unconfirmed.

A stream has no backlog (its ready count is 0), so the queue pacing of publishers never applied: a
consumer with prefetch 10 got ~30 msg/s while an unconfirmed publisher pushed 38,000 msg/s. Now a
waiting consumer within stream_queue.NEAR_TAIL of the tail paces publishers like a queue's consumer.
Count-based: the flood goes on until the consumer has its messages, within a generous deadline.
"""

from __future__ import annotations

import threading

from loadtest.amqp_client import AMQPClient
from tests.helpers import ack_deliveries, flood_thread

WANT = 3000  # ~100 s at the starved rate; well under a second when paced
PREFETCH = 10


def test_stream_consumer_progresses_during_an_unconfirmed_publish_flood(node_factory):
    node = node_factory(frontends=1, shards=1)
    queue = "flooded-stream"
    stop = threading.Event()
    published = [0]
    errors: list = []

    with AMQPClient(node.url, timeout=30.0).connect() as con:
        con.queue_declare(queue, durable=True, arguments={"x-queue-type": "stream"})
        con.basic_qos(PREFETCH)
        con.basic_consume(queue, no_ack=False)  # x-stream-offset defaults to next: the tail
        publisher = flood_thread(node.url, queue, b"x" * 16, 500, stop, published, errors)
        publisher.start()
        try:
            ack_deliveries(con, WANT, 60, published, errors)
            assert published[0] > 0 and not errors, errors
        finally:
            stop.set()
            publisher.join(30)
