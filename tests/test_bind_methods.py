"""broker/amqp/bind_methods.py (direct queue.bind / unbind / delete decoders) agrees with pamqp.

The reference is the parser's generic path for every other method (_args_fit, then pamqp's
unmarshal): on valid arguments both give the same fields, on invalid ones (truncated, trailing
bytes, a byte changed, random bytes) both refuse, and through the parser a refusal is 502
SYNTAX_ERROR naming the method, as before. Also here: argument-less methods (bind-ok, unbind-ok,
...) and queue.delete-ok / purge-ok encoded without pamqp equal pamqp's bytes (and a count pamqp
refuses is refused alike), and the frontend's request arguments equal plain(dict(method)) without
the ticket.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import frame as pamqp_frame

from broker.amqp import constants as C
from broker.amqp.bind_methods import (
    DECODERS,
    QUEUE_BIND,
    QUEUE_DELETE,
    QUEUE_UNBIND,
    decode_queue_bind,
    decode_queue_delete,
    decode_queue_unbind,
)
from broker.amqp.encoder import encode_method
from broker.amqp.events import ConnectionProtocolError, MethodFrame
from broker.amqp.parser import _METHOD_FIELDS, FrameParser, _args_fit
from frontend.amqp.replies import method_args, plain
from tests.codec_strategies import headers, routing_keys, shortstr

SETTINGS = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
CLASSES = {QUEUE_BIND: commands.Queue.Bind, QUEUE_UNBIND: commands.Queue.Unbind, QUEUE_DELETE: commands.Queue.Delete}


def pamqp_decode(index: int, args: bytes):
    """The parser's generic path: None where it answers 502."""
    cls, fields = _METHOD_FIELDS[index]
    if not _args_fit(fields, args):
        return None
    method = cls.__new__(cls)
    try:
        method.unmarshal(args)
    except Exception:
        return None
    return method


def fields(method) -> list | None:
    return None if method is None else [(name, getattr(method, name)) for name in method.__slots__]


def direct(index: int, args: bytes, pad: bytes = b"") -> list | None:
    """The direct decoder on args inside a larger buffer (the parser hands it the whole read)."""
    data = b"\xce\x01" + args + pad
    return fields(DECODERS[index](data, 2, 2 + len(args)))


names = shortstr()
tables = st.one_of(st.just({}), headers)


@st.composite
def bind_methods(draw):
    index = draw(st.sampled_from([QUEUE_BIND, QUEUE_UNBIND, QUEUE_DELETE]))
    if index == QUEUE_DELETE:
        return commands.Queue.Delete(queue=draw(names), if_unused=draw(st.booleans()), if_empty=draw(st.booleans()),
                                     nowait=draw(st.booleans()))
    kw = {"queue": draw(names), "exchange": draw(names), "routing_key": draw(routing_keys),
          "arguments": draw(tables)}
    if index == QUEUE_BIND:
        kw["nowait"] = draw(st.booleans())
    return CLASSES[index](**kw)


def args_of(method) -> bytes:
    return method.marshal()


@SETTINGS
@given(bind_methods(), st.binary(max_size=8))
def test_valid_arguments_decode_as_pamqp_decodes_them(method, pad):
    args = args_of(method)
    expected = fields(pamqp_decode(method.index, args))
    assert expected is not None
    assert direct(method.index, args, pad) == expected
    assert expected == fields(method)


@SETTINGS
@given(bind_methods(), st.data())
def test_mutated_arguments_are_refused_or_decoded_as_pamqp_does(method, data):
    args = bytearray(args_of(method))
    how = data.draw(st.sampled_from(["cut", "append", "flip", "flips"]))
    if how == "cut":
        args = args[: data.draw(st.integers(0, max(len(args) - 1, 0)))]
    elif how == "append":
        args += data.draw(st.binary(min_size=1, max_size=6))
    else:
        for _ in range(1 if how == "flip" else data.draw(st.integers(2, 5))):
            i = data.draw(st.integers(0, len(args) - 1))
            args[i] = data.draw(st.integers(0, 255))
    args = bytes(args)
    pad = data.draw(st.binary(max_size=8))
    assert direct(method.index, args, pad) == fields(pamqp_decode(method.index, args))


@SETTINGS
@given(st.sampled_from([QUEUE_BIND, QUEUE_UNBIND, QUEUE_DELETE]), st.binary(max_size=40), st.binary(max_size=8))
def test_random_arguments_are_refused_or_decoded_as_pamqp_does(index, args, pad):
    assert direct(index, args, pad) == fields(pamqp_decode(index, args))


@pytest.mark.parametrize("decode, args", [
    (decode_queue_bind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00\x00"),  # no bits: table short
    (decode_queue_bind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00\x00\x00\x00"),  # trailing byte
    (decode_queue_bind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00\x00\x01"),  # table longer than the frame
    (decode_queue_bind, b"\x00\x00\x02\xff\xfe\x01e\x00\x00\x00\x00\x00\x00"),  # queue not UTF-8
    (decode_queue_bind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00\x00\x03\x01kS"),  # table value cut short
    (decode_queue_bind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00\x00\x03\x01kZ"),  # unknown table value type
    (decode_queue_unbind, b"\x00\x00\x01q\x01e\x00\x00\x00\x00"),  # table cut short
    (decode_queue_unbind, b"\x00\x00\x09q"),  # queue longer than the frame
    (decode_queue_unbind, b"\x00\x00"),  # nothing but the ticket
    (decode_queue_delete, b"\x00\x00\x01q"),  # no bits
    (decode_queue_delete, b"\x00\x00\x01q\x00\x00"),  # trailing byte
    (decode_queue_delete, b"\x00\x00\x05q\x00"),  # queue longer than the frame
    (decode_queue_delete, b"\x00\x00\x02\xff\xfe\x00"),  # queue not UTF-8
])
def test_refusals_agree_with_pamqp(decode, args):
    index = {decode_queue_bind: QUEUE_BIND, decode_queue_unbind: QUEUE_UNBIND, decode_queue_delete: QUEUE_DELETE}[decode]
    assert pamqp_decode(index, args) is None
    assert decode(args + b"\x00\x00\x00\x00", 0, len(args)) is None


def server_events(*frames: bytes) -> list:
    parser = FrameParser()
    return parser.feed(C.PROTOCOL_HEADER + b"".join(frames))


@SETTINGS
@given(bind_methods(), st.integers(1, 65535))
def test_parser_gives_the_pamqp_object(method, channel):
    events = server_events(pamqp_frame.marshal(method, channel))
    frame = events[-1]
    assert isinstance(frame, MethodFrame) and frame.channel == channel
    assert frame.method.__class__ is method.__class__ and fields(frame.method) == fields(method)


@pytest.mark.parametrize("method", [commands.Queue.Bind(queue="q", exchange="e"), commands.Queue.Unbind(queue="q"),
                                    commands.Queue.Delete(queue="q")])
def test_parser_answers_undecodable_arguments_with_syntax_error(method):
    frame = pamqp_frame.marshal(method, 1)
    size = struct.unpack_from(">I", frame, 3)[0]
    cut = struct.pack(">BHI", 1, 1, size - 1) + frame[7 : 7 + size - 1] + b"\xce"
    error = server_events(cut)[-1]
    assert isinstance(error, ConnectionProtocolError)
    assert (error.code, error.class_id, error.method_id) == (C.SYNTAX_ERROR, 50, method.index & 0xFFFF)


ARGLESS = [cls for cls in commands.INDEX_MAPPING.values() if not cls.__slots__]


@pytest.mark.parametrize("cls", ARGLESS, ids=lambda cls: cls.name)
@pytest.mark.parametrize("channel", [0, 1, 300, 65535])
def test_methods_without_arguments_encode_as_pamqp_does(cls, channel):
    assert encode_method(channel, cls()) == pamqp_frame.marshal(cls(), channel)


@pytest.mark.parametrize("cls", [commands.Queue.DeleteOk, commands.Queue.PurgeOk])
@pytest.mark.parametrize("count", [0, 1, 1 << 16, 0xFFFFFFFF])
@pytest.mark.parametrize("channel", [0, 1, 65535])
def test_message_count_replies_encode_as_pamqp_does(cls, count, channel):
    assert encode_method(channel, cls(count)) == pamqp_frame.marshal(cls(count), channel)


@pytest.mark.parametrize("count", [-1, 1 << 32, 1.0, None])
def test_a_message_count_pamqp_refuses_is_refused(count):
    method = commands.Queue.DeleteOk.__new__(commands.Queue.DeleteOk)
    method.message_count = count
    with pytest.raises(TypeError):
        pamqp_frame.marshal(method, 1)
    with pytest.raises(TypeError):
        encode_method(1, method)


def test_bind_ok_and_unbind_ok_are_among_them():
    assert {commands.Queue.BindOk, commands.Queue.UnbindOk, commands.Exchange.BindOk} <= set(ARGLESS)


@SETTINGS
@given(bind_methods())
def test_request_arguments_are_plain_fields_without_ticket(method):
    expected = plain(dict(method))
    expected.pop("ticket")
    assert method_args(method) == expected
