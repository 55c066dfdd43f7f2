"""Publish runs on a real node (docs/architecture.md "The publish path"): thousands of publishes sent
in one write, so the frontend reads them in large chunks and its parser turns consecutive alike
ones into runs, give exactly what per-message publishing gives: order per queue, confirm tags,
nacks from a full reject-publish queue, mandatory returns, and the global counters."""

from __future__ import annotations

import random
import time
import urllib.request

import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import uid
from tests.raw_amqp import FrameClient

# Separate frontend and shard processes (--colocate off, tests/conftest.py): the frontend keeps listening while its shard is killed and restarted.
COLOCATE = "off"

pytestmark = pytest.mark.integration

PROPS = [C.Basic.Properties(), C.Basic.Properties(delivery_mode=2), C.Basic.Properties(headers={"a": 1}),
         C.Basic.Properties(expiration="60000")]
MAX_LENGTH = 100


def _counters(node) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name[len("rabbitmq_global_messages_"):]: f.samples[0].value
            for f in text_string_to_metric_families(text) if f.name.startswith("rabbitmq_global_messages_")}


def _settle(client: FrameClient, channel: int, n: int, returns: dict[int, list]) -> dict[int, bool]:
    """Read until confirm tags 1..n of `channel` are settled: {tag: acked}; basic.return bodies go
    to returns[channel] in the order they come."""
    settled: dict[int, bool] = {}
    while len(settled) < n:
        ch, frame = client.recv()
        if isinstance(frame, C.Basic.Return):
            header = client.recv()[1]
            assert isinstance(header, pheader.ContentHeader) and header.body_size
            body = client.recv()[1]
            assert isinstance(body, pbody.ContentBody)
            returns.setdefault(ch, []).append(body.value)
            continue
        assert ch == channel and isinstance(frame, (C.Basic.Ack, C.Basic.Nack)), (ch, frame)
        tags = [t for t in range(1, frame.delivery_tag + 1) if t not in settled] if frame.multiple \
            else [frame.delivery_tag]
        assert tags and all(t not in settled for t in tags), f"{frame} settles nothing new"
        for t in tags:
            settled[t] = isinstance(frame, C.Basic.Ack)
    return settled


@pytest.mark.parametrize("transport", ["unix", "zmq"])  # both data-plane transports batch runs by weight
def test_runs_keep_order_confirms_returns_and_counts(node_factory, transport):
    node = node_factory(name="node", frontends=1, shards=2,
                        extra_args=["--stats-interval", "200", "--ipc-transport", transport])
    rnd = random.Random(15)
    pub = FrameClient(node.port)
    pub.open_channel(1)
    pub.open_channel(2)
    q = [uid(f"run{i}") for i in range(4)]
    for i, name in enumerate(q):
        args = {"x-max-length": MAX_LENGTH, "x-overflow": "reject-publish"} if i == 3 else {}
        pub.send(1, C.Queue.Declare(queue=name, arguments=args))
        pub.expect(1, C.Queue.DeclareOk)
    fx, hx = uid("fan"), uid("hdr")
    pub.send(1, C.Exchange.Declare(exchange=fx, exchange_type="fanout"))
    pub.expect(1, C.Exchange.DeclareOk)
    pub.send(1, C.Exchange.Declare(exchange=hx, exchange_type="headers"))
    pub.expect(1, C.Exchange.DeclareOk)
    ax = uid("alt")  # unroutable here: to its alternate exchange, the fanout
    pub.send(1, C.Exchange.Declare(exchange=ax, exchange_type="direct", arguments={"alternate-exchange": fx}))
    pub.expect(1, C.Exchange.DeclareOk)
    binds = [(q[0], "amq.direct", "k0", {}), (q[1], "amq.direct", "k1", {}), (q[0], fx, "", {}), (q[1], fx, "", {}),
             (q[3], fx, "", {}), (q[1], hx, "", {"x-match": "any", "a": 1})]
    for queue, exchange, key, args in binds:
        pub.send(1, C.Queue.Bind(queue=queue, exchange=exchange, routing_key=key, arguments=args))
        pub.expect(1, C.Queue.BindOk)
    pub.send(1, C.Confirm.Select())
    pub.expect(1, C.Confirm.SelectOk)

    # (exchange, routing key, queues it routes to for each of PROPS)
    targets = [("amq.direct", "k0", lambda p: [0]), ("amq.direct", "k1", lambda p: [1]), ("", q[2], lambda p: [2]),
               ("", q[3], lambda p: [3]), (fx, "", lambda p: [0, 1, 3]), (ax, "k", lambda p: [0, 1, 3]), (hx, "", lambda p: [1] if p == 2 else []),
               ("amq.direct", uid("nowhere"), lambda p: [])]
    expected: list[list[bytes]] = [[], [], [], []]
    returned: dict[int, list[bytes]] = {1: [], 2: []}
    nacked: set[int] = set()
    seq = {1: 0, 2: 0}  # confirm tags of channel 1; a counter for channel 2
    counts = {"received": 0, "received_confirm": 0, "unroutable_returned": 0, "unroutable_dropped": 0}
    chunks: list[bytes] = []
    total = 0
    while total < 10_000:
        channel = rnd.choice((1, 1, 2))
        exchange, key, route = rnd.choice(targets)
        props = rnd.choice((0, 0, 0, 1, 2, 3))
        mandatory = rnd.random() < 0.5
        for _ in range(rnd.choice((1, 2, 5, 30, 80))):
            seq[channel] += 1
            total += 1
            body = f"{channel}:{seq[channel]}:{exchange}:{key}".encode()
            chunks.append(pub.publish_frames(channel, exchange, key, body, PROPS[props], mandatory))
            counts["received"] += 1
            counts["received_confirm"] += channel == 1
            queues = route(props)
            if not queues:
                if mandatory:
                    returned[channel].append(body)
                counts["unroutable_returned" if mandatory else "unroutable_dropped"] += 1
            for i in queues:
                if i == 3 and len(expected[3]) == MAX_LENGTH:
                    if channel == 1:
                        nacked.add(seq[1])  # reject-publish: one refusing queue nacks the message
                    continue
                expected[i].append(body)
    pub.sock.sendall(b"".join(chunks))  # one write: the node reads it in large chunks, runs form
    got_returns: dict[int, list] = {}
    settled = _settle(pub, 1, seq[1], got_returns)
    assert {t for t, ok in settled.items() if not ok} == nacked
    assert len(settled) == seq[1]
    assert nacked and len(nacked) < seq[1]

    cons = FrameClient(node.port)
    cons.open_channel(1)
    for i, name in enumerate(q):
        cons.send(1, C.Basic.Consume(queue=name, consumer_tag=f"c{i}", no_ack=True))
    got: list[list[bytes]] = [[], [], [], []]
    want = sum(map(len, expected))
    cons.sock.settimeout(15)
    oks = 0
    while oks < 4 or sum(map(len, got)) < want:
        _ch, frame = cons.recv()
        if isinstance(frame, C.Basic.ConsumeOk):
            oks += 1
            continue
        assert isinstance(frame, C.Basic.Deliver), frame
        cons.recv()
        got[int(frame.consumer_tag[1:])].append(cons.recv()[1].value)
    for i in range(4):
        assert got[i] == expected[i], f"queue {i}: {len(got[i])} delivered, {len(expected[i])} expected"
    # Channel 2's returns come after its publishes were handled; channel 1's before their acks.
    while len(got_returns.get(2, [])) < len(returned[2]):
        ch, frame = pub.recv()
        assert isinstance(frame, C.Basic.Return) and ch == 2, (ch, frame)
        pub.recv()
        got_returns.setdefault(2, []).append(pub.recv()[1].value)
    assert got_returns.get(1, []) == returned[1] and got_returns.get(2, []) == returned[2]
    assert returned[1] and returned[2]

    want_counts = {**counts, "confirmed": seq[1] - len(nacked)}
    deadline = time.monotonic() + 10
    while True:
        now = _counters(node)
        if {k: now.get(k) for k in want_counts} == want_counts:
            break
        assert time.monotonic() < deadline, ({k: now.get(k) for k in want_counts}, want_counts)
        time.sleep(0.05)
    pub.close()
    cons.close()


def test_a_run_in_a_transaction_waits_for_commit(node_factory):
    node = node_factory(name="node", frontends=1, shards=1)
    client = FrameClient(node.port)
    client.open_channel(1)
    name = uid("txrun")
    client.send(1, C.Queue.Declare(queue=name), C.Tx.Select())
    client.expect(1, C.Queue.DeclareOk)
    client.expect(1, C.Tx.SelectOk)
    publishes = b"".join(client.publish_frames(1, "", name, b"m%d" % i) for i in range(50))
    client.sock.sendall(publishes + pframe.marshal(C.Queue.Declare(queue=name, passive=True), 1))
    assert client.expect(1, C.Queue.DeclareOk).message_count == 0  # held by the transaction
    client.sock.sendall(publishes + pframe.marshal(C.Tx.Rollback(), 1) + pframe.marshal(C.Tx.Commit(), 1))
    client.expect(1, C.Tx.RollbackOk)
    client.expect(1, C.Tx.CommitOk)
    client.send(1, C.Queue.Declare(queue=name, passive=True))
    assert client.expect(1, C.Queue.DeclareOk).message_count == 0  # both runs were rolled back
    client.sock.sendall(publishes + pframe.marshal(C.Tx.Commit(), 1))
    client.expect(1, C.Tx.CommitOk)
    client.send(1, C.Queue.Declare(queue=name, passive=True))
    assert client.expect(1, C.Queue.DeclareOk).message_count == 50
    client.send(1, C.Basic.Get(queue=name, no_ack=True))
    assert client.expect(1, C.Basic.GetOk)
    client.recv()
    assert client.recv()[1].value == b"m0"
    client.close()


def test_persistent_runs_to_a_durable_queue_are_confirmed_after_they_are_stored(node_factory):
    """The synced path: every body of a run waits for the group sync before its confirm; all of them
    are there, in order, after the shard is killed and restarted."""
    node = node_factory(name="node", frontends=1, shards=1)
    client = FrameClient(node.port)
    client.open_channel(1)
    name = uid("durrun")
    client.send(1, C.Queue.Declare(queue=name, durable=True), C.Confirm.Select())
    client.expect(1, C.Queue.DeclareOk)
    client.expect(1, C.Confirm.SelectOk)
    persistent = C.Basic.Properties(delivery_mode=2)
    client.sock.sendall(b"".join(client.publish_frames(1, "", name, b"p%d" % i, persistent) for i in range(300)))
    settled = _settle(client, 1, 300, {})
    assert all(settled.values())
    client.sock.close()
    old = node.kill_worker("shard", 0)
    node.wait_worker_restarted("shard", 0, old)
    client = FrameClient(node.port)
    client.open_channel(1)
    got = []
    deadline = time.monotonic() + 15
    while len(got) < 300:
        assert time.monotonic() < deadline, f"{len(got)} of 300 after the restart"
        client.send(1, C.Basic.Get(queue=name, no_ack=True))
        _ch, frame = client.recv()
        if isinstance(frame, C.Basic.GetEmpty):
            time.sleep(0.05)  # the restarted shard may still be loading the queue
            continue
        assert isinstance(frame, C.Basic.GetOk), frame
        client.recv()
        got.append(client.recv()[1].value)
    assert got == [b"p%d" % i for i in range(300)]
    client.close()


def _bind_keys(client: FrameClient, queue: str, keys: list[str]) -> None:
    client.send(1, *[C.Queue.Bind(queue=queue, exchange="amq.direct", routing_key=k) for k in keys])
    for _ in keys:
        client.expect(1, C.Queue.BindOk)


def _deliveries(client: FrameClient, n: int, ctag: str | None = None) -> list[bytes]:
    """The bodies of the next n deliveries (to consumer ctag, when given)."""
    got = []
    while len(got) < n:
        _ch, frame = client.recv()
        assert isinstance(frame, C.Basic.Deliver), frame
        assert ctag is None or frame.consumer_tag == ctag, frame
        header = client.recv()[1]
        got.append(client.recv()[1].value if header.body_size else b"")
    return got


def test_runs_interrupted_by_key_changes_keep_order_and_confirms(node_factory):
    """One write whose publishes take a new routing key each time (the parser's run probe backs off),
    then one key (runs again), two keys taking turns, blocks of five per key: all of them reach the
    queue in order, every confirm is an ack, and a no-ack consumer waiting gets them in order."""
    node = node_factory(name="node", frontends=1, shards=1)
    pub = FrameClient(node.port)
    pub.open_channel(1)
    name = uid("keys")
    keys = [f"{i:03d}.k" for i in range(200)]  # one length, one last byte: every probe's byte tests pass
    pub.send(1, C.Queue.Declare(queue=name))
    pub.expect(1, C.Queue.DeclareOk)
    _bind_keys(pub, name, keys)
    cons = FrameClient(node.port)
    cons.open_channel(1)
    cons.send(1, C.Basic.Consume(queue=name, consumer_tag="c", no_ack=True))
    cons.expect(1, C.Basic.ConsumeOk)
    pub.send(1, C.Confirm.Select())
    pub.expect(1, C.Confirm.SelectOk)
    phases = ([keys[i % 200] for i in range(3000)] + [keys[7]] * 3000 + [keys[i % 2] for i in range(1000)]
              + [keys[i // 5 % 200] for i in range(2000)] + [keys[i % 200] for i in range(1000)] + [keys[9]] * 2000)
    bodies = [b"m%d" % i for i in range(len(phases))]
    pub.sock.sendall(b"".join(pub.publish_frames(1, "amq.direct", k, body) for k, body in zip(phases, bodies,
                                                                                              strict=True)))
    settled = _settle(pub, 1, len(bodies), {})
    assert len(settled) == len(bodies) and all(settled.values())
    assert _deliveries(cons, len(bodies), "c") == bodies
    pub.close()
    cons.close()


@pytest.mark.parametrize("transport", ["unix", "zmq"])  # both batch a delivery run's items (put_many)
def test_delivery_runs_keep_order_through_credit_and_cancel(node_factory, transport):
    """Runs fanned out to a queue with a waiting no-ack consumer (delivery runs) and one without (stored):
    the consumer does not read, so its credit runs out in the middle of a run and the rest is stored;
    it then reads some, is cancelled, and a second consumer gets the rest: every body once, in order,
    in both queues; every publish confirmed."""
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--ipc-transport", transport])
    pub = FrameClient(node.port)
    pub.open_channel(1)
    live, kept, fx = uid("live"), uid("kept"), uid("fan")
    pub.send(1, C.Exchange.Declare(exchange=fx, exchange_type="fanout"))
    pub.expect(1, C.Exchange.DeclareOk)
    for name in (live, kept):
        pub.send(1, C.Queue.Declare(queue=name), C.Queue.Bind(queue=name, exchange=fx))
        pub.expect(1, C.Queue.DeclareOk)
        pub.expect(1, C.Queue.BindOk)
    cons = FrameClient(node.port, timeout=30)
    cons.open_channel(1)
    cons.send(1, C.Basic.Consume(queue=live, consumer_tag="first", no_ack=True))
    cons.expect(1, C.Basic.ConsumeOk)
    pub.send(1, C.Confirm.Select())
    pub.expect(1, C.Confirm.SelectOk)
    # 600 B bodies cost 2 credits each: the window (contract.CREDIT_WINDOW) holds 8,000 of them.
    n = 12_000
    bodies = [b"%06d" % i + bytes(594) for i in range(n)]
    pub.sock.sendall(b"".join(pub.publish_frames(1, fx, "", body) for body in bodies))
    settled = _settle(pub, 1, n, {})
    assert len(settled) == n and all(settled.values())
    first = _deliveries(cons, 6000, "first")
    cons.send(1, C.Basic.Cancel(consumer_tag="first"))
    while True:  # deliveries already on their way come before cancel-ok
        _ch, frame = cons.recv()
        if isinstance(frame, C.Basic.CancelOk):
            break
        assert isinstance(frame, C.Basic.Deliver) and frame.consumer_tag == "first", frame
        header = cons.recv()[1]
        assert header.body_size
        first.append(cons.recv()[1].value)
    assert first == bodies[: len(first)]
    cons.send(1, C.Basic.Consume(queue=live, consumer_tag="second", no_ack=True))
    cons.expect(1, C.Basic.ConsumeOk)
    assert _deliveries(cons, n - len(first), "second") == bodies[len(first):]
    cons.send(1, C.Basic.Consume(queue=kept, consumer_tag="kept", no_ack=True))
    cons.expect(1, C.Basic.ConsumeOk)
    assert _deliveries(cons, n, "kept") == bodies
    cons.send(1, C.Queue.Declare(queue=live, passive=True))
    assert cons.expect(1, C.Queue.DeclareOk).message_count == 0
    pub.close()
    cons.close()
