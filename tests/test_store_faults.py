"""A queue whose files fail on the disk hurts that queue only, and no more than it must.

Real faults, planted in a running node's data dir: a sealed segment file renamed aside (the read
cursor cannot map it when it gets there), a directory where the queue's delivered mark goes (the
mark's open fails). Each is healed again by the test, and what was stuck must then move on its own,
with nothing lost.
"""

from __future__ import annotations

import os

import pika

from shard.store import queue_dir
from tests.harness import pumping, wait_until
from tests.helpers import uid

SEGMENT = 65536  # the smallest --segment-size: a few 10 KB messages fill one
BODY = 10_000
N = 20  # messages of BODY bytes: segments 1..4 (6 a segment), 2 and 3 sealed and not mapped


def _small_segment_node(node_factory):
    """One frontend, one shard (every queue on the same shard), 64 KiB segments."""
    return node_factory(frontends=1, shards=1, extra_args=["--segment-size", str(SEGMENT)])


def _segment(node, queue: str, no: int) -> str:
    return os.path.join(queue_dir(str(node.data_dir), "/", queue), f"msgs.{no:010d}")


def test_a_queue_whose_segment_cannot_be_read_does_not_stop_the_others_and_resumes_when_healed(node_factory):
    """Queue `bad` holds N messages over four segments; its second segment file is renamed aside, so
    its delivery pass raises when the read cursor gets there. A queue on the same shard, woken in the
    same passes (a fanout publishes to both), keeps delivering; `bad` is retried on its own, and once
    the file is back it delivers the rest without anything else waking it."""
    node = _small_segment_node(node_factory)
    bad, good, fanout = uid("bad"), uid("good"), uid("both")
    conn = node.connect()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare(fanout, "fanout")
        for q in (bad, good):
            ch.queue_declare(q)
            ch.queue_bind(q, fanout)
        for i in range(N):
            ch.basic_publish("", bad, b"%03d" % i + b"x" * BODY)
        seg2 = _segment(node, bad, 2)
        assert os.path.exists(_segment(node, bad, 4)), sorted(os.listdir(os.path.dirname(seg2)))
        os.rename(seg2, seg2 + ".aside")
        healed = False
        try:
            got: dict[str, list[bytes]] = {bad: [], good: []}
            cons = conn.channel()
            for q in (bad, good):
                cons.basic_consume(q, lambda _c, _m, _p, b, q=q: got[q].append(b[:3]))
            # Segment 1's messages go out, then the cursor cannot map segment 2.
            wait_until(lambda: len(got[bad]) >= 1, 10, "bad's first messages", pause=pumping(conn))
            for i in range(10):
                ch.basic_publish(fanout, "", b"f%02d" % i)
                wait_until(lambda i=i: len(got[good]) == i + 1, 10, f"good's message {i}", pause=pumping(conn),
                           context=lambda: f"good got {got[good]}, bad got {len(got[bad])}")
            stuck = len(got[bad])
            assert 0 < stuck < N, stuck
            os.rename(seg2 + ".aside", seg2)
            healed = True
            # Nothing wakes `bad` now but its retry.
            wait_until(lambda: len(got[bad]) == N + 10, 20, "the rest of bad's messages", pause=pumping(conn),
                       context=lambda: f"bad got {len(got[bad])}")
            assert got[bad] == [b"%03d" % i for i in range(N)] + [b"f%02d" % i for i in range(10)]
            assert got[good] == [b"f%02d" % i for i in range(10)]
        finally:
            if not healed:
                os.rename(seg2 + ".aside", seg2)
        log = node.log_text()  # one error for the episode (not one per retry), one line at its end
        assert log.count(f"queue '{bad}' in vhost '/': delivery failed (FileNotFoundError") == 1, log
        assert log.count(f"queue '{bad}' in vhost '/': delivers again") == 1, log
    finally:
        if conn.is_open:
            try:
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                pass
