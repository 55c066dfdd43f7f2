"""A clean stop forwards no message twice: due delayed messages and a deduplicating exchange's
forwards (shard/forward_settle.py; dead letters: tests/test_dead_letter_stop.py).

A shard that forwarded a message to a queue of another shard keeps its own copy until that shard
confirms it: a delayed message stays in its delay store, a dead letter in its outbox (and a
deduplicating exchange's owner owes the dead letter's source a confirm until its targets confirmed).
The target confirms a persistent message after its next group sync, and every shard of a node
stops at once: a shard that stops without waiting for its peers' confirms routes the delayed message
again after the restart (or sends the dead letter again, to an owner whose cache is empty by then),
and the target queue holds it twice.

After a kill -9 of the node, at least once: the forwarding side sends what it kept again.

The window is held open with a test-only stall of the target shard's group syncs
(SHARDMQ_TEST_STALL_FSYNC_WHILE's ``.shard-N`` twin): the forwards are stored, not confirmed. The
stall ends once the forwarding shard either stopped (the bug) or logged that it waits for its peers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pika
import pytest

from broker.dedup import exchange_shard
from broker.routing import delay_store_shard
from tests.harness import Node
from tests.helpers import WAIT, count, names_on_different_shards, reject_all, uid, wait_count

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)

N = 40
WAITS = "stops once its peers answer: "  # shard/forward_settle.py's log line


def _wait_log(node: Node, *texts: str) -> str:
    """Wait until one of `texts` is in the node's log; the one found."""
    deadline = time.monotonic() + WAIT
    while True:
        log = node.log_text()
        for text in texts:
            if text in log:
                return text
        assert time.monotonic() < deadline, f"none of {texts!r} logged:\n{node.log_tail()}"
        time.sleep(0.02)


def _wait_logged(node: Node, text: str, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while node.log_text().count(text) < n:
        assert time.monotonic() < deadline, f"{text!r} not logged {n} times:\n{node.log_tail()}"
        time.sleep(0.02)


def _stop_then_release(node: Node, stall: Path, forwarder: int) -> None:
    """Stop the node; end the stall of the target's syncs once shard `forwarder` has stopped (what
    the unfixed code does, its forwards unconfirmed) or said it waits for them; restart."""
    stopper = threading.Thread(target=node.stop)
    stopper.start()
    try:
        _wait_log(node, f"shard {forwarder} stopped", f"shard {forwarder} {WAITS}{N} ")
    finally:
        stall.unlink()
    stopper.join(WAIT + 20)
    assert not stopper.is_alive()
    node.start()
    _wait_logged(node, "ready: ", 4)  # both shards, both starts: what they recovered is known now


def _bodies(ch, queue: str) -> list[bytes]:
    out = []
    while True:
        method, _p, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body)


def _delayed_in_flight(node: Node, stall: Path) -> tuple[str, list[bytes], Path]:
    """N delayed messages of shard 0's delay store fall due and are stored by the queue's shard (1),
    unconfirmed (its syncs are held). Returns the queue, the bodies and the stall file to remove."""
    x = names_on_different_shards(uid("dx"))[0]
    assert delay_store_shard("/", x, 2) == 0
    q = names_on_different_shards(uid("dq"))[1]
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(x, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, x)
    held = Path(f"{stall}.shard-1")
    held.touch()  # shard 1 stores what comes, confirms nothing; shard 0 (the delay store) syncs
    bodies = [b"d%d" % i for i in range(N)]
    for body in bodies:  # confirmed once in the delay store (shard 0)
        ch.basic_publish(x, "", body, pika.BasicProperties(delivery_mode=2, headers={"x-delay": 50}))
    wait_count(ch, q, N)  # due and stored, not confirmed
    conn.close()
    return q, bodies, held


def _dedup_dead_letters_in_flight(node: Node, stall: Path, queue_shard: int = 0) -> tuple[str, list[bytes], Path]:
    """N messages of shard 0 are dead-lettered to a deduplicating exchange owned by shard 1, whose
    queue is on shard 0 again (or on the owner: its forward goes to its own ROUTER): source -> owner
    -> queue, stored there unconfirmed (the queue's shard's syncs are held). Returns the queue, the
    bodies and the stall file to remove."""
    x = next(n for i in range(1000) if exchange_shard("/", n := uid(f"dedup{i}"), 2) == 1)
    src = names_on_different_shards(uid("src"))[0]
    q = names_on_different_shards(uid("dq"))[queue_shard]
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(x, "fanout", durable=True, arguments={"x-message-deduplication": True})
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, x)
    ch.queue_declare(src, durable=True, arguments={"x-dead-letter-exchange": x})
    bodies = [b"m%d" % i for i in range(N)]
    for i, body in enumerate(bodies):
        ch.basic_publish("", src, body, pika.BasicProperties(
            delivery_mode=2, headers={"x-deduplication-header": f"k{i}"}))
    held = Path(f"{stall}.shard-{queue_shard}")
    held.touch()  # the queue's shard stores what comes, confirms nothing
    reject_all(conn, ch, src, N)
    wait_count(ch, q, N)  # through the owner and back, stored, not confirmed
    conn.close()
    return q, bodies, held


def _node(node_factory, tmp_path) -> tuple[Node, Path]:
    stall = tmp_path / "stall"
    return node_factory(name="node", frontends=2, shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)}), stall


def test_due_delayed_messages_confirmed_late_are_not_routed_again_after_a_clean_stop(node_factory, tmp_path):
    """The delay store's shard (0) must keep the records until the confirms come, or it routes them
    again after the restart."""
    node, stall = _node(node_factory, tmp_path)
    q, bodies, held = _delayed_in_flight(node, stall)

    _stop_then_release(node, held, forwarder=0)

    assert "delayed messages recovered" not in node.log_text()  # each was removed after its confirm
    conn = node.connect()
    ch = conn.channel()
    assert count(ch, q) == N
    assert _bodies(ch, q) == bodies
    conn.close()


@pytest.mark.parametrize("queue_shard", [0, 1], ids=["queue-on-source", "queue-on-owner"])
def test_dead_letters_through_a_dedup_owner_are_not_sent_again_after_a_clean_stop(node_factory, tmp_path,
                                                                                  queue_shard):
    """The owner (shard 1) must wait for the queue's confirms and pass them on to the source, or the
    source sends every dead letter again after the restart and the owner (its cache lives in memory)
    forwards each a second time. With the queue on the owner its forwards go to its own ROUTER and
    are answered by its own group sync (the owner without the wait would neither wait nor stop while
    that sync is held: the test fails on the log it waits for)."""
    node, stall = _node(node_factory, tmp_path)
    q, bodies, held = _dedup_dead_letters_in_flight(node, stall, queue_shard)

    _stop_then_release(node, held, forwarder=1)

    assert "dead letters unconfirmed before the restart are sent again" not in node.log_text()
    conn = node.connect()
    ch = conn.channel()
    assert count(ch, q) == N
    assert _bodies(ch, q) == bodies
    conn.close()


@pytest.mark.parametrize("setup", [_delayed_in_flight, _dedup_dead_letters_in_flight], ids=["delayed", "dedup-dlx"])
def test_forwards_in_flight_survive_a_kill9_of_the_node(node_factory, tmp_path, setup):
    """kill -9 of every process of the node while the forwards are stored but unconfirmed: at least
    once. The forwarding side still has its copy (delay store, outbox) and sends it again after the
    restart; the target's unsynced copies may survive too (written, not fsynced: the page cache
    outlives the processes), so duplicates are possible, loss is not."""
    node, stall = _node(node_factory, tmp_path)
    q, bodies, held = setup(node, stall)
    os.killpg(node.pid, signal.SIGKILL)
    node.proc.wait()
    held.unlink()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    got: list[bytes] = []
    deadline = time.monotonic() + WAIT
    while not set(bodies) <= set(got):
        assert time.monotonic() < deadline, f"lost: {sorted(set(bodies) - set(got))}\n{node.log_tail()}"
        got += _bodies(ch, q)
        time.sleep(0.02)
    conn.close()


def test_a_peer_that_stops_first_still_takes_what_a_later_one_routes(node_factory):
    """Shard 0 (the delay store) gets its STOP 800 ms after shard 1 (SHARDMQ_TEST_CONTROL_DELAY_MS)
    and routes what falls due meanwhile to a local queue and to one on shard 1. Shard 1 must keep
    serving until shard 0 said it is done (PEER_DONE): a closed shard 1 would leave those records in
    the delay store, and their re-routing after the restart doubles the local queue's copies."""
    node = node_factory(name="node", frontends=2, shards=2, env={"SHARDMQ_TEST_CONTROL_DELAY_MS": "sh-0:800"})
    x = names_on_different_shards(uid("dx"))[0]
    assert delay_store_shard("/", x, 2) == 0
    local, remote = names_on_different_shards(uid("dq"))
    conn = node.connect()
    ch = conn.channel()
    ch.exchange_declare(x, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    for q in (local, remote):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, x)
    m = 600
    bodies = [b"s%d" % i for i in range(m)]
    first_due = time.monotonic() + 0.3
    for i, body in enumerate(bodies):  # due one every 5 ms, across the stop
        delay = max(1, int((first_due + i * 0.005 - time.monotonic()) * 1000))
        ch.basic_publish(x, "", body, pika.BasicProperties(delivery_mode=2, headers={"x-delay": delay}))
    ch.confirm_delivery()  # same channel, same shard: confirmed after every delayed publish before it
    ch.basic_publish(x, "", b"last", pika.BasicProperties(delivery_mode=2, headers={"x-delay": 1}))
    bodies.append(b"last")
    conn.close()
    node.stop()
    node.start()
    conn = node.connect()
    ch = conn.channel()
    for q in (local, remote):
        # What is left routes in one turn per 2,000, its copies before any later due one: at the
        # full count nothing more comes.
        deadline = time.monotonic() + WAIT
        while count(ch, q) < len(bodies):
            assert time.monotonic() < deadline, f"{q}: {count(ch, q)} of {len(bodies)}"
            time.sleep(0.02)
    for q in (local, remote):
        assert sorted(_bodies(ch, q)) == sorted(bodies), q
    conn.close()
