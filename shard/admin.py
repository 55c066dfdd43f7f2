"""What the node's management API asks a shard directly (QUERY ops "purge", "get", "publish").

Low-rate operator actions, carried over the control socket like ``queue_info``:

- ``purge`` {vhost, queue} -> {"messages": purged}
- ``get`` {vhost, queue, count, requeue} -> {"messages": [[redelivered, exchange, routing_key,
  props_raw, body, remaining], ...]}: requeue True puts them back (RabbitMQ's ack_requeue_true /
  reject_requeue_true), False removes them
- ``publish`` {vhost, queues, exchange, routing_key, props_raw, body, persistent} -> {}: stored in the
  named queues of this shard, unconfirmed (as RabbitMQ's HTTP publish)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from broker import contract
from shard.consumers import ChannelRef
from shard.stream_queue import StreamQueue

if TYPE_CHECKING:
    from shard.queue import Queue

_NODE = b"node"  # owner identity of messages a management get holds while it reads them


class AdminShard(Protocol):
    """What the management operations use of the shard (shard/worker.py ShardWorker)."""

    queues: dict[tuple[str, str], Queue]

    def publish(self, fe: bytes, item: list) -> bool:
        """The frontends' PUBLISH path: a management publish is stored as theirs are."""

    def mark_dirty(self, q: Queue) -> None: ...


def admin_query(worker: AdminShard, op: str, args: dict) -> tuple[bool, Any]:
    if op == "publish":
        worker.publish(_NODE, [contract.PUBLISH, args["vhost"], list(args["queues"]), args.get("exchange", ""),
                                args.get("routing_key", ""), bytes(args.get("props_raw") or b""),
                                bytes(args.get("body") or b""), bool(args.get("persistent")), None, None, None])
        # A delivery pass over the queues it went to, not over every queue of the shard.
        for name in args["queues"]:
            q = worker.queues.get((args["vhost"], name))
            if q is not None:
                worker.mark_dirty(q)
        return True, {}
    vhost, name = args["vhost"], args["queue"]
    q = worker.queues.get((vhost, name))
    if q is None:
        return False, [404, f"NOT_FOUND - no queue '{name}' in vhost '{vhost}'", 0, 0]
    if q.__class__ is StreamQueue:
        return False, [540, f"NOT_IMPLEMENTED - not supported by queue '{name}' in vhost '{vhost}'", 0, 0]
    if op == "purge":
        n = q.purge()
        worker.mark_dirty(q)
        return True, {"messages": n}
    requeue = bool(args.get("requeue", True))
    chan = ChannelRef(_NODE, 0, 0)
    got: list[list] = []
    held: list[int] = []
    try:
        for _ in range(max(0, int(args.get("count", 1)))):
            msg = q.get(chan, not requeue)
            if msg is None:
                break
            _qid, msg_id, redelivered, exchange, routing_key, props_raw, body, remaining = msg
            got.append([bool(redelivered), exchange, routing_key, props_raw, body, remaining])
            if requeue:
                held.append(msg_id)
    finally:
        # Put back, also when a get raised: this channel is no client's, so no close would ever
        # requeue what it holds (nor is it in any channel's queues for the consumer-timeout scan).
        for msg_id in held:
            q.nack(msg_id, _NODE, 0, 0, True)
        if chan.unacked:  # a get that raised after it took its message
            q.requeue_owned(lambda owner: owner is chan)
        worker.mark_dirty(q)  # what it put back goes to the queue's consumers (only this queue changed)
    return True, {"messages": got}
