"""`shardmq verify DATA_DIR`: check every stored record offline, change nothing.

Walks every directory under the data dir that holds segment files (queues, priority levels,
streams, delay stores) and the MQTT key-value logs (``kv/``), and checks each record's length, field lengths and CRC32, each meta file,
and that each ack entry names a record. Prints one line per finding and a summary; exits 0 when
everything is intact (a torn tail of a write segment, which recovery cuts and which was never
confirmed, is reported but is not damage; a bad record or an end of data before the store's
synced mark, shard/synced_mark.py, was confirmed and is damage), 1 on damage, 2 on a usage error. Run it on a stopped
node (or a copy): a running node's write segments change under it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import zlib

from broker.kv_log import HEAD as _KV_HEAD
from broker.kv_log import KV_DIR, parse, parse_name
from shard import record, synced_mark
from shard.segment import DATA_START, FORMAT_VERSION, META_SIZE, VERSION_HEADER, Meta, read_ack_entries

# A stream's smeta file (shard/stream_store.py; not imported, so that this module stays a leaf).
_SMETA = struct.Struct("<IIQQQQQQ")
_SMETA_SIZE = _SMETA.size + 4
_U64 = struct.Struct("<Q")


class Report:
    def __init__(self, out) -> None:
        self.out = out
        self.damage = 0
        self.tails = 0
        self.records = 0
        self.segments = 0
        self.kv_records = 0
        self.kv_logs = 0

    def say(self, kind: str, path: str, text: str) -> None:
        if kind == "damaged":
            self.damage += 1
        elif kind == "torn-tail":
            self.tails += 1
        print(f"{kind}: {path}: {text}", file=self.out)


def _numbers(names: list[str], kind: str) -> list[int]:
    out = []
    for name in names:
        k, dot, num = name.partition(".")
        if k == kind and dot and len(num) == 10 and num.isdigit():
            out.append(int(num))
    return sorted(out)


def verify_dir(path: str, report: Report) -> None:
    """Check the segment files of one store directory."""
    names = os.listdir(path)
    msgs = _numbers(names, "msgs")
    metas = set(_numbers(names, "meta"))
    smetas = set(_numbers(names, "smeta"))
    for name in sorted(names):
        if ".damaged-" in name:
            report.say("set-aside", os.path.join(path, name), "bytes an earlier recovery copied aside")
    expect: int | None = None  # a stream segment's first offset, from the previous segment
    mark = synced_mark.read(path)
    for i, no in enumerate(msgs):
        last = i == len(msgs) - 1
        seg_path = os.path.join(path, f"msgs.{no:010d}")
        report.segments += 1
        smeta = _read_smeta(os.path.join(path, f"smeta.{no:010d}"), report) if no in smetas else None
        sealed = no in metas or (smeta is not None and bool(smeta[1]))
        synced = mark[1] if mark is not None and last and mark[0] == no and not sealed else 0
        starts = _verify_segment(seg_path, last, sealed, report, synced)
        if no in metas:
            _verify_meta(os.path.join(path, f"meta.{no:010d}"), starts, report)
        if smeta is not None:
            expect = _verify_smeta(os.path.join(path, f"smeta.{no:010d}"), smeta, starts, expect, report)
        else:
            expect = None  # no (valid) smeta: where the next segment's offsets start is not known here
        acks = os.path.join(path, f"acks.{no:010d}")
        if os.path.exists(acks) and starts is not None:
            _verify_acks(acks, starts[0], report)


def _read_smeta(path: str, report: Report) -> tuple | None:
    """(version, sealed, first, count, used, ...) of a stream smeta file, None (reported) if damaged."""
    with open(path, "rb") as f:
        data = f.read(_SMETA_SIZE + 1)
    if len(data) != _SMETA_SIZE or zlib.crc32(data[:_SMETA.size]) != struct.unpack_from("<I", data, _SMETA.size)[0]:
        report.say("damaged", path, "stream meta file does not decode or its CRC does not match (recovery rescans)")
        return None
    return _SMETA.unpack_from(data)


def _verify_smeta(path: str, smeta: tuple, scanned: tuple[set[int], int, int] | None, expect: int | None,
                  report: Report) -> int | None:
    """Check a stream segment's smeta against its records; returns the next segment's first offset."""
    _version, sealed, first, count, used = smeta[:5]
    if expect is not None and first != expect:
        report.say("damaged", path, f"first offset {first}, the previous segment ends at offset {expect}")
    if not sealed:
        return first + scanned[1] if scanned is not None else None
    if scanned is not None and (count, used) != (scanned[1], scanned[2]):
        report.say("damaged", path, f"stream meta says {count} offsets in {used} bytes, the segment holds "
                   f"{scanned[1]} in {scanned[2]}")
    return first + count


def _verify_segment(path: str, last: bool, has_meta: bool, report: Report,
                    synced: int = 0) -> tuple[set[int], int, int] | None:
    """(record starts, offset count, used bytes), or None when the file cannot be read as a segment.

    The offset count is the record count, except that a stream's filler (damaged records set aside
    by recovery) counts for the offsets it stands for (its timestamp field)."""
    size = os.path.getsize(path)
    if size < DATA_START:
        if not last:
            report.say("damaged", path, f"{size} bytes: shorter than the version header")
        return None
    with open(path, "rb") as f:
        if VERSION_HEADER.unpack(f.read(DATA_START))[0] != FORMAT_VERSION:
            report.say("damaged", path, "unknown format version (recovery sets the file aside)")
            return None
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        starts: set[int] = set()
        offsets = 0
        pos = DATA_START
        while True:
            result = record.ScanResult()
            for p, flags, _blen in record.scan(mm, pos, size, True, result):
                starts.add(p)
                report.records += 1
                offsets += max(1, _U64.unpack_from(mm, p + record.HEADER_SIZE)[0]) if flags & record.FLAG_FILLER else 1
            if not result.reason:
                if result.end >= min(synced, size):
                    return starts, offsets, result.end
                result.reason = f"end of data at {result.end} before the synced position {synced}"
            nxt = record.resync(mm, result.end, size)
            if nxt < 0 and last and not has_meta and result.end >= synced:
                report.say("torn-tail", path, f"{result.reason}; {size - result.end} bytes after it hold no valid "
                           "record (a write cut short by a crash: never confirmed, recovery cuts it)")
                return starts, offsets, result.end
            stop = nxt if nxt >= 0 else (min(synced, size) if synced > result.end else size)
            why = ("valid records follow" if nxt >= 0 else
                   "before the synced mark (confirmed data)" if stop < size else "up to the end of the file")
            report.say("damaged", path, f"{result.reason}; bytes {result.end}..{stop} damaged, {why}")
            if nxt < 0:
                return starts, offsets, size
            pos = nxt
    finally:
        mm.close()


def _verify_meta(path: str, scanned: tuple[set[int], int, int] | None, report: Report) -> None:
    with open(path, "rb") as f:
        meta = Meta.decode(f.read(META_SIZE + 1))
    if meta is None:
        report.say("damaged", path, "meta file does not decode or its CRC does not match (recovery rescans)")
    elif scanned is not None and (meta.count, meta.used) != (scanned[1], scanned[2]):
        report.say("damaged", path, f"meta says {meta.count} records in {meta.used} bytes, the segment holds "
                   f"{scanned[1]} in {scanned[2]}")


def _verify_acks(path: str, starts: set[int], report: Report) -> None:
    entries, bad, _old = read_ack_entries(path)
    if bad:
        report.say("damaged", path, f"{bad} ack entries fail their checksum (recovery ignores them)")
    stray = [p for p in entries if p not in starts]
    if stray:
        report.say("damaged", path, f"{len(stray)} ack entries name no record, e.g. position {stray[0]}")


def verify_kv_log(path: str, report: Report) -> None:
    """Check one MQTT key-value log (broker/kv_log.py): its records up to the end of the file.

    A bad record with a valid one after it is damage (overwritten: each log has one writer, which
    only appends); a bad end with nothing valid after it is a torn tail (a put that was never
    answered). A log of the shared layout before 2026-11-26 is reported: the node reads it once.
    """
    parsed = parse_name(os.path.basename(path))
    if parsed is None:
        return
    with open(path, "rb") as fh:
        data = fh.read()
    records, good = parse(data)
    report.kv_logs += 1
    report.kv_records += len(records)
    if parsed[1] is None:
        report.say("old-layout", path, f"a KV log shared by every shard (layout before 2026-11-26): the node "
                                       f"reads it once at its next boot, {len(records)} records up to offset {good}")
    if good == len(data):
        return
    later = next((pos for pos in range(good + 1, len(data) - 8) if _kv_record_at(data, pos)), None)
    if later is None:
        report.say("torn-tail", path, f"{len(data) - good} bytes after offset {good} hold no valid record")
    else:
        report.say("damaged", path, f"bad record at offset {good}, a valid record follows at {later}: "
                                    f"the records after offset {good} are lost at the next start")


def _kv_record_at(data: bytes, pos: int) -> bool:
    length, crc = _KV_HEAD.unpack_from(data, pos)
    body = data[pos + 8:pos + 8 + length]
    return 0 < length == len(body) and zlib.crc32(body) == crc


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardmq verify", description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", metavar="DATA_DIR", help="the node's data directory (node stopped)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    root = os.path.abspath(args.data_dir)
    if not os.path.isdir(root):
        print(f"shardmq verify: {root} is not a directory", file=sys.stderr)
        return 2
    report = Report(sys.stdout)
    for dirpath, _dirnames, filenames in sorted(os.walk(root)):
        if any(n.startswith("msgs.") for n in filenames) and "run" not in os.path.relpath(dirpath, root).split(os.sep):
            try:
                verify_dir(dirpath, report)
            except OSError as exc:
                report.say("damaged", dirpath, f"unreadable: {exc}")
    kv_root = os.path.join(root, KV_DIR)
    for dirpath, _dirnames, filenames in sorted(os.walk(kv_root)):
        for name in sorted(filenames):
            try:
                verify_kv_log(os.path.join(dirpath, name), report)
            except OSError as exc:
                report.say("damaged", os.path.join(dirpath, name), f"unreadable: {exc}")
    if report.kv_logs:
        print(f"checked {report.kv_records} records in {report.kv_logs} KV logs", file=sys.stdout)
    print(f"checked {report.records} records in {report.segments} segments: "
          f"{report.damage} damaged, {report.tails} torn tails", file=sys.stdout)
    return 1 if report.damage else 0

