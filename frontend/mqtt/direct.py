"""QoS 0 sessions served in the frontend: a publish on this frontend goes straight to their connections.

A clean MQTT session whose subscriptions are all QoS 0 needs nothing of a queue: its messages are
neither stored across a restart nor acknowledged, and a copy is at most once. So, as RabbitMQ's
native MQTT (3.12+) delivers QoS 0 subscriptions without a classic queue, a publish routed on this
frontend to the (exclusive, transient) queue of such a session is written to that session's
connection here, encoded once for all of them: no shard stores it, nothing crosses a process. The
queue and its bindings still exist (routing, permissions and the management API see them), and
publishes from other frontends or AMQP channels reach it through its shard and the no-ack consumer
as before. The first QoS 1/2 subscription of the session takes it out of here for good (its
messages then wait in the queue for acknowledgements).

Flow: while such a session's client does not keep up (the transport paused our writing), or once
``TURN_PACKETS`` wait for it in one loop turn (the event loop reads each socket up to 32 times a turn:
without this one turn could read megabytes from publishers before anything is written), the
publishers that write to it are not read (their TCP windows fill and they wait), as they would
be through a broker that does not queue; so the clients' CPU goes to reading, not to publishing
messages that would pile up. A client that stays behind for ``SLOW_AFTER`` seconds holds no one any
more and drops what comes beyond ``DROP_BYTES`` waiting in its transport, as RabbitMQ's QoS 0 queue
drops beyond its mailbox limit: QoS 0 is at most once, and a stalled subscriber must neither hold up
publishers for good nor fill the memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker

DROP_BYTES = 4 << 20
DROP_QUEUED = 100_000
TURN_PACKETS = 2000
SLOW_AFTER = 5.0


class DirectQueues:
    """This frontend's directly served session queues, by (vhost, queue name); ``gen`` changes with
    every change of them (or of their subscriptions), so publishers know when a routing plan is stale."""

    __slots__ = ("conns", "gen")

    def __init__(self) -> None:
        self.conns: dict[tuple[str, str], Any] = {}
        self.gen = 0

    def add(self, vhost: str, queue: str, conn: Any) -> None:
        self.conns[(vhost, queue)] = conn
        self.gen += 1

    def remove(self, vhost: str, queue: str, conn: Any) -> None:
        if self.conns.get((vhost, queue)) is conn:
            del self.conns[(vhost, queue)]
            self.gen += 1

    def changed(self) -> None:
        self.gen += 1


def direct_queues(worker: FrontendWorker) -> DirectQueues:
    """The worker's DirectQueues (kept on the worker, which knows nothing of MQTT)."""
    found = worker.__dict__.get("mqtt_direct")
    if found is None:
        found = worker.__dict__["mqtt_direct"] = DirectQueues()
    return found
