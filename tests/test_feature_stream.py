"""Stream queues (x-queue-type: stream) on a real node, driven by pika and aio-pika."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import signal
import time

import aio_pika
import pika
import pytest
from pika.exceptions import ConnectionClosedByBroker

from tests.helpers import WAIT, channel_error, count, uid

STREAM = {"x-queue-type": "stream"}


def declare(ch, q: str, **extra) -> None:
    ch.queue_declare(q, durable=True, arguments={**STREAM, **extra})


def publish(ch, q: str, bodies, headers=None) -> None:
    """Publish with confirms (the ch fixture is in confirm mode): stored when this returns."""
    for body in bodies:
        ch.basic_publish("", q, body, pika.BasicProperties(delivery_mode=2, headers=headers))


def read(conn, q: str, n: int, args: dict | None = None, tag: str | None = None, prefetch: int = 50,
         ack: int | None = None, wait_more: float = 0.0, channel=None) -> list[tuple[int, bytes]]:
    """Consume n messages: [(x-stream-offset, body)]; acks the first `ack` (all when None), then cancels.

    Returns the first n; with wait_more > 0 everything that arrived, so the caller can check that
    nothing beyond n arrived within that time.
    """
    ch = channel or conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got: list[tuple[int, bytes]] = []

    def on_message(c, method, props, body):
        got.append((props.headers["x-stream-offset"], body))
        # Only the first n count: acks free credit, so more can arrive in the same batch; acking those
        # too would move a tracked offset past what the caller read.
        if len(got) <= n and (ack is None or len(got) <= ack):
            c.basic_ack(method.delivery_tag)

    kwargs = {"consumer_tag": tag} if tag else {}
    ctag = ch.basic_consume(q, on_message, arguments=args or {}, **kwargs)
    deadline = time.monotonic() + WAIT
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n}: {got}"
        conn.process_data_events(time_limit=0.05)
    if wait_more:
        conn.process_data_events(time_limit=wait_more)
    ch.basic_cancel(ctag)
    if channel is None:
        ch.close()
    return got if wait_more else got[:n]


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


# --------------------------------------------------------------------------- declare
def test_declare_rules(conn, ch):
    q = uid("s")
    rs = f"queue '{q}' in vhost '/'"
    for kwargs, text in (
        ({"durable": False}, f"PRECONDITION_FAILED - invalid property 'non-durable' for {rs}"),
        ({"durable": True, "exclusive": True}, f"PRECONDITION_FAILED - invalid property 'exclusive-owner' for {rs}"),
        ({"durable": True, "auto_delete": True}, f"PRECONDITION_FAILED - invalid property 'auto-delete' for {rs}"),
    ):
        assert channel_error(conn, lambda c, kw=kwargs: c.queue_declare(q, arguments=STREAM, **kw)) == (406, text)
    for extra, text in (
        ({"x-message-ttl": 1000}, f"invalid arg 'x-message-ttl' for {rs} of queue type rabbit_stream_queue"),
        ({"x-dead-letter-exchange": "dlx"},
         f"invalid arg 'x-dead-letter-exchange' for {rs} of queue type rabbit_stream_queue"),
        ({"x-max-age": "7 days"}, f"invalid arg 'x-max-age' for {rs}"),
        ({"x-max-length-bytes": -1}, f"invalid arg 'x-max-length-bytes' for {rs}"),
        ({"x-stream-max-segment-size-bytes": 0}, f"invalid arg 'x-stream-max-segment-size-bytes' for {rs}"),
    ):
        code, reply = channel_error(conn, lambda c, e=extra: declare(c, q, **e))
        assert code == 406 and text in reply, reply
    declare(ch, q, **{"x-max-age": "7D", "x-max-length-bytes": 1 << 30})
    declare(ch, q, **{"x-max-age": "7D", "x-max-length-bytes": 1 << 30})  # equivalent redeclare
    assert count(ch, q) == 0


def test_consume_requires_manual_ack_and_prefetch(conn, ch):
    q = uid("s")
    declare(ch, q)
    text = f"PRECONDITION_FAILED - consumer prefetch count is not set for stream queue '{q}' in vhost '/'"

    def no_ack(c):
        c.basic_qos(prefetch_count=10)
        c.basic_consume(q, lambda *a: None, auto_ack=True)

    assert channel_error(conn, no_ack) == (406, text)
    assert channel_error(conn, lambda c: c.basic_consume(q, lambda *a: None)) == (406, text)

    def bad_offset(c):
        c.basic_qos(prefetch_count=10)
        c.basic_consume(q, lambda *a: None, arguments={"x-stream-offset": "yesterday"})

    code, reply = channel_error(conn, bad_offset)
    assert code == 406 and "x-stream-offset must be" in reply


def test_basic_get_and_purge_are_refused(node):
    conn = node.connect()
    ch = conn.channel()
    q = uid("s")
    declare(ch, q)
    with pytest.raises(ConnectionClosedByBroker) as info:
        ch.basic_get(q)
    assert info.value.reply_code == 540
    assert info.value.reply_text == f"NOT_IMPLEMENTED - basic.get not supported by stream queues queue '{q}' in vhost '/'"
    conn = node.connect()
    with pytest.raises(ConnectionClosedByBroker) as info:
        conn.channel().queue_purge(q)
    assert info.value.reply_code == 540


# --------------------------------------------------------------------------- offsets
def test_start_offsets_and_offset_headers(conn, ch):
    q = uid("s")
    declare(ch, q)
    publish(ch, q, bodies(10))
    assert count(ch, q) == 10
    expected = [(i, f"m{i}".encode()) for i in range(10)]
    assert read(conn, q, 10, {"x-stream-offset": "first"}, wait_more=0.1) == expected
    assert read(conn, q, 6, {"x-stream-offset": 4}, wait_more=0.1) == expected[4:]
    assert read(conn, q, 1, {"x-stream-offset": "last"}, wait_more=0.1) == expected[9:]
    # "next" (and no x-stream-offset at all) only sees what is published after it attached.
    for args in ({"x-stream-offset": "next"}, {}):
        sub = conn.channel()
        sub.basic_qos(prefetch_count=10)
        got: list = []

        def on_message(c, m, p, b, got=got):
            got.append((p.headers["x-stream-offset"], b))
            c.basic_ack(m.delivery_tag)

        sub.basic_consume(q, on_message, arguments=args)
        conn.process_data_events(time_limit=0.2)
        assert got == []
        n = count(ch, q)
        publish(ch, q, [b"new"])
        deadline = time.monotonic() + WAIT
        while not got:
            assert time.monotonic() < deadline
            conn.process_data_events(time_limit=0.05)
        assert got == [(n, b"new")]
        sub.close()
    # Acks removed nothing.
    assert count(ch, q) == 12


def test_timestamp_and_interval_offsets(conn, ch):
    q = uid("s")
    declare(ch, q)
    publish(ch, q, [b"old"])
    # AMQP timestamps are whole seconds: "old" must lie before the second that "new" starts,
    # and more than 1 s before the interval consumer attaches.
    time.sleep(1.2)
    mark = time.time()
    publish(ch, q, [b"new"])
    assert read(conn, q, 1, {"x-stream-offset": "1s"}, wait_more=0.1) == [(1, b"new")]
    since = datetime.datetime.fromtimestamp(int(mark), tz=datetime.UTC)
    assert read(conn, q, 1, {"x-stream-offset": since}, wait_more=0.1) == [(1, b"new")]
    assert read(conn, q, 2, {"x-stream-offset": "1h"}) == [(0, b"old"), (1, b"new")]


def test_two_consumers_at_their_own_pace(conn, ch):
    q = uid("s")
    declare(ch, q)
    publish(ch, q, bodies(20))
    slow_ch, fast_ch = conn.channel(), conn.channel()
    slow_ch.basic_qos(prefetch_count=2)
    fast_ch.basic_qos(prefetch_count=100)
    slow, fast = [], []
    held = []

    def on_slow(c, m, p, b):
        slow.append(p.headers["x-stream-offset"])
        held.append(m.delivery_tag)

    slow_ch.basic_consume(q, on_slow, arguments={"x-stream-offset": "first"})
    fast_ch.basic_consume(q, lambda c, m, p, b: (fast.append(p.headers["x-stream-offset"]),
                                                 c.basic_ack(m.delivery_tag)),
                          arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + WAIT
    while len(fast) < 20:
        assert time.monotonic() < deadline
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=0.1)
    assert fast == list(range(20))
    assert slow == [0, 1]  # held by its prefetch while the other read everything
    # nack (even with requeue) and ack only release prefetch: the slow one reads on, nothing repeats.
    slow_ch.basic_nack(held.pop(0), requeue=True)
    slow_ch.basic_ack(held.pop(0))
    while len(slow) < 4:
        assert time.monotonic() < deadline
        conn.process_data_events(time_limit=0.05)
    assert slow == [0, 1, 2, 3]
    assert count(ch, q) == 20
    assert read(conn, q, 20, {"x-stream-offset": "first"}) == [(i, f"m{i}".encode()) for i in range(20)]


# --------------------------------------------------------------------------- filtering
def test_filtering(conn, ch):
    q = uid("s")
    declare(ch, q)
    publish(ch, q, [b"r0"], {"x-stream-filter-value": "red"})
    publish(ch, q, [b"b1"], {"x-stream-filter-value": "blue"})
    publish(ch, q, [b"n2"])
    publish(ch, q, [b"r3"], {"x-stream-filter-value": "red"})
    publish(ch, q, [b"g4"], {"x-stream-filter-value": "green"})
    first = {"x-stream-offset": "first"}
    assert read(conn, q, 2, {**first, "x-stream-filter": "red"}, wait_more=0.2) == [(0, b"r0"), (3, b"r3")]
    assert read(conn, q, 3, {**first, "x-stream-filter": ["red", "blue"]}, wait_more=0.2) == [
        (0, b"r0"), (1, b"b1"), (3, b"r3")]
    assert read(conn, q, 3, {**first, "x-stream-filter": "blue,green", "x-stream-match-unfiltered": True},
                wait_more=0.2) == [(1, b"b1"), (2, b"n2"), (4, b"g4")]

    def bad_filter(c):
        c.basic_qos(prefetch_count=10)
        c.basic_consume(q, lambda *a: None, arguments={"x-stream-filter": 5})

    code, reply = channel_error(conn, bad_filter)
    assert code == 406 and "x-stream-filter must be" in reply


# --------------------------------------------------------------------------- retention
def _offsets(conn, q: str, n: int) -> list[int]:
    return [o for o, _ in read(conn, q, n, {"x-stream-offset": "first"}, wait_more=0.1)]


@pytest.mark.parametrize("limit", [{"x-max-length-bytes": 1500}, {"x-max-length": 12}])
def test_retention_by_size_and_length_removes_whole_segments(conn, ch, limit):
    q = uid("s")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 500}, **limit)
    publish(ch, q, [b"x" * 60 for _ in range(60)])
    n = count(ch, q)
    assert 0 < n < 60
    if "x-max-length" in limit:
        # Whole segments only (4 records of this size fit in 500 bytes): the write segment may add to it.
        assert n <= 12 + 4
    offsets = _offsets(conn, q, n)
    assert offsets == list(range(60 - n, 60))  # retained messages keep their offsets
    # A numeric offset below the first retained one is clamped to it.
    assert read(conn, q, 1, {"x-stream-offset": 0}, prefetch=1, ack=0)[0][0] == 60 - n


def test_retention_by_age(conn, ch):
    q = uid("s")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 500, "x-max-age": "1s"})
    publish(ch, q, [b"o" * 60 for _ in range(20)])
    # No more publishes or consumers: the shard's timer removes the aged segments.
    deadline = time.monotonic() + WAIT
    while (n := count(ch, q)) == 20:
        assert time.monotonic() < deadline, "nothing aged out"
        time.sleep(0.05)
    assert 0 < n < 20  # the write segment stays
    publish(ch, q, [b"n" * 60 for _ in range(20)])
    n = count(ch, q)
    got = read(conn, q, n, {"x-stream-offset": "first"})
    assert [o for o, _ in got] == list(range(40 - n, 40))
    assert got[-20:] == [(i, b"n" * 60) for i in range(20, 40)]


def test_segments_aged_out_by_the_timer_show_in_the_management_api(node_factory):
    """An idle stream shrinking on its max-age timer (no publish, no reader) reports its new count:
    the STATS report reads only the queues touched since the last one, and the timer touches it."""
    from tests.mgmt_api import Api

    node = node_factory(extra_args=["--stats-interval", "200"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("s")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 500, "x-max-age": "1s"})
    publish(ch, q, [b"o" * 60 for _ in range(20)])
    api = Api(node.http_port)

    def shown() -> int | None:  # the list's counts come from the shards' STATS (one queue's GET asks the shard)
        return next((x.get("messages") for x in api.get("/api/queues/%2F") if x["name"] == q), None)

    deadline = time.monotonic() + WAIT
    while shown() != 20:  # the publishes' report
        assert time.monotonic() < deadline, shown()
        time.sleep(0.05)
    # The timer may age out more segments between two readings: compare the list with a count read
    # right after it, until they agree on a shrunk stream.
    while not (0 < (n := count(ch, q)) < 20 and shown() == n == count(ch, q)):
        assert time.monotonic() < deadline, f"the API lists {shown()} messages, the stream holds {n}"
        time.sleep(0.05)
    conn.close()


# --------------------------------------------------------------------------- offset tracking
def test_server_side_offset_tracking_resumes_after_reconnect(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("s")
    declare(ch, q)
    publish(ch, q, bodies(10))
    track = {"x-stream-offset": "first", "x-stream-automatic-offset-tracking": True}
    # 5 delivered, 3 acked: the next connection resumes at the first unacked one.
    assert [o for o, _ in read(conn, q, 5, track, tag="reader-a", prefetch=5, ack=3)] == [0, 1, 2, 3, 4]
    conn.close()
    conn = node.connect()
    assert [o for o, _ in read(conn, q, 2, track, tag="reader-a", prefetch=2)] == [3, 4]
    # LavinMQ's other form: x-stream-offset null tracks too and starts at the first message.
    assert [o for o, _ in read(conn, q, 2, {"x-stream-offset": None}, tag="reader-b", prefetch=2)] == [0, 1]
    assert [o for o, _ in read(conn, q, 1, {"x-stream-offset": None}, tag="reader-b", prefetch=1)] == [2]
    # An explicit offset without the tracking flag ignores (and does not move) the stored one.
    assert [o for o, _ in read(conn, q, 1, {"x-stream-offset": 0}, tag="reader-a", prefetch=1)] == [0]
    assert [o for o, _ in read(conn, q, 1, track, tag="reader-a", prefetch=1)] == [5]
    conn.close()


def test_stream_contents_offsets_and_tracked_offsets_survive_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("s")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 400})
    publish(ch, q, bodies(30))
    track = {"x-stream-offset": "first", "x-stream-automatic-offset-tracking": True}
    assert [o for o, _ in read(conn, q, 7, track, tag="durable-reader", prefetch=7)] == list(range(7))
    conn.close()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    assert count(ch, q) == 30
    assert read(conn, q, 30, {"x-stream-offset": "first"}) == [(i, f"m{i}".encode()) for i in range(30)]
    assert [o for o, _ in read(conn, q, 2, track, tag="durable-reader", prefetch=2)] == [7, 8]
    publish(ch, q, [b"after"])
    assert read(conn, q, 1, {"x-stream-offset": "last"}) == [(30, b"after")]
    conn.close()


# --------------------------------------------------------------------------- aio-pika
def test_aio_pika_consumer_reads_from_an_offset(shared_node):
    async def main() -> list[tuple[int, bytes]]:
        connection = await aio_pika.connect(shared_node.url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.set_qos(prefetch_count=10)
            name = uid("s")
            queue = await channel.declare_queue(name, durable=True, arguments=STREAM)
            for i in range(5):
                await channel.default_exchange.publish(
                    aio_pika.Message(f"a{i}".encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT), name)
            got = []
            async with queue.iterator(arguments={"x-stream-offset": 2}) as it:
                async for message in it:
                    async with message.process():
                        got.append((message.headers["x-stream-offset"], message.body))
                    if len(got) == 3:
                        break
            return got

    got = asyncio.run(asyncio.wait_for(main(), WAIT * 2))
    assert got == [(2, b"a2"), (3, b"a3"), (4, b"a4")]



def test_retention_policy_applies_to_existing_streams(node_factory, tmp_path):
    path = tmp_path / "definitions.json"

    def write(definition: dict) -> None:
        path.write_text(json.dumps({"policies": [{
            "vhost": "/", "name": "stream-retention", "pattern": "^pol-stream", "apply-to": "queues",
            "priority": 0, "definition": definition}], "operator_policies": [], "parameters": []}))

    write({"max-length-bytes": 1500})
    node = node_factory(name="pol", frontends=1, shards=1, extra_args=["--definitions", str(path)])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("pol-stream")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 500})
    publish(ch, q, [b"x" * 60 for _ in range(60)])
    n = count(ch, q)
    assert 0 < n < 30
    assert _offsets(conn, q, n) == list(range(60 - n, 60))
    write({"max-length": 1})  # tighter at runtime: whole sealed segments go at once
    os.kill(node.pid, signal.SIGHUP)
    deadline = time.monotonic() + WAIT
    while count(ch, q) >= n:
        assert time.monotonic() < deadline, "the new policy was not applied"
        time.sleep(0.05)
    m = count(ch, q)
    assert _offsets(conn, q, m) == list(range(60 - m, 60))
    conn.close()


def test_confirmed_messages_and_tracked_offsets_survive_kill9(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("s")
    declare(ch, q)
    publish(ch, q, bodies(12))
    track = {"x-stream-offset": "first", "x-stream-automatic-offset-tracking": True}
    assert [o for o, _ in read(conn, q, 4, track, tag="crash-reader", prefetch=4)] == [0, 1, 2, 3]
    # Tracked offsets reach the disk with the shard's periodic sync (batched, not per ack): wait for it.
    offsets_file = node.data_dir / hashlib.sha1(b"/").hexdigest() / hashlib.sha1(q.encode()).hexdigest() / "offsets"
    deadline = time.monotonic() + WAIT
    while not (offsets_file.exists() and json.loads(offsets_file.read_text())["offsets"].get("crash-reader") == 4):
        assert time.monotonic() < deadline, "tracked offset never written"
        time.sleep(0.05)
    node.kill9()
    node.start()
    conn = node.connect()
    assert read(conn, q, 12, {"x-stream-offset": "first"}) == [(i, f"m{i}".encode()) for i in range(12)]
    assert [o for o, _ in read(conn, q, 1, track, tag="crash-reader", prefetch=1)] == [4]
    conn.close()


def test_offset_header_keeps_other_properties_and_replaces_a_published_one(conn, ch):
    q = uid("s")
    declare(ch, q)
    ch.basic_publish("", q, b"p0", pika.BasicProperties(content_type="text/plain", correlation_id="c-1"))
    ch.basic_publish("", q, b"p1", pika.BasicProperties(
        content_type="application/json", headers={"x-stream-offset": "forged", "k": "v"}, priority=3))
    sub = conn.channel()
    sub.basic_qos(prefetch_count=5)
    got = []
    sub.basic_consume(q, lambda c, m, p, b: got.append(p), arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + WAIT
    while len(got) < 2:
        assert time.monotonic() < deadline
        conn.process_data_events(time_limit=0.05)
    assert (got[0].content_type, got[0].correlation_id, got[0].headers) == ("text/plain", "c-1",
                                                                            {"x-stream-offset": 0})
    assert (got[1].content_type, got[1].priority, got[1].headers) == ("application/json", 3,
                                                                       {"k": "v", "x-stream-offset": 1})
    sub.close()


def test_basic_recover_reads_unacked_deliveries_again(conn, ch):
    q = uid("s")
    declare(ch, q)
    publish(ch, q, bodies(6))
    sub = conn.channel()
    sub.basic_qos(prefetch_count=3)
    got = []
    sub.basic_consume(q, lambda c, m, p, b: got.append((p.headers["x-stream-offset"], m.delivery_tag)),
                      arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + WAIT
    while len(got) < 3:
        assert time.monotonic() < deadline
        conn.process_data_events(time_limit=0.05)
    sub.basic_ack(got[0][1])  # offset 0 done; 1 and 2 are still unacked
    conn.process_data_events(time_limit=0.1)
    assert [o for o, _ in got] == [0, 1, 2, 3]
    sub.basic_recover(requeue=True)
    while len(got) < 7:
        assert time.monotonic() < deadline, got
        conn.process_data_events(time_limit=0.05)
    assert [o for o, _ in got] == [0, 1, 2, 3, 1, 2, 3]
    sub.close()


# --------------------------------------------------------------------------- with other features
def test_streams_with_the_node_default_consumer_timeout_and_periodic_work(node_factory):
    """A stream consumer holding unacked deliveries is not timed out (RabbitMQ has no consumer timeout
    on streams), and the shard's periodic work (timeout scan, delivery-count saving, syncs) keeps
    running with a stream present: a classic queue's slow consumer is still timed out afterwards."""
    node = node_factory(frontends=1, shards=1, extra_args=["--consumer-timeout", "300"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    s, q = uid("s"), uid("q")
    declare(ch, s)
    assert ch.queue_declare(s, durable=True, arguments=STREAM).method.message_count == 0  # redeclare
    ch.queue_declare(q, durable=True, arguments={"x-delivery-limit": 5})
    publish(ch, s, bodies(3))
    holder = conn.channel()
    got = read(conn, s, 3, args={"x-stream-offset": "first"}, ack=0, wait_more=1.0, channel=holder)
    assert [b for _o, b in got] == bodies(3)
    assert holder.is_open  # 1 s with 3 unacked stream deliveries, timeout 300 ms: still open
    ch.basic_publish("", q, b"slow", pika.BasicProperties(delivery_mode=2))
    slow = conn.channel()
    slow.basic_consume(q, lambda *a: None)
    deadline = time.monotonic() + WAIT
    while slow.is_open:
        assert time.monotonic() < deadline, "the classic queue's consumer was never timed out"
        conn.process_data_events(time_limit=0.05)
    assert holder.is_open
    conn.close()
    node.stop()
    assert "Traceback" not in node.log_text()


def test_redeclare_with_another_segment_size_is_inequivalent(conn, ch):
    q = uid("s")
    declare(ch, q, **{"x-stream-max-segment-size-bytes": 1 << 20})
    code, text = channel_error(conn, lambda c: declare(c, q, **{"x-stream-max-segment-size-bytes": 2 << 20}))
    assert code == 406 and "inequivalent arg 'x-stream-max-segment-size-bytes'" in text, text
