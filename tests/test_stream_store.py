"""StreamStore (shard/stream_store.py): offsets, cursors, retention, tracked offsets and recovery."""

from __future__ import annotations

import io
import logging
import os

from shard import record
from shard.segment import DATA_START
from shard.stream_store import OFFSETS_FILE, StreamStore
from shard.verify import Report, verify_dir

PROPS = b"\x10\x00\x02"
SEG = 400  # a few records per segment


def fill(s: StreamStore, n: int, start: int = 0, ts: int = 1_000_000) -> None:
    for i in range(start, start + n):
        s.append(ts + i, 1, "amq.direct", "rk", PROPS, b"m%03d" % i)


def read_all(s: StreamStore, kind: str = "first", value: int = 0) -> list[tuple[int, bytes]]:
    c = s.cursor(kind, value)
    out = []
    while (m := s.read(c)) is not None:
        out.append((m[0], m[6]))
    s.release(c)
    return out


def segment_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("msgs."))


def test_offsets_cursors_and_many_readers(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 30)
    assert (s.count, s.first_offset, s.next_offset) == (30, 0, 30)
    assert len(segment_files(tmp_path)) > 3
    assert read_all(s) == [(i, b"m%03d" % i) for i in range(30)]
    assert [o for o, _ in read_all(s, "offset", 17)] == list(range(17, 30))
    assert read_all(s, "last") == [(29, b"m029")]
    assert read_all(s, "next") == []
    assert [o for o, _ in read_all(s, "timestamp", 1_000_000 + 25)] == list(range(25, 30))
    # Two readers interleaved over the same files, each at its own position.
    a, b = s.cursor("first"), s.cursor("offset", 10)
    assert [s.read(a)[0] for _ in range(3)] == [0, 1, 2]
    assert [s.read(b)[0] for _ in range(3)] == [10, 11, 12]
    assert s.read(a)[0] == 3
    # A reader at the end sees what is appended after it.
    n = s.cursor("next")
    assert s.read(n) is None
    fill(s, 1, start=30)
    assert s.read(n)[0] == 30
    s.close()


def test_retention_removes_whole_segments_and_keeps_offsets(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    behind = s.cursor("first")
    fill(s, 40)
    s.configure(12, None, None)
    assert s.count <= 12 and s.first_offset > 0
    assert s.first_offset + s.count == 40
    got = read_all(s)
    assert got[0][0] == s.first_offset and got[-1] == (39, b"m039")
    # The reader that was behind continues at the oldest retained message.
    assert s.read(behind)[0] == s.first_offset
    # Offsets below the first retained one are clamped to it.
    assert read_all(s, "offset", 0)[0][0] == s.first_offset
    s.configure(None, 2 * SEG, None)
    assert s.bytes <= 2 * SEG
    s.configure(None, None, 1)  # timestamps are in 1970: everything but the write segment is old
    assert len(segment_files(tmp_path)) == 1
    first = s.first_offset
    s.sync()
    s.close()
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert s.first_offset == first and s.next_offset == 40
    fill(s, 1, start=40)
    assert read_all(s)[-1] == (40, b"m040")
    s.close()


def test_reopen_keeps_offsets_and_tracked_consumers(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 25)
    s.track("reader-1", 7)
    s.flush_acks()
    assert s.dirty
    s.sync()
    s.close()
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert (s.count, s.next_offset) == (25, 25)
    assert s.tracked == {"reader-1": 7}
    assert read_all(s) == [(i, b"m%03d" % i) for i in range(25)]
    s.close()
    # Without close (a crash after the page cache has the data): same content.
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 5, start=25)
    del s
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert [o for o, _ in read_all(s)] == list(range(30))
    s.close()


def _last_segment(path) -> str:
    return os.path.join(path, segment_files(path)[-1])


def _record_starts(path: str) -> list[int]:
    with open(path, "rb") as f:
        data = f.read()
    result = record.ScanResult()
    return [pos for pos, _f, _b in record.scan(data, DATA_START, len(data), True, result)]


def test_damaged_record_before_valid_ones_is_skipped_and_offsets_kept(tmp_path, caplog):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 10)
    s.sync()
    s.close()
    last = _last_segment(tmp_path)
    starts = _record_starts(last)
    assert len(starts) >= 2
    with open(last, "r+b") as f:  # flip a body byte of the second-to-last record
        f.seek(starts[-2] + 30)
        b = f.read(1)
        f.seek(starts[-2] + 30)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING):
        s = StreamStore(str(tmp_path), segment_size=SEG)
    assert "CRC mismatch" in caplog.text and "offsets 8..8 lost" in caplog.text
    # Damage, not a torn tail (a valid record follows): only that record is gone, offsets stay.
    assert s.next_offset == 10 and s.damaged_records == 1
    assert [o for o, _ in read_all(s)] == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert os.path.exists(last + f".damaged-{starts[-2]}")
    # New appends take the offsets after the last one and survive another reopen (no new loss).
    fill(s, 2, start=100)
    s.sync()
    s.close()
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert s.damaged_records == 0
    assert read_all(s)[-3:] == [(9, b"m009"), (10, b"m100"), (11, b"m101")]
    s.close()


def test_torn_record_mid_write(tmp_path, caplog):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 2)
    s.sync()
    fill(s, 1)  # after the last sync (past the synced mark): never confirmed
    s.close()
    last = _last_segment(tmp_path)
    starts = _record_starts(last)
    with open(last, "r+b") as f:  # the length of a record whose payload never made it
        f.seek(starts[-1])
        f.write(b"\xff\x00\x00\x00\x01\x02\x03\x04")
    with caplog.at_level(logging.WARNING):
        s = StreamStore(str(tmp_path), segment_size=SEG)
    assert "stream" in caplog.text
    assert s.next_offset == len(starts) - 1 == 2
    assert [o for o, _ in read_all(s)] == list(range(s.next_offset))
    s.close()


def test_missing_final_smeta_of_a_sealed_segment_is_rebuilt(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 20)
    s.sync()
    s.close()
    first_seg = segment_files(tmp_path)[0].replace("msgs", "smeta")
    os.unlink(tmp_path / first_seg)
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert (s.count, s.first_offset, s.next_offset) == (20, 0, 20)
    assert [o for o, _ in read_all(s)] == list(range(20))
    s.close()
    assert os.path.exists(tmp_path / first_seg)


def test_garbage_files_never_prevent_open(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 5)
    s.sync()
    s.close()
    with open(tmp_path / "msgs.0000000099", "wb") as f:
        f.write(b"\x07\x00\x00\x00garbage")
    with open(tmp_path / "smeta.0000000123", "wb") as f:
        f.write(b"stray")
    with open(tmp_path / OFFSETS_FILE, "wb") as f:
        f.write(b"{not json")
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert [o for o, _ in read_all(s)] == list(range(5))
    assert s.tracked == {}
    assert not os.path.exists(tmp_path / "smeta.0000000123")
    s.close()


def test_readers_map_only_the_segments_they_are_in(tmp_path):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 1500)
    segs = s._segs
    assert len(segs) > 150
    mapped = lambda: sum(1 for seg in segs if seg.mm is not None)  # noqa: E731
    assert mapped() == 1  # only the write segment
    a, b = s.cursor("first"), s.cursor("offset", 700)
    most = 0
    while s.read(a) is not None:
        s.read(b)
        most = max(most, mapped())
    assert most <= 3  # a's segment, b's segment, the write segment
    s.release(a)
    s.release(b)
    assert mapped() == 1
    s.close()


def test_record_bigger_than_a_segment_and_sync_while_appending(tmp_path):
    import threading

    s = StreamStore(str(tmp_path), segment_size=SEG)
    s.append(1, 1, "", "", PROPS, b"a")
    s.append(2, 1, "", "", PROPS, b"b" * 3000)
    s.append(3, 1, "", "", PROPS, b"c")
    assert [(o, len(b)) for o, b in read_all(s)] == [(0, 1), (1, 3000), (2, 1)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def syncer():
        while not stop.is_set():
            try:
                s.sync()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    t = threading.Thread(target=syncer)
    t.start()
    try:
        fill(s, 3000, start=3)
    finally:
        stop.set()
        t.join()
    assert errors == []
    s.sync()
    s.close()
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert s.next_offset == 3003
    s.close()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_damage_in_sealed_segments_keeps_every_offset(tmp_path, caplog):
    s = StreamStore(str(tmp_path), segment_size=SEG)
    fill(s, 40)
    s.sync()
    s.close()
    segs = [os.path.join(tmp_path, n) for n in segment_files(tmp_path) if n.startswith("msgs.")]
    assert len(segs) >= 5
    starts = [_record_starts(p) for p in segs]
    firsts = [sum(map(len, starts[:i])) for i in range(len(starts))]
    _flip(segs[0], starts[0][1] + 30)  # segment 1 (valid smeta): found when first read
    with open(segs[1], "r+b") as f:  # segment 2: a length field; the smeta's count says how many
        f.seek(starts[1][1])
        f.write(b"\xff\xff\x00\x00")
    os.unlink(segs[2].replace("msgs.", "smeta."))  # segment 3 without smeta: scanned at start,
    _flip(segs[2], starts[2][0] + 2)  # its count from segment 4's first offset
    lost = {firsts[0] + 1, firsts[1] + 1, firsts[2]}
    with caplog.at_level(logging.WARNING):
        s = StreamStore(str(tmp_path), segment_size=SEG)
    assert s.damaged_records == 1 and s.next_offset == 40  # segment 3 at start; 1 and 2 not read yet
    want = [(i, b"m%03d" % i) for i in range(40) if i not in lost]
    assert read_all(s) == want
    assert s.damaged_records == 3 and s.count == 40
    # Addressing by offset and by time around the damage.
    assert read_all(s, "offset", firsts[1] + 1)[0] == (firsts[1] + 2, b"m%03d" % (firsts[1] + 2))
    assert read_all(s, "offset", firsts[1] + 2)[0][0] == firsts[1] + 2
    assert read_all(s, "timestamp", 1_000_000 + firsts[1] + 1)[0][0] == firsts[1] + 2
    assert f"offsets {firsts[1] + 1}..{firsts[1] + 1} lost" in caplog.text
    for i, n in ((0, starts[0][1]), (1, starts[1][1]), (2, starts[2][0])):
        assert os.path.exists(f"{segs[i]}.damaged-{n}")
    s.sync()
    s.close()
    # Durable: the same offsets after a reopen, nothing new lost, and verify finds it all clean.
    s = StreamStore(str(tmp_path), segment_size=SEG)
    assert read_all(s) == want and s.damaged_records == 0
    s.close()
    report = Report(io.StringIO())
    verify_dir(str(tmp_path), report)
    assert report.damage == 0 and report.segments == len(segs)
    _flip(segs[1].replace("msgs.", "smeta."), 20)  # a sealed smeta's count: verify says so
    out = io.StringIO()
    report = Report(out)
    verify_dir(str(tmp_path), report)
    assert report.damage == 1 and "stream meta file does not decode" in out.getvalue()
