"""Dead letters routed through a deduplicating exchange while the ISR is short of --min-isr.

A dead letter for a deduplicating exchange (x-message-deduplication) goes to the exchange's owner
shard as a DEDUP_PUBLISH; the owner forwards it to the shards of the routed queues and answers the
source once they have. With fewer in-sync followers than --min-isr every target stores its copy
and answers CONFIRM_NACK naming no queue (stored, not replicated as asked). The owner used to pass
on a bare NACK, which the source cannot tell from "the owner's forward went to a shard that
restarted" (maybe not stored), so it sent the dead letter again each second: one more copy in the
target queue per second of outage (a message without a deduplication header is never dropped as a
duplicate, and one with a header had its key forgotten at each NACK). See shard/dedup.py.
"""

from __future__ import annotations

import pika
import pytest

from broker.dedup import exchange_shard
from tests import helpers
from tests.test_replication import follower_node, leader_node, wait_for, wait_in_sync, wait_isr

pytestmark = pytest.mark.integration

N = 3


def _exchange_owned_by(shard: int, shards: int = 2) -> str:
    i = 0
    while exchange_shard("/", f"ddx-{i}", shards) != shard:
        i += 1
    return f"ddx-{i}"


@pytest.mark.parametrize("header", [False, True], ids=["no-dedup-header", "dedup-header"])
def test_dead_letters_to_a_dedup_exchange_under_min_isr_are_stored_once(node_factory, header):
    leader = leader_node(node_factory, extra=["--min-isr", "1", "--queue-placement", "hash"])
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_isr(leader, "n2")
    source, target = helpers.names_on_different_shards("dldd")
    # The owner is the source's shard: the dead letter goes to it over the source's own ROUTER, and
    # its forward crosses to the target's shard (whose NACK the owner must pass on as "stored").
    exchange = _exchange_owned_by(0)
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(exchange, "direct", durable=True, arguments={"x-message-deduplication": True})
    ch.queue_declare(target, durable=True)
    ch.queue_bind(target, exchange, "k")
    ch.queue_declare(source, durable=True, arguments={"x-dead-letter-exchange": exchange,
                                                      "x-dead-letter-routing-key": "k"})
    for i in range(N):
        headers = {"x-deduplication-header": f"m{i}"} if header else None
        ch.basic_publish("", source, b"dead-%d" % i, pika.BasicProperties(delivery_mode=2, headers=headers))
    tags = [ch.basic_get(source, auto_ack=False)[0].delivery_tag for _ in range(N)]
    follower.stop()
    wait_for(lambda: "follower n2 is out of sync" in leader.log_text(), "n2 out of sync", node=leader)
    wait_isr(leader, "")
    for tag in tags:
        ch.basic_reject(tag, requeue=False)
    # The source settles each dead letter once the owner answers that every routed queue holds it;
    # a resend (once a second) would add a copy to the target first.
    settled = "dead letter(s) stored on shard 0 but not made durable there"

    def in_target() -> int:
        return ch.queue_declare(target, passive=True).method.message_count
    wait_for(lambda: in_target() > N or (settled in leader.log_text() and in_target() == N),
             "the dead letters settled, or sent again", node=leader)
    assert in_target() == N
    # The ISR back: the one copy of each, and nothing from the outbox follows.
    follower.start(wait=False)
    wait_isr(leader, "n2")
    ch.basic_publish("", target, b"after", pika.BasicProperties(delivery_mode=2))
    bodies = []
    while (got := ch.basic_get(target, auto_ack=True))[0] is not None:
        bodies.append(got[2])
    assert bodies == [b"dead-%d" % i for i in range(N)] + [b"after"]
    assert ch.queue_declare(source, passive=True).method.message_count == 0
    conn.close()
