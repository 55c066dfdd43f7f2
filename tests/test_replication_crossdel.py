"""A queue deleted on one leader shard and declared again on another: the follower keeps the new queue.

Queue directories are ``<sha1(vhost)>/<sha1(name)>/`` whichever shard owns the queue, and each leader
shard replicates on its own stream. Under balanced placement a queue deleted on shard A can be
declared again on shard B: the same directory. Shard A's DELETE of it can reach a follower after
shard B's first writes to the new queue; the follower's rmtree then removed the new queue's files,
confirmed messages with them (lost at a failover). A relay holds shard A's stream (leader to follower)
while the queue is deleted, declared again and published to, so the DELETE arrives last.
"""

from __future__ import annotations

import hashlib
import itertools
import threading

import pika
import pytest

from broker.definitions.entities import queue_shard
from tests.mgmt_api import Api
from tests.mgmt_api import q as path_q
from tests.tcp_relay import Relay
from tests.test_replication import SECRET, leader_node, promoted_sequence, wait_for, wait_isr

pytestmark = pytest.mark.integration

N = 50


class StreamHoldingRelay(Relay):
    """Relays every stream; what the leader sends on ``stream`` is held while ``hold`` is set (the
    pump thread waits, so nothing is lost or reordered within the stream)."""

    def __init__(self, target_port: int, stream: bytes) -> None:
        self.stream = stream
        self._tags = itertools.count(1)
        self.held_tags: set[int] = set()
        self.hold = threading.Event()
        self.holding = threading.Event()  # a chunk of the held stream is waiting now
        self._release = threading.Event()
        super().__init__(target_port)

    def connection_tag(self) -> int:
        return next(self._tags)

    def forward(self, data: bytes, from_leader: bool, tag: int) -> bytes | None:
        if not from_leader and self.stream in data:  # the follower's HELLO names its stream
            self.held_tags.add(tag)
        if from_leader and tag in self.held_tags and self.hold.is_set():
            self.holding.set()
            self._release.wait()
        return data

    def release(self) -> None:
        self.hold.clear()
        self._release.set()


def _name(home: int, prefix: str) -> str:
    return next(n for i in itertools.count() if queue_shard("/", n := f"{prefix}{i}", 2) == home)


def _publish(ch, queue: str, start: int, n: int) -> None:
    for i in range(start, start + n):
        ch.basic_publish("", queue, f"{queue}-{i}-".encode().ljust(200, b"."),
                         pika.BasicProperties(delivery_mode=2))


def test_a_late_delete_from_the_old_shard_never_removes_the_queue_declared_again_on_another(node_factory):
    leader = leader_node(node_factory, extra=["--min-isr", "1", "--replication-ack-timeout", "120"])
    relay = StreamHoldingRelay(leader.rport, b"shard-0")
    try:
        follower = node_factory(name="n2", frontends=1, shards=2, env=SECRET, start=False,
                                extra_args=["--cluster", "--node-name", "n2", "--follow", f"127.0.0.1:{relay.port}"])
        follower.start(wait=False)
        wait_isr(leader, "n2")
        # Balanced placement (the default): x on shard 0 (its home, both empty), g1 on shard 1, g2 on
        # shard 0 (a tie: its home); g1 deleted, so shard 0 has 2 queues and shard 1 none.
        x, g1, g2 = _name(0, "x"), _name(0, "g1-"), _name(0, "g2-")
        conn = leader.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        for q in (x, g1, g2):
            ch.queue_declare(q, durable=True)
        _publish(ch, x, 0, 5)  # the old queue's messages: gone with it
        api = Api(leader.http_port)
        assert [api.get(f"/api/queues/%2F/{path_q(n)}")["shard"] for n in (x, g1, g2)] == [0, 1, 0]
        ch.queue_delete(g1)
        assert relay.held_tags, "the follower's shard-0 stream was not seen"
        relay.hold.set()
        ch.queue_delete(x)  # on shard 0: its DELETE is held by the relay
        wait_for(relay.holding.is_set, "shard 0's DELETE held")
        # Until shard 0's reaper has moved the old directory the node places x there again
        # (broker/queue_leftovers.py); on the leader it is gone soon, on the follower not yet.
        qdir = leader.data_dir / hashlib.sha1(b"/").hexdigest() / hashlib.sha1(x.encode()).hexdigest()
        wait_for(lambda: not qdir.exists(), "shard 0's reaper to move the old directory away")
        ch.queue_declare(x, durable=True)  # on shard 1 now (fewer queues): the same directory
        assert api.get(f"/api/queues/%2F/{path_q(x)}")["shard"] == 1
        _publish(ch, x, 0, N)  # confirmed: the follower acked them on shard 1's stream
        relay.release()
        _publish(ch, g2, 0, 1)  # confirmed after the follower acked shard 0's stream past the DELETE
        conn.close()
        leader.kill9()
        follower.stop()
        # The failover: the follower's data dir started as a node has every confirmed message of x.
        assert promoted_sequence(node_factory, follower, x, N) == list(range(N))
    finally:
        relay.release()
        relay.close()
