"""QueueStore against a simple in-memory model: random append/shift/ack/requeue/purge/reopen sequences."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shard import store as store_module
from shard.store import QueueStore

SEGMENT = 512  # tiny, so sequences cross many segment boundaries and big records get their own


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="qs-model-")
        self.keep_transient = False
        self.store = QueueStore(self.dir, segment_size=SEGMENT)
        self.records: dict[int, tuple] = {}  # msg_id -> (ts, flags, ex, rk, props, body), live ones
        self.cursor: list[int] = []  # ready, never delivered since the last (re)open, in append order
        self.requeued: list[int] = []  # ready again, sorted
        self.outstanding: set[int] = set()
        self.n = 0
        # The store's delivered mark (one past the last record taken from the cursor; persisted) and
        # what it was at the last reopen: records below it come back with redelivered=True.
        self.mark = 0
        self.redeliver_below = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        persistent=st.booleans(),
        rk=st.text(max_size=5),
        props=st.binary(max_size=20),
        size=st.sampled_from([0, 1, 10, 100, 700, 2000]),
    )
    def append(self, persistent, rk, props, size):
        self.n += 1
        body = (b"%d|" % self.n).ljust(size, b".")
        rec = (self.n, int(persistent), "x", rk, props, body)
        msg_id = self.store.append(*rec)
        assert msg_id not in self.records
        assert not self.cursor or msg_id > self.cursor[-1]
        self.records[msg_id] = rec
        self.cursor.append(msg_id)

    @rule()
    def shift(self):
        msg = self.store.shift()
        if self.requeued:
            expect, redelivered = self.requeued.pop(0), True
        elif self.cursor:
            expect = self.cursor.pop(0)
            redelivered = expect < self.redeliver_below
            self.mark = max(self.mark, expect + 1)
        else:
            assert msg is None
            return
        assert msg is not None
        assert msg[:2] == (expect, redelivered)
        assert msg[2:] == self.records[expect]
        self.outstanding.add(expect)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def ack(self, data):
        msg_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        assert self.store.ack(msg_id)
        self.outstanding.discard(msg_id)
        del self.records[msg_id]

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def requeue(self, data):
        msg_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        assert self.store.requeue(msg_id)
        self.outstanding.discard(msg_id)
        self.requeued.append(msg_id)
        self.requeued.sort()

    @rule()
    def peek(self):
        msg = self.store.peek()
        expect = self.requeued[0] if self.requeued else self.cursor[0] if self.cursor else None
        assert (msg[0] if msg else None) == expect

    @rule(whole=st.booleans())
    def purge(self, whole):
        # whole: segments of ready messages go whole from one message on (the write segment replaced),
        # not from store._PURGE_WHOLE_MIN, which these small sequences seldom reach.
        saved = store_module._PURGE_WHOLE_MIN
        store_module._PURGE_WHOLE_MIN = 1 if whole else saved
        try:
            removed = self.store.purge()
        finally:
            store_module._PURGE_WHOLE_MIN = saved
        gone = self.requeued + self.cursor
        assert removed == len(gone)
        for msg_id in gone:
            del self.records[msg_id]
        self.requeued, self.cursor = [], []

    @rule()
    def drop_head(self):
        msg = self.store.drop_head()
        if self.requeued:
            expect = self.requeued.pop(0)
        elif self.cursor:
            expect = self.cursor.pop(0)
            self.mark = max(self.mark, expect + 1)
        else:
            assert msg is None
            return
        assert msg[0] == expect
        del self.records[expect]

    @rule(clean=st.booleans(), keep_transient=st.booleans())
    def reopen(self, clean, keep_transient):
        if clean:
            self.store.sync()
            self.store.close()
        else:
            del self.store  # crash: no close, no sync
        self.store = QueueStore(self.dir, segment_size=SEGMENT, keep_transient=keep_transient)
        if not keep_transient:
            self.records = {k: r for k, r in self.records.items() if r[1] & 1}
        self.cursor = sorted(self.records)
        self.requeued = []
        self.outstanding = set()
        # Messages delivered before the restart (and not acked) are redelivered; ids appended from
        # now on start at the end of the data, so the mark is clamped there.
        end = self.store._wseg.no << 32 | self.store._wseg.used
        self.redeliver_below = self.mark = min(self.mark, end)

    @invariant()
    def counts(self):
        ready = self.requeued + self.cursor
        assert self.store.ready == len(ready)
        assert self.store.ready_bytes == sum(len(self.records[i][5]) for i in ready)


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
