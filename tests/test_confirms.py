"""Publisher confirms on a real node, seen on the raw wire (pamqp frames) and through pika.

The raw client shows what client libraries hide: how acks are batched with
``multiple``, that every publish is settled exactly once, and the order of
basic.return and basic.ack for an unroutable mandatory message.
"""

from __future__ import annotations

import pika
import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import header as pheader

from tests.helpers import names_on_different_shards, uid
from tests.raw_amqp import FrameClient

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


@pytest.fixture
def raw(shared_node):
    client = FrameClient(shared_node.port)
    client.open_channel(1)
    yield client
    client.close()


def declare(raw: FrameClient, name: str, channel: int = 1, **kw) -> str:
    raw.send(channel, C.Queue.Declare(queue=name, **kw))
    return raw.expect(channel, C.Queue.DeclareOk).queue


def select(raw: FrameClient, channel: int = 1) -> None:
    raw.send(channel, C.Confirm.Select())
    raw.expect(channel, C.Confirm.SelectOk)


def collect_confirms(raw: FrameClient, n: int, channel: int = 1) -> tuple[list, list]:
    """Read basic.ack/nack frames until tags 1..n are all settled; return (frames, settled-in-order)."""
    frames = []
    settled: list[int] = []
    pending = set(range(1, n + 1))
    while pending:
        ch, frame = raw.recv()
        assert ch == channel and isinstance(frame, (C.Basic.Ack, C.Basic.Nack)), frame
        frames.append(frame)
        tags = sorted(t for t in pending if t <= frame.delivery_tag) if frame.multiple else [frame.delivery_tag]
        assert tags and set(tags) <= pending, f"{frame} settles nothing new (already settled or unknown)"
        pending -= set(tags)
        settled.extend(tags)
    return frames, settled


def message_count(raw: FrameClient, name: str, channel: int = 1) -> int:
    raw.send(channel, C.Queue.Declare(queue=name, passive=True))
    return raw.expect(channel, C.Queue.DeclareOk).message_count


# ----------------------------------------------------------------------- raw wire
def test_every_publish_is_acked_once_with_multiple_batching(raw):
    n = 1000
    q = declare(raw, "", exclusive=True)
    select(raw)
    raw.sock.sendall(b"".join(raw.publish_frames(1, "", q, b"m%d" % i) for i in range(n)))
    frames, settled = collect_confirms(raw, n)
    assert all(isinstance(f, C.Basic.Ack) for f in frames)
    assert sorted(settled) == list(range(1, n + 1))
    assert any(f.multiple for f in frames), "1000 pipelined publishes were acked one frame each"
    assert len(frames) < n
    assert message_count(raw, q) == n


def test_persistent_to_durable_queues_on_two_shards_acked_once(raw):
    n = 300
    names = names_on_different_shards(uid("dur"))
    for name in names:
        declare(raw, name, durable=True)
    ex = uid("fanout")
    raw.send(1, C.Exchange.Declare(exchange=ex, exchange_type="fanout"))
    raw.expect(1, C.Exchange.DeclareOk)
    for name in names:
        raw.send(1, C.Queue.Bind(queue=name, exchange=ex))
        raw.expect(1, C.Queue.BindOk)
    select(raw)
    persistent = C.Basic.Properties(delivery_mode=2)
    raw.sock.sendall(b"".join(raw.publish_frames(1, ex, "", b"p%d" % i, persistent) for i in range(n)))
    frames, settled = collect_confirms(raw, n)
    assert all(isinstance(f, C.Basic.Ack) for f in frames)
    for name in names:
        assert message_count(raw, name) == n
        raw.send(1, C.Queue.Delete(queue=name))
        assert raw.expect(1, C.Queue.DeleteOk).message_count == n
    raw.send(1, C.Exchange.Delete(exchange=ex))
    raw.expect(1, C.Exchange.DeleteOk)


def test_unroutable_mandatory_is_returned_before_its_ack(raw):
    select(raw)
    raw.sock.sendall(raw.publish_frames(1, "amq.direct", uid("nowhere"), b"back", mandatory=True)
                     + raw.publish_frames(1, "amq.direct", uid("nowhere"), b"dropped"))
    ret = raw.expect(1, C.Basic.Return)
    assert (ret.reply_code, ret.reply_text) == (312, "NO_ROUTE")
    raw.expect(1, pheader.ContentHeader)
    assert raw.expect(1, pbody.ContentBody).value == b"back"
    frames, settled = collect_confirms(raw, 2)
    assert all(isinstance(f, C.Basic.Ack) for f in frames) and sorted(settled) == [1, 2]


def test_confirm_select_nowait_then_acks(raw):
    q = declare(raw, "", exclusive=True)
    raw.send(1, C.Confirm.Select(nowait=True))
    raw.sock.sendall(raw.publish_frames(1, "", q, b"x"))
    frames, _ = collect_confirms(raw, 1)
    assert isinstance(frames[0], C.Basic.Ack) and frames[0].delivery_tag == 1


def test_confirms_are_per_channel(raw):
    q = declare(raw, "", exclusive=True)
    raw.open_channel(2)
    select(raw, 1)
    select(raw, 2)
    raw.sock.sendall(raw.publish_frames(1, "", q, b"a") + raw.publish_frames(2, "", q, b"b")
                     + raw.publish_frames(1, "", q, b"c"))
    seen: dict[int, set] = {1: set(), 2: set()}
    while seen != {1: {1, 2}, 2: {1}}:
        ch, frame = raw.recv()
        assert isinstance(frame, C.Basic.Ack), frame
        upto = range(1, frame.delivery_tag + 1) if frame.multiple else [frame.delivery_tag]
        seen[ch].update(upto)
        assert seen[ch] <= {1: {1, 2}, 2: {1}}[ch]


def test_confirm_and_tx_do_not_mix(raw):
    select(raw)
    raw.send(1, C.Tx.Select())
    close = raw.expect(1, C.Channel.Close)
    assert close.reply_code == 406
    raw.send(1, C.Channel.CloseOk())
    raw.open_channel(2)
    raw.send(2, C.Tx.Select())
    raw.expect(2, C.Tx.SelectOk)
    raw.send(2, C.Confirm.Select())
    close = raw.expect(2, C.Channel.Close)
    assert close.reply_code == 406
    raw.send(2, C.Channel.CloseOk())


def test_server_generated_consumer_tag(raw):
    # pika and aio-pika always send a tag of their own; an empty one must get an amq.ctag- name.
    q = declare(raw, "", exclusive=True)
    raw.send(1, C.Basic.Consume(queue=q, consumer_tag=""))
    tag1 = raw.expect(1, C.Basic.ConsumeOk).consumer_tag
    raw.send(1, C.Basic.Consume(queue=q, consumer_tag=""))
    tag2 = raw.expect(1, C.Basic.ConsumeOk).consumer_tag
    assert tag1.startswith("amq.ctag-") and tag2.startswith("amq.ctag-") and tag1 != tag2
    raw.send(1, C.Basic.Cancel(consumer_tag=tag1))
    assert raw.expect(1, C.Basic.CancelOk).consumer_tag == tag1


# --------------------------------------------------------------------- durability
def test_confirmed_persistent_messages_survive_kill9(node):
    names = names_on_different_shards(uid("kill9"))
    connection = node.connect()
    ch = connection.channel()
    ch.confirm_delivery()
    for name in names:
        ch.queue_declare(name, durable=True)
    props = pika.BasicProperties(delivery_mode=2, headers={"n": 1})
    for i in range(100):
        ch.basic_publish("", names[i % 2], b"d%d" % i, props)  # returns after the broker's ack
    node.kill9()  # right after the last confirm: no graceful sync, no close
    node.restart()
    connection = node.connect()
    ch = connection.channel()
    for s, name in enumerate(names):
        assert ch.queue_declare(name, passive=True).method.message_count == 50
        got = [ch.basic_get(name, auto_ack=True) for _ in range(50)]
        assert [b for _, _, b in got] == [b"d%d" % i for i in range(s, 100, 2)]
        assert got[0][1].headers == {"n": 1} and got[0][1].delivery_mode == 2
    connection.close()


# --------------------------------------------------------------------------- nack
def test_reject_publish_overflow_is_nacked(raw):
    q = declare(raw, "", exclusive=True, arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
    select(raw)
    raw.sock.sendall(b"".join(raw.publish_frames(1, "", q, b"r%d" % i) for i in range(5)))
    frames, _ = collect_confirms(raw, 5)
    outcome = {}
    for f in frames:
        tags = [t for t in range(1, f.delivery_tag + 1) if t not in outcome] if f.multiple else [f.delivery_tag]
        outcome.update(dict.fromkeys(tags, isinstance(f, C.Basic.Ack)))
    assert outcome == {1: True, 2: True, 3: True, 4: False, 5: False}
    assert message_count(raw, q) == 3
    raw.send(1, C.Basic.Get(queue=q, no_ack=True))
    raw.expect(1, C.Basic.GetOk)
    raw.expect(1, pheader.ContentHeader)
    assert raw.expect(1, pbody.ContentBody).value == b"r0"
    raw.sock.sendall(raw.publish_frames(1, "", q, b"room again"))
    frames, _ = collect_confirms_from(raw, 6)
    assert isinstance(frames[0], C.Basic.Ack)


def test_nack_when_one_of_two_shards_rejects(raw):
    full, free = names_on_different_shards(uid("mixed"))
    declare(raw, full, exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    declare(raw, free, exclusive=True)
    ex = uid("fanout")
    raw.send(1, C.Exchange.Declare(exchange=ex, exchange_type="fanout", auto_delete=True))
    raw.expect(1, C.Exchange.DeclareOk)
    for name in (full, free):
        raw.send(1, C.Queue.Bind(queue=name, exchange=ex))
        raw.expect(1, C.Queue.BindOk)
    select(raw)
    raw.sock.sendall(raw.publish_frames(1, ex, "", b"half"))
    frames, _ = collect_confirms(raw, 1)
    assert isinstance(frames[0], C.Basic.Nack)
    assert (message_count(raw, full), message_count(raw, free)) == (0, 1)


def collect_confirms_from(raw: FrameClient, tag: int, channel: int = 1) -> tuple[list, list]:
    ch, frame = raw.recv()
    assert ch == channel and isinstance(frame, (C.Basic.Ack, C.Basic.Nack)) and frame.delivery_tag == tag, frame
    return [frame], [tag]
