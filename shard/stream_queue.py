"""A stream queue (`x-queue-type: stream`) inside a shard: an append-only log, one cursor per consumer.

The shard worker calls the same methods as on `shard.queue.Queue`. Differences:
acks and nacks only release prefetch (nothing is removed or requeued), every
consumer reads the shared log at its own pace from where `x-stream-offset` put
it, deliveries carry the message's offset in the `x-stream-offset` header, and a
consumer that tracks its offset (LavinMQ's server-side offset tracking) has it
stored under its consumer tag so a reconnect resumes after its last ack.
Storage is `shard.stream_store.StreamStore`; docs/features.md has the rules.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import decode as amqp_decode
from pamqp import encode as amqp_encode

from broker import contract
from broker.amqp.properties import decode_headers
from broker.policies import max_age_seconds
from shard.consumers import ChannelRef, Consumer
from shard.stream_store import Cursor, StreamStore

if TYPE_CHECKING:
    from shard.timers import TimerHeap

Send = Callable[[bytes, list], None]

_DELIVER = contract.DELIVER
_CREDIT_SHIFT = contract.CREDIT_BYTES_SHIFT
_FILTER_KEY = b"x-stream-filter-value"
_OFFSET_KEY = b"\x0fx-stream-offset"
_OFFSET_ENTRY = struct.Struct(">q")
_U32 = struct.Struct(">I")
_FLAG_HEADERS = 0x2000
# Records a filtering consumer may skip in one delivery turn before the shard serves others.
_SCAN_PER_TURN = 4096
# Messages behind the tail within which a waiting consumer paces publishers (tail_consumer_waiting).
NEAR_TAIL = 100_000

OFFSET_ERROR = ("x-stream-offset must be an integer, a timestamp, an interval such as '1h', "
                "'first', 'next' or 'last'")


def retention_args(arguments: dict) -> tuple[int | None, int | None, int | None]:
    """(max messages, max bytes, max age in seconds) from a stream's effective arguments."""

    def nonneg(key: str) -> int | None:
        v = arguments.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    age = arguments.get("x-max-age")
    try:
        max_age = max_age_seconds(age) if age is not None else None
    except ValueError:
        max_age = None
    return nonneg("x-max-length"), nonneg("x-max-length-bytes"), max_age


def segment_size(arguments: dict, default: int) -> int:
    v = arguments.get("x-stream-max-segment-size-bytes")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def parse_start(value: Any, now_ms: int) -> tuple[str, int]:
    """Where `x-stream-offset` says to start: (kind, value) for StreamStore.cursor. ValueError if invalid."""
    if value in ("first", "last", "next"):
        return value, 0
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(OFFSET_ERROR)
        return "offset", value
    if isinstance(value, dict) and isinstance(value.get("timestamp"), int):
        # An AMQP timestamp (seconds), tagged by the frontend so it is not taken for an offset.
        return "timestamp", value["timestamp"] * 1000
    if isinstance(value, str):
        try:
            return "timestamp", now_ms - max_age_seconds(value) * 1000
        except ValueError:
            pass
    raise ValueError(OFFSET_ERROR)


def _parse_filters(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        values = value.split(",")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        values = value
    else:
        raise ValueError("x-stream-filter must be a string or an array of strings")
    filters = frozenset(v.strip() for v in values if v.strip())
    return filters or None  # an empty filter filters nothing


def _tracking_flag(value: Any) -> bool:
    return value is True or value == "true"


def consume_error(q: StreamQueue, no_ack: bool, prefetch: int, arguments: dict) -> list | None:
    """[code, text, class, method] refusing a basic.consume on the stream, or None if it is acceptable."""
    rs = f"stream queue '{q.name}' in vhost '{q.vhost}'"
    if no_ack or not prefetch:
        # RabbitMQ 4 answers both (a no-ack consumer has no prefetch) with this text.
        return [406, f"PRECONDITION_FAILED - consumer prefetch count is not set for {rs}", 60, 20]
    try:
        if "x-stream-offset" in arguments and arguments["x-stream-offset"] is not None:
            parse_start(arguments["x-stream-offset"], 0)
        _parse_filters(arguments.get("x-stream-filter"))
    except ValueError as exc:
        return [406, f"PRECONDITION_FAILED - {exc}", 60, 20]
    unfiltered = arguments.get("x-stream-match-unfiltered")
    if unfiltered is not None and not isinstance(unfiltered, bool):
        return [406, "PRECONDITION_FAILED - x-stream-match-unfiltered must be a boolean", 60, 20]
    return None


def with_offset(props_raw: bytes, offset: int) -> bytes:
    """props_raw with header `x-stream-offset` = offset (AMQP long), spliced in without a full re-encode."""
    entry = _OFFSET_KEY + b"l" + _OFFSET_ENTRY.pack(offset)
    try:
        n = len(props_raw)
        if n < 2:
            return props_raw
        flags = (props_raw[0] << 8) | props_raw[1]
        pos = 2
        word = flags
        while word & 1:
            word = (props_raw[pos] << 8) | props_raw[pos + 1]
            pos += 2
        for bit in (0x8000, 0x4000):  # content-type, content-encoding precede headers
            if flags & bit:
                pos += 1 + props_raw[pos]
        if not flags & _FLAG_HEADERS:
            return (bytes((props_raw[0] | 0x20, props_raw[1])) + props_raw[2:pos] + _U32.pack(len(entry))
                    + entry + props_raw[pos:])
        tlen = _U32.unpack_from(props_raw, pos)[0]
        table = props_raw[pos + 4:pos + 4 + tlen]
        if _OFFSET_KEY in table:  # the publisher set one: ours replaces it
            _, headers = amqp_decode.field_table(bytes(props_raw[pos:pos + 4 + tlen]))
            headers.pop("x-stream-offset", None)
            table = amqp_encode.field_table(headers)[4:]
        return (props_raw[:pos] + _U32.pack(len(table) + len(entry)) + table + entry
                + props_raw[pos + 4 + tlen:])
    except Exception:  # malformed properties are delivered as they were stored
        return props_raw


class Reader:
    """One consumer's view of the stream: its cursor, filter, and deliveries it has not acked."""

    __slots__ = ("cursor", "tag", "filters", "match_unfiltered", "tracking", "pending")

    def __init__(self, cursor: Cursor, tag: str, filters: frozenset[str] | None, match_unfiltered: bool,
                 tracking: bool) -> None:
        self.cursor = cursor
        self.tag = tag
        self.filters = filters
        self.match_unfiltered = match_unfiltered
        self.tracking = tracking
        self.pending: dict[int, int] = {}  # delivery id -> offset, in delivery (= offset) order

    def matches(self, props_raw: bytes) -> bool:
        if _FILTER_KEY not in props_raw:
            return self.match_unfiltered
        try:
            headers = decode_headers(props_raw) or {}
        except ValueError:
            return self.match_unfiltered
        value = headers.get("x-stream-filter-value")
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not isinstance(value, str):
            return self.match_unfiltered
        return any(v.strip() in self.filters for v in value.split(","))

    def resume_at(self) -> int:
        """Offset a reconnect resumes at: the oldest unacked delivery, else the next unread one."""
        for offset in self.pending.values():
            return offset
        return self.cursor.offset


class StreamShard(Protocol):
    """What a stream queue uses of the shard that holds it (shard/worker.py ShardWorker)."""

    timers: TimerHeap

    def mark_dirty(self, q: StreamQueue) -> None: ...


class StreamQueue:
    __slots__ = (
        "qid", "vhost", "name", "durable", "auto_delete", "arguments", "store", "consumers", "unacked",
        "had_consumers", "exclusive_consumer", "deleted", "shard", "readers", "_next_id", "_track_dirty",
        "_age_wake", "n_published", "n_delivered", "n_acked",
    )

    def __init__(self, qid: int, vhost: str, name: str, defn: Any, store: StreamStore, shard: StreamShard,
                 arguments: dict) -> None:
        self.qid = qid
        self.n_published = self.n_delivered = self.n_acked = 0  # see shard/queue.py
        self.vhost = vhost
        self.name = name
        self.durable = bool(defn.durable)
        self.auto_delete = bool(defn.auto_delete)
        self.arguments = dict(arguments)
        self.store = store
        self.shard = shard
        self.consumers: list[Consumer] = []
        # delivery id -> owner; ids are per queue (two consumers may hold the same offset)
        self.unacked: dict[int, Consumer | ChannelRef] = {}
        self.readers: dict[Consumer, Reader] = {}
        self.had_consumers = False
        self.exclusive_consumer = False
        self.deleted = False
        self._next_id = 1
        self._track_dirty: set[Reader] = set()
        self._age_wake: int | None = None
        self._age_check()

    def configure(self, arguments: dict) -> None:
        """Effective arguments changed (a policy): new retention limits."""
        self.arguments = dict(arguments)
        self.store.configure(*retention_args(arguments))
        self._age_check()

    def _age_check(self) -> None:
        """Apply max-age now and keep a timer for the next segment to age out, so idle streams shrink too."""
        store = self.store
        if store.max_age_s is None:
            return
        store.enforce_retention()
        when = store.age_deadline()
        if when is not None and (self._age_wake is None or when < self._age_wake):
            self._age_wake = when
            self.shard.timers.schedule(when, self._age_fired)

    def _age_fired(self) -> None:
        self._age_wake = None
        if not self.deleted:
            before = self.store.count
            self._age_check()
            if self.store.count != before:  # segments aged out with no publish or reader to notice:
                self.shard.mark_dirty(self)  # the pass it schedules puts the new counts in the next STATS

    # ----------------------------------------------------------------- consumers
    def add_consumer(self, consumer: Consumer) -> None:
        """Place the consumer's cursor (arguments were checked by consume_error)."""
        args = consumer.arguments
        store = self.store
        tag = consumer.tag
        client_tag = not tag.startswith("amq.ctag-")
        if "x-stream-offset" not in args:
            tracking, start = client_tag, ("next", 0)
        elif args["x-stream-offset"] is None:  # LavinMQ: null means track, from the first message
            tracking, start = client_tag, ("first", 0)
        else:
            tracking = client_tag and _tracking_flag(args.get("x-stream-automatic-offset-tracking"))
            start = parse_start(args["x-stream-offset"], int(time.time() * 1000))
        stored = store.tracked.get(tag) if tracking else None
        if stored is not None:
            start = ("offset", stored)
        cursor = store.cursor(*start)
        self.readers[consumer] = Reader(cursor, tag, _parse_filters(args.get("x-stream-filter")),
                                        args.get("x-stream-match-unfiltered") is True, tracking)
        self.consumers.append(consumer)
        self.had_consumers = True
        if consumer.exclusive:
            self.exclusive_consumer = True

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        if consumer.exclusive:
            self.exclusive_consumer = False
        reader = self.readers.pop(consumer, None)
        if reader is not None:
            if reader.tracking:
                self.store.track(reader.tag, reader.resume_at())
            self._track_dirty.discard(reader)
            self.store.release(reader.cursor)

    # ------------------------------------------------------------------ delivery
    def publish(self, ts: int, flags: int, exchange: str, routing_key: str, props_raw: bytes, body: bytes) -> bool:
        self.store.append(ts, flags, exchange, routing_key, props_raw, body)
        return True

    def deliver(self, send: Send) -> None:
        """Every consumer that can take reads on from its own cursor."""
        store = self.store
        if self._track_dirty:
            for reader in self._track_dirty:
                store.track(reader.tag, reader.resume_at())
            self._track_dirty.clear()
        if store.max_age_s is not None:
            self._age_check()
        read = store.read
        unacked = self.unacked
        qid = self.qid
        more = False
        for c in self.consumers:
            if not c.can_take():
                continue
            reader = self.readers[c]
            cursor = reader.cursor
            filtered = reader.filters is not None
            pending = reader.pending
            skipped = 0
            while c.can_take():
                m = read(cursor)
                if m is None:
                    break
                offset, _ts, _flags, exchange, routing_key, props_raw, body = m
                if filtered and not reader.matches(props_raw):
                    skipped += 1
                    if skipped >= _SCAN_PER_TURN:
                        more = True
                        break
                    continue
                did = self._next_id
                self._next_id = did + 1
                c.credit -= 1 + (len(body) >> _CREDIT_SHIFT)
                c.unacked += 1
                c.chan.unacked += 1
                unacked[did] = c
                pending[did] = offset
                send(c.fe, [_DELIVER, c.conn_id, c.channel, c.tag, qid, did, False,
                            exchange, routing_key, with_offset(props_raw, offset), body])
            if skipped and reader.tracking and not pending:
                self._track_dirty.add(reader)
        if more:
            self.shard.mark_dirty(self)

    def tail_consumer_waiting(self, backlog: int) -> bool:
        """A consumer near the tail (more than ``backlog`` behind it, less than NEAR_TAIL) cannot take
        more now: publishers are paced for it as for a queue's consumers (the worker's flow control).

        A consumer far behind (replaying history) does not slow publishers down: it is reading a log,
        not falling behind live traffic.
        """
        tail = self.store.next_offset
        readers = self.readers
        for c in self.consumers:
            if c.active and not c.can_take():
                reader = readers.get(c)
                if reader is not None and backlog < tail - reader.cursor.offset <= NEAR_TAIL:
                    return True
        return False

    def get(self, chan: ChannelRef, no_ack: bool) -> list | None:
        return None  # the worker refuses basic.get on a stream before it gets here

    # ---------------------------------------------------------------- settlement
    def _settle(self, msg_id: int, fe: bytes, conn_id: int, channel: int) -> bool:
        owner = self.unacked.get(msg_id)
        if owner is None or owner.conn_id != conn_id or owner.channel != channel or owner.fe != fe:
            return False
        del self.unacked[msg_id]
        owner.settle()
        reader = self.readers.get(owner)  # type: ignore[arg-type]
        if reader is not None:
            reader.pending.pop(msg_id, None)
            if reader.tracking:
                self._track_dirty.add(reader)
        return True

    def ack(self, msg_id: int, fe: bytes, conn_id: int, channel: int) -> bool:
        return self._settle(msg_id, fe, conn_id, channel)

    def nack(self, msg_id: int, fe: bytes, conn_id: int, channel: int, requeue: bool) -> bool:
        return self._settle(msg_id, fe, conn_id, channel)  # nothing leaves or re-enters a stream

    def requeue_owned(self, match: Callable[[Consumer | ChannelRef], bool]) -> int:
        """Channel/connection gone or basic.recover: their deliveries stop counting against prefetch.

        A consumer still attached (basic.recover) reads again from its oldest released
        delivery; a gone consumer's reader was already dropped by remove_consumer.
        """
        gone = [did for did, owner in self.unacked.items() if match(owner)]
        rewind: dict[Reader, int] = {}
        for did in gone:
            owner = self.unacked.pop(did)
            owner.settle()
            reader = self.readers.get(owner)  # type: ignore[arg-type]
            if reader is not None:
                offset = reader.pending.pop(did, None)
                if offset is not None and offset < rewind.get(reader, offset + 1):
                    rewind[reader] = offset
        for reader, offset in rewind.items():
            self.store.seek(reader.cursor, offset)
        return len(gone)

    def purge(self) -> int:
        return 0  # the worker refuses queue.purge on a stream before it gets here

    def info(self) -> dict:
        return {"messages": self.store.count, "consumers": len(self.consumers),
                "damaged_records": self.store.damaged_records, "damaged_acks": 0}
