"""The file format and names of the shards' small key-value logs (shard/kvstore.py, broker/kv_layout.py).

A log is a sequence of ``[u32 length][u32 crc32][msgpack [key, value]]`` records (value None
deletes the key). Each shard writes its own log per (vhost, space):
``<data>/kv/<sha1(vhost)>/<sha1(space)>.shard-N.log``: one writer per file, whatever shard
a key's placement picks (several shards keep session records of one vhost). The node places
the records at boot (broker/kv_layout.py), before any shard opens a log.

The layout before it, ``<sha1(space)>.log`` (one log per vhost and space, appended by every
shard that kept a key of it, each at its own offset), is read once by the node and replaced.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from typing import Any

import msgpack

from broker.datadir import name_hash

KV_DIR = "kv"
HEAD = struct.Struct("<II")
# <sha1(space)>.shard-N.log (N: the shard that writes it), or <sha1(space)>.log (the old shared log).
_NAME = re.compile(r"^([0-9a-f]{40})(?:\.shard-(\d+))?\.log$")


def log_name(space: str, shard: int) -> str:
    return f"{name_hash(space)}.shard-{shard}.log"


def log_path(data_dir: str, vhost: str, space: str, shard: int) -> str:
    return os.path.join(data_dir, KV_DIR, name_hash(vhost), log_name(space, shard))


def parse_name(name: str) -> tuple[str, int | None] | None:
    """(sha1(space), shard index, None for the old shared log) of a log's file name; None: not a log."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def encode(key: str, value: Any) -> bytes:
    body = msgpack.packb([key, value], use_bin_type=True)
    return HEAD.pack(len(body), zlib.crc32(body)) + body


def parse(data: bytes) -> tuple[list[tuple[str, Any]], int]:
    """The records up to the first torn or corrupt one, and the size they take (what follows is not
    trusted: a torn tail after a crash, or a record something else overwrote)."""
    out: list[tuple[str, Any]] = []
    pos = 0
    n = len(data)
    while pos + 8 <= n:
        length, crc = HEAD.unpack_from(data, pos)
        body = data[pos + 8:pos + 8 + length]
        if len(body) != length or zlib.crc32(body) != crc:
            break
        try:
            key, value = msgpack.unpackb(body, raw=False)
        except Exception:
            break
        out.append((key, value))
        pos += 8 + length
    return out, pos


def read_log(path: str) -> tuple[list[tuple[str, Any]], int, bytes]:
    """A log's records (see parse), their size, and the file's bytes (b"" when there is no file)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return [], 0, b""
    records, good = parse(data)
    return records, good, data


def replay(records: list[tuple[str, Any]], items: dict[str, Any] | None = None) -> dict[str, Any]:
    """The live keys after records (a None value deletes)."""
    items = {} if items is None else items
    for key, value in records:
        if value is None:
            items.pop(key, None)
        else:
            items[key] = value
    return items
