"""The shard's periodic STATS report (broker/contract.py): the counts of the queues it owns.

Read from counters the queues keep anyway (ready count and bytes, the unacked map, the
consumer list) and three totals (published, delivered, acked: one integer add per message or per
delivery turn), once per stats_interval.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Protocol

from shard.queue import Queue

if TYPE_CHECKING:
    from shard.dead_letter_forwards import DeadLetterForwards


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


class StatsShard(Protocol):
    """What the report reads of the shard (shard/worker.py ShardWorker)."""

    queues: dict[tuple[str, str], Queue]
    sync_histogram: SyncHistogram
    dead_letters: DeadLetterForwards


# The counters of a queue that has seen nothing: the one tuple every such queue's entry holds in
# StatsReporter.sent (100,000 idle queues keep no 11-tuple each between reports).
_IDLE = (0,) * 11


def _rows(worker: StatsShard) -> tuple[dict[tuple[str, str], tuple], list]:
    """Every queue's counters by (vhost, name): ready, unacked, consumers, ready bytes, then the
    totals published, delivered (all kinds), acked, delivered to no-ack consumers, got with ack, got
    without ack, redelivered (a STATS row is vhost, name and these: broker/node_stats.py names the
    positions); and the damaged list."""
    rows: dict[tuple[str, str], tuple] = {}
    damaged = []  # only queues with storage damage (docs/storage.md "Recovery"): usually none
    idle = _IDLE
    for key, q in worker.queues.items():
        store = q.store
        if q.__class__ is Queue:  # the common case, read directly: 100,000 queues every interval
            row = (store.ready, len(q.unacked), len(q.consumers), store.ready_bytes,
                   q.n_published, q.n_delivered, q.n_acked, q.n_deliver_no_ack, q.n_get, q.n_get_no_ack,
                   store.n_redelivered)
            rows[key] = idle if row == idle else row
            if store.damaged_records or store.damaged_acks:
                damaged.append([key[0], key[1], int(store.damaged_records), int(store.damaged_acks)])
            continue
        info = q.info()
        if info.get("damaged_records") or info.get("damaged_acks"):
            damaged.append([key[0], key[1], int(info.get("damaged_records", 0)), int(info.get("damaged_acks", 0))])
        row = (int(info.get("messages", 0)), len(q.unacked), len(q.consumers),
               int(getattr(store, "ready_bytes", 0) or 0), q.n_published, q.n_delivered, q.n_acked,
               getattr(q, "n_deliver_no_ack", 0), getattr(q, "n_get", 0), getattr(q, "n_get_no_ack", 0),
               getattr(store, "n_redelivered", 0))
        rows[key] = idle if row == idle else row
    return rows, damaged


class StatsReporter:
    """Builds the shard's STATS payloads as deltas: only the rows that changed since the last report,
    and the queues removed since then. An idle queue costs a tuple compare here and nothing on the
    wire or in the node, whose event loop would otherwise unpack 50,000 rows per shard per interval
    (issue #11). The first report, and the one after the node asks (QUERY "stats_full": it lost
    track, a seq gap), carries every row with "full": true."""

    __slots__ = ("sent", "seq", "full_next", "rows_sent")

    def __init__(self) -> None:
        self.sent: dict[tuple[str, str], tuple] = {}  # what the node holds, as of our last report
        self.seq = 0
        self.full_next = True
        self.rows_sent = 0  # queue rows sent since the shard started (tests and metrics count them)

    def report(self, worker: StatsShard) -> dict:
        rows, damaged = _rows(worker)
        sent = self.sent
        full = self.full_next
        if full:
            changed = [(*key, *row) for key, row in rows.items()]
            removed: list = []
        else:
            get = sent.get
            changed = [(*key, *row) for key, row in rows.items() if get(key) != row]
            # New queues are among the changed rows, so this counts removals without a scan of `sent`.
            n_new = sum(1 for row in changed if (row[0], row[1]) not in sent)
            removed = [list(key) for key in sent if key not in rows] if len(sent) + n_new > len(rows) else []
        self.sent = rows
        self.full_next = False
        self.seq += 1
        self.rows_sent += len(changed)
        totals = [sum(row[i] for row in rows.values()) for i in range(4, 11)]
        return {"seq": self.seq, "full": full, "queues": changed, "removed": removed, "rows_sent": self.rows_sent,
                "totals": totals, "fsync": worker.sync_histogram.report(),
                "segment_bytes": sum(_segment_bytes(q.store) for q in worker.queues.values()), "damaged": damaged,
                "dead_letters_unconfirmed": len(worker.dead_letters.pending)}
