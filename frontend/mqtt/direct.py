"""Clean MQTT sessions served in the frontend: a publish on this frontend goes straight to their connections.

A clean session's (exclusive, transient) queue never outlives its connection: a dead frontend or
shard ends the connection, and the queue with it. So, as RabbitMQ's native MQTT (3.12+) delivers QoS 0
subscriptions without a classic queue, a publish routed on this frontend to such a session's queue is
written to that session's connection here: QoS 0 encoded once for all of them, QoS 1/2 from one head
per message (codec.publish_head) within the in-flight window, messages beyond it waiting in order in
the connection. No shard stores it, nothing crosses a process, and the publisher's PUBACK does not wait
for it. The queue and its bindings still exist (routing, permissions and the management API see
them), and publishes from other frontends or AMQP channels reach it through its shard and consumer as
before. A session is served here from its first SUBSCRIBE to its end.

Flow: while such a session's client does not keep up (the transport paused our writing, or messages
wait for the window), or once ``TURN_PACKETS`` wait for it in one loop turn (the event loop reads each
socket up to 32 times a turn: without this one turn could read megabytes from publishers before
anything is written), the publishers that write to it are not read (their TCP windows fill and they
wait), as through a broker that does not queue; so the clients' CPU goes to reading, not to publishing
messages that would pile up. Only connections without subscriptions are held (one with some must be
read for its own acknowledgements). A client that reads and acknowledges nothing between two looks
``SLOW_AFTER`` seconds apart holds no one any more and loses what comes beyond ``DROP_BYTES`` waiting
in its transport (QoS 0) or ``DROP_QUEUED`` waiting messages (QoS 1/2), as RabbitMQ's QoS 0 queue
drops beyond its mailbox limit and mosquitto beyond max_queued_messages: a stalled subscriber must
neither hold up publishers for good nor fill the memory.
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
