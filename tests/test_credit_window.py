"""The shard -> frontend credit window (contract.CREDIT_WINDOW, CREDIT_BYTES_SHIFT) over many refills.

A consumer's shard spends credit per delivery and the frontend returns it once written; each test
moves several windows' worth through one consumer, so a frontend that returned less credit than the
shard charged (or computed the cost differently) stalls the consumer, and one that returned more,
or a refill that reordered or repeated deliveries, shows in the order and the counts.
"""
from __future__ import annotations

import pytest

from broker import contract
from tests.helpers import count, uid, wait_count
from tests.test_basic import Inbox, wait_for

WINDOWS = 2.5


@pytest.fixture
def pub(conn):
    return conn.channel()  # unconfirmed: the counts below are checked on the queue instead


def _publish(ch, queue: str, bodies) -> None:
    for body in bodies:
        ch.basic_publish("", queue, body)


def _fill_then_consume(conn, pub, n: int, words: int) -> tuple[str, Inbox]:
    """Queue n bodies of ``words`` 4-byte sequence numbers, then consume them all with no-ack; checks
    they arrived in order. Returns the queue and the consumer's inbox."""
    q = uid()
    pub.queue_declare(q, auto_delete=True)
    _publish(pub, q, (i.to_bytes(4, "big") * words for i in range(n)))
    wait_count(pub, q, n, timeout=30)
    ch = conn.channel()
    inbox = Inbox()
    ch.basic_consume(q, inbox, auto_ack=True)
    wait_for(conn, lambda: len(inbox) >= n, f"all {n} messages", timeout=60)
    assert [int.from_bytes(b[:4], "big") for b in inbox.bodies] == list(range(n))
    return q, inbox


def test_small_bodies_over_several_windows_arrive_once_in_order(conn, pub):
    n = int(contract.CREDIT_WINDOW * WINDOWS)  # each 16 B body costs one credit
    q, inbox = _fill_then_consume(conn, pub, n, 4)
    wait_count(pub, q, 0)
    assert len(inbox) == n  # nothing delivered twice after the last refill


def test_large_bodies_spend_credit_by_size_and_keep_flowing(conn, pub):
    size = 64 * 1024
    cost = 1 + (size >> contract.CREDIT_BYTES_SHIFT)
    n = int(contract.CREDIT_WINDOW * WINDOWS) // cost + 1  # several byte-bounded windows
    _q, inbox = _fill_then_consume(conn, pub, n, size // 4)
    assert all(len(b) == size for b in inbox.bodies)


def test_prefetch_still_bounds_deliveries_under_a_large_window(conn, pub):
    prefetch, n = 3, 20
    q = uid()
    pub.queue_declare(q, auto_delete=True)
    _publish(pub, q, (bytes([i]) for i in range(n)))
    wait_count(pub, q, n)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    inbox = Inbox()
    ch.basic_consume(q, inbox)
    # The queue's ready count is the shard's: prefetch left n - prefetch there, not fewer.
    wait_for(conn, lambda: len(inbox) >= prefetch and count(pub, q) == n - prefetch, "the first prefetch")
    assert len(inbox) == prefetch
    ch.basic_ack(inbox.items[-1][0].delivery_tag, multiple=True)
    wait_for(conn, lambda: len(inbox) >= 2 * prefetch and count(pub, q) == n - 2 * prefetch, "the second prefetch")
    assert len(inbox) == 2 * prefetch
    assert inbox.bodies == [bytes([i]) for i in range(2 * prefetch)]
