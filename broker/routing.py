"""Binding tables of the exchange types: which destinations a message reaches.

Each table holds the bindings of one source exchange and answers
``match(routing_key, headers)`` with an :data:`Entry`: a pair
``(queue_names, exchange_names)`` of tuples. Entries are precomputed or
cached, so the publish hot path allocates nothing for direct, fanout and
(cached) topic routing. Callers must not mutate what they get back.

A destination is ``(kind, name)`` with kind ``"queue"`` or ``"exchange"``.
Several bindings may lead to the same destination (different routing keys or
arguments); tables count them so removing one keeps the others.

Semantics follow RabbitMQ:

* topic keys are split on ``.`` (``""`` is zero words, ``"a."`` is ``a`` and
  an empty word); ``*`` matches exactly one word (possibly empty), ``#`` zero
  or more words;
* headers bindings use ``x-match`` ``all`` (default), ``any``, ``all-with-x``
  or ``any-with-x``; other ``x-`` keys are ignored unless a ``-with-x`` mode is
  used; a binding value of ``None`` (AMQP void) only requires the header to be
  present; values compare like Erlang ``==`` (numbers across int/float, but
  booleans are not numbers; text and bytes holding the same UTF-8 compare
  equal).
"""

from __future__ import annotations

import zlib
from datetime import datetime
from typing import Any

from broker.amqp.properties import decode_headers, decode_properties, encode_properties

Dest = tuple[str, str]
Entry = tuple[tuple[str, ...], tuple[str, ...]]

EMPTY: Entry = ((), ())

X_MATCH_VALUES = ("all", "any", "all-with-x", "any-with-x")


def _entry(dests: dict[Dest, int]) -> Entry:
    if not dests:
        return EMPTY
    queues = tuple(name for kind, name in dests if kind == "queue")
    exchanges = tuple(name for kind, name in dests if kind == "exchange")
    return queues, exchanges


def _inc(counts: dict[Dest, int], dest: Dest) -> None:
    counts[dest] = counts.get(dest, 0) + 1


def _dec(counts: dict[Dest, int], dest: Dest) -> None:
    n = counts.get(dest, 0) - 1
    if n > 0:
        counts[dest] = n
    else:
        counts.pop(dest, None)


class DirectTable:
    """Exact routing-key match: one dict lookup per publish."""

    __slots__ = ("_counts", "_entries")

    def __init__(self) -> None:
        self._counts: dict[str, dict[Dest, int]] = {}
        self._entries: dict[str, Entry] = {}

    def add(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        counts = self._counts.setdefault(routing_key, {})
        _inc(counts, dest)
        self._entries[routing_key] = _entry(counts)

    def remove(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        counts = self._counts.get(routing_key)
        if counts is None:
            return
        _dec(counts, dest)
        if counts:
            self._entries[routing_key] = _entry(counts)
        else:
            del self._counts[routing_key]
            del self._entries[routing_key]

    def match(self, routing_key: str, headers: Any = None) -> Entry:
        return self._entries.get(routing_key, EMPTY)


class FanoutTable:
    """Every bound destination, whatever the key: a precomputed entry."""

    __slots__ = ("_counts", "_entry")

    def __init__(self) -> None:
        self._counts: dict[Dest, int] = {}
        self._entry: Entry = EMPTY

    def add(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        _inc(self._counts, dest)
        self._entry = _entry(self._counts)

    def remove(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        _dec(self._counts, dest)
        self._entry = _entry(self._counts)

    def match(self, routing_key: str, headers: Any = None) -> Entry:
        return self._entry


def split_topic(key: str) -> list[str]:
    """Split a routing or binding key into words the way RabbitMQ does."""
    return key.split(".") if key else []


class _TrieNode:
    __slots__ = ("children", "dests")

    def __init__(self) -> None:
        self.children: dict[str, _TrieNode] = {}
        self.dests: dict[Dest, int] = {}


class TopicTable:
    """A trie over binding-key words, with a bounded cache of results per key.

    The cache is dropped whole on any binding change: changes are rare next to
    publishes, and a stale entry would route through a removed binding.
    """

    __slots__ = ("_root", "_cache", "_cache_size")

    def __init__(self, cache_size: int = 4096) -> None:
        self._root = _TrieNode()
        self._cache: dict[str, Entry] = {}
        self._cache_size = cache_size

    def add(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        node = self._root
        for word in split_topic(routing_key):
            child = node.children.get(word)
            if child is None:
                child = node.children[word] = _TrieNode()
            node = child
        _inc(node.dests, dest)
        self._cache.clear()

    def remove(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        path = [self._root]
        words = split_topic(routing_key)
        for word in words:
            child = path[-1].children.get(word)
            if child is None:
                return
            path.append(child)
        _dec(path[-1].dests, dest)
        # Prune empty branches so the trie does not grow with churn.
        for i in range(len(words), 0, -1):
            node = path[i]
            if node.dests or node.children:
                break
            del path[i - 1].children[words[i - 1]]
        self._cache.clear()

    def match(self, routing_key: str, headers: Any = None) -> Entry:
        entry = self._cache.get(routing_key)
        if entry is not None:
            return entry
        found: dict[Dest, int] = {}
        self._walk(self._root, split_topic(routing_key), 0, found)
        entry = _entry(found)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[routing_key] = entry
        return entry

    def _walk(self, node: _TrieNode, words: list[str], i: int, found: dict[Dest, int]) -> None:
        children = node.children
        n = len(words)
        if i == n:
            if node.dests:
                found.update(node.dests)
        else:
            child = children.get(words[i])
            if child is not None:
                self._walk(child, words, i + 1, found)
            if words[i] != "*":  # a literal "*" word was already followed above
                child = children.get("*")
                if child is not None:
                    self._walk(child, words, i + 1, found)
        hash_child = children.get("#")
        if hash_child is not None:
            # '#' swallows zero or more words: try every remaining suffix.
            for j in range(i, n + 1):
                self._walk(hash_child, words, j, found)


# _norm of an empty table (or of no arguments): what most bindings carry, without the sort and generator.
EMPTY_TABLE_KEY = ("table", ())


def _norm(value: Any) -> Any:
    """A comparison key giving Erlang '==' semantics to decoded AMQP values."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("num", value)
    if isinstance(value, datetime):
        # A timestamp is an integer in Erlang: it equals a long of the same seconds (RabbitMQ 3.10.8
        # routes both), and a binding's timestamp argument is stored as those seconds (plain()).
        return ("num", int(value.timestamp()))
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return ("str", raw.decode("utf-8"))
        except UnicodeDecodeError:
            return ("bytes", raw)
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, dict):
        return ("table", tuple(sorted((k, _norm(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("array", tuple(_norm(v) for v in value))
    return ("other", repr(value))


class _HeadersBinding:
    __slots__ = ("dest", "any", "pattern", "key")

    def __init__(self, dest: Dest, arguments: dict | None, key: Any) -> None:
        args = arguments or {}
        mode = args.get("x-match", "all")
        if isinstance(mode, (bytes, bytearray)):
            mode = bytes(mode).decode("utf-8", "replace")
        if mode not in X_MATCH_VALUES:
            mode = "all"  # RabbitMQ treats unvalidated legacy values as 'all'
        with_x = mode.endswith("-with-x")
        self.dest = dest
        self.any = mode.startswith("any")
        # (header name, normalized value or None for presence-only)
        self.pattern = tuple(
            (k, None if v is None else _norm(v))
            for k, v in args.items()
            if k != "x-match" and (with_x or not k.startswith("x-"))
        )
        self.key = key

    def matches(self, headers: dict) -> bool:
        if self.any:
            for name, want in self.pattern:
                if name in headers and (want is None or _norm(headers[name]) == want):
                    return True
            return False
        for name, want in self.pattern:
            if name not in headers:
                return False
            if want is not None and _norm(headers[name]) != want:
                return False
        return True


class HeadersTable:
    """Headers matching: every binding is tested against the message headers."""

    __slots__ = ("_bindings",)

    def __init__(self) -> None:
        self._bindings: list[_HeadersBinding] = []

    @staticmethod
    def _key(dest: Dest, routing_key: str, arguments: dict | None) -> Any:
        return (dest, routing_key, _norm(arguments) if arguments else EMPTY_TABLE_KEY)

    def add(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        key = self._key(dest, routing_key, arguments)
        self._bindings.append(_HeadersBinding(dest, arguments, key))

    def remove(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        key = self._key(dest, routing_key, arguments)
        for i, b in enumerate(self._bindings):
            if b.key == key:
                del self._bindings[i]
                return

    def match(self, routing_key: str, headers: dict | None) -> Entry:
        if not self._bindings:
            return EMPTY
        hdrs = headers or {}
        found: dict[Dest, int] = {}
        for b in self._bindings:
            if b.dest not in found and b.matches(hdrs):
                found[b.dest] = 1
        return _entry(found)


def _jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach): the bucket of a 64-bit key among ``buckets``."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def consistent_hash_weight(routing_key: str) -> int | None:
    """The weight a consistent-hash binding key stands for, or None when it is not a positive integer."""
    try:
        weight = int(routing_key)
    except (TypeError, ValueError):
        return None
    return weight if weight > 0 else None


class ConsistentHashTable:
    """RabbitMQ's x-consistent-hash: each binding owns ``weight`` buckets (its key is the weight).

    The routing key, or the header named by the exchange's ``hash-header`` (or
    ``x-hash-on``) argument, is hashed (CRC32 folded to 64 bits) and placed
    with jump consistent hashing, so the same key always reaches the same
    destination while the bindings stay the same, and destinations receive
    shares proportional to their weights.
    """

    __slots__ = ("_bindings", "_buckets", "header")

    def __init__(self, arguments: dict | None = None) -> None:
        args = arguments or {}
        header = args.get("hash-header", args.get("x-hash-on"))
        if isinstance(header, (bytes, bytearray)):
            header = bytes(header).decode("utf-8", "replace")
        self.header: str | None = header if isinstance(header, str) and header else None
        self._bindings: list[tuple[Dest, str]] = []
        self._buckets: list[Entry] = []

    def _rebuild(self) -> None:
        buckets: list[Entry] = []
        for dest, routing_key in sorted(self._bindings):
            entry = _entry({dest: 1})
            buckets.extend([entry] * (consistent_hash_weight(routing_key) or 0))
        self._buckets = buckets

    def add(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        self._bindings.append((dest, routing_key))
        self._rebuild()

    def remove(self, dest: Dest, routing_key: str, arguments: dict | None) -> None:
        try:
            self._bindings.remove((dest, routing_key))
        except ValueError:
            return
        self._rebuild()

    def match(self, routing_key: str, headers: dict | None = None) -> Entry:
        buckets = self._buckets
        if not buckets:
            return EMPTY
        if self.header is not None:
            value = (headers or {}).get(self.header)
            if value is None:
                return EMPTY
            data = value if isinstance(value, (bytes, bytearray)) else str(value).encode()
        else:
            data = routing_key.encode()
        h = zlib.crc32(data)
        key = (h << 32) | zlib.crc32(data, h)
        return buckets[_jump_hash(key, len(buckets))]


TABLES = {
    "direct": DirectTable,
    "fanout": FanoutTable,
    "topic": TopicTable,
    "headers": HeadersTable,
    "x-consistent-hash": ConsistentHashTable,
}

DELAYED_TYPE = "x-delayed-message"
EXCHANGE_TYPES = (*TABLES, DELAYED_TYPE)


def delayed_type_error(arguments: dict | None) -> str | None:
    """RabbitMQ's refusal text when an x-delayed-message exchange lacks a valid x-delayed-type."""
    value = (arguments or {}).get("x-delayed-type")
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    if value in TABLES:
        return None
    return "Invalid argument, 'x-delayed-type' must be an existing exchange type"


def delay_store_shard(vhost: str, exchange: str, shard_count: int) -> int:
    """The shard that keeps the delayed messages of an exchange (frontend and shards agree on it).

    Computed, not stored: after a restart with another shard count the new owner opens the
    store, whose directory does not depend on the count (shard/delayed.py).
    """
    return zlib.crc32(f"{vhost}\0{exchange}".encode()) % max(1, shard_count)


def routing_type(exchange_type: str, arguments: dict | None = None) -> str:
    """The type whose table routes for an exchange (a delayed exchange routes as its x-delayed-type)."""
    if exchange_type == DELAYED_TYPE:
        value = (arguments or {}).get("x-delayed-type", "direct")
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        return value if value in TABLES else "direct"
    return exchange_type


def new_table(exchange_type: str, arguments: dict | None = None) -> Any:
    kind = routing_type(exchange_type, arguments)
    if kind == "x-consistent-hash":
        return ConsistentHashTable(arguments)
    return TABLES[kind]()


def x_match_error(arguments: dict | None) -> str | None:
    """RabbitMQ's reason text when a headers binding's x-match is invalid, else None."""
    if not arguments or "x-match" not in arguments:
        return None
    value = arguments["x-match"]
    if isinstance(value, str):
        if value in X_MATCH_VALUES:
            return None
        return f'Invalid x-match field value <<"{value}">>; expected all, any, all-with-x, or any-with-x'
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).decode("utf-8", "replace")
        if text in X_MATCH_VALUES:
            return None
        return f'Invalid x-match field value <<"{text}">>; expected all, any, all-with-x, or any-with-x'
    return f"Invalid x-match field type {amqp_type_name(value)} (value {value!r}); expected longstr"


def amqp_type_name(value: Any) -> str:
    """The AMQP field type a client library would most likely have sent for value."""
    if value is None:
        return "void"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "signedint" if -(2**31) <= value < 2**31 else "long"
    if isinstance(value, float):
        return "double"
    if isinstance(value, (str, bytes, bytearray)):
        return "longstr"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


# ---------------------------------------------------------------- sender-selected distribution (CC/BCC)
# Used by the frontends at publish and by the shards when a delayed message is due, so it lives
# here rather than in either of them.
_HEADERS_BIT = 0x20  # first flag octet of raw AMQP properties: headers present
_CC_MARK = b"\x02CC"
_BCC_MARK = b"\x03BCC"


def may_have_cc(props_raw: bytes) -> bool:
    """False when the message certainly carries no CC/BCC header (a memmem, no decoding)."""
    return (len(props_raw) > 1 and props_raw[0] & _HEADERS_BIT != 0
            and (_CC_MARK in props_raw or _BCC_MARK in props_raw))


def _strs(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)):
        return []
    out = []
    for v in value:
        if isinstance(v, (bytes, bytearray)):
            out.append(bytes(v).decode("utf-8", "replace"))
        elif isinstance(v, str):
            out.append(v)
    return out


def sender_routes(props_raw: bytes) -> tuple[bytes, list[str]]:
    """(properties to store, extra routing keys) for sender-selected distribution.

    The CC and BCC headers (arrays of strings) add routing keys on the same
    exchange; BCC is removed from the stored properties, so properties are
    re-encoded only when BCC is present.
    """
    headers = decode_headers(props_raw) or {}
    keys = _strs(headers.get("CC")) + _strs(headers.get("BCC"))
    if "BCC" in headers:
        props = decode_properties(props_raw)
        hdrs = dict(props.headers or {})
        hdrs.pop("BCC", None)
        props.headers = hdrs
        props_raw = encode_properties(props)
    return props_raw, keys
