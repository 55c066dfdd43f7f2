"""x-delivery-count across shard restarts: a small per-queue file of (msg_id, count) pairs.

Only queues that count returns (``x-delivery-limit``, quorum) have counts, and
only returned messages have one, so the file is small. It is rewritten (tmp
file + rename, no fsync) with the shard's periodic sync when the counts changed
since the last write, and at a clean stop: a shard crash loses at most the last
second of counting (a power loss may lose more, like any unsynced page-cache
write). Counts of messages that are gone by the next start are dropped at load.
"""

from __future__ import annotations

import os
import struct

from broker import write_observer

FILE = "delivery-counts"
_PAIR = struct.Struct("<QI")


def load(queue_dir: str) -> dict[int, int]:
    """The saved counts; {} when there is no file or it is torn."""
    try:
        with open(os.path.join(queue_dir, FILE), "rb") as fh:
            data = fh.read()
    except OSError:
        return {}
    size = _PAIR.size
    usable = len(data) - len(data) % size
    return {mid: n for mid, n in (_PAIR.unpack_from(data, off) for off in range(0, usable, size)) if n > 0}


def save(queue_dir: str, counts: dict[int, int]) -> None:
    path = os.path.join(queue_dir, FILE)
    if not counts:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        if write_observer.current is not None:
            write_observer.current.delete(path)
        return
    tmp = path + ".tmp"
    pack = _PAIR.pack
    data = b"".join(pack(mid, min(n, 0xFFFFFFFF)) for mid, n in counts.items())
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
    if write_observer.current is not None:
        write_observer.current.replace(path, data)
