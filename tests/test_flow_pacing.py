"""Publishers are paced to a consumer at its prefetch limit: the queue's backlog stays bounded.

The shard holds PROCESSED answers while a queue with consumers has a backlog and a consumer cannot
take more, and releases held batches as it delivers. It used to release a whole batch (hundreds of
publishes) for every turn with at least one delivery, and counted the acks in a batch as publishes,
so a publisher ran far ahead of an acking consumer and the queue grew without bound: in the
persistent-confirm benchmark publish 23k vs consume 12k msg/s, and seconds of end-to-end latency.
Count-based: the consumer acks every message it gets until it has WANT of them, while the flood runs
unconfirmed; then the queue's ready count must be near the pacing threshold, not the flood's size.
"""

from __future__ import annotations

import threading

from loadtest.amqp_client import AMQPClient
from shard import worker
from tests.helpers import ack_deliveries, flood_thread

WANT = 30_000
PREFETCH = 1000
CHUNK = 500


def test_an_unconfirmed_flood_is_paced_to_an_acking_consumer(node_factory):
    node = node_factory(frontends=1, shards=1)
    queue = "paced"
    stop = threading.Event()
    published = [0]
    errors: list = []

    with AMQPClient(node.url, timeout=30.0).connect() as con:
        con.queue_declare(queue)
        con.basic_qos(PREFETCH)
        con.basic_consume(queue, no_ack=False)
        publisher = flood_thread(node.url, queue, b"x" * 1024, CHUNK, stop, published, errors)
        publisher.start()
        try:
            ack_deliveries(con, WANT, 120, published, errors)
            with AMQPClient(node.url, timeout=30.0).connect() as probe:
                backlog = probe.queue_declare(queue, passive=True)[1]
        finally:
            stop.set()
            publisher.join(30)
        assert not errors, errors
    # Paced: the threshold, what the frontend has in flight (8 batches) and what the publisher's
    # socket buffers hold. Unpaced, the flood ran several times ahead of the consumer.
    print("BACKLOG", backlog, published[0])
    bound = worker._FLOW_BACKLOG + 20_000
    assert backlog < bound, f"{backlog} ready after {WANT} consumed ({published[0]} sent)"
