"""Publisher back-pressure bounds the bytes in flight from a frontend to a shard, not only the batches.

MAX_BATCHES_IN_FLIGHT alone let a few batches of large bodies hold hundreds of MB in the ZeroMQ
queues of both processes. The frontend also pauses its publishers while the unanswered batches to a
shard hold more than MAX_BYTES_IN_FLIGHT; what one loop turn had read already may still go out. The
frontend reports its peak (STATS -> Prometheus ``shardmq_publish_bytes_in_flight_peak``): counted
bytes, not RSS.
"""

from __future__ import annotations

import threading
import time

from broker import contract
from broker.amqp import encoder
from loadtest.amqp_client import AMQPClient
from tests.test_metrics import scrape, value

PUBLISHERS = 4
BODY = 512 << 10
PER_PUBLISHER = 40


def _flood(url: str, queue: str, errors: list) -> None:
    try:
        with AMQPClient(url, timeout=60.0).connect() as c:
            frame = encoder.encode_publish(1, "", queue, False, b"\x00\x00", b"x" * BODY, c.frame_max)
            for _ in range(PER_PUBLISHER):
                c.send(frame)
            c.queue_declare(queue, passive=True)  # a round trip: every publish before it was read
    except Exception as exc:  # reported by the test thread
        errors.append(exc)


def test_bytes_in_flight_to_a_shard_stay_bounded_under_a_large_body_flood(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    queue = "big-bodies"
    with AMQPClient(node.url).connect() as c:
        c.queue_declare(queue)
        errors: list = []
        threads = [threading.Thread(target=_flood, args=(node.url, queue, errors)) for _ in range(PUBLISHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        total = PUBLISHERS * PER_PUBLISHER
        deadline = time.monotonic() + 60
        while (n := c.queue_declare(queue, passive=True)[1]) != total:
            assert time.monotonic() < deadline, f"{n} of {total} messages stored"
            time.sleep(0.1)
    deadline = time.monotonic() + 30
    while (peak := value(scrape(node)["shardmq_publish_bytes_in_flight_peak"])) == 0:
        assert time.monotonic() < deadline, "the frontend never reported its peak"
        time.sleep(0.1)
    # One loop turn after the bound is crossed: each publisher may complete one more message.
    slack = PUBLISHERS * (BODY + (64 << 10))
    assert BODY <= peak <= contract.MAX_BYTES_IN_FLIGHT + slack, peak
