"""The AMQP codec: hand-tuned encoders equal pamqp byte for byte, parse(encode(x)) == x, any
fragmentation yields the same events, no input makes the parser raise, and each protocol error
gets the reply code the spec and RabbitMQ give it."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body as pamqp_body
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from broker.amqp import constants as C
from broker.amqp.encoder import (
    encode_ack,
    encode_content,
    encode_deliver,
    encode_heartbeat,
    encode_method,
    encode_nack,
    encode_protocol_header,
    encode_publish,
    encode_reject,
)
from broker.amqp.events import (
    Ack,
    BadProtocolHeader,
    ChannelProtocolError,
    ConnectionProtocolError,
    ContentMethod,
    Deliver,
    Heartbeat,
    MethodFrame,
    Nack,
    ProtocolHeaderReceived,
    Publish,
    Reject,
)
from broker.amqp.parser import FrameParser
from broker.amqp.properties import decode_headers, delivery_mode
from tests.codec_strategies import (
    bodies,
    channels,
    exchange_names,
    frame_maxes,
    properties,
    routing_keys,
    shortstr,
    tags,
)

HDR = C.PROTOCOL_HEADER
EMPTY = b"\x00\x00"
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pamqp_content(channel: int, method, props, body: bytes, frame_max: int) -> bytes:
    """What pamqp produces for a content-bearing method, split the way the spec says."""
    out = pamqp_frame.marshal(method, channel)
    out += pamqp_frame.marshal(pamqp_header.ContentHeader(0, len(body), props), channel)
    limit = frame_max - 8 if frame_max else max(len(body), 1)
    for start in range(0, len(body), limit):
        out += pamqp_frame.marshal(pamqp_body.ContentBody(body[start : start + limit]), channel)
    return out


def raw_frame(ftype: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + bytes((end,))


def method_payload(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    return struct.pack(">HH", class_id, method_id) + args


def header_payload(body_size: int, props_raw: bytes = EMPTY, class_id: int = 60, weight: int = 0) -> bytes:
    return struct.pack(">HHQ", class_id, weight, body_size) + props_raw


def norm(events: list) -> list:
    """pamqp method objects have no __eq__; compare them by name and fields."""
    return [
        ("MethodFrame", e.channel, e.method.name, list(e.method))
        if isinstance(e, MethodFrame)
        else ("ContentMethod", e.channel, e.method.name, list(e.method), e.props_raw, e.body)
        if isinstance(e, ContentMethod)
        else e
        for e in events
    ]


def feed_all(parser: FrameParser, chunks) -> list:
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


# --------------------------------------------------------------------------- encoders == pamqp


@SETTINGS
@given(channels, shortstr(), tags, st.booleans(), exchange_names, routing_keys, properties, bodies, frame_maxes)
def test_encode_deliver_matches_pamqp(channel, ctag, tag, redelivered, exchange, rk, props, body, frame_max):
    expected = pamqp_content(channel, commands.Basic.Deliver(ctag, tag, redelivered, exchange, rk), props, body,
                             frame_max)
    assert encode_deliver(channel, ctag, tag, redelivered, exchange, rk, props.marshal(), body, frame_max) == expected
    # names already encoded by the caller (a frontend caches its consumer tags) give the same bytes
    assert encode_deliver(channel, ctag.encode(), tag, redelivered, exchange.encode(), rk.encode(),
                          props.marshal(), body, frame_max) == expected


@SETTINGS
@given(channels, exchange_names, routing_keys, st.booleans(), properties, bodies, frame_maxes)
def test_encode_publish_matches_pamqp(channel, exchange, rk, mandatory, props, body, frame_max):
    method = commands.Basic.Publish(exchange=exchange, routing_key=rk, mandatory=mandatory)
    expected = pamqp_content(channel, method, props, body, frame_max)
    assert encode_publish(channel, exchange, rk, mandatory, props.marshal(), body, frame_max) == expected


@SETTINGS
@given(channels, tags, st.booleans(), exchange_names, routing_keys, st.integers(0, 2**32 - 1), properties, bodies,
       frame_maxes)
def test_encode_content_matches_pamqp(channel, tag, redelivered, exchange, rk, count, props, body, frame_max):
    for method in (commands.Basic.GetOk(tag, redelivered, exchange, rk, count),
                   commands.Basic.Return(312, "NO_ROUTE", exchange, rk)):
        expected = pamqp_content(channel, method, props, body, frame_max)
        assert encode_content(channel, method, props.marshal(), body, frame_max) == expected


@SETTINGS
@given(st.integers(0, 65535), tags, st.booleans(), st.booleans())
def test_encode_ack_nack_reject_match_pamqp(channel, tag, multiple, requeue):
    assert encode_ack(channel, tag, multiple) == pamqp_frame.marshal(commands.Basic.Ack(tag, multiple), channel)
    assert encode_nack(channel, tag, multiple, requeue) == pamqp_frame.marshal(
        commands.Basic.Nack(tag, multiple, requeue), channel)
    assert encode_reject(channel, tag, requeue) == pamqp_frame.marshal(commands.Basic.Reject(tag, requeue), channel)


def test_encode_fixed_frames():
    assert encode_protocol_header() == b"AMQP\x00\x00\x09\x01"
    assert encode_heartbeat() == pamqp_frame.marshal(pamqp_frame.heartbeat.Heartbeat(), 0)
    close = commands.Channel.Close(404, "NOT_FOUND - no exchange 'x'", 60, 40)
    assert encode_method(3, close) == pamqp_frame.marshal(close, 3)


def test_encoders_refuse_overlong_short_strings():
    with pytest.raises(ValueError):
        encode_deliver(1, "t" * 256, 1, False, "", "rk", EMPTY, b"x")
    with pytest.raises(ValueError):
        encode_publish(1, "", "r" * 256, False, EMPTY, b"x")


def test_empty_body_has_no_body_frame_and_big_body_is_split():
    assert encode_publish(1, "", "q", False, EMPTY, b"").count(b"\xce") == 2
    data = encode_publish(1, "", "q", False, EMPTY, b"x" * 250, frame_max=108)
    frames = []
    pos = 0
    while pos < len(data):
        ftype, _, size = struct.unpack_from(">BHI", data, pos)
        frames.append((ftype, size))
        pos += size + 8
    assert frames[2:] == [(3, 100), (3, 100), (3, 50)]


# --------------------------------------------------------------------------- parse(encode(x)) == x

message_items = st.one_of(
    st.tuples(st.just("publish"), channels, exchange_names, routing_keys, st.booleans(), properties, bodies),
    st.tuples(st.just("ack"), channels, tags, st.booleans()),
    st.tuples(st.just("nack"), channels, tags, st.booleans(), st.booleans()),
    st.tuples(st.just("reject"), channels, tags, st.booleans()),
    st.tuples(st.just("heartbeat")),
    st.tuples(st.just("qos"), channels, st.integers(0, 65535)),
    st.tuples(st.just("declare"), channels, exchange_names, st.booleans()),
)


def encode_item(item, frame_max: int) -> tuple[bytes, list]:
    """The bytes a client sends for one item and the events a server parser must produce."""
    kind = item[0]
    if kind == "publish":
        _, ch, ex, rk, mandatory, props, body = item
        raw = props.marshal()
        return (encode_publish(ch, ex, rk, mandatory, raw, body, frame_max),
                [Publish(ch, ex, rk, mandatory, False, raw, body)])
    if kind == "ack":
        return encode_ack(item[1], item[2], item[3]), [Ack(*item[1:])]
    if kind == "nack":
        return encode_nack(*item[1:]), [Nack(*item[1:])]
    if kind == "reject":
        return encode_reject(*item[1:]), [Reject(*item[1:])]
    if kind == "heartbeat":
        return encode_heartbeat(), [Heartbeat(0)]
    if kind == "qos":
        method = commands.Basic.Qos(prefetch_count=item[2])
    else:
        method = commands.Queue.Declare(queue=item[2], durable=item[3], arguments={"x-max-length": 10})
    return encode_method(item[1], method), [MethodFrame(item[1], method)]


def encode_stream(items, frame_max: int) -> tuple[bytes, list]:
    data, expected = [HDR], [ProtocolHeaderReceived()]
    for item in items:
        raw, events = encode_item(item, frame_max)
        data.append(raw)
        expected += events
    return b"".join(data), expected


@SETTINGS
@given(st.lists(message_items, max_size=12), frame_maxes, st.lists(st.integers(0, 10**6), max_size=20))
def test_parse_encode_roundtrip_any_fragmentation(items, frame_max, cuts):
    data, expected = encode_stream(items, frame_max)
    whole = FrameParser(frame_max=max(frame_max, 4096)).feed(data)
    assert norm(whole) == norm(expected)
    pieces = FrameParser(frame_max=max(frame_max, 4096))
    assert norm(feed_all(pieces, split_at(data, cuts))) == norm(expected)


def test_one_byte_at_a_time_gives_the_same_events():
    items = [("publish", 1, "amq.direct", "k", True, commands.Basic.Properties(delivery_mode=2), b"x" * 5000),
             ("ack", 1, 7, True), ("heartbeat",), ("publish", 2, "", "q", False, commands.Basic.Properties(), b""),
             ("declare", 3, "q1", True)]
    data, expected = encode_stream(items, 4096)
    parser = FrameParser(frame_max=4096)
    assert norm(feed_all(parser, [data[i : i + 1] for i in range(len(data))])) == norm(expected)


@SETTINGS
@given(st.lists(st.tuples(exchange_names, routing_keys, properties, st.binary(min_size=1, max_size=600)),
                min_size=1, max_size=5),
       st.randoms(use_true_random=False))
def test_interleaved_channels_assemble_separately(messages, rnd):
    frame_max = 4096 if rnd.random() < 0.3 else 17 + rnd.randrange(200)
    queues = []
    for ch, (ex, rk, props, body) in enumerate(messages, start=1):
        data = encode_publish(ch, ex, rk, False, props.marshal(), body, frame_max)
        frames, pos = [], 0
        while pos < len(data):
            size = struct.unpack_from(">I", data, pos + 3)[0]
            frames.append(data[pos : pos + size + 8])
            pos += size + 8
        queues.append((ch, frames))
    stream, expected = [HDR], [ProtocolHeaderReceived()]
    while queues:
        i = rnd.randrange(len(queues))
        ch, frames = queues[i]
        stream.append(frames.pop(0))
        if not frames:
            ex, rk, props, body = messages[ch - 1]
            expected.append(Publish(ch, ex, rk, False, False, props.marshal(), body))
            queues.pop(i)
    assert FrameParser(frame_max=max(frame_max, 4096)).feed(b"".join(stream)) == expected


@SETTINGS
@given(channels, shortstr(), tags, st.booleans(), exchange_names, routing_keys, properties, bodies, frame_maxes,
       st.lists(st.integers(0, 10**5), max_size=8))
def test_client_role_parses_deliveries_confirms_and_content_methods(
    channel, ctag, tag, redelivered, exchange, rk, props, body, frame_max, cuts
):
    raw = props.marshal()
    get_ok = commands.Basic.GetOk(tag, redelivered, exchange, rk, 5)
    data = (encode_deliver(channel, ctag, tag, redelivered, exchange, rk, raw, body, frame_max)
            + encode_ack(channel, tag, True) + encode_nack(channel, tag, False, False)
            + encode_content(channel, get_ok, raw, body, frame_max)
            + encode_method(channel, commands.Basic.ConsumeOk(ctag)))
    expected = [Deliver(channel, ctag, tag, redelivered, exchange, rk, raw, body), Ack(channel, tag, True),
                Nack(channel, tag, False, False), ContentMethod(channel, get_ok, raw, body),
                MethodFrame(channel, commands.Basic.ConsumeOk(ctag))]
    parser = FrameParser("client", frame_max=max(frame_max, 4096))
    assert norm(feed_all(parser, split_at(data, cuts))) == norm(expected)


# --------------------------------------------------------------------------- never raises

def check_event_shape(events: list) -> None:
    fatal = [i for i, e in enumerate(events) if isinstance(e, (ConnectionProtocolError, BadProtocolHeader))]
    assert fatal in ([], [len(events) - 1])
    for e in events:
        if isinstance(e, ConnectionProtocolError):
            assert e.code in C.CONNECTION_LEVEL_CODES and e.code != C.INTERNAL_ERROR, e
        if isinstance(e, ChannelProtocolError):
            assert e.code == C.PRECONDITION_FAILED


@SETTINGS
@given(st.sampled_from(["server", "client"]), st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=10))
def test_random_bytes_never_raise(role, junk, cuts):
    data = (HDR if role == "server" else b"") + junk
    whole = FrameParser(role, frame_max=4096, max_message_size=50).feed(data)
    check_event_shape(whole)
    pieces = feed_all(FrameParser(role, frame_max=4096, max_message_size=50), split_at(data, cuts))
    assert norm(pieces) == norm(whole)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "delete", "insert"]), st.integers(0, 10**6), st.integers(0, 255),
              st.integers(1, 20)),
    min_size=1, max_size=4,
)


def mutate(data: bytes, muts) -> bytes:
    buf = bytearray(data)
    for kind, where, value, length in muts:
        i = where % (len(buf) + 1)
        if kind == "flip" and i < len(buf):
            buf[i] ^= value or 1
        elif kind == "delete":
            del buf[i : i + length]
        else:
            buf[i:i] = bytes([value]) * length
    return bytes(buf)


@SETTINGS
@given(st.lists(message_items, min_size=1, max_size=6), mutations, st.lists(st.integers(0, 10**6), max_size=10),
       st.sampled_from([10, 100, 10**6]))
def test_mutated_streams_never_raise_and_fragmentation_agrees(items, muts, cuts, max_message_size):
    data = mutate(encode_stream(items, 64)[0], muts)
    frame_max = 4096
    whole_parser = FrameParser(frame_max=frame_max, max_message_size=max_message_size)
    whole = whole_parser.feed(data)
    check_event_shape(whole)
    parser = FrameParser(frame_max=frame_max, max_message_size=max_message_size)
    pieces = []
    for chunk in split_at(data, cuts):
        pieces += parser.feed(chunk)
        # buffered input never exceeds one frame the header allowed
        assert parser._pending_len < frame_max + 8
    assert norm(pieces) == norm(whole)
    if whole and isinstance(whole[-1], ConnectionProtocolError):
        assert parser.feed(data) == [] and parser.dead


# --------------------------------------------------------------------------- protocol header

def test_protocol_header_split_over_feeds():
    parser = FrameParser()
    assert parser.feed(b"AMQ") == []
    assert parser.feed(b"P\x00\x00") == []
    assert parser.feed(b"\x09\x01" + encode_heartbeat()) == [ProtocolHeaderReceived(), Heartbeat(0)]


def test_amqp_0_9_header_is_accepted_like_rabbitmq():
    assert FrameParser().feed(b"AMQP\x01\x01\x00\x09") == [ProtocolHeaderReceived()]


@pytest.mark.parametrize("header", [b"AMQP\x00\x00\x09\x00", b"AMQP\x01\x01\x00\x0a", b"GET / HTTP/1.1\r\n"])
def test_bad_protocol_header(header):
    parser = FrameParser()
    assert parser.feed(header) == [BadProtocolHeader(header[:8])]
    assert parser.dead and parser.feed(HDR) == []


def test_client_sees_server_refusing_with_its_header():
    assert FrameParser("client").feed(HDR) == [BadProtocolHeader(HDR)]


# --------------------------------------------------------------------------- error codes

def server_feed(*frames: bytes, **kwargs) -> list:
    return FrameParser(**kwargs).feed(HDR + b"".join(frames))


def last_error(events: list) -> tuple:
    err = events[-1]
    assert isinstance(err, ConnectionProtocolError), events
    return err.code, err.class_id, err.method_id


PUBLISH_ARGS = b"\x00\x00" + b"\x02ex" + b"\x02rk" + b"\x00"
PUBLISH = raw_frame(1, 1, method_payload(60, 40, PUBLISH_ARGS))


def test_frame_over_frame_max_is_frame_error_before_its_payload_arrives():
    parser = FrameParser(frame_max=4096)
    parser.feed(HDR)
    # RabbitMQ tolerates a payload of frame_max (clients are often 8 bytes off); one more is an error
    assert parser.feed(struct.pack(">BHI", 3, 1, 4096)) == []
    parser = FrameParser(frame_max=4096)
    events = parser.feed(HDR + struct.pack(">BHI", 3, 1, 4097))
    assert events[0] == ProtocolHeaderReceived() and last_error(events)[0] == C.FRAME_ERROR


def test_frame_max_can_be_lowered_after_tune():
    parser = FrameParser()
    parser.feed(HDR)
    parser.frame_max = 4096
    assert last_error(parser.feed(struct.pack(">BHI", 1, 1, 5000)))[0] == C.FRAME_ERROR


@pytest.mark.parametrize("frame", [
    raw_frame(8, 0, b"", end=0x00),  # bad frame-end octet
    raw_frame(4, 1, b"abc"),  # unknown frame type
    raw_frame(8, 1, b""),  # heartbeat on a non-zero channel
    raw_frame(8, 0, b"x"),  # heartbeat with a payload
    raw_frame(1, 1, b"\x00\x3c"),  # method frame shorter than class+method ids
])
def test_frame_errors(frame):
    assert last_error(server_feed(frame))[0] == C.FRAME_ERROR


@pytest.mark.parametrize("payload", [method_payload(60, 99), method_payload(99, 10), method_payload(10, 12)])
def test_unknown_method_is_not_implemented(payload):
    code, class_id, method_id = last_error(server_feed(raw_frame(1, 1, payload)))
    assert code == C.NOT_IMPLEMENTED and (class_id, method_id) == struct.unpack(">HH", payload)


@pytest.mark.parametrize("payload", [
    method_payload(60, 40, PUBLISH_ARGS[:-1]),  # publish without its bits
    method_payload(60, 40, PUBLISH_ARGS + b"\x00"),  # trailing byte
    method_payload(60, 40, b"\x00\x00\x09ex"),  # exchange longer than the frame
    method_payload(60, 40, b"\x00\x00\x02\xff\xfe\x02rk\x00"),  # exchange not UTF-8
    method_payload(60, 80, b"\x00" * 8),  # ack without bits
    method_payload(60, 120, b"\x00" * 10),  # nack too long
    method_payload(60, 90, b""),  # reject without arguments
    method_payload(50, 10, b"\x00\x00\x05q"),  # queue.declare truncated short string
    method_payload(50, 10, b"\x00\x00\x01q\x00\x00\x00\x00\x10"),  # queue.declare table longer than frame
    method_payload(10, 11, b"\x00\x00\x00\x05\x03abcS"),  # start-ok with a malformed table
])
def test_undecodable_arguments_are_syntax_errors(payload):
    assert last_error(server_feed(raw_frame(1, 1, payload)))[0] == C.SYNTAX_ERROR


def test_client_undecodable_deliver_is_syntax_error():
    deliver = encode_deliver(1, "c", 1, False, "e", "r", EMPTY, b"")
    size = struct.unpack_from(">I", deliver, 3)[0]
    truncated = raw_frame(1, 1, deliver[7 : 7 + size - 1])
    assert last_error(FrameParser("client").feed(truncated))[0] == C.SYNTAX_ERROR


@pytest.mark.parametrize("frames", [
    [raw_frame(2, 1, header_payload(1))],  # header without a content method
    [raw_frame(3, 1, b"x")],  # body without a content method
    [raw_frame(3, 0, b"x")],  # content on channel 0
    [PUBLISH, raw_frame(3, 1, b"x")],  # body where the header belongs
    [PUBLISH, PUBLISH],  # method where the header belongs
    [PUBLISH, raw_frame(2, 1, header_payload(2)), raw_frame(2, 1, header_payload(2))],  # header mid-body
    [PUBLISH, raw_frame(2, 1, header_payload(2)), encode_ack(1, 1, False)],  # method mid-body
    [PUBLISH, raw_frame(2, 1, header_payload(2, class_id=50))],  # header of another class
    [PUBLISH, raw_frame(2, 1, header_payload(2, weight=1))],  # non-zero weight
])
def test_unexpected_frames(frames):
    assert last_error(server_feed(*frames))[0] == C.UNEXPECTED_FRAME


def test_other_channels_are_not_blocked_by_a_channel_mid_content():
    events = server_feed(PUBLISH, raw_frame(2, 1, header_payload(2)), encode_ack(2, 1, False),
                         raw_frame(3, 1, b"ab"))
    assert events[1:] == [Ack(2, 1, False), Publish(1, "ex", "rk", False, False, EMPTY, b"ab")]


def test_body_beyond_declared_size_is_frame_error():
    events = server_feed(PUBLISH, raw_frame(2, 1, header_payload(3)), raw_frame(3, 1, b"ab"), raw_frame(3, 1, b"cd"))
    assert last_error(events) == (C.FRAME_ERROR, 60, 40)


def test_content_method_on_channel_zero_is_channel_error():
    assert last_error(server_feed(raw_frame(1, 0, method_payload(60, 40, PUBLISH_ARGS))))[0] == C.CHANNEL_ERROR


def test_content_header_too_short_is_frame_error():
    assert last_error(server_feed(PUBLISH, raw_frame(2, 1, b"\x00<\x00\x00")))[0] == C.FRAME_ERROR


def test_events_before_an_error_are_returned_and_then_nothing():
    parser = FrameParser()
    events = parser.feed(HDR + encode_ack(1, 1, False) + raw_frame(9, 1, b"") + encode_ack(1, 2, False))
    assert events[:2] == [ProtocolHeaderReceived(), Ack(1, 1, False)]
    assert last_error(events)[0] == C.FRAME_ERROR and len(events) == 3
    assert parser.feed(encode_ack(1, 3, False)) == []


def test_message_over_max_size_is_channel_error_and_its_body_is_skipped():
    body = b"x" * 200
    data = HDR + encode_publish(1, "ex", "rk", False, EMPTY, body, frame_max=64) + encode_publish(
        1, "ex", "rk", False, EMPTY, b"small", frame_max=64)
    for parser_events in (FrameParser(max_message_size=100).feed(data),
                          feed_all(FrameParser(max_message_size=100), [data[i : i + 3] for i in range(0, len(data), 3)])):
        assert parser_events == [
            ProtocolHeaderReceived(),
            ChannelProtocolError(1, C.PRECONDITION_FAILED, "message size 200 is larger than configured max size 100",
                                 60, 40),
            Publish(1, "ex", "rk", False, False, EMPTY, b"small"),
        ]


def test_skipped_body_is_still_checked_against_its_declared_size():
    events = server_feed(PUBLISH, raw_frame(2, 1, header_payload(20)), raw_frame(3, 1, b"y" * 21),
                         max_message_size=10)
    assert isinstance(events[1], ChannelProtocolError) and last_error(events)[0] == C.FRAME_ERROR


# --------------------------------------------------------------------------- a real client's bytes

@SETTINGS
@given(channels, exchange_names, routing_keys, st.booleans(), st.binary(max_size=500),
       st.one_of(st.none(), st.sampled_from([1, 2])), st.lists(st.integers(0, 10**4), max_size=5))
def test_parses_what_pika_sends(channel, exchange, rk, mandatory, body, mode, cuts):
    import pika.frame
    import pika.spec

    props = pika.spec.BasicProperties(content_type="text/plain", delivery_mode=mode, headers={"k": "v"})
    data = (HDR + pika.frame.Method(0, pika.spec.Connection.TuneOk(2047, 4096, 60)).marshal()
            + pika.frame.Method(channel, pika.spec.Basic.Publish(exchange=exchange, routing_key=rk,
                                                                 mandatory=mandatory)).marshal()
            + pika.frame.Header(channel, len(body), props).marshal())
    for start in range(0, len(body), 4088):
        data += pika.frame.Body(channel, body[start : start + 4088]).marshal()
    events = feed_all(FrameParser(frame_max=4096), split_at(data, cuts))
    assert isinstance(events[1], MethodFrame) and events[1].method.frame_max == 4096
    pub = events[2]
    assert pub[:5] == (channel, exchange, rk, mandatory, False) and pub.body == body and len(events) == 3
    assert delivery_mode(pub.props_raw) == (mode or 0)
    assert decode_headers(pub.props_raw) == {"k": "v"}
