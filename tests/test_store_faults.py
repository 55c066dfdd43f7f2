"""A queue whose files fail on the disk hurts that queue only, and no more than it must.

Real faults, planted in a running node's data dir: a sealed segment file renamed aside (the read
cursor cannot map it when it gets there), a directory where the queue's delivered mark goes (the
mark's open fails). Each is healed again by the test, and what was stuck must then move on its own,
with nothing lost.
"""

from __future__ import annotations

import os

import pika
import pytest

from shard.segment import read_ack_entries
from shard.store import DELIVERED_MARK, queue_dir
from tests.harness import pumping, wait_until
from tests.helpers import uid

SEGMENT = 65536  # the smallest --segment-size: a few 10 KB messages fill one
BODY = 10_000
PERSISTENT = pika.BasicProperties(delivery_mode=2)
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


def test_a_get_whose_segment_cannot_be_read_is_answered_541_and_takes_nothing(node_factory):
    """basic.get takes `bad`'s messages one by one until the read cursor cannot map the second
    segment: that get is answered 541 INTERNAL_ERROR (not left waiting), the connection's close
    puts back what the earlier gets took, redelivered, and once the file is back every message is
    there, in order."""
    node = _small_segment_node(node_factory)
    bad = uid("getbad")
    conn = node.connect()
    other = node.connect()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(bad)
        for i in range(N):
            ch.basic_publish("", bad, b"%03d" % i + b"x" * BODY)
        seg2 = _segment(node, bad, 2)
        os.rename(seg2, seg2 + ".aside")
        try:
            taken = 0
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
                while taken <= N:
                    method, _p, body = ch.basic_get(bad, auto_ack=False)
                    assert body[:3] == b"%03d" % taken
                    taken += 1
            assert err.value.reply_code == 541, err.value
            assert "basic.get" in err.value.reply_text
            assert 0 < taken < N, taken
        finally:
            os.rename(seg2 + ".aside", seg2)
        och = other.channel()
        wait_until(lambda: och.queue_declare(bad, passive=True).method.message_count == N, 10,
                   "every message ready again")
        back = []
        for _ in range(N):
            method, _p, body = och.basic_get(bad, auto_ack=True)
            back.append((body[:3], method.redelivered))
        assert back == [(b"%03d" % i, i < taken) for i in range(N)]
        och.queue_delete(bad)
    finally:
        for c in (conn, other):
            if c.is_open:
                c.close()

def test_a_delivered_mark_that_cannot_be_written_is_retried_and_holds_nothing_up(node_factory):
    """The queue's delivered mark cannot be opened (a directory stands in its place) while a consumer
    takes its 10 messages and acks 5: the acks still reach the ack file, the shard's group syncs go
    on (a confirm on another queue comes), and once the directory is gone the mark is written without
    another delivery. After a kill -9 the 5 acked messages stay gone and the 5 unacked come back,
    redelivered (what the mark is for). The mark write used to raise, before the ack writes of the
    same flush: they waited for the fault to go, and a periodic sync that met it never ran again."""
    node = _small_segment_node(node_factory)
    q, other = uid("markfail"), uid("other")
    conn = node.connect()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(q, durable=True)
        ch.queue_declare(other, durable=True)
        for i in range(10):
            ch.basic_publish("", q, b"m%d" % i, PERSISTENT)
        qdir = queue_dir(str(node.data_dir), "/", q)
        mark = os.path.join(qdir, DELIVERED_MARK)
        os.mkdir(mark)  # the mark is opened at the queue's first delivery: none so far
        healed = False
        try:
            got: list = []
            cons = conn.channel()
            cons.basic_consume(q, lambda _c, m, _p, b: got.append((m.delivery_tag, b)))
            wait_until(lambda: len(got) == 10, 10, "10 deliveries", pause=pumping(conn))
            for tag, _b in got[:5]:
                cons.basic_ack(tag)
            acks = os.path.join(qdir, "acks.0000000001")
            wait_until(lambda: len(read_ack_entries(acks)[0]) == 5, 10, "5 acks in the ack file",
                       pause=pumping(conn), context=lambda: str(read_ack_entries(acks)))
            ch.basic_publish("", other, b"o0", PERSISTENT)  # confirmed: the group syncs go on
            os.rmdir(mark)
            healed = True
            # Written by the periodic sync's flush (nothing was delivered since), which met the
            # fault each second until now and goes on.
            wait_until(lambda: os.path.isfile(mark) and os.path.getsize(mark) == 8, 10,
                       "the mark written, with no delivery since")
            ch.basic_publish("", other, b"o1", PERSISTENT)
        finally:
            if not healed:
                os.rmdir(mark)
        log = node.log_text()
        assert log.count(f"{qdir}: cannot write the delivered mark") == 1, log
        assert log.count(f"{qdir}: delivered mark written again") == 1, log
    finally:
        if conn.is_open:
            conn.close()
    node.kill9()
    node.restart()
    conn = node.connect()
    try:
        ch = conn.channel()
        back = []
        while True:
            method, _p, body = ch.basic_get(q, auto_ack=True)
            if method is None:
                break
            back.append((body, method.redelivered))
        assert back == [(b"m%d" % i, True) for i in range(5, 10)]
        assert ch.queue_declare(other, passive=True).method.message_count == 2
    finally:
        conn.close()
