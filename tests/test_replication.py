"""Replication end to end: real leader and follower nodes (``--cluster`` static mode: ``--follow``),
real pika clients, temp data dirs. See docs/cluster.md."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import zlib
from pathlib import Path

import pika
import pika.exceptions
import pytest

from broker.temp_files import is_temp
from replication import protocol as p
from tests import helpers
from tests.harness import free_port
from tests.tcp_relay import Relay

pytestmark = pytest.mark.integration

SECRET = {"SHARDMQ_CLUSTER_SECRET": "test-secret"}
WAIT = 30.0


def leader_node(node_factory, name="n1", shards=2, extra=(), env=SECRET, **kwargs):
    rport = free_port()
    node = node_factory(name=name, frontends=1, shards=shards, env=env, **kwargs,
                        extra_args=["--cluster", "--etcd-endpoints", "none", "--node-name", name,
                                    "--replication-port", str(rport), *extra])
    node.rport = rport
    return node


def follower_node(node_factory, leader, name="n2", env=SECRET, start=True, extra=()):
    node = node_factory(name=name, frontends=1, shards=leader.shards, env=env, start=False,
                        extra_args=["--cluster", "--node-name", name, "--follow", f"127.0.0.1:{leader.rport}",
                                    *extra])
    if start:
        node.start(wait=False)
    return node


def wait_for(predicate, what: str, timeout: float = WAIT, node=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n" + (node.log_tail() if node else ""))


def log_count(node, text: str) -> int:
    return node.log_text().count(text)


def wait_in_sync(leader, name="n2", times=1):
    wait_for(lambda: log_count(leader, f"follower {name} is in sync") >= times, f"{name} in sync", node=leader)


def wait_isr(leader, names: str, shards: int = 2):
    """Wait until every shard of the leader gates its confirms on exactly ``names`` ("n2", "n2,n3")."""
    def ok() -> bool:
        text = leader.log_text()
        for i in range(shards):
            tag = f"replication shard-{i}: confirms wait for ISR ["
            at = text.rfind(tag)
            if at < 0 or not text.startswith(names + "]", at + len(tag)):
                return False
        return True
    wait_for(ok, f"the shards' ISR to be [{names}]", node=leader)


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """(length, CRC32) of every replicated file, trailing zeros cut (a leader's write segment is a
    sparse file mapped at full size; a follower holds its used part)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == "run" or rel.startswith("run" + os.sep):
            continue
        for n in names:
            if n == ".lock" or is_temp(n):  # never replicated (broker/temp_files.py)
                continue
            with open(os.path.join(dirpath, n), "rb") as f:
                data = f.read().rstrip(b"\0")
            out[os.path.normpath(os.path.join(rel, n))] = (len(data), zlib.crc32(data))
    return out


def wait_identical(leader, follower, timeout: float = WAIT):
    last = {}

    def same() -> bool:
        a, b = listing(leader.data_dir), listing(follower.data_dir)
        last["diff"] = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        return not last["diff"]
    try:
        wait_for(same, "identical data dirs", timeout)
    except AssertionError:
        raise AssertionError(f"data dirs differ: {last['diff']}\n{leader.log_tail()}\n{follower.log_tail()}") from None


def publish(node, queue_counts: dict[str, int], size: int = 1024) -> None:
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for q, n in queue_counts.items():
        ch.queue_declare(q, durable=True)
        for i in range(n):
            ch.basic_publish("", q, f"{q}-{i}-".encode().ljust(size, b"."), pika.BasicProperties(delivery_mode=2))
    conn.close()


def fill(node) -> None:
    """Queues with messages and acks, a stream, a delayed exchange holding messages, a user, a binding."""
    publish(node, {"qa": 50, "qb": 30})
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for _ in range(10):  # acks: records removed from qa
        method, _props, _body = ch.basic_get("qa", auto_ack=False)
        ch.basic_ack(method.delivery_tag)
    ch.queue_declare("st", durable=True, arguments={"x-queue-type": "stream"})
    for i in range(20):
        ch.basic_publish("", "st", b"stream-%d" % i, pika.BasicProperties(delivery_mode=2))
    ch.exchange_declare("dx", "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    ch.queue_declare("dq", durable=True)
    ch.queue_bind("dq", "dx", "k")
    for i in range(5):
        ch.basic_publish("dx", "k", b"later-%d" % i,
                         pika.BasicProperties(delivery_mode=2, headers={"x-delay": 3_600_000}))
    conn.close()


def count(node, queue: str) -> int:
    conn = node.connect()
    try:
        return conn.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        conn.close()


def test_full_sync_then_streaming_gives_identical_data_dirs(node_factory):
    leader = leader_node(node_factory)
    fill(leader)
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_identical(leader, follower)  # full sync
    fill(leader)  # streamed: appends, acks, a new stream segment's records, definitions
    publish(leader, {"qc": 40})
    wait_identical(leader, follower)
    names = listing(follower.data_dir)
    assert any(n.endswith("definitions.log") for n in names)
    assert any("/acks." in n for n in names) and any("/smeta." in n for n in names)
    assert any(n.startswith("delayed" + os.sep) for n in names)


def test_resync_deletes_what_the_leader_no_longer_has_and_repairs_corruption(node_factory):
    leader = leader_node(node_factory)
    publish(leader, {"keep": 20, "gone": 10})
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_identical(leader, follower)
    follower.stop()
    # While the follower is away: acks it misses, a queue deleted, more messages.
    conn = leader.connect()
    ch = conn.channel()
    for _ in range(5):
        method, _p, _b = ch.basic_get("keep", auto_ack=False)
        ch.basic_ack(method.delivery_tag)
    ch.queue_delete("gone")
    conn.close()
    publish(leader, {"keep": 5})
    # ... and a byte of one of its files flipped (same size: only the CRC32 can tell).
    seg = next(p for p in Path(follower.data_dir).rglob("msgs.*"))
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    follower.start(wait=False)
    wait_in_sync(leader, times=2)
    wait_identical(leader, follower)
    assert "gone" not in {p.read_text() for p in Path(follower.data_dir).rglob(".queue")}


def test_every_confirmed_message_is_on_the_follower(node_factory, tmp_path):
    leader = leader_node(node_factory)
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    publish(leader, {"c1": 300, "c2": 300})  # confirmed one by one: each waited for the follower's ack
    leader.kill9()  # the node only: its workers die with it (PDEATHSIG)
    follower.stop()
    # The follower's data dir, started as a plain node, holds every confirmed message.
    standalone = node_factory(name="promoted", frontends=1, shards=2, start=False)
    standalone.data_dir = follower.data_dir
    standalone.start()
    assert count(standalone, "c1") == 300 and count(standalone, "c2") == 300
    conn = standalone.connect()
    method, _p, body = conn.channel().basic_get("c1", auto_ack=True)
    assert body.startswith(b"c1-0-")
    conn.close()


def test_min_isr_nacks_publishes_and_refuses_durable_declares_until_a_follower_is_in_sync(node_factory):
    leader = leader_node(node_factory, extra=["--min-isr", "1"])
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    # Transient definitions are not held: they do not survive a failover anyway.
    ch.queue_declare("", exclusive=True)
    ch.queue_declare("transient", durable=False)
    # A durable declare is held for a while, then refused with a channel error; nothing is applied.
    t0 = time.monotonic()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("m", durable=True)
    assert err.value.reply_code == 406
    assert "--min-isr 1" in err.value.reply_text and "0 in-sync followers" in err.value.reply_text
    assert time.monotonic() - t0 >= 4.5  # held ~5 s first (a follower may come back meanwhile)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("m", durable=True, passive=True)
    assert err.value.reply_code == 404  # the refused declare left no queue behind
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("x", "direct", durable=True)
    assert err.value.reply_code == 406
    conn.close()
    # A durable declare that is waiting when a follower comes in sync is answered with declare-ok.
    declared: list = []

    def declare_while_held() -> None:
        with leader.connect() as c:
            declared.append(c.channel().queue_declare("held", durable=True).method.queue)
    waiter = threading.Thread(target=declare_while_held, daemon=True)
    waiter.start()
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_isr(leader, "n2")
    waiter.join(WAIT)
    if not declared:  # the follower took longer than the hold: then it was refused, as above
        with leader.connect() as c:
            c.channel().queue_declare("held", durable=True)
    publish(leader, {"m": 3})  # declares m durably; raises on a nack
    # The follower goes away: publishes are nacked, durable binds refused, with the reason logged.
    follower.stop()
    wait_for(lambda: "follower n2 is out of sync" in leader.log_text(), "n2 out of sync", node=leader)
    wait_isr(leader, "")
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "m", b"x", pika.BasicProperties(delivery_mode=2))
    wait_for(lambda: "< min-isr 1: nacking confirms" in leader.log_text(), "the reason logged", node=leader)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_bind("m", "amq.direct", "k")
    assert err.value.reply_code == 406 and "PRECONDITION_FAILED" in err.value.reply_text
    conn.close()


def test_a_dead_letter_under_min_isr_is_stored_once_not_once_a_second(node_factory):
    """A dead letter into a durable queue of another shard while the ISR is short of --min-isr: the
    target stores it and answers CONFIRM_NACK naming no queue (not replicated as asked). That copy
    is in the target; the source settles the dead letter with a warning, as a due delayed message
    is settled, where it used to send it again each second (one more copy per second of outage)."""
    leader = leader_node(node_factory, extra=["--min-isr", "1", "--queue-placement", "hash"])
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_isr(leader, "n2")
    names = helpers.names_on_different_shards("dlisr")
    source, target = names[0], names[1]
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(target, durable=True)
    ch.queue_declare(source, durable=True, arguments={"x-dead-letter-exchange": "",
                                                      "x-dead-letter-routing-key": target})
    ch.basic_publish("", source, b"dead", pika.BasicProperties(delivery_mode=2))
    method, _p, _b = ch.basic_get(source, auto_ack=False)
    follower.stop()
    wait_for(lambda: "follower n2 is out of sync" in leader.log_text(), "n2 out of sync", node=leader)
    wait_isr(leader, "")
    ch.basic_reject(method.delivery_tag, requeue=False)
    wait_for(lambda: "dead letter(s) stored on shard 1 but not made durable there" in leader.log_text(),
             "the dead letter settled with a warning", node=leader)
    assert ch.queue_declare(target, passive=True).method.message_count == 1
    # The ISR back: still the one copy (a resend would have added one per second meanwhile).
    follower.start(wait=False)
    wait_isr(leader, "n2")
    ch.basic_publish("", target, b"after", pika.BasicProperties(delivery_mode=2))
    assert ch.queue_declare(target, passive=True).method.message_count == 2
    assert [ch.basic_get(target, auto_ack=True)[2] for _ in range(2)] == [b"dead", b"after"]
    conn.close()


def test_a_follower_that_stops_acking_is_dropped_and_confirms_go_on(node_factory):
    leader = leader_node(node_factory, extra=["--replication-ack-timeout", "1"])
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    os.kill(follower.pid, signal.SIGSTOP)
    try:
        # Confirms wait for the stalled follower at most ~ack timeout, then go on without it.
        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: _collect(errors, publish, leader, {"s": 200}), daemon=True)
        t.start()
        t.join(WAIT * 2)
        assert not t.is_alive(), "confirms stuck behind a stalled follower"
        assert not errors, errors
        wait_for(lambda: "is out of sync" in leader.log_text(), "n2 out of sync", node=leader)
        assert "has not acked for" in leader.log_text()
    finally:
        os.kill(follower.pid, signal.SIGCONT)
    wait_in_sync(leader, times=2)  # it comes back with a resync
    wait_identical(leader, follower)


def test_wrong_secret_is_refused_both_ways(node_factory):
    leader = leader_node(node_factory)
    # A follower with another secret: the leader cannot prove it knows that one, so the follower
    # refuses the leader (and sends no proof of its own); it gets no data.
    follower = follower_node(node_factory, leader, env={"SHARDMQ_CLUSTER_SECRET": "not-the-secret"})
    wait_for(lambda: "does not know the cluster secret" in follower.log_text(), "the follower's refusal",
             node=follower)
    # A client that answers the challenge with a proof made from a wrong secret is refused by the leader.
    with socket.create_connection(("127.0.0.1", leader.rport), timeout=10) as sock:
        dec = p.Decoder()
        nonce = p.new_nonce()
        sock.sendall(p.encode_hello("intruder", "node", nonce))
        challenge = _read_event(sock, dec)
        assert isinstance(challenge, p.Challenge)
        sock.sendall(p.encode_auth(p.follower_proof(b"guess", "node", "intruder", challenge.nonce, nonce)))
        refused = _read_event(sock, dec)
        assert isinstance(refused, p.Refused) and refused.reason == "authentication failed"
        assert sock.recv(1) == b""  # and closed
    wait_for(lambda: "authentication failed" in leader.log_text(), "the leader's log", node=leader)
    assert not (Path(follower.data_dir) / "definitions.json").exists()
    assert "is in sync" not in leader.log_text()


def _read_event(sock, dec):
    events = []
    while not events:
        data = sock.recv(65536)
        assert data, "connection closed"
        events = dec.feed(data)
    return events[0]


class CorruptingRelay(Relay):
    """A TCP relay between follower and leader that flips one byte of the first leader->follower
    chunk containing ``marker`` (once), as a bad NIC or cable might."""

    def __init__(self, target_port: int, marker: bytes) -> None:
        self.marker = marker
        self.flipped = threading.Event()
        super().__init__(target_port)

    def forward(self, data: bytes, from_leader: bool, tag: int) -> bytes | None:
        if from_leader and not self.flipped.is_set() and (i := data.find(self.marker)) >= 0:
            data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
            self.flipped.set()
        return data


def test_an_action_corrupted_in_transit_is_never_applied_and_the_file_is_resynced(node_factory):
    leader = leader_node(node_factory)
    relay = CorruptingRelay(leader.rport, b"CORRUPT-ME")
    try:
        follower = node_factory(name="n2", frontends=1, shards=2, env=SECRET, start=False,
                                extra_args=["--cluster", "--node-name", "n2", "--follow", f"127.0.0.1:{relay.port}"])
        follower.start(wait=False)
        wait_in_sync(leader)
        publish(leader, {"cq": 1})
        conn = leader.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "cq", b"CORRUPT-ME" * 100, pika.BasicProperties(delivery_mode=2))  # confirmed
        conn.close()
        assert relay.flipped.is_set()
        wait_for(lambda: "CRC32 mismatch" in follower.log_text(), "the follower to refuse the action", node=follower)
        wait_in_sync(leader, times=2)  # a new session: the segment differs by CRC32 and is sent whole
        wait_identical(leader, follower)
    finally:
        relay.close()


class HoldingRelay(Relay):
    """A TCP relay that passes the first ``limit`` bytes the leader sends on each connection and
    swallows the rest, as a link that stalls in the middle of a full sync."""

    def __init__(self, target_port: int, limit: int) -> None:
        self.limit = limit
        self.passed: dict[int, int] = {}
        self._tags = 0
        super().__init__(target_port)

    def connection_tag(self) -> int:
        self._tags += 1
        return self._tags

    def forward(self, data: bytes, from_leader: bool, tag: int) -> bytes | None:
        if not from_leader:
            return data
        passed = self.passed.get(tag, 0)
        self.passed[tag] = passed + len(data)
        return data[:max(0, self.limit - passed)] or None


def _temps(root) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in Path(root).rglob("*.tmp")
                  if path.relative_to(root).parts[0] != "run")


def test_a_rewrite_a_killed_follower_left_half_done_leaves_no_tmp_file_behind(node_factory):
    """A follower killed while a full sync rewrote one of its files (its copy differed from the
    leader's: here a byte flipped) leaves ``<path>.tmp`` with the first chunk in it. The leader
    deletes that file meanwhile (the queue purged: its sealed segments go), so no later full sync
    rewrites the path, and the stale ``.tmp`` (never listed, never replicated) used to stay for good.
    A follower's start removes what a killed one left."""
    leader = leader_node(node_factory, extra=["--segment-size", str(2 << 20)])
    publish(leader, {"big": 50}, size=100_000)  # segments 1 and 2 sealed (2 MiB each), 3 written to
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_identical(leader, follower)
    follower.stop()
    seg = next(Path(follower.data_dir).rglob("msgs.0000000001"))
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    # Through a link that stalls after 1.5 MiB of a connection: the segment's first 1 MiB chunk
    # differs from the copy, so it goes to msgs.0000000001.tmp, and the rest never comes.
    relay = HoldingRelay(leader.rport, 3 << 19)
    try:
        follow = follower.extra_args.index("--follow") + 1
        follower.extra_args[follow] = f"127.0.0.1:{relay.port}"
        follower.start(wait=False)
        tmp = str(seg.relative_to(follower.data_dir)) + ".tmp"
        wait_for(lambda: tmp in _temps(follower.data_dir) and os.path.getsize(seg) > 0
                 and (Path(follower.data_dir) / tmp).stat().st_size >= 1 << 20,
                 "the rewrite's first chunk in its .tmp", node=follower)
        follower.kill9()
    finally:
        relay.close()
    assert _temps(follower.data_dir) == [tmp]
    conn = leader.connect()
    conn.channel().queue_purge("big")  # its sealed segments' files are deleted
    conn.close()
    follower.extra_args[follow] = f"127.0.0.1:{leader.rport}"
    follower.restart(wait=False)
    wait_in_sync(leader, times=2)
    wait_identical(leader, follower)
    assert not seg.exists()
    assert _temps(follower.data_dir) == []
    assert "removed 1 temporary file(s) a killed process left" in follower.log_text()


def test_a_leader_shard_that_dies_is_resynced_and_confirms_go_on(node_factory):
    leader = leader_node(node_factory, extra=["--min-isr", "1"])
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    publish(leader, {"k0": 20, "k1": 20})
    old = leader.kill_worker("shard", 0)
    leader.wait_worker_restarted("shard", 0, old)
    wait_in_sync(leader, times=2)  # the follower's session broke with the shard's stream; it resynced
    wait_isr(leader, "n2")
    publish(leader, {"k0": 5, "k1": 5})  # min-isr 1: acked only because the follower is back in the ISR
    wait_identical(leader, follower)


def test_a_follower_without_a_file_list_times_out_reconnects_and_syncs_once_the_leader_answers(node_factory):
    """The leader's shard that serves a stream is stopped (SIGSTOP): the node still welcomes the
    follower and hands the connection over, but no FILE_LIST comes. The follower gives up after
    --replication-file-list-timeout, says so, reconnects, and is in sync once the shard runs again."""
    leader = leader_node(node_factory, shards=1)
    publish(leader, {"fl": 100})
    shard = leader.worker_pid("shard", 0)
    os.kill(shard, signal.SIGSTOP)
    try:
        follower = follower_node(node_factory, leader, extra=["--replication-file-list-timeout", "1"])
        timed_out = "replication: no file list on stream shard-0 from n1 within 1 s of its welcome"
        wait_for(lambda: log_count(follower, timed_out) >= 2, "two file-list timeouts", node=follower)
        assert "reconnecting that stream alone" in follower.log_text()  # the node stream goes on
        assert log_count(leader, "follower n2 is in sync") == 0
    finally:
        os.kill(shard, signal.SIGCONT)
    wait_in_sync(leader)
    # The connections the follower gave up on were handed to the shard meanwhile: it drops them
    # instead of attaching them over the live one.
    wait_for(lambda: log_count(leader, "follower n2 closed this connection before its file list: dropped") >= 2,
             "the shard dropping the connections the follower gave up on", node=leader)
    wait_isr(leader, "n2", shards=1)
    publish(leader, {"fl": 50})  # confirmed once the follower acked them (it is in the ISR)
    wait_identical(leader, follower)
    leader.kill9()
    follower.stop()
    assert promoted_sequence(node_factory, follower, "fl", 150) == list(range(100)) + list(range(50))


def promoted_sequence(node_factory, follower, queue: str, n: int) -> list[int]:
    """Start the (stopped) follower's data dir as a plain node and read `queue`'s n messages back:
    the sequence numbers publish() gave their bodies, in queue order (the queue holds exactly n)."""
    standalone = node_factory(name="promoted", frontends=1, shards=1, start=False)
    standalone.data_dir = follower.data_dir
    standalone.start()
    assert count(standalone, queue) == n
    conn = standalone.connect()
    ch = conn.channel()
    bodies = [ch.basic_get(queue, auto_ack=True)[2] for _ in range(n)]
    conn.close()
    return [int(b.split(b"-")[1]) for b in bodies]


def test_role_api_follower_promoted_by_become_leader_then_replicates_to_a_new_follower(node_factory, tmp_path,
                                                                                       monkeypatch):
    """The coordinator's entry points on an in-process Node: follow, then become_leader (warm start of
    the replicated data dir), which also starts replicating to followers of its own."""
    import asyncio

    from broker.config import load_settings
    from broker.node import Node

    monkeypatch.setenv("SHARDMQ_CLUSTER_SECRET", SECRET["SHARDMQ_CLUSTER_SECRET"])
    leader = leader_node(node_factory)
    publish(leader, {"r": 10})
    amqp_port, rport = free_port(), free_port()
    settings = load_settings(
        ["--data-dir", str(tmp_path / "n2"), "--port", str(amqp_port), "--http-port", "0", "--shards", "2",
         # Listeners with fixed default ports off: another node on the machine may hold them.
         "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0",
         "--frontends", "1", "--cluster", "--node-name", "n2", "--replication-port", str(rport),
         "--follow", f"127.0.0.1:{leader.rport}"], dict(os.environ))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro_fn, timeout=WAIT):
        async def run():
            return await coro_fn()
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    node = call(lambda: _make_node(Node, settings))
    try:
        call(node.start)
        assert node.role == "follower"
        wait_for(lambda: node.repl_follower.status()["in_sync"], "in-process follower in sync", node=leader)
        publish(leader, {"r": 15})  # confirmed: on n2 too
        leader.kill9()
        call(node.become_leader, timeout=90)
        assert node.role == "leader"
        wait_for(lambda: node.ready, "the promoted node's frontends")
        conn = _connect_when_listening(amqp_port)
        assert conn.channel().queue_declare("r", passive=True).method.message_count == 25
        conn.close()
        n3 = node_factory(name="n3", frontends=1, shards=2, env=SECRET, start=False,
                          extra_args=["--cluster", "--node-name", "n3", "--follow", f"127.0.0.1:{rport}"])
        n3.start(wait=False)
        wait_for(lambda: "n3" in call(lambda: _in_sync(node)), "n3 in sync with the promoted node", node=n3)
        status = call(lambda: _followers(node))["n3"]
        assert status.connected and status.in_sync and status.lag_bytes >= 0 and status.last_ack_monotonic > 0
        streams = call(lambda: _streams(node))
        assert set(streams) == {"node", "shard-0", "shard-1"} and all("n3" in v for v in streams.values())
        n3.stop()
        wait_for(lambda: not call(lambda: _followers(node))["n3"].connected, "n3 listed as disconnected")
    finally:
        call(node.stop, timeout=60)
        loop.call_soon_threadsafe(loop.stop)


async def _make_node(node_cls, settings):
    return node_cls(settings)


async def _followers(node) -> dict:
    return node.repl_leader.followers()


async def _streams(node) -> dict:
    return node.repl_leader.stream_status()


async def _in_sync(node) -> set[str]:
    return {f.name for f in node.repl_leader.followers().values() if f.in_sync}


def _connect_when_listening(port: int) -> pika.BlockingConnection:
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1))
        except pika.exceptions.AMQPConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_graceful_stop_of_the_leader_leaves_its_followers_in_sync(node_factory):
    """Followers go away because the leader stops: that must not shrink the ISR (with etcd the last
    ISR write decides who may take over)."""
    leader = leader_node(node_factory)
    follower_node(node_factory, leader)
    wait_in_sync(leader)
    assert leader.stop() == 0
    assert "follower n2 is out of sync" not in leader.log_text()


def test_role_api_leader_becomes_follower_and_resyncs_to_the_new_leader(node_factory, tmp_path, monkeypatch):
    """become_follower on a serving leader: its workers stop, and its data dir becomes the other
    leader's (what that leader does not have is deleted: nothing it acked comes back)."""
    import asyncio

    from broker.config import load_settings
    from broker.node import Node

    monkeypatch.setenv("SHARDMQ_CLUSTER_SECRET", SECRET["SHARDMQ_CLUSTER_SECRET"])
    other = leader_node(node_factory, name="n1")
    publish(other, {"theirs": 7})
    amqp_port = free_port()
    data = tmp_path / "n2"
    settings = load_settings(
        ["--data-dir", str(data), "--port", str(amqp_port), "--http-port", "0", "--shards", "2", "--frontends", "1",
         "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0",  # fixed default ports: off
         "--cluster", "--etcd-endpoints", "none", "--node-name", "n2", "--replication-port", str(free_port())],
        dict(os.environ))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro_fn, timeout=WAIT):
        async def run():
            return await coro_fn()
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    node = call(lambda: _make_node(Node, settings))
    try:
        call(node.start)
        assert node.role == "leader"
        wait_for(lambda: node.ready, "n2 serving")
        conn = _connect_when_listening(amqp_port)
        ch = conn.channel()
        ch.queue_declare("mine", durable=True)
        ch.basic_publish("", "mine", b"only on n2", pika.BasicProperties(delivery_mode=2))
        conn.close()
        call(lambda: node.become_follower("127.0.0.1", other.rport), timeout=60)
        assert node.role == "follower" and not node.is_leader
        assert not any(w.proc and w.proc.returncode is None for w in node.sup.workers)
        wait_in_sync(other)
        fake = type("N", (), {"data_dir": data, "log_tail": lambda self: ""})()
        wait_identical(other, fake)
        assert "mine" not in {q.read_text() for q in data.rglob(".queue")}
    finally:
        call(node.stop, timeout=60)
        loop.call_soon_threadsafe(loop.stop)


def _collect(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def test_mqtt_retained_messages_and_sessions_are_replicated(node_factory):
    """The MQTT KV stores (retained messages, persistent sessions) live in shards: their files reach
    the follower, and a promoted copy still has them."""
    from broker.mqtt import codec as M
    from tests.raw_mqtt import RawMQTT

    leader = leader_node(node_factory, mqtt_port=free_port())
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    pub = RawMQTT(leader.mqtt_port)
    assert pub.connect("pub").return_code == 0
    pub.publish("home/kitchen/temp", b"21", qos=1, pid=1, retain=True)
    assert pub.recv() == M.Ack(M.PUBACK, 1)
    pub.disconnect()
    sleeper = RawMQTT(leader.mqtt_port)
    assert sleeper.connect("sleeper", clean=False).return_code == 0
    assert sleeper.subscribe(1, [("home/#", 1)]) == [1]
    sleeper.disconnect()
    wait_identical(leader, follower)
    assert any(p.parts[-3] == "kv" for p in Path(follower.data_dir).rglob("*.log"))
    leader.kill9()
    follower.stop()
    promoted = node_factory(name="promoted", frontends=1, shards=2, start=False, mqtt_port=free_port())
    promoted.data_dir = follower.data_dir
    promoted.start()
    late = RawMQTT(promoted.mqtt_port)
    assert late.connect("late").return_code == 0
    assert late.subscribe(1, [("home/#", 0)]) == [0]
    p = late.recv()
    assert (p.topic, p.payload, p.retain) == ("home/kitchen/temp", b"21", True)
    late.disconnect()
    again = RawMQTT(promoted.mqtt_port)
    assert again.connect("sleeper", clean=False).session_present
    again.disconnect()


def test_a_kv_store_its_restarted_shard_opens_again_reaches_a_follower_whose_stream_of_it_resynced_alone(
        node_factory):
    """A follower whose stream of a shard resyncs alone (the node stream goes on) does not get the
    node stream's list of the KV files again. The shard was killed after writing records that never
    reached the follower; the restarted shard opens the store only at its next put, after the
    stream's file list: the log goes to the followers whole then, not as an append after a hole."""
    from broker.mqtt import codec as M
    from frontend.mqtt.messages import retained_shard
    from tests.raw_mqtt import RawMQTT

    leader = leader_node(node_factory, mqtt_port=free_port(), extra=["--replication-ack-timeout", "1"])
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    shard = retained_shard("/", 2)

    def retain(topic: str, pid: int) -> None:
        pub = RawMQTT(leader.mqtt_port)
        assert pub.connect(f"pub{pid}").return_code == 0
        pub.publish(topic, b"v%d" % pid, qos=1, pid=pid, retain=True)
        assert pub.recv(timeout=WAIT) == M.Ack(M.PUBACK, pid)
        pub.disconnect()

    retain("t/1", 1)
    wait_identical(leader, follower)
    os.kill(follower.pid, signal.SIGSTOP)
    try:
        retain("t/2", 2)  # acked once the leader dropped the stopped follower (ack timeout 1 s)
        wait_for(lambda: "is out of sync" in leader.log_text(), "n2 out of sync", node=leader)
        retain("t/3", 3)  # written after the drop: never sent to the follower
        old = leader.kill_worker("shard", shard)
        leader.wait_worker_restarted("shard", shard, old)
    finally:
        os.kill(follower.pid, signal.SIGCONT)
    wait_in_sync(leader, times=2)
    assert f"stream shard-{shard} with" in follower.log_text(), follower.log_tail()  # that stream alone
    retain("t/4", 4)  # the restarted shard opens the store now
    wait_identical(leader, follower)
