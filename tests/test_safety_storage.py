"""One bad byte never costs more than the damaged record (issue #9, item 1).

Real segment files, damaged on disk between a close and a reopen: at the head, middle and tail of
the write segment, in a sealed segment with a valid meta (checked lazily, when first read), across
a segment boundary, and in acks and meta files. The node-level reproduction from the issue (3,000
confirmed messages, one byte flipped at offset 300,000) is at the end.
"""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import struct
import subprocess
import sys
import time
import urllib.request

import pika

from shard import record, synced_mark
from shard.segment import DATA_START, file_name
from shard.store import QueueStore, queue_dir
from tests.test_store import add, drain


def _flip(path: str, offset: int, mask: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _pos(msg_id: int) -> int:
    return msg_id & 0xFFFFFFFF


def _fill(path: str, n: int, **kw) -> list[int]:
    s = QueueStore(path, **kw)
    ids = [add(s, i, size=100) for i in range(n)]
    s.sync()
    s.close()
    return ids


def _reopen(path: str, caplog, **kw) -> QueueStore:
    with caplog.at_level(logging.WARNING, logger="shard.store"):
        return QueueStore(path, **kw)


def test_damage_at_head_middle_and_tail_of_the_write_segment(tmp_path, caplog):
    for where, victim in (("head", 0), ("middle", 25), ("last-but-one", 48)):
        path = str(tmp_path / where)
        ids = _fill(path, 50)
        seg = os.path.join(path, file_name("msgs", 1))
        _flip(seg, _pos(ids[victim]) + 30)  # inside the payload: the CRC catches it
        before = open(seg, "rb").read()
        s = _reopen(path, caplog)
        assert drain(s) == [i for i in range(50) if i != victim], where
        assert s.damaged_records == 1
        s.close()
        # The damaged bytes were set aside, byte for byte, before the segment was repaired.
        start, stop = _pos(ids[victim]), _pos(ids[victim + 1])
        aside = f"{seg}.damaged-{start}"
        assert open(aside, "rb").read() == before[start:stop]
        # The repair is durable: a second open finds a clean segment and the same messages.
        s = QueueStore(path)
        assert drain(s, ack=False) == []  # everything was acked by the drain above
        assert s.damaged_records == 0
        s.close()
    assert any("damaged bytes" in r.getMessage() for r in caplog.records)


def test_damaged_length_field_is_resynchronised(tmp_path, caplog):
    path = str(tmp_path)
    ids = _fill(path, 30)
    seg = os.path.join(path, file_name("msgs", 1))
    with open(seg, "r+b") as f:  # the length of record 10 says 4000 bytes: walking by it goes astray
        f.seek(_pos(ids[10]))
        f.write(struct.pack("<I", 4000))
    s = _reopen(path, caplog)
    assert drain(s) == [i for i in range(30) if i != 10]
    s.close()


def test_torn_last_record_is_still_a_cut_tail(tmp_path, caplog):
    path = str(tmp_path)
    s = QueueStore(path)
    ids = [add(s, i, size=100) for i in range(9)]
    s.sync()
    ids.append(add(s, 9, size=100))  # appended after the last sync: never confirmed
    s.close()
    assert synced_mark.read(path) == (1, _pos(ids[9]))
    seg = os.path.join(path, file_name("msgs", 1))
    _flip(seg, _pos(ids[9]) + 30)  # past the synced mark, nothing valid follows: a torn tail
    s = _reopen(path, caplog)
    assert drain(s) == list(range(9))
    assert s.damaged_records == 0
    assert not glob.glob(seg + ".damaged-*")
    assert any("torn tail" in r.getMessage() for r in caplog.records)
    s.close()


def test_damaged_last_record_before_the_synced_mark_is_damage(tmp_path, caplog):
    # Synced (so confirmed): the last record's bytes flipped is damage, not a tail to cut quietly.
    path = str(tmp_path)
    ids = _fill(path, 10)
    seg = os.path.join(path, file_name("msgs", 1))
    end = os.path.getsize(seg)
    assert synced_mark.read(path) is not None
    _flip(seg, _pos(ids[9]) + 30)
    before = open(seg, "rb").read()
    s = _reopen(path, caplog)
    assert drain(s) == list(range(9))
    assert s.damaged_records == 1
    stop = synced_mark.read(path)[1]
    assert stop <= end
    assert open(f"{seg}.damaged-{_pos(ids[9])}", "rb").read() == before[_pos(ids[9]):stop]
    assert not any("torn tail" in r.getMessage() for r in caplog.records)
    # New messages go after the filler; the damage stays repaired across another reopen.
    add(s, 10, size=100)
    s.sync()
    s.close()
    s = QueueStore(path)
    assert drain(s) == [10] and s.damaged_records == 0
    s.close()


def test_synced_records_gone_to_zeros_are_damage(tmp_path, caplog):
    # A clean end of data before the synced mark: the last synced records were lost (zeroed).
    path = str(tmp_path)
    ids = _fill(path, 10)
    seg = os.path.join(path, file_name("msgs", 1))
    with open(seg, "r+b") as f:
        f.seek(_pos(ids[8]))
        f.write(bytes(synced_mark.read(path)[1] - _pos(ids[8])))
    s = _reopen(path, caplog)
    assert drain(s) == list(range(8))
    assert s.damaged_records == 1  # one region: without a meta count, at least one record each
    assert glob.glob(seg + ".damaged-*")
    s.close()


def test_a_stale_synced_mark_of_an_emptied_queue_is_removed(tmp_path):
    path = str(tmp_path)
    s = QueueStore(path, segment_size=4096)
    for i in range(100):
        add(s, i, size=100)
    s.sync()
    assert synced_mark.read(path)[0] > 1
    s.close()
    for name in os.listdir(path):
        if name.startswith(("msgs.", "meta.", "acks.")):
            os.unlink(os.path.join(path, name))
    s = QueueStore(path)  # segment numbers start again from 1
    assert synced_mark.read(path) is None
    s.close()


def test_sealed_segment_with_valid_meta_is_verified_when_first_read(tmp_path, caplog):
    path = str(tmp_path)
    ids = _fill(path, 200, segment_size=4096)
    seg2 = [i for i in ids if i >> 32 == 2]
    victim = ids.index(seg2[5])
    assert os.path.exists(os.path.join(path, file_name("meta", 2)))
    _flip(os.path.join(path, file_name("msgs", 2)), _pos(seg2[5]) + 40)
    s = _reopen(path, caplog)
    assert s.ready == 200  # the meta vouched for it: not read at start
    got = drain(s)
    assert got == [i for i in range(200) if i != victim]  # was: the damaged record delivered as is
    assert s.damaged_records == 1
    assert s.ready == 0
    s.sync()
    s.close()


def test_damage_across_a_segment_boundary(tmp_path, caplog):
    path = str(tmp_path)
    ids = _fill(path, 200, segment_size=4096)
    seg1 = [i for i in ids if i >> 32 == 1]
    seg2 = [i for i in ids if i >> 32 == 2]
    os.unlink(os.path.join(path, file_name("meta", 1)))  # scanned at start, like a crash before the meta
    _flip(os.path.join(path, file_name("msgs", 1)), _pos(seg1[-1]) + 30)  # last record of segment 1
    _flip(os.path.join(path, file_name("msgs", 2)), _pos(seg2[0]) + 30)  # first record of segment 2
    s = _reopen(path, caplog)
    lost = {len(seg1) - 1, len(seg1)}
    assert drain(s) == [i for i in range(200) if i not in lost]
    assert s.damaged_records == 2
    s.close()


def test_damaged_meta_file_falls_back_to_a_scan(tmp_path, caplog):
    path = str(tmp_path)
    _fill(path, 200, segment_size=4096)
    _flip(os.path.join(path, file_name("meta", 1)), 6)
    s = _reopen(path, caplog)
    assert drain(s) == list(range(200))
    assert s.damaged_records == 0
    s.close()


def test_filler_is_a_valid_record_that_is_never_delivered():
    buf = bytearray(64)
    buf[: 40] = record.filler(40)
    result = record.ScanResult()
    assert [(p, f & record.FLAG_FILLER) for p, f, _ in record.scan(buf, 0, 64, True, result)] == [(0, 2)]
    assert result.reason == ""


# ----------------------------------------------------------------------------- the reproduction

def test_one_flipped_byte_in_a_confirmed_segment_costs_one_message(node_factory):
    node = node_factory(frontends=1, shards=1)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("dmg", durable=True)
    for i in range(3000):
        ch.basic_publish("", "dmg", b"%06d" % i + b"x" * 204, pika.BasicProperties(delivery_mode=2))
    conn.close()
    node.stop()
    seg = os.path.join(queue_dir(str(node.data_dir), "/", "dmg"), file_name("msgs", 1))
    _flip(seg, 300_000)
    # The offline check finds it (and says where) before anything is repaired.
    check = subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(node.data_dir)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "msgs.0000000001" in check.stdout and "damaged" in check.stdout
    node.start()
    conn = node.connect()
    ch = conn.channel()
    assert ch.queue_declare("dmg", passive=True).method.message_count == 2999  # was 1,219
    bodies = set()
    for _ in range(2999):
        _m, _p, body = ch.basic_get("dmg", auto_ack=True)
        bodies.add(int(body[:6]))
    assert len(bodies) == 2999 and bodies <= set(range(3000))
    conn.close()
    assert "damaged record(s) lost" in node.log_text()
    # The count is in the management API's queue document.
    req = urllib.request.Request(f"http://127.0.0.1:{node.http_port}/api/queues/%2F/dmg")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    assert (doc["damaged_records"], doc["damaged_acks"], doc["messages"]) == (1, 0, 0)
    assert glob.glob(seg + ".damaged-*")
    node.stop()
    check = subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(node.data_dir)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def _acked_half(path: str) -> list[int]:
    s = QueueStore(path)
    ids = [add(s, i, size=100) for i in range(20)]
    for _ in range(10):
        msg = s.shift()
        assert s.ack(msg[0])
    s.flush_acks()
    s.sync()
    s.close()
    return ids


def test_ack_entries_carry_a_checksum(tmp_path, caplog):
    path = str(tmp_path)
    _acked_half(path)
    acks = os.path.join(path, file_name("acks", 1))
    data = open(acks, "rb").read()
    assert data.startswith(b"SMQACK2\0") and len(data) == 8 + 10 * 8
    _flip(acks, 8 + 3 * 8 + 1)  # a byte of the 4th entry's position
    s = _reopen(path, caplog)
    # The damaged entry is detected and logged (it used to name another position, silently); its
    # message is delivered again rather than guessed away.
    assert s.damaged_acks == 1
    assert drain(s) == [3] + list(range(10, 20))
    assert any("damaged ack entries" in r.getMessage() for r in caplog.records)
    s.close()


def test_version_1_ack_files_are_read_and_migrated(tmp_path, caplog):
    path = str(tmp_path)
    ids = _acked_half(path)
    acks = os.path.join(path, file_name("acks", 1))
    with open(acks, "wb") as f:  # as written before this change: bare u32 positions
        f.write(struct.pack("<10I", *[_pos(i) for i in ids[:10]]))
    s = _reopen(path, caplog)
    assert drain(s, ack=False) == list(range(10, 20))
    s.close()
    assert open(acks, "rb").read().startswith(b"SMQACK2\0")


def test_verify_command_reports_damage_and_exits_non_zero(tmp_path):
    data = tmp_path / "data"
    qdir = queue_dir(str(data), "/", "q")
    ids = _acked_half(qdir)
    cmd = [sys.executable, "-m", "broker.cli", "verify", str(data)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checked 20 records in 1 segments: 0 damaged" in ok.stdout
    _flip(os.path.join(qdir, file_name("acks", 1)), 8 + 1)
    _flip(os.path.join(qdir, file_name("msgs", 1)), _pos(ids[4]) + 30)
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "CRC mismatch in record at" in bad.stdout and "valid records follow" in bad.stdout
    assert "1 ack entries fail their checksum" in bad.stdout
    usage = subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(tmp_path / "nope")],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "is not a directory" in usage.stderr


def _metric(node, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_a_flipped_byte_in_the_last_confirmed_record_is_damage_not_a_tail(node_factory):
    # Issue #9 item 1: a bad record lying before the last synced position is damage. The last
    # record of a write segment has nothing valid after it, so before the synced mark it was cut
    # quietly as a torn tail; a real torn tail (past the mark) still is.
    node = node_factory(frontends=1, shards=1)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for q in ("last", "tail"):
        ch.queue_declare(q, durable=True)
        for i in range(50):
            ch.basic_publish("", q, b"%06d" % i + b"x" * 100, pika.BasicProperties(delivery_mode=2))
    conn.close()
    node.stop()
    last_dir = queue_dir(str(node.data_dir), "/", "last")
    tail_dir = queue_dir(str(node.data_dir), "/", "tail")
    seg = os.path.join(last_dir, file_name("msgs", 1))
    no, end = synced_mark.read(last_dir)
    assert no == 1
    # The last record: the scan's last start before the synced end.
    mm = open(seg, "rb").read()
    starts = [p for p, _f, _b in record.scan(mm, DATA_START, end, True, record.ScanResult())]
    assert len(starts) == 50
    _flip(seg, starts[-1] + 30)
    # A torn append past the mark of the other queue: a header promising more than was written.
    tail_seg = os.path.join(tail_dir, file_name("msgs", 1))
    tail_end = synced_mark.read(tail_dir)[1]
    with open(tail_seg, "r+b") as f:
        f.seek(tail_end)
        f.write(record.HEADER.pack(400, 12345) + b"y" * 60)
    check = subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(node.data_dir)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stdout + check.stderr
    damaged = [line for line in check.stdout.splitlines() if line.startswith("damaged:")]
    assert len(damaged) == 1 and "before the synced mark" in damaged[0] and seg in damaged[0], check.stdout
    assert any(line.startswith("torn-tail:") and tail_seg in line for line in check.stdout.splitlines())
    node.start()
    conn = node.connect()
    ch = conn.channel()
    assert ch.queue_declare("last", passive=True).method.message_count == 49  # as before, but now counted
    assert ch.queue_declare("tail", passive=True).method.message_count == 50  # the tail cut, nothing lost
    bodies = [int(ch.basic_get("last", auto_ack=True)[2][:6]) for _ in range(49)]
    assert bodies == list(range(49))
    conn.close()
    log = node.log_text()
    assert "damaged record(s) lost" in log and "torn tail" in log
    assert glob.glob(seg + ".damaged-*") and not glob.glob(tail_seg + ".damaged-*")
    req = urllib.request.Request(f"http://127.0.0.1:{node.http_port}/api/queues/%2F/last")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["damaged_records"] == 1
    deadline = time.monotonic() + 30
    while _metric(node, "shardmq_damaged_records_total") != 1.0:
        assert time.monotonic() < deadline, _metric(node, "shardmq_damaged_records_total")
        time.sleep(0.05)
    node.stop()


def test_a_damaged_synced_mark_is_ignored(tmp_path, caplog):
    # The mark's own CRC fails: recovery falls back to the tail rule (never trusts a broken mark).
    path = str(tmp_path)
    ids = _fill(path, 10)
    _flip(os.path.join(path, synced_mark.NAME), 2)
    assert synced_mark.read(path) is None
    _flip(os.path.join(path, file_name("msgs", 1)), _pos(ids[9]) + 30)
    s = _reopen(path, caplog)
    assert drain(s) == list(range(9))
    assert s.damaged_records == 0
    assert any("torn tail" in r.getMessage() for r in caplog.records)
    s.close()
