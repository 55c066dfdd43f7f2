"""At-least-once dead-lettering across shards on a real node: a dead letter survives a kill -9 of
the shard it left while the shard it goes to has not confirmed it (shard/dead_letter_forwards.py).

Deterministic window: the target shard (the dead-letter queue's, or the deduplicating exchange's
owner) is SIGSTOPped before the reject, so it cannot store or confirm the dead letter; then the
source shard and the stopped target are both killed (what the target had in its socket buffer dies
with it). Without the outbox the source had already written the message's removal: it was lost.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pika
import pytest

from broker.dedup import exchange_shard
from tests.helpers import WAIT, uid
from tests.test_feature_dlx import get_one_unacked, uid_on

# Separate frontend and shard processes (--colocate off, tests/conftest.py): a SIGSTOPped or killed shard's frontend keeps serving the test's connection.
COLOCATE = "off"


def exchange_owned_by(shard: int, shards: int = 2) -> str:
    while True:
        name = uid("dedup-dlx")
        if exchange_shard("/", name, shards) == shard:
            return name


def wait_for_message(node, queue: str) -> tuple[pika.BasicProperties, bytes]:
    """basic.get from `queue` until a message is there, reconnecting while shards restart."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            conn = node.connect()
            try:
                method, props, body = conn.channel().basic_get(queue, auto_ack=True)
            finally:
                conn.close()
            if method is not None:
                return props, body
        except pika.exceptions.AMQPError:
            pass  # a restarted shard not serving yet
        assert time.monotonic() < deadline, f"the dead letter never reached {queue}\n{node.log_tail()}"
        time.sleep(0.05)


@pytest.mark.parametrize("via", ["queue", "dedup-exchange", "dedup-exchange-owned-by-source"])
def test_dead_letter_survives_a_source_shard_kill_before_the_target_confirms(node_factory, via):
    node = node_factory(name="node", frontends=2, shards=2, extra_args=["--stats-interval", "100"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    target = uid_on(1, "dlq")
    ch.queue_declare(target, durable=True)
    if via == "queue":
        dl_args = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": target}
    else:  # the exchange's owner decides, and confirms once the queue (on shard 1) has it
        dlx = exchange_owned_by(0 if via.endswith("source") else 1)
        ch.exchange_declare(dlx, "fanout", durable=True, arguments={"x-message-deduplication": True})
        ch.queue_bind(target, dlx)
        dl_args = {"x-dead-letter-exchange": dlx}
    source = uid_on(0, "src")
    ch.queue_declare(source, durable=True, arguments=dl_args)
    ch.basic_publish("", source, b"keep", pika.BasicProperties(
        delivery_mode=2, headers={"x-deduplication-header": "k1"}))
    method, _p, _b = get_one_unacked(ch, source)

    target_pid = node.worker_pid("shard", 1)
    os.kill(target_pid, signal.SIGSTOP)
    try:
        ch.basic_reject(method.delivery_tag, requeue=False)
        # Barrier: a consume-ok from the source shard travels after the reject on the same control
        # lane, so once it is here the source has dead-lettered (and removed) the message.
        barrier = conn.channel()
        barrier.basic_cancel(barrier.basic_consume(source, lambda *_: None))
        source_pid = node.kill_worker("shard", 0)
        node.kill_worker("shard", 1)  # stopped: it dies without having read the dead letter
    finally:
        try:
            os.kill(target_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    node.wait_worker_restarted("shard", 0, source_pid)
    node.wait_worker_restarted("shard", 1, target_pid)

    props, body = wait_for_message(node, target)
    assert body == b"keep"
    assert props.headers["x-death"][0]["queue"] == source
    assert props.headers["x-death"][0]["reason"] == "rejected"
    # The target confirms it: the source's outbox lets it go (the new incarnation's gauge reaches 0),
    # and a further restart sends nothing again.
    wait_unconfirmed_zero(node, 0)
    resent = RESENT_LINE in node.log_text()
    node.restart()
    assert resent and node.log_text().count(RESENT_LINE) == 1, node.log_tail()
    conn = node.connect()
    assert conn.channel().queue_declare(target, passive=True).method.message_count == 0
    conn.close()


RESENT_LINE = "dead letters unconfirmed before the restart are sent again"


def wait_unconfirmed_zero(node, shard: int) -> None:
    """Until the shard's own STATS (a restarted shard's first report comes after it loaded its
    outbox) say it holds no unconfirmed dead letter."""
    want = f'shardmq_shard_dead_letters_unconfirmed{{shard="{shard}"}} 0.0'
    deadline = time.monotonic() + WAIT
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        if want in text.splitlines():
            return
        assert time.monotonic() < deadline, f"shard {shard} still has unconfirmed dead letters"
        time.sleep(0.05)


def unconfirmed(node, shard: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    prefix = f'shardmq_shard_dead_letters_unconfirmed{{shard="{shard}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return None


def test_a_dead_letter_refused_by_a_full_queue_is_sent_again_once_there_is_room(node_factory):
    """x-overflow reject-publish on the target (another shard) answers CONFIRM_NACK: the dead letter
    stays in the source's outbox and is sent again every second (RabbitMQ's at-least-once worker
    retries too) instead of being dropped."""
    node = node_factory(name="node", frontends=2, shards=2, extra_args=["--stats-interval", "100"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    target = uid_on(1, "full")
    ch.queue_declare(target, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.basic_publish("", target, b"filler", pika.BasicProperties(delivery_mode=2))
    source = uid_on(0, "src")
    ch.queue_declare(source, durable=True, arguments={"x-dead-letter-exchange": "",
                                                      "x-dead-letter-routing-key": target})
    ch.basic_publish("", source, b"late", pika.BasicProperties(delivery_mode=2))
    method, _p, _b = get_one_unacked(ch, source)
    ch.basic_reject(method.delivery_tag, requeue=False)
    # Unconfirmed for half a second: the full queue has refused it by then (the pause only makes
    # sure the refusal came first; the test passes however long it takes).
    deadline = time.monotonic() + WAIT
    since = None
    while since is None or time.monotonic() - since < 0.5:
        assert time.monotonic() < deadline, "the dead letter never showed as unconfirmed"
        if unconfirmed(node, 0) == 1.0:
            since = since or time.monotonic()
        else:
            since = None
        time.sleep(0.05)
    assert ch.queue_declare(target, passive=True).method.message_count == 1
    assert ch.basic_get(target, auto_ack=True)[2] == b"filler"  # room for one again
    _props, body = wait_for_message(node, target)
    assert body == b"late"
    wait_unconfirmed_zero(node, 0)
    conn.close()
