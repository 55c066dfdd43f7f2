"""Back-pressure through a deduplicating exchange's owner shard, on a real node.

Publishes to an ``x-message-deduplication`` exchange go to the owner shard, which forwards them
to the shards of the routed queues (shard/dedup.py). The owner holds its PROCESSED answers to the
frontend while its own forwards to one of those shards are unanswered (ShardWorker.forwards_behind),
so the frontend stops reading the publisher: with the queue's shard frozen (SIGSTOP) a flood stops
after a bounded number of bytes instead of piling up in the owner's memory, and once the shard runs
again every message arrives and is confirmed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from broker.contract import MAX_BATCHES_IN_FLIGHT
from broker.dedup import exchange_shard
from broker.turn_batch import MAX_BATCH_ITEMS
from tests.helpers import WAIT, uid, wait_count
from tests.raw_amqp import RawClient
from tests.test_feature_dlx import uid_on

BODY = 1024
N = 65536
# Messages that may be read before the publisher is paused: batches of up to MAX_BATCH_ITEMS
# messages, MAX_BATCHES_IN_FLIGHT (+1) of them from the frontend to the owner unanswered and as
# many from the owner to the queue's shard (plus the turn at hand), and the kernel's socket
# buffers on loopback (a few MiB).
BOUND = 3 * (MAX_BATCHES_IN_FLIGHT + 2) * MAX_BATCH_ITEMS + (8 << 20) // BODY


def exchange_owned_by(shard: int) -> str:
    while True:
        name = uid("dx")
        if exchange_shard("/", name, 2) == shard:
            return name


@pytest.mark.parametrize("frozen", ["queue-shard", "owner"])
def test_a_flood_into_a_deduplicating_exchange_is_paced_by_the_shards_behind_it(node, frozen):
    """The owner (shard 0) frozen: its frontend batches go unanswered. The queue's shard (1) frozen:
    the owner's forwards go unanswered, and the owner holds its answers (the part this adds)."""
    conn = node.connect()
    ch = conn.channel()
    x = exchange_owned_by(0)
    ch.exchange_declare(x, "fanout", arguments={"x-message-deduplication": True})
    q = uid_on(1, "dq")
    ch.queue_declare(q)
    ch.queue_bind(q, x)

    client = RawClient(node.port, timeout=WAIT)
    client.handshake()
    client.open_channel(1)
    client.send_method(1, C.Confirm.Select())
    client.expect(C.Confirm.SelectOk)
    one = (pframe.marshal(C.Basic.Publish(exchange=x, routing_key=""), 1)
           + pframe.marshal(pheader.ContentHeader(0, BODY, C.Basic.Properties()), 1)
           + pframe.marshal(ContentBody(b"m" * BODY), 1))
    sent = [0]
    failed: list[BaseException] = []

    def flood() -> None:
        try:
            client.sock.settimeout(None)  # blocks while the node does not read
            for _ in range(N):
                client.sock.sendall(one)
                sent[0] += 1
        except BaseException as exc:  # reported by the test thread
            failed.append(exc)

    target = node.worker_pid("shard", 0 if frozen == "owner" else 1)
    os.kill(target, signal.SIGSTOP)
    try:
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        # Until the sender makes no progress for a second (or is done: the node read everything).
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + 60
        while sender.is_alive() and time.monotonic() - since < 1.0:
            assert time.monotonic() < deadline, "the flood neither ended nor stalled"
            if sent[0] != last:
                last, since = sent[0], time.monotonic()
            time.sleep(0.05)
        offered = sent[0]
        assert offered < BOUND, f"{offered} messages read with the queue's shard stopped (bound {BOUND})"
    finally:
        os.kill(target, signal.SIGCONT)
    sender.join(WAIT * 3)
    assert not sender.is_alive() and not failed, failed
    # Every message confirmed (acks with `multiple` up to N) and in the queue.
    acked = 0
    while acked < N:
        got = client.next_frame(WAIT)
        assert got is not None, f"{acked} of {N} confirmed"
        _ch, value = got
        if isinstance(value, C.Basic.Nack):
            raise AssertionError(f"nacked: {value!r}")
        if isinstance(value, C.Basic.Ack):
            acked = max(acked, value.delivery_tag)
    client.close()
    wait_count(ch, q, N)
    conn.close()
