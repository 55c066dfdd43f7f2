"""Dead-letter headers and cycle detection, as RabbitMQ's rabbit_dead_letter does them.

Only the dead-letter path decodes and re-encodes properties (pamqp); the
publish and deliver paths carry ``props_raw`` untouched.

``x-death`` is an array of tables, most recent first, one per {queue, reason}:
a second death in the same queue for the same reason increments that entry's
``count`` and moves it to the front. ``x-first-death-*`` are set once,
``x-last-death-*`` every time. A per-message ``expiration`` is removed (so the
message does not expire again where it is routed to) and kept as
``original-expiration``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from broker.amqp.properties import decode_properties, encode_properties

REJECTED = "rejected"
EXPIRED = "expired"
MAXLEN = "maxlen"
DELIVERY_LIMIT = "delivery_limit"

_FLAG_EXPIRATION_HI = 0x01  # expiration is bit 8 of the first flag word: bit 0 of its high byte
_FLAG_HEADERS_HI = 0x20  # headers: bit 13 of the first flag word
DLX_HEADER = "x-dead-letter-exchange"
DLRK_HEADER = "x-dead-letter-routing-key"
_DLX_HEADER_B = DLX_HEADER.encode()


def has_expiration(props_raw: bytes) -> bool:
    return len(props_raw) >= 2 and bool(props_raw[0] & _FLAG_EXPIRATION_HI)


def has_dlx_header(props_raw: bytes) -> bool:
    """Whether the message may carry a per-message ``x-dead-letter-exchange`` header (LavinMQ).

    A flag-bit test, then a substring search only for messages with headers; a false
    positive (the text inside a value) costs one properties decode later, nothing more.
    """
    return len(props_raw) >= 2 and bool(props_raw[0] & _FLAG_HEADERS_HI) and _DLX_HEADER_B in props_raw


def expiration_ms(props_raw: bytes) -> int | None:
    """The per-message TTL in ms, or None when absent or not a non-negative integer."""
    if not has_expiration(props_raw):
        return None
    try:
        exp = decode_properties(props_raw).expiration
        value = int(exp)
    except (ValueError, TypeError):
        return None
    return value if value >= 0 else None


def routing_keys(routing_key: str, headers: dict | None) -> list[str]:
    """The routing key plus CC keys (BCC never shows)."""
    keys = [routing_key]
    cc = headers.get("CC") if headers else None
    if isinstance(cc, list):
        keys.extend(k.decode() if isinstance(k, bytes) else str(k) for k in cc)
    return keys


def dead_letter_props(
    props_raw: bytes, queue: str, reason: str, exchange: str, routing_key: str, now_s: float
) -> tuple[bytes, list[str], list[tuple[str, str]], str | None, str | None]:
    """(new props_raw, routing keys of the original publish, deaths as [(queue, reason)] newest first,
    the message's own dead-letter exchange and routing key headers or None).

    The per-message ``x-dead-letter-exchange`` / ``x-dead-letter-routing-key`` headers are
    taken out of the dead-lettered message, as LavinMQ does (so they do not apply again
    wherever it is routed to).
    """
    props = decode_properties(props_raw)
    headers = dict(props.headers or {})
    msg_dlx = _str_or_none(headers.pop(DLX_HEADER, None))
    msg_dlrk = _str_or_none(headers.pop(DLRK_HEADER, None))
    keys = routing_keys(routing_key, headers)
    deaths = headers.get("x-death")
    deaths = list(deaths) if isinstance(deaths, list) else []
    found = None
    for i, d in enumerate(deaths):
        if isinstance(d, dict) and _s(d.get("queue")) == queue and _s(d.get("reason")) == reason:
            found = deaths.pop(i)
            break
    if found is not None:
        found = dict(found)
        count = found.get("count")
        found["count"] = (count if isinstance(count, int) else 0) + 1
    else:
        found = {
            "count": 1,
            "reason": reason,
            "queue": queue,
            "time": datetime.datetime.fromtimestamp(int(now_s), tz=datetime.UTC),
            "exchange": exchange,
            "routing-keys": keys,
        }
        if props.expiration is not None:
            found["original-expiration"] = props.expiration
    deaths.insert(0, found)
    headers["x-death"] = deaths
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-queue", queue)
    headers.setdefault("x-first-death-exchange", exchange)
    headers["x-last-death-reason"] = reason
    headers["x-last-death-queue"] = queue
    headers["x-last-death-exchange"] = exchange
    props.headers = headers
    props.expiration = None
    pairs = [(_s(d.get("queue")), _s(d.get("reason"))) for d in deaths if isinstance(d, dict)]
    return encode_properties(props), keys, pairs, msg_dlx, msg_dlrk


def is_cycle(target_queue: str, deaths: Sequence[tuple[str, str]]) -> bool:
    """A dead-letter cycle with no client rejection in it (rabbit_dead_letter:is_cycle/2).

    Walk the deaths newest first: a rejection means a client was involved (not a
    cycle); reaching the target queue first means the message went round
    automatically and would go round forever.
    """
    for queue, reason in deaths:
        if reason == REJECTED:
            return False
        if queue == target_queue:
            return True
    return False


def _str_or_none(value) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value) if value is not None else ""
