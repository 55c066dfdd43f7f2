"""The shard's periodic STATS report (broker/contract.py): the counts of the queues it owns.

Read from counters the queues keep anyway (ready count and bytes, the unacked map, the
consumer list) and three totals (published, delivered, acked: one integer add per message or per
delivery turn), once per stats_interval.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Protocol

from shard.queue import Queue

if TYPE_CHECKING:
    from shard.dead_letter_forwards import DeadLetterForwards


log = logging.getLogger("shardmq.shard")

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
_NO_DAMAGE = (0, 0)
# Tests: "1" makes every report check itself against a read of every queue (StatsReporter).
STATS_CHECK_ENV = "SHARDMQ_TEST_STATS_CHECK"
STATS_CHECK_FAILED = "stats check failed"  # the log line's start (tests/conftest.py looks for it)
_CHECK_MAX = 20_000
# Queues read per part of a report: a part is one loop turn's work in the shard and one STATS item for
# the node. 30,000 queues declared (or deleted) since the last report made one report 10-29 ms of the
# shard's loop in one piece (docs/benchmarks.md "Worst gap while 30,000 queues are deleted"); a queue
# costs 0.5-1.5 µs to read, so a part is under ~1 ms.
PART_ROWS = 500
# ... and fewer when a part costs more than PART_S of the shard's CPU (ShardWorker._send_stats_part sizes
# the next part from the last full one): in a pair at load 8-10 a part of 500 deleted queues took
# 1.0-3.5 ms (0.2 ms at the median alone on the machine; docs/benchmarks.md "The pair's turns during a
# 30,000-queue delete"). Never under PART_MIN_ROWS, so a report of 30,000 queues stays a few hundred parts.
PART_S = 0.0005
PART_MIN_ROWS = 100


def _row(q: Queue) -> tuple[tuple, tuple[int, int]]:
    """A queue's counters: ready, unacked, consumers, ready bytes, then the totals published,
    delivered (all kinds), acked, delivered to no-ack consumers, got with ack, got without ack,
    redelivered (a STATS row is vhost, name and these: broker/node_stats.py names the positions);
    and its damaged records and acks (docs/storage.md "Recovery")."""
    store = q.store
    if q.__class__ is Queue:  # the common case, read directly
        row = (store.ready, len(q.unacked), len(q.consumers), store.ready_bytes,
               q.n_published, q.n_delivered, q.n_acked, q.n_deliver_no_ack, q.n_get, q.n_get_no_ack,
               store.n_redelivered)
        damage = (int(store.damaged_records), int(store.damaged_acks)) \
            if store.damaged_records or store.damaged_acks else _NO_DAMAGE
    else:
        info = q.info()
        row = (int(info.get("messages", 0)), len(q.unacked), len(q.consumers),
               int(getattr(store, "ready_bytes", 0) or 0), q.n_published, q.n_delivered, q.n_acked,
               getattr(q, "n_deliver_no_ack", 0), getattr(q, "n_get", 0), getattr(q, "n_get_no_ack", 0),
               getattr(store, "n_redelivered", 0))
        damage = (int(info.get("damaged_records", 0)), int(info.get("damaged_acks", 0))) \
            if info.get("damaged_records") or info.get("damaged_acks") else _NO_DAMAGE
    return (_IDLE if row == _IDLE else row), damage


class StatsReporter:
    """Builds the shard's STATS payloads as deltas: only the rows that changed since the last report,
    and the queues removed since then (issue #11), at a cost proportional to the queues that may
    have changed, not to all of them (issue #15: 100,000 idle queues were 100,000 tuples, a dict and
    sums over them every interval).

    The shard names the queues whose counters may have changed: it adds them to ``touched`` (every
    queue of each delivery pass, which is where publishes, acks, consumers, requeues and expiries
    go, plus the few changes that skip that pass: a message given to a consumer without being
    stored, a basic.get, a new or replaced queue object) and calls ``gone`` for a deleted one. A
    report reads only those, compares each with what it last sent and keeps the totals, segment
    bytes and damaged list up to date by difference. The first report, and the one after the node
    asks (QUERY "stats_full": it lost track, a seq gap), reads every queue and carries every row
    with "full": true. ``SHARDMQ_TEST_STATS_CHECK=1`` (tests) makes every report also read every
    queue and log an error naming any queue whose change was not reported (a change the shard did
    not name).

    The shard reads a report in parts (``begin``, then ``part`` once per loop turn until ``busy`` is
    False), ``PART_ROWS`` queues each, and sends each part as its own STATS item: all but the last
    marked ``"more"`` (broker/contract.py), so the node merges their rows at once and takes the
    report's totals, and its rates, from the last part only."""

    __slots__ = ("sent", "seq", "full_next", "rows_sent", "touched", "_gone", "_totals", "_segments",
                 "_segment_total", "_damaged", "check", "_work", "_work_gone", "_at", "_full", "_parts")

    def __init__(self, check: bool = False) -> None:
        self.sent: dict[tuple[str, str], tuple] = {}  # what the node holds, as of our last report
        self.seq = 0
        self.full_next = True
        self.rows_sent = 0  # queue rows sent since the shard started (tests and metrics count them)
        # Queues whose counters may have changed since the last report (the shard adds to this set;
        # it is cleared, never replaced, so the shard may hold it).
        self.touched: set[Queue] = set()
        self._gone: set[tuple[str, str]] = set()  # deleted since the last report
        self._totals = [0] * 7  # sums of the sent rows' positions 4..10 (published ... redelivered)
        self._segments: dict[tuple[str, str], int] = {}  # segment bytes of the queues that have any
        self._segment_total = 0
        self._damaged: dict[tuple[str, str], tuple[int, int]] = {}  # only queues with damage
        self.check = check
        # The report being read in parts (begin, part): its queues, deleted keys, how far, full or not.
        self._work: list[Queue] | None = None
        self._work_gone: list[tuple[str, str]] = []
        self._at = 0
        self._full = False
        self._parts = 0  # parts sent of it so far

    def gone(self, key: tuple[str, str]) -> None:
        """The queue ``key`` was deleted (a queue declared again under it is touched anew)."""
        self._gone.add(key)

    def report(self, worker: StatsShard, pending: set | frozenset = frozenset()) -> dict:
        """The next STATS payload in one piece (the shard itself sends it in parts: ``begin``, ``part``)."""
        self.begin(worker, pending)
        return self.part(worker, budget=None)

    @property
    def busy(self) -> bool:
        """A report begun and not all sent (``part`` has more to give)."""
        return self._work is not None

    def begin(self, worker: StatsShard, pending: set | frozenset = frozenset()) -> None:
        """Start the next report: take the queues it reads (every queue for a full one; else those
        touched, ``pending``: marked for the next delivery pass, and the deleted ones). ``part`` then
        reads them a slice at a time; what changes meanwhile goes to the report after this one."""
        self._full = self.full_next
        if self._full:
            self._reset()
            self._work = list(worker.queues.values())
            self._work_gone = []
        else:
            self._work_gone = list(self._gone)
            self._work = list(self.touched | pending if pending else self.touched)
        self.touched.clear()
        self._gone.clear()
        self.full_next = False
        self.seq += 1
        self._at = 0

    def abandon(self) -> None:
        """Drop the report begun (a part failed): the caller sets ``full_next``."""
        self._work = None
        self._work_gone = []
        self._parts = 0

    def part(self, worker: StatsShard, budget: int | None = PART_ROWS,
             pending: set | frozenset = frozenset()) -> dict:
        """The next part of the report begun: at most ``budget`` queues read (None: all the rest).
        All but the last part carry ``"more": True`` and only rows (broker/contract.py STATS);
        the last one also the totals, after which ``busy`` is False. ``pending``: as for ``begin``,
        now (the self-check leaves the queues changed since their part was read to the next report)."""
        queues = worker.queues
        sent = self.sent
        changed: list = []
        removed: list = []
        n = 0
        gone = self._work_gone
        while gone and (budget is None or n < budget):
            key = gone.pop()
            n += 1
            if key not in queues and key in sent:
                self._drop(key)
                removed.append(list(key))
        work = self._work
        assert work is not None, "part() without begin()"
        at = self._at
        end = len(work) if budget is None else min(len(work), at + max(0, budget - n))
        get = queues.get
        full = self._full
        for i in range(at, end):
            q = work[i]
            key = (q.vhost, q.name)
            if get(key) is not q:
                continue  # deleted, or replaced by the object that is touched instead
            row, damage = _row(q)
            if full:
                changed.append((*key, *row))
                self._put(key, row, damage, q)
                continue
            old = sent.get(key)
            if old != row:
                changed.append((*key, *row))
                if old is not None:
                    self._drop(key)
                self._put(key, row, damage, q)
            else:  # its segments may have been written or removed all the same
                self._put_extras(key, damage, q)
        self._at = end
        self.rows_sent += len(changed)
        if gone or end < len(work):
            self._parts += 1
            return {"seq": self.seq, "full": full, "more": True, "queues": changed, "removed": removed}
        several = self._parts > 0
        self._work = None
        self._work_gone = []
        self._parts = 0
        if self.check:
            # A report read in several turns: what changed after its part was read is the next
            # report's (touched again, pending or deleted), so the check takes those as sent.
            later = {(q.vhost, q.name) for q in (self.touched | pending)} | self._gone if several else set()
            self._check(worker, later)
        return {"seq": self.seq, "full": full, "queues": changed, "removed": removed, "rows_sent": self.rows_sent,
                "totals": list(self._totals), "fsync": worker.sync_histogram.report(),
                "segment_bytes": self._segment_total,
                "damaged": [[k[0], k[1], d[0], d[1]] for k, d in self._damaged.items()],
                "dead_letters_unconfirmed": len(worker.dead_letters.pending)}

    # ------------------------------------------------------------ bookkeeping
    def _reset(self) -> None:
        self.sent = {}
        self._totals = [0] * 7
        self._segments = {}
        self._segment_total = 0
        self._damaged = {}

    def _put(self, key: tuple[str, str], row: tuple, damage: tuple[int, int], q: Queue) -> None:
        self.sent[key] = row
        if row is not _IDLE:
            totals = self._totals
            for i in range(7):
                totals[i] += row[4 + i]
        self._put_extras(key, damage, q)

    def _put_extras(self, key: tuple[str, str], damage: tuple[int, int], q: Queue) -> None:
        if damage is _NO_DAMAGE:
            self._damaged.pop(key, None)
        else:
            self._damaged[key] = damage
        seg = _segment_bytes(q.store)
        old = self._segments.pop(key, 0)
        if seg:
            self._segments[key] = seg
        self._segment_total += seg - old

    def _drop(self, key: tuple[str, str]) -> None:
        """Take a sent row out of the sums (it is replaced, or its queue is gone)."""
        row = self.sent.pop(key)
        if row is not _IDLE:
            totals = self._totals
            for i in range(7):
                totals[i] -= row[4 + i]
        self._damaged.pop(key, None)
        self._segment_total -= self._segments.pop(key, 0)

    def _check(self, worker: StatsShard, later: set | frozenset = frozenset()) -> None:
        """Tests: what a report of every queue would say against what the node was told (up to
        _CHECK_MAX queues: a test of 100,000 would spend the shard's time here)."""
        if len(worker.queues) > _CHECK_MAX:
            return
        wrong = []
        totals = [0] * 7
        segments = 0
        for key, q in worker.queues.items():
            if key in later:
                row = self.sent.get(key, _IDLE)
                segments += self._segments.get(key, 0)
            else:
                row, _damage = _row(q)
                if self.sent.get(key) != row:
                    wrong.append((key, self.sent.get(key), row))
                segments += _segment_bytes(q.store)
            for i in range(7):
                totals[i] += row[4 + i]
        for key in later:  # deleted after its part was read: still in what was sent
            if key not in worker.queues and key in self.sent:
                row = self.sent[key]
                for i in range(7):
                    totals[i] += row[4 + i]
                segments += self._segments.get(key, 0)
        extra = [key for key in self.sent if key not in worker.queues and key not in later]
        if wrong or extra or totals != self._totals or segments != self._segment_total:
            log.error(STATS_CHECK_FAILED + ": a change the shard did not report: rows %s, not removed %s, "
                      "totals %s (should be %s), segment bytes %d (should be %d)", wrong[:5], extra[:5],
                      self._totals, totals, self._segment_total, segments)
