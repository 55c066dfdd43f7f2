"""`startingOffset` / `endingOffset` values and turning them into numeric stream offsets.

A value is `first`, `last`, `next`, a non-negative integer offset, or an ISO-8601 timestamp
(`2026-11-25T12:00:00Z`; no zone means UTC). A timestamp is resolved by the broker like a consumer's
`x-stream-offset` timestamp: the first message stored at or after that second (AMQP timestamps
are whole seconds, so a fraction is dropped).

Bounds are half-open: a range [start, end) holds offsets start <= o < end. As an end, `next` and
`last` both mean "up to the newest message present when the read is planned", a number is
exclusive and a timestamp ends before the first message stored at or after it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from loadtest.amqp_client import AMQPClient
from pipeline.amqp import probe_offset, queue_count
from pipeline.schema import OptionError

NAMED = ("first", "last", "next")
# How long a probe waits for the broker's first delivery. A stream with a matching message delivers
# it in the same shard turn as consume-ok, so only "nothing stored at/after that time" waits this long.
PROBE_WAIT = 2.0


@dataclass(frozen=True)
class OffsetSpec:
    kind: str  # "first" | "last" | "next" | "offset" | "timestamp"
    offset: int = 0
    when: dt.datetime | None = None

    def __str__(self) -> str:
        if self.kind == "offset":
            return str(self.offset)
        if self.kind == "timestamp":
            assert self.when is not None
            return self.when.isoformat()
        return self.kind


def parse(value: object, option: str) -> OffsetSpec:
    """An OffsetSpec; OptionError naming `option` for anything else."""
    text = str(value).strip()
    low = text.lower()
    if low in NAMED:
        return OffsetSpec(low)
    if text.isdigit():
        return OffsetSpec("offset", int(text))
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise OptionError(f"option {option} must be first, last, next, a non-negative offset or an ISO-8601 "
                          f"timestamp, not {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return OffsetSpec("timestamp", when=when)


@dataclass(frozen=True)
class Bounds:
    """The retained offsets of a stream when asked: first <= o < next."""

    first: int
    next: int


def bounds(client: AMQPClient, queue: str) -> Bounds:
    """First retained and next offset of a stream queue (two short probe consumers)."""
    if queue_count(client, queue) == 0:
        # Retention never removes the segment being written, so an empty stream never held anything.
        return Bounds(0, 0)
    first = probe_offset(client, queue, "first", PROBE_WAIT * 5)
    last = probe_offset(client, queue, "last", PROBE_WAIT * 5)
    if first is None or last is None:
        raise OptionError(f"stream '{queue}' holds messages but delivered none to a probe consumer")
    return Bounds(first, last + 1)


def resolve(client: AMQPClient, queue: str, spec: OffsetSpec, b: Bounds, as_end: bool) -> int:
    """The numeric offset `spec` names, clamped to the retained range `b`."""
    if spec.kind == "first":
        return b.first
    if spec.kind in ("next", "last"):
        if spec.kind == "last" and not as_end and b.next > b.first:
            return b.next - 1
        return b.next
    if spec.kind == "offset":
        return min(max(spec.offset, b.first), b.next)
    assert spec.when is not None
    found = probe_offset(client, queue, spec.when.replace(microsecond=0), PROBE_WAIT)
    return b.next if found is None else min(max(found, b.first), b.next)


def split(start: int, end: int, per_partition: int) -> list[tuple[int, int]]:
    """[start, end) cut into consecutive ranges of at most `per_partition` offsets."""
    return [(s, min(s + per_partition, end)) for s in range(start, end, per_partition)]
