"""The interface between the frontend's client of the cluster and one client session.

``FrontendWorker`` (frontend/worker.py) drives sessions of every protocol through
these methods only, so it imports nothing protocol-specific. A session is an
``asyncio.Protocol`` (data in through ``data_received``); it writes what it
produced during a loop turn in ``flush_turn`` (the worker calls it once per turn
for every session that called ``worker.mark_dirty``).

Items from shards carry the contract's fields: ``channel`` is a number the
session chose when it sent the CONSUME/PUBLISH (an AMQP channel, an MQTT
session's fixed lane); ``code`` is a reply code as the contract carries it
(AMQP's numbers, which the node and shards use for every protocol).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

# The code the worker closes sessions with when the broker (not the client) ends them.
CONNECTION_FORCED = 320


class Session(Protocol):
    conn_id: int
    vhost: str
    # True once the session published: only publishing sessions are paused under back-pressure.
    publisher: bool
    transport: asyncio.Transport | None
    # Optional (read with getattr by the worker): ``user`` (closing a user's sessions),
    # ``apply_alarms()`` (block a publishing session while worker.alarms is not empty),
    # ``on_deliver_run(shard, items)`` (consecutive DELIVER items of one batch for one channel and
    # consumer, in order; without it the worker calls on_deliver per item) and the
    # fields frontend/stats.py reports to the management API.

    def on_deliver(self, shard: int, item: list) -> None:
        """A contract DELIVER item for one of this session's consumers."""

    def on_confirm(self, channel: int, seqs: list, ok: bool) -> None:
        """CONFIRM / CONFIRM_NACK for publishes this session sent with confirm fields."""

    def on_cancel_notify(self, channel: int, tag: str) -> None:
        """The shard dropped a consumer (its queue was deleted)."""

    def on_return(self, channel: int, item: list) -> None:
        """A contract RETURN item: a mandatory publish of this session routed nowhere after all."""

    def on_close_channel(self, channel: int, code: int, text: str) -> None:
        """A shard closes a channel/lane of this session with an error."""

    def shard_lost(self, shard: int) -> None:
        """This shard died (its next incarnation is starting): settle what the session had in flight
        there (nack unconfirmed publishes, cancel its consumers) and stay open, as RabbitMQ does for
        a crashed queue (frontend/amqp/shard_loss.py). Sessions with nothing there do nothing."""

    def flush_turn(self) -> None:
        """End of a loop turn: write what this session produced in one go."""

    def pause_reading(self, reason: str) -> None: ...

    def resume_reading(self, reason: str) -> None: ...

    def fail(self, code: int, text: str) -> None:
        """The broker closes this session (shutdown, vhost deleted)."""

    def internal_error(self, exc: BaseException) -> None:
        """A bug while handling this session's items: close it, never crash the process."""
