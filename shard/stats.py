"""The shard's periodic STATS report (broker/contract.py): the counts of the queues it owns.

Read from counters the queues keep anyway (ready count and bytes, the unacked map, the
consumer list) and three totals (published, delivered, acked: one integer add per message or per
delivery turn), once per stats_interval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shard.worker import ShardWorker


def shard_stats(worker: ShardWorker) -> dict:
    queues = []
    for (vhost, name), q in worker.queues.items():
        info = q.info()
        ready = int(info.get("messages", 0))
        unacked = len(q.unacked)
        queues.append([vhost, name, ready, unacked, len(q.consumers), int(getattr(q.store, "ready_bytes", 0) or 0),
                       q.n_published, q.n_delivered, q.n_acked])
    return {"queues": queues}
