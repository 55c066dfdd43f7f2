"""Which queue directories held nothing but their name file when the shard last stopped cleanly.

A boot of 100,000 durable queues spent most of a shard's time listing each queue's directory and
checking its ``.queue`` file (two system calls and more per queue), although most queues never held
a message. At a clean stop a shard writes, per vhost, ``<sha1(vhost)>/.idle-at-stop.shard-N``: for
each of its plain queues whose directory held only its name file (seen so at open, no segment
since), the directory's inode number and ctime. At the next boot a queue found there whose
directory has the same inode and ctime (one ``stat``) opens empty without the listing: any file
created, removed or renamed in the directory since (a segment, a mark, the name file rewritten; by
this shard, a replication follower or an operator) changes its ctime, and a directory made again
is another inode. The file is removed when read, so after a crash the next boot lists every
directory as before.

Which directories qualify at a stop: the store is empty and never made a file in this life (its
placeholder write segment), and the directory's ctime is older than the moment this shard's boot
listed (or checked) it, less ``MIN_AGE_NS``: then it did not change since it was seen to hold no
segment, so a listing at the next boot would open it empty too. The margin covers the clock's tick
(a change right after the listing in the same tick would keep its ctime: git's "racily clean"
entries); a clock stepped back by more than that between two changes could fool it.
"""

from __future__ import annotations

import os
import struct
import zlib

PREFIX = ".idle-at-stop.shard-"
_MAGIC = b"SMQIDLE1"
_HEAD = struct.Struct("<8sII")  # magic, record count, crc32 of the records
_RECORD = struct.Struct("<20sQq")  # sha1(queue name) digest, st_ino, st_ctime_ns
MIN_AGE_NS = 2_000_000_000


def path_of(vhost_dir: str, shard: int) -> str:
    return f"{vhost_dir}/{PREFIX}{shard}"


def stamp(path: str) -> tuple[int, int]:
    """What a directory's entries are checked by: (inode, ctime in ns)."""
    st = os.stat(path)
    return st.st_ino, st.st_ctime_ns


def take(vhost_dir: str, shard: int) -> dict[str, tuple[int, int]]:
    """The stamps shard wrote at its last clean stop, by sha1(queue name) in hex; the file is
    removed (a crash from here on leaves none). Empty when there is none or it does not check out."""
    path = path_of(vhost_dir, shard)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    os.unlink(path)
    if len(data) < _HEAD.size:
        return {}
    magic, count, crc = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size:]
    if magic != _MAGIC or len(body) != count * _RECORD.size or zlib.crc32(body) != crc:
        return {}
    return {digest.hex(): (ino, ctime) for digest, ino, ctime in _RECORD.iter_unpack(body)}


def write(vhost_dir: str, shard: int, queue_dirs: list[str], listed_ns: int) -> int:
    """At a clean stop: the stamps of queue_dirs (directories of this vhost whose stores are empty and
    hold no file: nothing was appended since they were opened) that did not change since
    ``listed_ns``, when this shard's boot listed (or checked) them and found nothing but the name
    file; the number written. Not fsynced: a file lost in a crash only means the next boot lists
    every directory."""
    records = []
    before = listed_ns - MIN_AGE_NS
    for qdir in queue_dirs:
        try:
            ino, ctime = stamp(qdir)
        except OSError:
            continue
        if ctime < before:
            records.append(_RECORD.pack(bytes.fromhex(qdir.rpartition("/")[2]), ino, ctime))
    path = path_of(vhost_dir, shard)
    if not records:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return 0
    body = b"".join(records)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(_MAGIC, len(records), zlib.crc32(body)) + body)
    os.replace(tmp, path)
    return len(records)
