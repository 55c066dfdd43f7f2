"""Who a shard delivers to: consumers, and the channels they (and basic.get) belong to.

A ``ChannelRef`` stands for one client channel on one frontend as seen by this
shard: it carries the channel-wide (``global``) prefetch and how many messages
from this shard are unacked on it. A ``Consumer`` adds the per-consumer
prefetch and the credit the frontend has granted (see contract.CREDIT_WINDOW).
Unacked messages point at their owner (consumer or channel) so a channel
close can find and requeue them without a per-message index elsewhere. Which
queues to look in is the channel's ``queues``: every queue it consumed from or
did a manual-ack basic.get on since it opened, so a close,
basic.recover or a frontend's death visits those queues only, not every queue
of the shard (docs/architecture.md "Channel close").
"""

from __future__ import annotations

from broker import contract


class ChannelRef:
    __slots__ = ("fe", "conn_id", "channel", "global_prefetch", "unacked", "queues")

    # basic.get deliveries have no consumer argument: the queue's or the node's timeout applies.
    timeout: int | None = None

    def __init__(self, fe: bytes, conn_id: int, channel: int) -> None:
        self.fe = fe
        self.conn_id = conn_id
        self.channel = channel
        self.global_prefetch = 0
        self.unacked = 0
        # qid -> None of every queue where this channel may have consumers or unacked messages: a
        # superset (a cancelled consumer's queue stays until the close), never missing one. Added to
        # on basic.consume and a manual-ack basic.get, before the queue or its store is touched (what
        # raises after must not leave an unacked message outside it), not per delivery: a consumer's
        # deliveries are all from its own queue, so the hot path keeps nothing here. A deleted
        # queue's qid is dropped at the next look (ShardWorker._queues_of).
        self.queues: dict[int, None] = {}

    @property
    def chan(self) -> ChannelRef:
        return self

    def settle(self) -> None:
        self.unacked -= 1


class Consumer:
    __slots__ = (
        "fe", "conn_id", "channel", "tag", "no_ack", "exclusive", "prefetch", "unacked", "credit",
        "chan", "arguments", "priority", "active", "timeout",
    )

    def __init__(
        self,
        chan: ChannelRef,
        tag: str,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
        arguments: dict,
    ) -> None:
        if not isinstance(arguments, dict):
            arguments = {}
        self.chan = chan
        self.fe = chan.fe
        self.conn_id = chan.conn_id
        self.channel = chan.channel
        self.tag = tag
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0
        self.credit = contract.CREDIT_WINDOW
        self.arguments = arguments
        # The frontend refuses non-integer values (406); anything else here counts as the default.
        self.priority = _int_or(arguments.get("x-priority"), 0)
        # x-consumer-timeout (ms) overrides the queue's and the node's; 0 turns it off for this consumer.
        self.timeout = _int_or(arguments.get("x-consumer-timeout"), None)
        # False for a registered but idle consumer of a single-active-consumer queue.
        self.active = True

    def can_take(self) -> bool:
        if self.credit <= 0 or not self.active:
            return False
        if self.no_ack:
            return True
        if self.prefetch and self.unacked >= self.prefetch:
            return False
        chan = self.chan
        return not (chan.global_prefetch and chan.unacked >= chan.global_prefetch)

    def settle(self) -> None:
        self.unacked -= 1
        self.chan.unacked -= 1


def _int_or(value: object, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
