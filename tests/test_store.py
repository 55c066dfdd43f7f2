"""QueueStore: ordering, acks, requeues, segments, recovery from clean and unclean shutdowns."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

import pytest

from shard import record, segment_dir
from shard import store as store_module
from shard.segment import DATA_START, Meta, file_name
from shard.segment_dir import REAPER_NAME, REAPER_NICE, TRASH_PREFIX
from shard.store import QueueStore, make_queue_dir, queue_dir
from tests.harness import wait_until

PROPS = b"\x80\x00\x02"  # delivery-mode present, = 2


def add(store: QueueStore, i: int, flags: int = 1, size: int = 0) -> int:
    body = (b"m%d|" % i).ljust(size, b"x")
    return store.append(1000 + i, flags, "ex", f"rk.{i}", PROPS, body)


def body_index(msg: tuple) -> int:
    return int(msg[7].split(b"|")[0][1:])


def drain(store: QueueStore, ack: bool = True) -> list[int]:
    out = []
    while (msg := store.shift()) is not None:
        out.append(body_index(msg))
        if ack:
            assert store.ack(msg[0])
    return out


def files(path: str, kind: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(kind + "."))


def test_append_shift_ack_order(tmp_path):
    s = QueueStore(str(tmp_path))
    ids = [add(s, i) for i in range(10)]
    assert ids == sorted(ids) and ids[0] == (1 << 32 | DATA_START)
    assert s.ready == 10
    assert s.ready_bytes == sum(len(b"m%d|" % i) for i in range(10))
    msg = s.shift()
    assert msg == (ids[0], False, 1000, 1, "ex", "rk.0", PROPS, b"m0|")
    assert s.ready == 9
    assert s.peek()[0] == ids[1]
    assert s.read(ids[0]) == (1000, 1, "ex", "rk.0", PROPS, b"m0|")
    assert s.ack(ids[0])
    assert not s.ack(ids[0]), "second ack of the same message"
    assert not s.ack(ids[5]), "ack of a message never delivered"
    assert drain(s) == list(range(1, 10))
    assert s.ready == 0 and s.ready_bytes == 0
    assert s.shift() is None and s.peek() is None
    s.close()


def test_requeue_order_and_redelivered(tmp_path):
    s = QueueStore(str(tmp_path))
    ids = [add(s, i) for i in range(6)]
    got = [s.shift() for _ in range(4)]
    assert s.requeue(ids[2]) and s.requeue(ids[0])
    assert s.ready == 4
    nxt = s.peek()
    assert nxt[:2] == (ids[0], True)
    order = [(m[0], m[1]) for m in iter(s.shift, None)]
    assert order == [(ids[0], True), (ids[2], True), (ids[4], False), (ids[5], False)]
    assert got[1][7] == b"m1|"
    s.close()


def test_empty_strings_and_utf8(tmp_path):
    s = QueueStore(str(tmp_path))
    mid = s.append(5, 0, "", "", b"", b"")
    mid2 = s.append(6, 1, "ëx", "ключ", b"p" * 300, b"\x00" * 70000)
    assert s.shift() == (mid, False, 5, 0, "", "", b"", b"")
    assert s.shift() == (mid2, False, 6, 1, "ëx", "ключ", b"p" * 300, b"\x00" * 70000)
    s.close()


def test_purge_keeps_outstanding(tmp_path):
    s = QueueStore(str(tmp_path), segment_size=4096)
    ids = [add(s, i) for i in range(300)]
    a = s.shift()
    b = s.shift()
    s.requeue(a[0])
    assert s.ready == 299
    assert s.purge() == 299
    assert s.ready == 0 and s.ready_bytes == 0 and s.shift() is None
    # the outstanding one can still be acked or requeued
    assert s.requeue(b[0])
    assert s.shift()[0] == ids[1]
    assert s.ack(ids[1])
    # only the write segment is left
    assert len(files(str(tmp_path), "msgs")) == 1
    add(s, 1000)
    assert drain(s) == [1000]
    s.close()
    s = QueueStore(str(tmp_path), segment_size=4096)
    assert s.ready == 0
    s.close()


def test_purge_deletes_segments_of_ready_messages_whole(tmp_path):
    """Segments holding ready messages only go whole, the write segment too (a fresh one takes its
    place): no ack per record. The count is exact, later appends are read in order, and neither a
    clean reopen nor one after a crash brings a purged message back."""
    path = str(tmp_path)
    s = QueueStore(path, segment_size=32768)
    ids = [add(s, i) for i in range(2000)]
    segs = sorted({i >> 32 for i in ids})
    assert len(segs) >= 3
    assert sum(1 for i in ids if i >> 32 == segs[-1]) >= store_module._PURGE_WHOLE_MIN
    assert s.purge() == 2000
    assert s.ready == 0 and s.ready_bytes == 0 and s.shift() is None
    assert files(path, "msgs") == [file_name("msgs", segs[-1] + 1)]
    assert files(path, "acks") == []
    add(s, 5001)
    del s  # a crash: no close, no sync
    s = QueueStore(path, segment_size=32768)
    assert s.ready == 1
    add(s, 5002)
    assert drain(s) == [5001, 5002]
    s.close()
    s = QueueStore(path, segment_size=32768)
    assert s.ready == 0
    s.close()


def test_purge_walks_a_segment_that_holds_an_outstanding_message(tmp_path):
    """Many ready messages beside an outstanding (delivered, unacked) one in the write segment, and
    a requeued one: the ready ones go one by one, the outstanding one stays to be acked or requeued."""
    path = str(tmp_path)
    s = QueueStore(path, segment_size=1 << 20)
    ids = [add(s, i) for i in range(1000)]
    a = s.shift()
    b = s.shift()
    s.requeue(a[0])
    assert s.purge() == 999
    assert files(path, "msgs") == [file_name("msgs", ids[0] >> 32)]
    assert s.requeue(b[0]) and s.shift()[0] == ids[1]
    assert s.ack(ids[1])
    add(s, 5001)
    assert drain(s) == [5001]
    s.close()
    s = QueueStore(path, segment_size=1 << 20)
    assert s.ready == 0
    s.close()


def test_rollover_and_deletion_of_acked_segments(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    ids = [add(s, i, size=100) for i in range(200)]
    segs = sorted({i >> 32 for i in ids})
    assert len(segs) > 4 and segs == list(range(1, len(segs) + 1))
    msgs = files(path, "msgs")
    assert msgs[0] == file_name("msgs", 1) == "msgs.0000000001"
    # sealed segments are truncated to their used length and have a valid meta
    for no in segs[:-1]:
        size = os.path.getsize(os.path.join(path, file_name("msgs", no)))
        assert size <= 4096
        with open(os.path.join(path, file_name("meta", no)), "rb") as f:
            meta = Meta.decode(f.read())
        assert meta is not None and meta.used == size
        assert meta.count == sum(1 for i in ids if i >> 32 == no)
    first_seg = [i for i in ids if i >> 32 == 1]
    for _ in first_seg:
        s.ack(s.shift()[0])
    assert file_name("msgs", 1) not in os.listdir(path)
    assert file_name("acks", 1) not in os.listdir(path)
    assert file_name("meta", 1) not in os.listdir(path)
    assert drain(s) == list(range(len(first_seg), 200))
    assert files(path, "msgs") == [file_name("msgs", segs[-1])]
    s.close()


def test_record_bigger_than_segment(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    big = b"B" * 10000
    first = s.append(1, 1, "", "q", b"", big)  # fresh store: the empty write segment just grows
    small = add(s, 1)
    second = s.append(2, 1, "", "q", b"", big)
    add(s, 2)
    assert len({first >> 32, small >> 32, second >> 32}) == 3
    assert s.shift()[7] == big
    s.sync()
    s.close()
    s = QueueStore(path, segment_size=4096)
    out = [m[7] for m in iter(s.shift, None)]
    assert out == [big, b"m1|", big, b"m2|"]
    s.close()


def test_reopen_after_close_keeps_unacked_and_ready(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(250):
        add(s, i)
    for _ in range(100):
        s.ack(s.shift()[0])
    for _ in range(20):
        s.shift()  # outstanding: ready again after a restart
    s.sync()
    s.close()
    s = QueueStore(path, segment_size=4096)
    assert s.ready == 150
    assert s.ready_bytes == sum(len(b"m%d|" % i) for i in range(100, 250))
    assert drain(s, ack=False) == list(range(100, 250))
    s.close()


def test_reopen_without_close(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(250):
        add(s, i)
    for _ in range(30):
        s.ack(s.shift()[0])
    del s  # no close, no sync: like a crash of the process (the page cache keeps the writes)
    s = QueueStore(path, segment_size=4096)
    assert s.ready == 220
    assert drain(s, ack=False)[:3] == [30, 31, 32]
    s.close()


def test_transient_dropped_on_recovery(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(300):
        add(s, i, flags=1 if i % 3 == 0 else 0)
    s.close()
    s = QueueStore(path, segment_size=4096)
    assert drain(s, ack=False) == list(range(0, 300, 3))
    s.close()
    # dropping is durable: a store that keeps transients finds them gone too
    s = QueueStore(path, segment_size=4096, keep_transient=True)
    assert s.ready == 100
    s.close()


def test_keep_transient(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096, keep_transient=True)
    for i in range(300):
        add(s, i, flags=0)
    s.close()
    s = QueueStore(path, segment_size=4096, keep_transient=True)
    assert drain(s) == list(range(300))
    s.close()


def test_acks_reloaded_and_skipped(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(300):
        add(s, i)
    msgs = [s.shift() for _ in range(200)]
    for m in msgs[::2]:  # ack every other one, spread over sealed and write segments
        s.ack(m[0])
    s.close()
    s = QueueStore(path, segment_size=4096)
    expect = [i for i in range(200) if i % 2] + list(range(200, 300))
    assert s.ready == len(expect)
    assert drain(s) == expect
    s.close()


def _tail(path: str) -> str:
    return os.path.join(path, files(path, "msgs")[-1])


def _setup_tail(path: str, n: int = 5) -> list[int]:
    s = QueueStore(path)
    ids = [add(s, i) for i in range(n)]
    s.close()
    return ids


def _reopen_and_check(path: str, expect: list[int], caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shard.store"):
        s = QueueStore(path)
    assert any("cut" in r.getMessage() for r in caplog.records)
    add(s, 100)
    add(s, 101)
    s.close()
    s = QueueStore(path)
    assert drain(s) == [*expect, 100, 101]
    s.close()


def test_torn_tail_truncated_mid_record(tmp_path, caplog):
    path = str(tmp_path)
    ids = _setup_tail(path)
    last = ids[-1] & 0xFFFFFFFF
    os.truncate(_tail(path), last + 12)  # cuts the last record in the middle
    _reopen_and_check(path, [0, 1, 2, 3], caplog)


def test_garbage_after_last_record(tmp_path, caplog):
    path = str(tmp_path)
    ids = _setup_tail(path)
    with open(_tail(path), "r+b") as f:
        f.seek(record.skip(f.read(), ids[-1] & 0xFFFFFFFF))
        f.write(os.urandom(64))
    _reopen_and_check(path, [0, 1, 2, 3, 4], caplog)


def test_flipped_byte_in_last_record(tmp_path, caplog):
    path = str(tmp_path)
    ids = _setup_tail(path)
    at = (ids[-1] & 0xFFFFFFFF) + 20
    with open(_tail(path), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    _reopen_and_check(path, [0, 1, 2, 3], caplog)


def test_corrupt_record_in_sealed_segment_without_meta(tmp_path, caplog):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    ids = [add(s, i) for i in range(200)]
    s.close()
    seg1 = [i for i in ids if i >> 32 == 1]
    os.unlink(os.path.join(path, file_name("meta", 1)))
    with open(os.path.join(path, file_name("msgs", 1)), "r+b") as f:
        f.seek((seg1[10] & 0xFFFFFFFF) + 12)
        f.write(b"\xff\xff")
    with caplog.at_level(logging.WARNING, logger="shard.store"):
        s = QueueStore(path, segment_size=4096)
    assert any("CRC mismatch" in r.getMessage() for r in caplog.records)
    # Damage in a sealed segment costs the damaged record only (issue #9), not the rest of it.
    assert drain(s) == list(range(10)) + list(range(11, 200))
    assert s.damaged_records == 1
    s.close()


def test_garbage_files_never_prevent_open(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(200):
        add(s, i)
    s.close()
    with open(os.path.join(path, file_name("meta", 1)), "wb") as f:
        f.write(os.urandom(32))  # bad crc: ignored, the segment is scanned
    with open(os.path.join(path, file_name("acks", 2)), "wb") as f:
        f.write(os.urandom(4001))  # random positions (not record starts) and a torn tail
    with open(os.path.join(path, file_name("msgs", 9)), "wb") as f:
        f.write(b"\x07\x00\x00\x00" + os.urandom(100))  # unknown version
    with open(os.path.join(path, file_name("acks", 77)), "wb") as f:
        f.write(b"\x01\x00")  # orphan
    with open(os.path.join(path, "junk.txt"), "wb") as f:
        f.write(b"hello")
    s = QueueStore(path, segment_size=4096)
    assert drain(s) == list(range(200))
    add(s, 500)
    s.close()
    s = QueueStore(path, segment_size=4096)
    assert drain(s) == [500]
    s.close()


def test_empty_last_segment_file(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(200):
        add(s, i)
    s.close()
    last = files(path, "msgs")[-1]
    no = int(last.split(".")[1])
    open(os.path.join(path, file_name("msgs", no + 1)), "wb").close()  # crash right after creating it
    s = QueueStore(path, segment_size=4096)
    assert drain(s) == list(range(200))
    s.close()


def test_torn_ack_file(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path)
    for i in range(5):
        add(s, i)
    for _ in range(2):
        s.ack(s.shift()[0])
    s.close()
    with open(os.path.join(path, file_name("acks", 1)), "ab") as f:
        f.write(b"\x99\x00")
    s = QueueStore(path)
    assert s.ready == 3
    s.ack(s.shift()[0])
    s.close()
    s = QueueStore(path)
    assert drain(s) == [3, 4]
    s.close()


def test_drop_head(tmp_path):
    s = QueueStore(str(tmp_path))
    ids = [add(s, i) for i in range(3)]
    s.shift()
    s.requeue(ids[0])
    assert s.drop_head()[0] == ids[0]
    assert s.drop_head()[0] == ids[1]
    assert s.ready == 1
    s.close()
    s = QueueStore(str(tmp_path))
    assert drain(s) == [2]
    s.close()


def test_delete(tmp_path):
    path = queue_dir(str(tmp_path), "/", "q1")
    s = QueueStore(path)
    add(s, 1)
    s.delete()
    assert not os.path.exists(path)
    s.sync()  # a sync scheduled before the delete must be harmless


def test_delete_later_reaps_in_the_background_and_a_redeclare_starts_empty(tmp_path):
    import time

    path = queue_dir(str(tmp_path), "/", "q1")
    s = QueueStore(path)
    add(s, 1)
    s.sync()
    s.delete(later=True)
    # The same name, right away: a fresh store, whether the reaper thread has renamed the old
    # directory aside yet or queue_dir takes it over first.
    again = QueueStore(queue_dir(str(tmp_path), "/", "q1"))
    assert again.ready == 0
    add(again, 2)
    deadline = time.monotonic() + 10
    while any(TRASH_PREFIX in n for n in os.listdir(os.path.dirname(path))) or not os.path.isdir(path):
        assert time.monotonic() < deadline, "the deleted store's directory was never removed"
        time.sleep(0.01)
    assert drain(again) == [2]
    again.close()


def test_delete_later_removes_the_directory(tmp_path):
    import time

    path = queue_dir(str(tmp_path), "/", "gone")
    s = QueueStore(path)
    add(s, 1)
    s.sync()
    s.delete(later=True)
    deadline = time.monotonic() + 10
    while os.listdir(os.path.dirname(path)) != [".vhost"]:
        assert time.monotonic() < deadline, os.listdir(os.path.dirname(path))
        time.sleep(0.01)


def test_delete_later_of_many_while_some_names_come_back(tmp_path):
    """The reaper moves queued directories into trash directories while the loop declares some of
    the deleted names again (claim_path, racing the reaper's renames): every re-declared store
    keeps exactly its new message, every other directory and every trash directory goes."""
    import time

    names = [f"q{i}" for i in range(250)]
    stores = {}
    for n in names:
        stores[n] = QueueStore(queue_dir(str(tmp_path), "v", n))
        add(stores[n], 1)
    again = {}
    for i, n in enumerate(names):
        stores[n].delete(later=True)
        if i % 7 == 0 and i >= 14:  # an earlier name back while later deletes keep the reaper busy
            back = names[i - 14]
            again[back] = QueueStore(queue_dir(str(tmp_path), "v", back))
            add(again[back], 2)
    vdir = os.path.dirname(stores[names[0]].path)
    kept = {hashlib.sha1(n.encode()).hexdigest() for n in again} | {".vhost"}
    deadline = time.monotonic() + 30
    while set(os.listdir(vdir)) != kept:
        left = set(os.listdir(vdir)) - kept
        assert time.monotonic() < deadline, f"{len(left)} left, e.g. {sorted(left)[:3]}"
        time.sleep(0.01)
    for n, s in again.items():
        assert s.ready == 1 and drain(s) == [2], n
        s.close()


def _task_stat(tid: int) -> tuple[str, int]:
    """(comm, nice) of a thread of this process, from /proc/self/task/<tid>/stat."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text[text.rindex(")") + 1:].split()[16])  # field 19 of stat(5): nice


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_reaper_thread_runs_niced_and_named(tmp_path):
    """Its renames yield the core to the loop (shard/segment_dir.py _lower_priority): the reaper
    thread, and only it, runs 10 nicer than the process, under its own name in /proc."""
    main_nice = _task_stat(threading.get_native_id())[1]
    s = QueueStore(queue_dir(str(tmp_path), "/", "nice"))
    add(s, 1)
    s.delete(later=True)  # starts the reaper on first use
    reaper = segment_dir._reaper
    assert reaper is not None and reaper.is_alive()
    want = (REAPER_NAME, min(19, main_nice + REAPER_NICE))
    wait_until(lambda: _task_stat(reaper.native_id) == want, 10, f"the reaper as {want}: {_task_stat(reaper.native_id)}")
    assert _task_stat(threading.get_native_id())[1] == main_nice  # the calling thread keeps its own


def test_a_new_queue_sets_a_leftover_directory_aside_and_starts_empty(tmp_path):
    """make_queue_dir(new=True) over a directory no store of this process owns (a deleted queue's,
    left by a shard that died before removing it): set aside and removed, never taken over."""
    path = queue_dir(str(tmp_path), "/", "left")
    old = QueueStore(path)
    add(old, 1)
    old.sync()
    old.close()  # the shard died: nobody removes it
    again, made = make_queue_dir(str(tmp_path), "/", "left", new=True)
    assert again == path and made
    s = QueueStore(again, empty_dir=made)
    assert s.ready == 0 and sorted(os.listdir(path)) == [".queue"]
    wait_until(lambda: not any(n.startswith(TRASH_PREFIX) for n in os.listdir(os.path.dirname(path))), 10,
               "the leftover removed")
    add(s, 2)
    assert drain(s) == [2]
    s.close()
    # Not new (a boot's open of a durable queue): the directory is the queue's, taken as it is.
    assert make_queue_dir(str(tmp_path), "/", "left") == (path, False)


def test_empty_store_has_no_segment_file_until_the_first_message(tmp_path):
    path = queue_dir(str(tmp_path), "/", "lazy")
    s = QueueStore(path)
    assert sorted(os.listdir(path)) == [".queue"] and not s.dirty
    s.sync()
    s.close()
    s = QueueStore(path)  # reopened empty: still nothing
    assert sorted(os.listdir(path)) == [".queue"]
    add(s, 7)
    assert file_name("msgs", 1) in os.listdir(path) and s.dirty
    s.sync()
    s.close()
    s = QueueStore(path)
    assert drain(s) == [7]
    s.close()


def test_queue_dir_layout(tmp_path):
    path = queue_dir(str(tmp_path), "vh", "my-queue")
    vdir = os.path.dirname(path)
    assert vdir == os.path.join(str(tmp_path), hashlib.sha1(b"vh").hexdigest())
    assert os.path.basename(path) == hashlib.sha1(b"my-queue").hexdigest()
    with open(os.path.join(path, ".queue")) as f:
        assert f.read() == "my-queue"
    with open(os.path.join(vdir, ".vhost")) as f:
        assert f.read() == "vh"
    assert queue_dir(str(tmp_path), "vh", "my-queue") == path


def test_dirty_and_sync(tmp_path):
    s = QueueStore(str(tmp_path))
    s.sync()
    assert not s.dirty
    add(s, 1)
    assert s.dirty
    s.sync()
    assert not s.dirty
    s.ack(s.shift()[0])
    assert s.dirty
    s.flush_acks()  # the shard writes acks once per loop turn, on its loop thread
    s.sync()
    assert not s.dirty
    s.close()


def test_sync_in_thread_while_appending(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    stop = threading.Event()
    errors = []

    def syncer():
        try:
            while not stop.is_set():
                s.sync()
        except Exception as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=syncer)
    t.start()
    try:
        for i in range(3000):
            add(s, i, size=40)
            if i % 3 == 0:
                s.ack(s.shift()[0])
    finally:
        stop.set()
        t.join()
    assert not errors
    s.sync()
    s.close()
    s = QueueStore(path, segment_size=4096)
    assert drain(s) == list(range(1000, 3000))
    s.close()


def test_crash_between_seal_and_new_segment(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    ids = [add(s, i) for i in range(120)]
    s.close()
    last = ids[-1] >> 32
    assert last == 2
    # as if the crash hit after segment 1 was truncated but before its meta and segment 2 existed
    os.unlink(os.path.join(path, file_name("meta", 1)))
    os.unlink(os.path.join(path, file_name("msgs", 2)))
    s = QueueStore(path, segment_size=4096)
    n1 = sum(1 for i in ids if i >> 32 == 1)
    assert s.ready == n1
    # segment 1 is the write segment again: extended back to the segment size (sparse)
    assert os.path.getsize(os.path.join(path, file_name("msgs", 1))) == 4096
    add(s, 500)
    s.close()
    s = QueueStore(path, segment_size=4096)
    assert drain(s) == [*range(n1), 500]
    s.close()


def test_acks_past_cut_point_are_forgotten(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path)
    ids = [add(s, i) for i in range(5)]
    for _ in range(5):
        s.ack(s.shift()[0])
    s.close()
    # power loss: the ack file made it to disk, the last two records did not
    os.truncate(_tail(path), ids[3] & 0xFFFFFFFF)
    s = QueueStore(path)
    assert s.ready == 0
    add(s, 10)  # lands where record 3 was: it must not be taken for acked
    add(s, 11)
    s.close()
    s = QueueStore(path)
    assert drain(s) == [10, 11]
    s.close()


def test_first_sync_makes_a_new_queue_dir_durable(tmp_path, monkeypatch):
    """Before the first confirm into a new queue dir, the entries naming it are fsynced (issue #9)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    data = tmp_path / "data"
    qdir = queue_dir(str(data), "/", "fresh")
    store = QueueStore(qdir)
    store.append(1, 1, "", "fresh", b"", b"x")
    store.sync()
    vdir = os.path.dirname(qdir)
    for path in (qdir, vdir, str(data)):
        assert path in synced, (path, synced)
    synced.clear()
    store.append(1, 1, "", "fresh", b"", b"y")
    store.sync()
    assert vdir not in synced  # once per store, not per sync
    store.close()


def test_blocks_are_allocated_ahead_of_the_writer_not_for_the_whole_segment(tmp_path):
    """An idle queue must not cost a whole segment of disk: blocks are reserved in ALLOC_STEP steps
    ahead of the write position (so a full disk is an OSError, never a SIGBUS), and every record
    still lands in allocated blocks as the segment fills."""
    from shard.segment import ALLOC_STEP

    path = str(tmp_path)
    s = QueueStore(path, segment_size=8 * ALLOC_STEP)
    add(s, 0)
    msgs = os.path.join(path, file_name("msgs", 1))
    assert os.path.getsize(msgs) == 8 * ALLOC_STEP
    assert os.stat(msgs).st_blocks * 512 <= ALLOC_STEP  # one step, not 8 MiB
    ids = [add(s, i, size=1000) for i in range(3000)]  # ~3 MB: past several steps
    seg = s._wseg
    assert seg.used <= seg.alloc_end <= seg.size
    assert os.stat(msgs).st_blocks * 512 >= seg.used
    assert drain(s) == [0, *range(3000)]
    assert len(ids) == 3000
    s.close()


def _record_syncs(monkeypatch) -> list[str]:
    calls: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def fdatasync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return calls


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fill_and_sync(store, n: int = 400) -> list[int]:
    """Append n persistent 1 KiB messages (several segments of 64 KiB), take and ack every other
    one, sync after each hundred; returns the ids left unacked."""
    kept = []
    for i in range(n):
        store.append(1, 1, "", "q", b"", b"%04d" % i + b"x" * 1020)
        if i % 100 == 99:
            store.sync()
    i = 0
    while (m := store.shift()) is not None:
        if i % 2:
            kept.append(m[0])
        else:
            store.ack(m[0])
        i += 1
    store.flush_acks()
    store.sync()
    return kept


def test_a_non_durable_queues_store_is_never_fsynced_but_closes_its_sealed_segments(tmp_path, monkeypatch):
    """A non-durable queue's store (fsync=False) makes no fsync/fdatasync at all (its directory is
    deleted at the node's next start), still closes the fds of the segments it sealed, and what it
    wrote is all there for a shard that was killed and reopens it (the page cache holds it)."""
    from shard.priority_store import open_store

    calls = _record_syncs(monkeypatch)
    # The control: a durable queue's store does fsync, so the recording sees the calls.
    before = _open_fds()
    durable = QueueStore(queue_dir(str(tmp_path / "data"), "/", "durable"), segment_size=64 << 10)
    _fill_and_sync(durable)
    assert calls
    durable_fds = _open_fds() - before
    durable.close()
    for name, args in (("plain", None), ("priority", {"x-max-priority": 3})):
        calls.clear()
        path = queue_dir(str(tmp_path / "data"), "/", name)
        before = _open_fds()
        store = open_store(path, args, 64 << 10, fsync=False)
        kept = _fill_and_sync(store)
        assert calls == [], (name, calls)
        assert not store.dirty
        # 400 KiB in 64 KiB segments: the sealed ones' msgs and meta fds are closed as a synced
        # durable store's are (what stays open is the write segment's and the ack files).
        assert _open_fds() - before <= durable_fds, (name, durable_fds, os.listdir("/proc/self/fd"))
        store.close()
        again = open_store(path, args, 64 << 10, fsync=False)
        assert again.ready == len(kept) == 200
        got = []
        while (m := again.shift()) is not None:
            got.append(m[0])
        assert sorted(got) == sorted(kept)
        again.close()
        assert calls == []


def test_a_confirm_round_fsyncs_records_not_acks_and_a_later_round_fsyncs_the_acks(tmp_path, monkeypatch):
    """sync(acks=False), the round confirms wait for, fdatasyncs the segment and leaves the ack file
    and the delivered mark for a later round with acks (the periodic pass): a confirm never waits on
    acks. The acks are written all the same (a killed shard finds them in the page cache: a store
    reopened without any further sync has them), and the store stays dirty until they are fsynced."""
    from shard.store import DELIVERED_MARK

    calls = _record_syncs(monkeypatch)
    path = queue_dir(str(tmp_path / "data"), "/", "q")
    s = QueueStore(path, segment_size=64 << 10)
    for i in range(10):
        add(s, i)
    s.sync()  # the first round also fsyncs the new directories; not what this test looks at
    for _ in range(4):
        assert s.ack(s.shift()[0])
    s.flush_acks()
    add(s, 10)
    calls.clear()
    s.sync(acks=False)
    names = [os.path.basename(c) for c in calls]
    assert "msgs.0000000001" in names
    assert not [n for n in names if n.startswith("acks.") or n == DELIVERED_MARK], names
    assert s.dirty  # the acks still wait for their round
    # What a shard killed now leaves: the acks are in the file (page cache), the records too.
    again = QueueStore(path, segment_size=64 << 10)
    assert drain(again, ack=False) == list(range(4, 11))
    again.close()
    calls.clear()
    s.sync()  # the periodic round: the acks and the mark now
    names = [os.path.basename(c) for c in calls]
    assert "acks.0000000001" in names and DELIVERED_MARK in names, names
    assert not s.dirty
    calls.clear()
    s.sync()
    assert calls == []  # nothing left to make durable
    s.close()
