"""The shard's periodic STATS report (broker/contract.py): the counts of the queues it owns.

Read from counters the queues keep anyway (ready count and bytes, the unacked map, the
consumer list) and three totals (published, delivered, acked: one integer add per message or per
delivery turn), once per stats_interval.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shard.worker import ShardWorker


# Upper bounds (seconds) of the fsync latency histogram buckets (Prometheus' "le"), +Inf implied.
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SyncHistogram:
    """Durations of the shard's group syncs (one observation per fsync batch, not per message)."""

    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(FSYNC_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(FSYNC_BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1

    def report(self) -> dict:
        return {"buckets": list(FSYNC_BUCKETS), "counts": list(self.counts), "sum": self.total, "count": self.n}


def _segment_bytes(store: Any) -> int:
    """Bytes written into a store's segments (priority stores hold one store per level)."""
    subs = getattr(store, "_all", None)
    if subs is not None:
        return sum(_segment_bytes(s) for s in subs)
    segs = getattr(store, "_segs", None) or {}
    if isinstance(segs, dict):  # QueueStore: by segment number; StreamStore: a list, oldest first
        segs = segs.values()
    return sum(getattr(seg, "used", 0) for seg in segs)


def shard_stats(worker: ShardWorker) -> dict:
    queues = []
    damaged = []  # only queues with storage damage (docs/storage.md "Recovery"): usually none
    for (vhost, name), q in worker.queues.items():
        info = q.info()
        if info.get("damaged_records") or info.get("damaged_acks"):
            damaged.append([vhost, name, int(info.get("damaged_records", 0)), int(info.get("damaged_acks", 0))])
        ready = int(info.get("messages", 0))
        unacked = len(q.unacked)
        queues.append([vhost, name, ready, unacked, len(q.consumers), int(getattr(q.store, "ready_bytes", 0) or 0),
                       q.n_published, q.n_delivered, q.n_acked])
    totals = [sum(q.n_published for q in worker.queues.values()), sum(q.n_delivered for q in worker.queues.values()),
              sum(q.n_acked for q in worker.queues.values())]
    return {"queues": queues, "totals": totals, "fsync": worker.sync_histogram.report(),
            "segment_bytes": sum(_segment_bytes(q.store) for q in worker.queues.values()), "damaged": damaged,
            "dead_letters_unconfirmed": len(worker.dead_letters.pending)}
