"""The parser's publish runs (publish_runs=True): expanding every PublishRun into its Publish events
gives exactly the events of the parser without runs, for any frame sequence split at any reads."""

from __future__ import annotations

import struct
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from broker.amqp import parser as parser_module
from broker.amqp.encoder import encode_ack, encode_heartbeat, encode_method, encode_publish
from broker.amqp.events import MethodFrame, Publish, PublishRun
from broker.amqp.parser import FrameParser
from broker.amqp.properties import encode_properties

HDR = b"AMQP\x00\x00\x09\x01"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Few distinct values, so that consecutive publishes are often alike and runs form.
# Same length as another (delivery-mode 1 and 2), and one with another's bytes as its prefix (the
# parser does not decode properties, so any bytes will do).
_PROPS = [b"\x00\x00", encode_properties(commands.Basic.Properties(delivery_mode=2)),
          encode_properties(commands.Basic.Properties(headers={"a": 1}, expiration="100")),
          encode_properties(commands.Basic.Properties(delivery_mode=1)), b"\x10\x00\x02\x00"]
_body = st.one_of(st.just(b""), st.binary(max_size=8), st.binary(min_size=30, max_size=300))
# A group of publishes alike but for their bodies (what a run is made of), flattened below.
_publishes = st.tuples(
    st.sampled_from([1, 1, 1, 2, 3]),  # channel
    st.sampled_from(["", "amq.direct", "x"]),
    # "a1"/"b1": same length and last byte, so a probe's byte tests pass and only its compare fails
    st.sampled_from(["k", "", "k2", "a1", "b1"]),
    st.booleans(),  # mandatory
    # bodies, each with its properties: mostly the first ones (same properties bytes), not always
    st.lists(st.tuples(st.sampled_from([0, 0, 0, 0, 1, 2, 3, 4]), _body), min_size=1, max_size=6),
).map(lambda g: [("publish", *g[:4], props, body) for props, body in g[4]])
_other = st.one_of(
    st.tuples(st.just("ack"), st.sampled_from([1, 2]), st.integers(1, 100)),
    st.tuples(st.just("heartbeat")),
    st.tuples(st.just("qos"), st.sampled_from([1, 2])),
    st.tuples(st.just("invalid"), st.sampled_from([1, 2])),  # ends the stream with an error mid-run
).map(lambda item: [item])
_streams = st.lists(st.one_of(_publishes, _publishes, _publishes, _other), min_size=1, max_size=12).map(
    lambda groups: [item for group in groups for item in group])


def _frames(item: tuple, frame_max: int) -> list[bytes]:
    kind = item[0]
    if kind == "publish":
        _, ch, ex, rk, mandatory, props, body = item
        data = encode_publish(ch, ex, rk, mandatory, _PROPS[props], body, frame_max)
    elif kind == "ack":
        data = encode_ack(item[1], item[2], False)
    elif kind == "heartbeat":
        data = encode_heartbeat()
    elif kind == "qos":
        data = encode_method(item[1], commands.Basic.Qos(prefetch_count=5))
    else:  # a publish whose frame end octet is wrong: FRAME_ERROR, everything after it ignored
        data = bytearray(encode_publish(item[1], "", "k", False, b"\x00\x00", b"z"))
        data[struct.unpack_from(">I", data, 3)[0] + 7] = 0
        data = bytes(data)
    out, pos = [], 0
    while pos < len(data):
        size = struct.unpack_from(">I", data, pos + 3)[0]
        out.append(data[pos : pos + size + 8])
        pos += size + 8
    return out


def _expand(events: list) -> list:
    """Every PublishRun as its Publish events; pamqp methods (no __eq__) by name and fields."""
    out = []
    for ev in events:
        if ev.__class__ is PublishRun:
            assert len(ev.bodies) >= 2
            out.extend(Publish(*ev[:6], body) for body in ev.bodies)
        elif ev.__class__ is MethodFrame:
            out.append(("MethodFrame", ev.channel, ev.method.name, list(ev.method)))
        else:
            out.append(ev)
    return out


def _feed(parser: FrameParser, chunks: list[bytes]) -> list:
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


@SETTINGS
@given(_streams, st.randoms(use_true_random=False))
def test_runs_expand_to_the_per_message_events(items, rnd):
    _check_runs_expand(items, rnd)


@SETTINGS
@given(_streams, st.randoms(use_true_random=False))
def test_runs_expand_to_the_per_message_events_while_the_probe_backs_off(items, rnd):
    """The same with a probe that backs off after every miss for a few bytes: runs start and stop
    anywhere in a stream, in the middle of reads too."""
    with mock.patch.object(parser_module, "_PROBE_MISSES", 1), mock.patch.object(parser_module, "_PROBE_WAIT", 50):
        _check_runs_expand(items, rnd)


def _check_runs_expand(items: list, rnd) -> None:
    frame_max = 4096 if rnd.random() < 0.5 else 40 + rnd.randrange(200)
    # Interleave the frames of different channels' messages (a channel's own frames stay in order).
    queues = [(item[1] if len(item) > 1 else 0, _frames(item, frame_max)) for item in items]
    stream = [HDR]
    while queues:
        # Mostly in order; sometimes a frame of one of the next messages of another channel first.
        i = rnd.randrange(min(3, len(queues))) if rnd.random() < 0.2 else 0
        if queues[i][0] == queues[0][0]:
            i = 0
        frames = queues[i][1]
        stream.append(frames.pop(0))
        if not frames:
            queues.pop(i)
    data = b"".join(stream)
    cuts = sorted(rnd.randrange(len(data) + 1) for _ in range(rnd.randrange(6)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    plain = _feed(FrameParser(frame_max=frame_max), chunks)
    with_runs = _feed(FrameParser(frame_max=frame_max, publish_runs=True), chunks)
    assert _expand(with_runs) == _expand(plain)


def test_a_run_holds_consecutive_alike_publishes_only():
    props = _PROPS[1]
    data = HDR + b"".join([
        encode_publish(1, "x", "k", False, props, b"a"),
        encode_publish(1, "x", "k", False, props, b"b"),
        encode_publish(1, "x", "k", False, props, b"c"),
        encode_publish(1, "x", "k2", False, props, b"d"),  # another routing key: a new run
        encode_publish(1, "x", "k2", False, props, b"e"),
        encode_publish(1, "x", "k2", True, props, b"f"),  # mandatory
        encode_publish(1, "x", "k2", True, _PROPS[3], b"f2"),  # other properties of the same length
        encode_publish(1, "x", "k2", True, _PROPS[0], b"g"),  # other properties
        encode_publish(2, "x", "k2", True, _PROPS[0], b"h"),  # another channel
        encode_publish(2, "x", "k2", True, _PROPS[0], b"i"),
        encode_ack(2, 1, False),
        encode_publish(2, "x", "k2", True, _PROPS[0], b"j"),  # after another event
    ])
    events = FrameParser(publish_runs=True).feed(data)
    assert events[1:] == [
        PublishRun(1, "x", "k", False, False, props, [b"a", b"b", b"c"]),
        PublishRun(1, "x", "k2", False, False, props, [b"d", b"e"]),
        Publish(1, "x", "k2", True, False, props, b"f"),
        Publish(1, "x", "k2", True, False, _PROPS[3], b"f2"),
        Publish(1, "x", "k2", True, False, _PROPS[0], b"g"),
        PublishRun(2, "x", "k2", True, False, _PROPS[0], [b"h", b"i"]),
        events[7],
        Publish(2, "x", "k2", True, False, _PROPS[0], b"j"),
    ]
    assert events[7].__class__.__name__ == "Ack"
    # Without publish_runs nothing changes.
    assert all(ev.__class__ is not PublishRun for ev in FrameParser().feed(data))


def _frame(ftype: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + bytes((end,))


def _publish_raw(body: bytes, body_size: int | None = None, body_frame_size: int | None = None,
                 end: int = 0xCE) -> bytes:
    """basic.publish on channel 1 with hand-made content frames (sizes and end octet as given)."""
    size = len(body) if body_size is None else body_size
    method = encode_method(1, commands.Basic.Publish(exchange="x", routing_key="k"))
    header = _frame(2, 1, struct.pack(">HHQ", 60, 0, size) + b"\x00\x00")
    bsize = len(body) if body_frame_size is None else body_frame_size
    return method + header + struct.pack(">BHI", 3, 1, bsize) + body + bytes((end,))


@pytest.mark.parametrize("bad, parser_args", [
    (_publish_raw(b"a\xce", body_size=1), {}),  # body frame larger than the header said, 0xCE where it would end
    (_publish_raw(b"zz", end=0), {}),  # bad frame end octet on the body
    (_publish_raw(b"y" * 300), {"frame_max": 4096, "max_message_size": 200}),  # over max_message_size
    (_publish_raw(b"y" * 5000), {"frame_max": 4096}),  # body frame over frame_max
])
def test_a_malformed_message_after_a_run_gets_the_same_answer(bad, parser_args):
    data = HDR + _publish_raw(b"one") + _publish_raw(b"two") + bad + _publish_raw(b"three")
    plain = FrameParser(**parser_args).feed(data)
    with_runs = FrameParser(publish_runs=True, **parser_args).feed(data)
    assert with_runs[1].__class__ is PublishRun
    assert _expand(with_runs) == _expand(plain)


def _pub(key: str, body: bytes = b"b", channel: int = 1) -> bytes:
    return encode_publish(channel, "x", key, False, _PROPS[1], body)


def _keys(n: int, tag: str = "a") -> bytes:
    """n publishes, each with another routing key of one length and last byte (every probe misses)."""
    return b"".join(_pub(f"{tag}{i:04d}.k") for i in range(n))


def _runs(events: list) -> list:
    return [len(ev.bodies) for ev in events if ev.__class__ is PublishRun]


def test_the_probe_backs_off_after_four_misses_and_retries_after_16_kib():
    probe_wait = parser_module._PROBE_WAIT
    parser, plain = FrameParser(publish_runs=True), FrameParser()

    def feed(data: bytes) -> list:
        events = parser.feed(data)
        assert _expand(events) == _expand(plain.feed(data))  # whatever the probe does
        return events

    feed(HDR)
    run = _pub("same.k", b"1") + _pub("same.k", b"2") + _pub("same.k", b"3")
    assert _runs(feed(run)) == [3]
    # Three misses, then a run: the run resets the count.
    assert _runs(feed(_keys(3) + run)) == [3]
    assert _runs(feed(_keys(3) + run)) == [3]
    # Four misses in a row: the rest of the read is not probed, nor the next 16 KiB.
    assert _runs(feed(_keys(4) + run)) == []
    assert _runs(feed(run)) == []
    filler = _keys(probe_wait // len(_pub("a0000.k")) + 1, "f")
    assert len(filler) > probe_wait
    assert _runs(feed(filler)) == []
    assert _runs(feed(run)) == [3]  # retried: a run again, the back-off ends
    # Back off again, then a retry that misses once: backed off for twice as long.
    assert _runs(feed(_keys(4) + run)) == []
    feed(filler)
    assert _runs(feed(_pub("b0000.k") + run)) == []  # probed: one miss, backs off at once
    feed(filler)
    assert _runs(feed(run)) == []  # 16 of the 32 KiB read
    feed(filler)
    assert _runs(feed(run)) == [3]
    # Other frames between publishes are misses too; a lone publish at the end of a read is not.
    acks = b"".join(_pub("same.k") + encode_ack(1, i, False) for i in range(1, 5))
    assert _runs(feed(acks + run)) == []
    feed(filler)
    for _ in range(10):
        feed(_pub("same.k"))
    assert _runs(feed(run)) == [3]


def test_the_probe_counts_misses_per_connection_not_per_channel():
    """A channel whose publishes miss backs off the connection's other channels too (documented)."""
    parser = FrameParser(publish_runs=True)
    parser.feed(HDR)
    two = _pub("same.k", b"1", 2) + _pub("same.k", b"2", 2)
    events = parser.feed(_keys(4) + two)
    assert _runs(events) == [] and len(events) == 6
