"""PriorityStore: order across levels, FIFO within a level, requeue, purge, drop-head, ids, recovery."""

from __future__ import annotations

import os

import pytest
from pamqp import commands

from shard.priority_store import LEVEL_SHIFT, PriorityStore, max_priority_of, open_store
from shard.store import QueueStore


def props(priority: int | None, persistent: bool = True) -> bytes:
    return commands.Basic.Properties(priority=priority, delivery_mode=2 if persistent else None).marshal()


def add(store, i: int, priority: int | None, persistent: bool = True) -> int:
    return store.append(1000 + i, 1 if persistent else 0, "ex", f"rk.{i}", props(priority, persistent),
                        b"m%d" % i)


def drain(store, ack: bool = True) -> list[int]:
    out = []
    while (msg := store.shift()) is not None:
        out.append(int(msg[7][1:]))
        if ack:
            assert store.ack(msg[0])
    return out


def test_highest_priority_first_fifo_within_level(tmp_path):
    s = PriorityStore(str(tmp_path), 10)
    prios = [0, 5, None, 10, 5, 3, 10, 0]
    for i, p in enumerate(prios):
        add(s, i, p)
    assert s.ready == 8 and s.ready_bytes == 16
    assert s.peek()[7] == b"m3"
    assert drain(s) == [3, 6, 1, 4, 5, 0, 2, 7]
    assert s.ready == 0 and s.ready_bytes == 0
    assert s.shift() is None and s.peek() is None
    s.close()


def test_over_max_is_max_and_absent_is_zero(tmp_path):
    s = PriorityStore(str(tmp_path), 3)
    add(s, 0, 200)
    add(s, 1, 3)
    add(s, 2, None)
    add(s, 3, 0)
    assert s.levels == [3, 0]
    assert drain(s) == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["p-000", "p-003"]
    s.close()


def test_ids_unique_and_carry_the_level(tmp_path):
    s = PriorityStore(str(tmp_path), 255)
    ids = [add(s, i, i % 256) for i in range(300)]
    assert len(set(ids)) == 300
    assert all(mid >> LEVEL_SHIFT == i % 256 for i, mid in enumerate(ids))
    assert all(mid < 2**64 for mid in ids)  # what msgpack carries
    assert ids[0] == (1 << 32 | 4)  # level 0: the level store's own id
    for i, mid in enumerate(ids):
        assert s.read(mid)[5] == b"m%d" % i
    s.close()


def test_requeue_goes_back_to_its_level_ahead_of_newer(tmp_path):
    s = PriorityStore(str(tmp_path), 9)
    for i, p in enumerate([1, 1, 1, 5]):
        add(s, i, p)
    m3 = s.shift()
    m0 = s.shift()
    assert (m3[7], m0[7]) == (b"m3", b"m0")
    assert s.ready == 2
    assert s.requeue(m0[0])
    assert not s.requeue(m0[0] + (7 << LEVEL_SHIFT))  # no such level
    assert s.ready == 3 and s.ready_bytes == 6
    add(s, 4, 1)
    nxt = s.shift()
    assert nxt[7] == b"m0" and nxt[1] is True  # redelivered, ahead of m1 and m4
    assert s.ack(nxt[0]) and not s.ack(nxt[0])
    assert s.requeue(m3[0])
    assert drain(s) == [3, 1, 2, 4]
    s.close()


def test_drop_head_and_purge(tmp_path):
    s = PriorityStore(str(tmp_path), 5)
    for i, p in enumerate([0, 5, 2, 5]):
        add(s, i, p)
    assert s.drop_head()[7] == b"m1"  # the head is the highest priority (RabbitMQ)
    out = s.shift()
    assert out[7] == b"m3"
    assert s.purge() == 2
    assert s.ready == 0 and s.ready_bytes == 0 and s.shift() is None
    assert s.requeue(out[0])  # outstanding messages survive a purge
    assert drain(s) == [3]
    s.close()


def test_mark_and_after(tmp_path):
    s = PriorityStore(str(tmp_path), 5)
    old_hi = add(s, 0, 5)
    old_lo = add(s, 1, 0)
    mark = s.mark()
    new_lo = add(s, 2, 0)
    new_mid = add(s, 3, 2)  # a level that did not exist at the mark
    assert not s.after(old_hi, mark) and not s.after(old_lo, mark)
    assert s.after(new_lo, mark) and s.after(new_mid, mark)
    assert old_hi > new_lo  # why `>=` on ids is not enough here
    q = QueueStore(str(tmp_path / "plain"))
    a = q.append(1, 1, "", "k", props(None), b"a")
    qm = q.mark()
    b = q.append(1, 1, "", "k", props(None), b"b")
    assert not q.after(a, qm) and q.after(b, qm)
    q.close()
    s.close()


def test_recovery_keeps_levels_order_and_acks(tmp_path):
    path = str(tmp_path / "q")
    s = PriorityStore(path, 10, segment_size=65536)
    for i in range(60):
        add(s, i, i % 4 * 3, persistent=i != 59)  # levels 0, 3, 6, 9; the last one is transient
    taken = [s.shift() for _ in range(20)]  # the 15 of level 9 and 5 of level 6
    for msg in taken[:10]:
        assert s.ack(msg[0])
    s.flush_acks()
    s.sync()
    s.close()

    r = PriorityStore(path, 10, segment_size=65536)
    # unacked ones are ready again, in place; the transient one is gone
    assert r.ready == 49
    order = drain(r)
    assert order == ([i for i in range(59) if i % 4 == 3][10:]
                     + [i for i in range(60) if i % 4 == 2]
                     + [i for i in range(60) if i % 4 == 1]
                     + [i for i in range(60) if i % 4 == 0])
    r.flush_acks()
    r.sync()
    r.close()
    # everything acked: empty levels are removed at the next open
    e = PriorityStore(path, 10)
    assert e.ready == 0 and e.levels == []
    assert [n for n in os.listdir(path) if n.startswith("p-")] == []
    add(e, 0, 4)
    e.sync()
    e.close()
    assert PriorityStore(path, 10).levels == [4]


def test_unsynced_close_and_dirty(tmp_path):
    s = PriorityStore(str(tmp_path), 2)
    assert not s.dirty
    add(s, 0, 1)
    assert s.dirty
    s.sync()
    assert not s.dirty
    m = s.shift()
    s.ack(m[0])
    assert s.dirty
    s.flush_acks()
    s.sync()
    assert not s.dirty
    s.delete()
    assert not os.path.exists(tmp_path)


def test_open_store_and_max_priority_of(tmp_path):
    assert max_priority_of(None) is None
    assert max_priority_of({"x-max-priority": 10}) == 10
    assert max_priority_of({"x-max-priority": 0}) == 0
    assert max_priority_of({"x-max-priority": True}) is None
    assert isinstance(open_store(str(tmp_path / "a"), {}, 1 << 20), QueueStore)
    p = open_store(str(tmp_path / "b"), {"x-max-priority": 0}, 1 << 20)
    assert isinstance(p, PriorityStore)
    add(p, 0, 9)
    add(p, 1, None)
    assert p.levels == [0] and drain(p) == [0, 1]  # max 0: one level, plain FIFO
    p.close()


def test_level_segment_numbers_exhausted_is_refused_not_aliased(tmp_path):
    s = PriorityStore(str(tmp_path), 5)
    add(s, 0, 1)
    s.sync()
    s.close()
    level = tmp_path / "p-001"
    os.rename(level / "msgs.0000000001", level / f"msgs.{2**24 - 1:010d}")
    r = PriorityStore(str(tmp_path), 5)
    assert r.ready == 1
    with pytest.raises(OverflowError):
        add(r, 1, 1)
    add(r, 2, 2)  # other levels go on
    assert drain(r) == [2, 0]
    r.close()
