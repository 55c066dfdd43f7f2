"""Message deduplication settings, shared by the node (validation), frontends and shards.

LavinMQ semantics (``x-message-deduplication`` on a queue or an exchange):

* the key is the value of the message header named by the ``x-deduplication-header``
  argument, by default the header ``x-deduplication-header`` itself; a message without
  it is never a duplicate and is not remembered;
* the cache holds at most ``x-cache-size`` keys (default 128), the oldest inserted goes
  first (FIFO, a hit does not refresh it);
* an entry expires after the message's own ``x-cache-ttl`` header (ms) or else the
  ``x-cache-ttl`` argument (ms); without either it stays until evicted.

The cache itself lives in the shard (``shard/dedup.py``); this module only reads
arguments and message headers, so it has no process-specific dependencies.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

ENABLE = "x-message-deduplication"
CACHE_SIZE = "x-cache-size"
CACHE_TTL = "x-cache-ttl"
HEADER = "x-deduplication-header"
DEDUP_ARGS = (ENABLE, CACHE_SIZE, CACHE_TTL, HEADER)
DEFAULT_CACHE_SIZE = 128  # LavinMQ's MemoryCache default
_MAX_U32 = (1 << 32) - 1
_HEADERS_BIT = 0x20  # first property-flag octet: headers present
_TTL_MARK = b"\x0bx-cache-ttl"


class DedupSettings(NamedTuple):
    size: int
    ttl: int | None  # ms; None = entries do not expire
    header: str
    mark: bytes  # the header name as it appears in an encoded table (shortstr), for a cheap memmem


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dedup_args_error(args: dict) -> tuple[str, str] | None:
    """(argument, text) for the first invalid deduplication argument, or None.

    As LavinMQ, the other arguments are only looked at when ``x-message-deduplication``
    is true; the texts are LavinMQ's (``x-cache-size header not a Int``), plus range checks
    LavinMQ leaves to an integer overflow.
    """
    if ENABLE not in args:
        return None
    if not isinstance(args[ENABLE], bool):
        return ENABLE, f"{ENABLE} header not a Bool"
    if not args[ENABLE]:
        return None
    if CACHE_SIZE in args:
        v = args[CACHE_SIZE]
        if not _is_int(v):
            return CACHE_SIZE, f"{CACHE_SIZE} header not a Int"
        if not 0 < v <= _MAX_U32:
            return CACHE_SIZE, f"{CACHE_SIZE} must be between 1 and {_MAX_U32}, got {v}"
    if CACHE_TTL in args:
        v = args[CACHE_TTL]
        if not _is_int(v):
            return CACHE_TTL, f"{CACHE_TTL} header not a Int"
        if not 0 <= v <= _MAX_U32:
            return CACHE_TTL, f"{CACHE_TTL} must be between 0 and {_MAX_U32}, got {v}"
    if HEADER in args and not isinstance(args[HEADER], str):
        return HEADER, f"{HEADER} header not a String"
    return None


def dedup_settings(args: dict | None) -> DedupSettings | None:
    """The settings when deduplication is on (arguments already validated), else None."""
    if not args or args.get(ENABLE) is not True:
        return None
    size = args.get(CACHE_SIZE)
    ttl = args.get(CACHE_TTL)
    header = args.get(HEADER)
    if not isinstance(header, str):
        header = HEADER
    encoded = header.encode()
    return DedupSettings(
        size if _is_int(size) and size > 0 else DEFAULT_CACHE_SIZE,
        ttl if _is_int(ttl) and ttl >= 0 else None,
        header,
        bytes((len(encoded),)) + encoded if len(encoded) < 256 else encoded,
    )


def _key(value: Any) -> Any:
    """A hashable, msgpack-able key that keeps AMQP field types apart (1 vs "1" vs 1.0 vs true)."""
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if _is_int(value):
        return value
    return f"\x00{type(value).__name__}:{value!r}"


def dedup_key(props_raw: bytes, settings: DedupSettings) -> tuple[Any, int | None]:
    """(key, ttl ms) of a message; key None when it carries no deduplication header.

    Decodes the headers table only when the header name occurs in the raw properties.
    The per-message ``x-cache-ttl`` header (a non-negative integer) overrides the default.
    """
    if len(props_raw) < 2 or not props_raw[0] & _HEADERS_BIT or settings.mark not in props_raw:
        return None, None
    from broker.amqp.properties import decode_headers  # not at import: the node never needs pamqp here

    try:
        headers = decode_headers(props_raw)
    except ValueError:
        return None, None
    if not headers:
        return None, None
    value = headers.get(settings.header)
    if value is None:
        return None, None
    ttl = settings.ttl
    if _TTL_MARK in props_raw:
        own = headers.get(CACHE_TTL)
        if _is_int(own) and 0 <= own <= _MAX_U32:
            ttl = own
    return _key(value), ttl


def exchange_shard(vhost: str, name: str, shard_count: int) -> int:
    """The shard that holds a deduplicating exchange's cache: stable across processes and boots."""
    return zlib.crc32(f"exchange\0{vhost}\0{name}".encode()) % max(1, shard_count)
