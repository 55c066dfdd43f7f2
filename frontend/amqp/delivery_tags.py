"""Delivery tags of one channel: tag -> where the message lives (shard, queue id, msg id).

Tags grow by one per delivery, and the dict keeps insertion order, so "all
tags <= N" (an ack with multiple=True) is a walk from the front that stops at
N. Messages delivered with no_ack take a tag but are not remembered.
"""

from __future__ import annotations

from broker.amqp.constants import PRECONDITION_FAILED
from broker.amqp.errors import AMQPChannelError

Ref = tuple[int, int, int]  # shard, queue_id, msg_id


class UnknownDeliveryTag(AMQPChannelError):
    def __init__(self, tag: int, class_id: int = 60, method_id: int = 80) -> None:
        super().__init__(PRECONDITION_FAILED, f"unknown delivery tag {tag}", class_id, method_id)


class DeliveryTags:
    __slots__ = ("next_tag", "unacked")

    def __init__(self) -> None:
        self.next_tag = 1
        self.unacked: dict[int, Ref] = {}

    def __len__(self) -> int:
        return len(self.unacked)

    def add(self, shard: int, queue_id: int, msg_id: int) -> int:
        tag = self.next_tag
        self.next_tag = tag + 1
        self.unacked[tag] = (shard, queue_id, msg_id)
        return tag

    def skip(self) -> int:
        """A tag for a no-ack delivery: numbered, never acked."""
        tag = self.next_tag
        self.next_tag = tag + 1
        return tag

    def skip_many(self, n: int) -> int:
        """Tags for ``n`` no-ack deliveries in a row: returns the first."""
        tag = self.next_tag
        self.next_tag = tag + n
        return tag

    def take(self, tag: int, multiple: bool, class_id: int = 60, method_id: int = 80) -> list[Ref]:
        """Remove and return the refs an ack/nack/reject of ``tag`` settles.

        Mirrors RabbitMQ: tag 0 with multiple means every outstanding tag; otherwise
        ``tag`` itself must be outstanding or the channel fails with 406.
        """
        unacked = self.unacked
        if multiple:
            if tag == 0:
                refs = list(unacked.values())
                unacked.clear()
                return refs
            if tag not in unacked:
                raise UnknownDeliveryTag(tag, class_id, method_id)
            done = []
            for t in unacked:
                if t > tag:
                    break
                done.append(t)
            pop = unacked.pop
            return [pop(t) for t in done]
        ref = unacked.pop(tag, None)
        if ref is None:
            raise UnknownDeliveryTag(tag, class_id, method_id)
        return [ref]

    def take_all(self) -> list[Ref]:
        refs = list(self.unacked.values())
        self.unacked.clear()
        return refs

    def shards(self) -> set[int]:
        return {ref[0] for ref in self.unacked.values()}


def group_by_shard(refs: list[Ref]) -> dict[int, list[int]]:
    """shard -> flat [queue_id, msg_id, ...] as ACK/NACK items carry them."""
    out: dict[int, list[int]] = {}
    for shard, qid, mid in refs:
        if shard < 0:
            continue  # delivered by a shard that died since: its restart made the message ready again
        flat = out.get(shard)
        if flat is None:
            out[shard] = [qid, mid]
        else:
            flat.append(qid)
            flat.append(mid)
    return out
