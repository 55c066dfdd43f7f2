"""PriorityStore against an in-memory model: random append/shift/ack/requeue/purge/drop-head/reopen."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pamqp import commands

from shard.priority_store import LEVEL_SHIFT, PriorityStore

INNER = (1 << LEVEL_SHIFT) - 1

SEGMENT = 512  # tiny: levels cross many segment boundaries
MAX = 7


class PriorityModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ps-model-")
        self.store = PriorityStore(self.dir, MAX, segment_size=SEGMENT)
        self.records: dict[int, tuple] = {}  # live msg_id -> record
        self.cursor: dict[int, list[int]] = {}  # level -> ready, never delivered since (re)open, append order
        self.requeued: dict[int, list[int]] = {}  # level -> ready again, sorted
        self.outstanding: set[int] = set()
        self.n = 0
        self.mark: dict[int, int] = {}  # level -> its store's delivered mark (inner ids)
        self.below: dict[int, int] = {}  # level -> the mark at the last reopen: redelivered below it

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _head(self) -> tuple[int, bool, int, bool] | None:
        """(msg id, redelivered, level, from the requeued list)."""
        for level in range(MAX, -1, -1):
            if self.requeued.get(level):
                return self.requeued[level][0], True, level, True
            if self.cursor.get(level):
                msg_id = self.cursor[level][0]
                return msg_id, msg_id & INNER < self.below.get(level, 0), level, False
        return None

    def _take_head(self) -> tuple[int, bool] | None:
        head = self._head()
        if head is None:
            return None
        msg_id, redelivered, level, requeued = head
        (self.requeued if requeued else self.cursor)[level].pop(0)
        if not requeued:  # the level's delivered mark moves past it (persisted, see QueueStore)
            self.mark[level] = max(self.mark.get(level, 0), (msg_id & INNER) + 1)
        return msg_id, redelivered

    @rule(persistent=st.booleans(), priority=st.one_of(st.none(), st.integers(0, 12)),
          size=st.sampled_from([0, 10, 100, 700]))
    def append(self, persistent, priority, size):
        self.n += 1
        props = commands.Basic.Properties(priority=priority, delivery_mode=2 if persistent else 1).marshal()
        rec = (self.n, int(persistent), "x", "rk", props, (b"%d|" % self.n).ljust(size, b"."))
        msg_id = self.store.append(*rec)
        level = min(priority or 0, MAX)
        assert msg_id >> LEVEL_SHIFT == level
        assert msg_id not in self.records
        self.records[msg_id] = rec
        self.cursor.setdefault(level, []).append(msg_id)

    @rule()
    def shift(self):
        msg = self.store.shift()
        expect = self._take_head()
        if expect is None:
            assert msg is None
            return
        assert msg[:2] == expect
        assert msg[2:] == self.records[expect[0]]
        self.outstanding.add(expect[0])

    @rule()
    def peek(self):
        msg = self.store.peek()
        head = self._head()
        assert (msg[:2] if msg else None) == (head[:2] if head else None)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def ack(self, data):
        msg_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        assert self.store.ack(msg_id)
        assert not self.store.ack(msg_id)
        self.outstanding.discard(msg_id)
        del self.records[msg_id]

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def requeue(self, data):
        msg_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        assert self.store.requeue(msg_id)
        self.outstanding.discard(msg_id)
        lst = self.requeued.setdefault(msg_id >> LEVEL_SHIFT, [])
        lst.append(msg_id)
        lst.sort()

    @rule()
    def purge(self):
        gone = [i for lst in (*self.requeued.values(), *self.cursor.values()) for i in lst]
        assert self.store.purge() == len(gone)
        for msg_id in gone:
            del self.records[msg_id]
        self.requeued, self.cursor = {}, {}

    @rule()
    def drop_head(self):
        msg = self.store.drop_head()
        expect = self._take_head()
        if expect is None:
            assert msg is None
            return
        assert msg[0] == expect[0]
        del self.records[expect[0]]

    @rule(clean=st.booleans())
    def reopen(self, clean):
        if clean:
            self.store.flush_acks()
            self.store.sync()
            self.store.close()
        else:
            self.store.flush_acks()  # acks of finished turns are in the page cache
            del self.store  # crash: no close, no sync
        self.store = PriorityStore(self.dir, MAX, segment_size=SEGMENT)
        self.records = {k: r for k, r in self.records.items() if r[1] & 1}
        self.cursor = {}
        for msg_id in sorted(self.records):
            self.cursor.setdefault(msg_id >> LEVEL_SHIFT, []).append(msg_id)
        self.requeued = {}
        self.outstanding = set()
        for level in list(self.mark):
            inner = self.store._levels.get(level)
            end = inner._wseg.no << 32 | inner._wseg.used if inner is not None else 0
            self.below[level] = self.mark[level] = min(self.mark[level], end)

    @invariant()
    def counts(self):
        ready = [i for lst in (*self.requeued.values(), *self.cursor.values()) for i in lst]
        assert self.store.ready == len(ready)
        assert self.store.ready_bytes == sum(len(self.records[i][5]) for i in ready)


TestPriorityModel = PriorityModel.TestCase
TestPriorityModel.settings = settings(
    max_examples=40, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
