"""A clean stop sends no dead letter twice (shard/dead_letter_forwards.py).

A dead letter for a queue of another shard stays in the source shard's outbox until the target
confirms it, and the target confirms a persistent one after its next group sync. Every shard of a
node stops at once, so at a clean stop the target may hold a dead letter it has not confirmed yet:
the source must wait for that confirm and the target must send it after its final sync, or the
restarted source sends the letter again and the target queue holds it twice.
"""

from __future__ import annotations

import threading

import pika

from tests.harness import Node, wait_until
from tests.helpers import WAIT, names_on_different_shards, reject_all, uid, wait_count
from tests.test_feature_combinations import STREAM, read_stream

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)

N = 40


def _wait_log(node: Node, text: str, count: int = 1) -> None:
    wait_until(lambda: node.log_text().count(text) >= count, WAIT, f"{text!r} logged", context=node.log_tail)


def _queue_count(ch, q: str, n: int) -> None:
    wait_count(ch, q, n)


def test_dead_letters_confirmed_late_are_not_sent_again_after_a_clean_stop(node_factory, tmp_path):
    """The targets' group syncs are held (SHARDMQ_TEST_STALL_FSYNC_WHILE) while N messages are
    rejected, so their dead letters are in the target queues (a stream and a classic queue on the
    other shard) but unconfirmed when the node is told to stop; the hold ends once the stop has
    begun. After the restart each queue holds every dead letter once, in order."""
    stall = tmp_path / "stall-fsync"
    node = node_factory(name="node", frontends=2, shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)})
    src, log = names_on_different_shards(uid("dls"))
    _, classic = names_on_different_shards(uid("dlc"))
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlx = uid("dlx")
    ch.exchange_declare(dlx, "fanout", durable=True)
    ch.queue_declare(log, durable=True, arguments=STREAM)
    ch.queue_declare(classic, durable=True)
    ch.queue_bind(log, dlx)
    ch.queue_bind(classic, dlx)
    ch.queue_declare(src, durable=True, arguments={"x-dead-letter-exchange": dlx})
    bodies = [b"m%d" % i for i in range(N)]
    for body in bodies:
        ch.basic_publish("", src, body, pika.BasicProperties(delivery_mode=2))
    stall.touch()  # from here no group sync finishes, so no dead letter is confirmed
    reject_all(conn, ch, src, N)
    assert [b for _o, b, _h in read_stream(conn, log, N)] == bodies  # stored, not yet confirmed
    _queue_count(ch, classic, N)
    conn.close()

    stopper = threading.Thread(target=node.stop)
    stopper.start()
    # The shards are told to stop once the frontends have: end the hold after both began to stop, so
    # the stop begins with the dead letters unconfirmed (what reproduces the double send on the old
    # code; the fixed code keeps every letter once whenever the hold ends).
    _wait_log(node, "shard 0 stopping")
    _wait_log(node, "shard 1 stopping")
    stall.unlink()
    stopper.join(WAIT)
    assert not stopper.is_alive()
    node.start()

    # The source shard reads its outbox before it reports ready: a letter left there would be sent again.
    _wait_log(node, "ready: ", 4)  # both shards, both starts
    assert "dead letters unconfirmed before the restart are sent again" not in node.log_text()
    conn = node.connect()
    assert [(o, b) for o, b, _h in read_stream(conn, log, N)][:N] == list(enumerate(bodies))
    ch = conn.channel()
    _queue_count(ch, classic, N)
    assert [ch.basic_get(classic, auto_ack=True)[2] for _ in range(N)] == bodies
    conn.close()
