"""x-delivery-limit / x-delivery-count and x-consumer-timeout on a real node (pika, aio-pika)."""

from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path

import aio_pika
import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from shard.store import queue_dir
from tests.helpers import WAIT, control_lane_barrier, count, get_one, uid

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


def get_unacked(ch, queue: str):
    return get_one(ch, queue, auto_ack=False)


def test_delivery_count_header_and_limit_dead_letters(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = uid()
    ch.queue_declare(q, arguments={"x-delivery-limit": 2, "x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"poison")
    seen = []
    for _ in range(3):  # delivered limit + 1 times
        method, props, body = get_unacked(ch, q)
        seen.append((props.headers or {}).get("x-delivery-count"))
        ch.basic_nack(method.delivery_tag, requeue=True)
    assert seen == [None, 1, 2]
    method, props, body = get_unacked(ch, dlq)
    assert body == b"poison"
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"
    assert props.headers["x-death"][0]["queue"] == q
    assert count(ch, q) == 0


def test_delivery_limit_counts_channel_close_returns(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-delivery-limit": 0})
    ch.basic_publish("", q, b"once")
    other = conn.channel()
    method, _p, _b = get_unacked(other, q)
    other.close()  # returned once: more than 0, dropped (no DLX)
    control_lane_barrier(conn, q)  # the shard has handled the return
    assert count(ch, q) == 0
    assert ch.basic_get(q, auto_ack=True)[0] is None


def test_quorum_type_redelivery_carries_delivery_count(ch):
    q = uid()
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
    ch.basic_publish("", q, b"qq")
    method, props, _b = get_unacked(ch, q)
    assert not (props.headers or {}).get("x-delivery-count")
    ch.basic_reject(method.delivery_tag, requeue=True)
    method, props, _b = get_unacked(ch, q)
    assert method.redelivered and props.headers["x-delivery-count"] == 1
    ch.basic_ack(method.delivery_tag)


def test_consumer_timeout_closes_the_channel_with_406(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-consumer-timeout": 200})
    ch.basic_publish("", q, b"slow")
    cch = conn.channel()
    got = []
    with pytest.raises(ChannelClosedByBroker) as info:
        for method, _props, _body in cch.consume(q, inactivity_timeout=WAIT):
            assert method is not None, "the channel was not closed"
            got.append(method.delivery_tag)
    assert got, "the message was never delivered"
    assert info.value.reply_code == 406
    assert info.value.reply_text.startswith(f"PRECONDITION_FAILED - delivery acknowledgement on channel "
                                            f"{cch.channel_number} timed out")
    # The unacked message went back to the queue with the channel.
    deadline = time.monotonic() + WAIT
    while count(ch, q) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_consumer_timeout_spares_a_consumer_that_acks(shared_node):
    async def run() -> list[bytes]:
        connection = await aio_pika.connect(shared_node.url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1)  # the timeout runs per delivery, from its delivery
            q = await channel.declare_queue(uid(), arguments={"x-consumer-timeout": 300})
            for i in range(5):
                await channel.default_exchange.publish(aio_pika.Message(b"a%d" % i), routing_key=q.name)
            got = []
            async with q.iterator() as it:
                async for message in it:
                    await asyncio.sleep(0.1)  # each within the timeout; together well past it
                    await message.ack()
                    got.append(message.body)
                    if len(got) == 5:
                        break
            assert not channel.is_closed
            return got

    assert asyncio.run(asyncio.wait_for(run(), WAIT)) == [b"a%d" % i for i in range(5)]


@pytest.mark.parametrize("qtype, kwargs, text", [
    ("stream", {"durable": False}, "invalid property 'non-durable' for queue '{q}' in vhost '/'"),
    ("fancy", {"durable": True}, "invalid arg 'x-queue-type' for queue '{q}' in vhost '/': unsupported queue type"),
    ("quorum", {"durable": False}, "invalid property 'non-durable' for queue '{q}' in vhost '/'"),
    ("quorum", {"durable": True, "exclusive": True}, "invalid property 'exclusive-owner' for queue '{q}'"),
    ("quorum", {"durable": True, "auto_delete": True}, "invalid property 'auto-delete' for queue '{q}'"),
])
def test_unsupported_queue_types_are_refused_with_406(conn, qtype, kwargs, text):
    q = uid()
    channel = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.queue_declare(q, arguments={"x-queue-type": qtype}, **kwargs)
    assert info.value.reply_code == 406
    assert info.value.reply_text.startswith("PRECONDITION_FAILED - " + text.format(q=q)), info.value.reply_text


def test_classic_queue_type_is_accepted(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-queue-type": "classic"})
    ch.basic_publish("", q, b"c")
    assert count(ch, q) == 1


def test_delivery_counts_survive_a_node_restart_and_a_shard_crash(node):
    q = uid("qq")

    def channel():
        c = node.connect()
        channel_ = c.channel()
        channel_.confirm_delivery()
        return c, channel_

    def returned_count(channel_) -> int | None:
        method, props, _body = get_unacked(channel_, q)
        channel_.basic_nack(method.delivery_tag, requeue=True)
        return (props.headers or {}).get("x-delivery-count")

    conn, ch = channel()
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 10})
    ch.basic_publish("", q, b"counted", pika.BasicProperties(delivery_mode=2))
    assert [returned_count(ch), returned_count(ch)] == [None, 1]
    conn.close()
    node.restart()  # clean stop: the counts are written at stop
    conn, ch = channel()
    assert returned_count(ch) == 2
    # A crash loses at most what the periodic sync (1 s) had not written yet: wait until it has.
    counts_file = Path(queue_dir(str(node.data_dir), "/", q)) / "delivery-counts"
    deadline = time.monotonic() + WAIT
    while not (counts_file.exists() and counts_file.read_bytes()[8:12] == (3).to_bytes(4, "little")):
        assert time.monotonic() < deadline, "the delivery counts were never written"
        time.sleep(0.05)
    shard = zlib.crc32(f"/\0{q}".encode()) % node.shards
    node.wait_worker_restarted("shard", shard, node.kill_worker("shard", shard))
    if conn.is_open:
        try:
            conn.close()
        except Exception:  # the frontend closed it when the shard died
            pass
    deadline = time.monotonic() + WAIT
    while True:
        try:
            conn, ch = channel()
            assert returned_count(ch) == 3
            break
        except pika.exceptions.AMQPError:
            assert time.monotonic() < deadline, "the restarted shard never served the queue"
            time.sleep(0.1)
    conn.close()
