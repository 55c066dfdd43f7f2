"""Reply texts and errors as RabbitMQ words them, and msgpack-safe method arguments."""

from __future__ import annotations

import datetime
import decimal
from typing import Any

from broker.amqp.constants import CONNECTION_LEVEL_CODES, INTERNAL_ERROR, REPLY_TEXT
from broker.amqp.errors import AMQPChannelError, AMQPConnectionError, AMQPError

# reply-text is a shortstr (at most 255 bytes); RabbitMQ cuts a longer one to 252 bytes + "...".
MAX_REPLY_TEXT = 255


def reply_text(code: int, text: str) -> str:
    """"NOT_FOUND - no queue 'q' in vhost '/'"; texts that already carry the prefix are kept.

    Longer than 255 bytes (a long queue name makes that common), it is cut as RabbitMQ's
    amqp_exception_explanation cuts it, so the channel error stays a channel error instead of an
    unencodable frame; the cut never splits a UTF-8 character (RabbitMQ's can).
    """
    prefix = REPLY_TEXT.get(code, "ERROR")
    if not (text.startswith(prefix) and text[len(prefix):len(prefix) + 3] == " - "):
        text = f"{prefix} - {text}"
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= MAX_REPLY_TEXT:
        return text
    return raw[:MAX_REPLY_TEXT - 3].decode("utf-8", "ignore") + "..."


def error_from_reply(result: Any, class_id: int, method_id: int) -> AMQPError:
    """The exception for a failed REPLY / REPLY_DATA: result is [code, text, class_id, method_id]."""
    try:
        code, text = int(result[0]), str(result[1])
        if len(result) > 3 and result[2]:
            class_id, method_id = int(result[2]), int(result[3])
    except (TypeError, ValueError, IndexError):
        code, text = INTERNAL_ERROR, f"malformed error reply {result!r}"
    if code in CONNECTION_LEVEL_CODES:
        return AMQPConnectionError(code, text, class_id, method_id)
    return AMQPChannelError(code, text, class_id, method_id)


# Values plain() returns as they are, tested first: a request's fields are mostly these.
_SCALARS = frozenset((str, int, bool, float, bytes, type(None)))


def plain(value: Any) -> Any:
    """Field-table values msgpack can carry (Decimal -> str, datetime -> epoch seconds)."""
    if value.__class__ in _SCALARS:
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    return value


def method_args(method: Any) -> dict:
    """A pamqp method's fields but its ticket, msgpack-safe: plain(dict(method)) without pamqp's
    __iter__ generator and a plain() call per scalar field (a request's fields are mostly scalars;
    this is on every declare/bind round trip, docs/benchmarks.md "Bind round trip in a pair")."""
    args = {}
    for name in method.__slots__:
        value = getattr(method, name)
        args[name] = value if value.__class__ in _SCALARS else plain(value)
    args.pop("ticket", None)
    return args


def consume_arguments(arguments: dict) -> dict:
    """basic.consume arguments for the shard: plain(), but an `x-stream-offset` timestamp is tagged.

    plain() turns a timestamp into epoch seconds, which a stream could not tell from a
    numeric offset; the shard reads {"timestamp": seconds} (shard/stream_queue.py).
    """
    args = plain(arguments)
    offset = arguments.get("x-stream-offset")
    if isinstance(offset, datetime.datetime):
        args["x-stream-offset"] = {"timestamp": int(offset.timestamp())}
    return args
