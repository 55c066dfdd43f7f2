"""Direct decoders of queue.bind, queue.unbind and queue.delete (sans-IO: bytes in, a pamqp method object out).

A bind/unbind churn is a control-plane hot path: one synchronous round trip per operation, all of it
Python CPU in a row (docs/benchmarks.md, "Bind round trip in a pair"). pamqp's generic unmarshal
(a loop over the method's slots, a type lookup, a decoder call and a slice per argument) plus
broker/amqp/parser.py's _args_fit walk were ~8 % of the pair's CPU per operation; these decoders
read the arguments with one precompiled struct and three slices. queue.delete is here for the same
reason: 30,000 pipelined deletes are parsed in the pair beside the other queues' traffic
(docs/benchmarks.md "CPU per delete").

They return the same pamqp objects (commands.Queue.Bind / Unbind / Delete, built without __init__,
as the parser's generic path builds them) with the same fields, or None where the parser's
generic path (_args_fit, then pamqp's unmarshal) refuses the arguments: not occupying the
frame's payload exactly, a short string that is not UTF-8, a field table pamqp cannot decode. The
parser answers None with 502 SYNTAX_ERROR, as before. tests/test_bind_methods.py checks that the
two agree on valid and invalid arguments (hypothesis).

The field table is decoded by pamqp (an empty one, what bind churn sends, is {} at once).
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import commands, decode

# ticket (short), then the queue name's length octet
_TICKET_LEN = struct.Struct(">HB")
_U32 = struct.Struct(">I")
_EMPTY_TABLE = b"\x00\x00\x00\x00"

QUEUE_BIND = commands.Queue.Bind.index
QUEUE_UNBIND = commands.Queue.Unbind.index
QUEUE_DELETE = commands.Queue.Delete.index

_Bind = commands.Queue.Bind
_Unbind = commands.Queue.Unbind
_Delete = commands.Queue.Delete
_field_table = decode.field_table


def _table(data: bytes, t: int, end: int) -> dict | None:
    """The field table at t that ends exactly at end, or None (what pamqp refuses)."""
    if t + 4 > end:
        return None
    if t + 4 == end:
        return {} if data[t:end] == _EMPTY_TABLE else None
    if _U32.unpack_from(data, t)[0] != end - t - 4:
        return None
    try:
        return _field_table(data[t:end])[1]
    except Exception:  # pamqp's table decoder raises ValueError, but also struct.error, IndexError...
        return None


def _names(data: bytes, p: int, end: int) -> tuple | None:
    """ticket, queue, exchange, routing key from p, and the offset after them; None when they do not fit."""
    if p + 3 > end:
        return None
    ticket, n = _TICKET_LEN.unpack_from(data, p)
    q = p + 3
    e = q + n  # exchange length octet
    if e >= end:
        return None
    r = e + 1 + data[e]  # routing key length octet
    if r >= end:
        return None
    after = r + 1 + data[r]
    if after > end:
        return None
    try:
        return ticket, data[q:e].decode("utf-8"), data[e + 1 : r].decode("utf-8"), data[r + 1 : after].decode(
            "utf-8"), after
    except UnicodeDecodeError:
        return None


def decode_queue_bind(data: bytes, p: int, end: int) -> Any:
    """queue.bind from its arguments data[p:end] (after class and method ids), or None: a syntax error.

    ticket(short) queue(shortstr) exchange(shortstr) routing-key(shortstr) no-wait(bit) arguments(table)
    """
    names = _names(data, p, end)
    if names is None:
        return None
    ticket, queue, exchange, routing_key, b = names
    if b >= end:
        return None
    arguments = _table(data, b + 1, end)
    if arguments is None:
        return None
    method = _Bind.__new__(_Bind)
    method.ticket = ticket
    method.queue = queue
    method.exchange = exchange
    method.routing_key = routing_key
    method.nowait = data[b] & 1 == 1
    method.arguments = arguments
    return method


def decode_queue_unbind(data: bytes, p: int, end: int) -> Any:
    """queue.unbind from its arguments data[p:end], or None: a syntax error.

    ticket(short) queue(shortstr) exchange(shortstr) routing-key(shortstr) arguments(table)
    """
    names = _names(data, p, end)
    if names is None:
        return None
    ticket, queue, exchange, routing_key, t = names
    arguments = _table(data, t, end)
    if arguments is None:
        return None
    method = _Unbind.__new__(_Unbind)
    method.ticket = ticket
    method.queue = queue
    method.exchange = exchange
    method.routing_key = routing_key
    method.arguments = arguments
    return method


def decode_queue_delete(data: bytes, p: int, end: int) -> Any:
    """queue.delete from its arguments data[p:end], or None: a syntax error.

    ticket(short) queue(shortstr) if-unused(bit) if-empty(bit) no-wait(bit); the bits' octet is the
    last one (its other bits ignored, as pamqp does)
    """
    if p + 4 > end:
        return None
    ticket, n = _TICKET_LEN.unpack_from(data, p)
    b = p + 3 + n
    if b + 1 != end:
        return None
    try:
        queue = data[p + 3 : b].decode("utf-8")
    except UnicodeDecodeError:
        return None
    bits = data[b]
    method = _Delete.__new__(_Delete)
    method.ticket = ticket
    method.queue = queue
    method.if_unused = bits & 1 == 1
    method.if_empty = bits & 2 == 2
    method.nowait = bits & 4 == 4
    return method


# class << 16 | method -> decoder(data, start of arguments, end of payload)
DECODERS = {QUEUE_BIND: decode_queue_bind, QUEUE_UNBIND: decode_queue_unbind, QUEUE_DELETE: decode_queue_delete}
