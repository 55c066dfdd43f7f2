"""The unix-socket data plane (broker/unixio.py) keeps the ZeroMQ ROUTER/DEALER semantics the workers
rely on: identities, per-turn batches in order, queueing while not connected, reconnection after the
listening side restarts, handover to a new connection with the same identity, silent drops for an
identity that is not connected, and frames bigger than the read buffer. Real sockets on uvloop, as
in the workers; the node-level behaviour (kill -9 of a shard) is in test_worker_crash/test_recovery."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop

from broker import contract
from broker.turn_batch import MAX_BATCH_ITEMS
from broker.unixio import UnixDealer, UnixRouter
from tests.harness import async_wait_until


def run(scenario: Callable) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), 20))


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    await async_wait_until(cond, timeout, what)


class Inbox:
    def __init__(self) -> None:
        self.batches: list[tuple[bytes | None, object, list]] = []

    def __call__(self, ident: bytes | None, header: object, items: list) -> None:
        self.batches.append((ident, header, items))

    @property
    def items(self) -> list:
        return [item for _i, _h, items in self.batches for item in items]


@pytest.fixture
def path(tmp_path) -> str:
    return str(tmp_path / "shard-0.stream")


def test_batches_go_both_ways_with_identity_header_and_sizes(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        at_router, at_dealer = Inbox(), Inbox()
        router = UnixRouter(loop, path, at_router)
        seq = iter(range(1, 100))
        dealer = UnixDealer(loop, path, b"fe-0", at_dealer, lambda _dest: [7, next(seq)])
        sent: list[int] = []
        dealer.on_sent = sent.append
        for i in range(3):
            dealer.put(None, [contract.PUBLISH, i])
        await until(lambda: len(at_router.items) == 3, "the first batch")
        assert at_router.batches == [(b"fe-0", [7, 1], [[contract.PUBLISH, 0], [contract.PUBLISH, 1],
                                                         [contract.PUBLISH, 2]])]  # one batch per turn
        assert sent == [len(contract.pack([7, 1], at_router.batches[0][2]))]
        router.put(b"fe-0", [contract.PROCESSED, 1])
        router.put(b"fe-0", [contract.DELIVER, "x"])
        await until(lambda: len(at_dealer.items) == 2, "the answer")
        assert at_dealer.batches == [(None, 0, [[contract.PROCESSED, 1], [contract.DELIVER, "x"]])]
        dealer.close()
        router.close()

    run(scenario)


def test_batches_put_before_the_listener_exists_wait_and_keep_their_order(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        dealer = UnixDealer(loop, path, b"fe-1", Inbox())
        for i in range(5):
            dealer.put(None, [contract.PUBLISH, i])
            await asyncio.sleep(0.02)  # separate turns: separate batches, still queued
        assert not dealer.connected
        router = UnixRouter(loop, path, inbox)
        await until(lambda: len(inbox.items) == 5, "the queued batches")
        assert inbox.items == [[contract.PUBLISH, i] for i in range(5)]
        assert len(inbox.batches) == 5
        dealer.close()
        router.close()

    run(scenario)


def test_a_dealer_reconnects_when_the_listener_restarts(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        first, second, at_dealer = Inbox(), Inbox(), Inbox()
        router = UnixRouter(loop, path, first)
        dealer = UnixDealer(loop, path, b"fe-0", at_dealer)
        dealer.put(None, [contract.PUBLISH, "a"])
        await until(lambda: first.items == [[contract.PUBLISH, "a"]], "the first incarnation's batch")
        router.close()  # the shard dies: its connections close
        await until(lambda: not dealer.connected, "the dealer to see the close")
        dealer.put(None, [contract.PUBLISH, "b"])  # while nobody listens: queued
        await asyncio.sleep(0.05)
        router = UnixRouter(loop, path, second)  # the restarted shard, same path
        await until(lambda: second.items == [[contract.PUBLISH, "b"]], "the queued batch at the new listener")
        router.put(b"fe-0", [contract.PROCESSED, 9])  # the new incarnation knows the identity again
        await until(lambda: at_dealer.items == [[contract.PROCESSED, 9]], "the new listener's answer")
        dealer.close()
        router.close()

    run(scenario)


def test_a_new_connection_with_the_same_identity_takes_over(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox, old_inbox, new_inbox = Inbox(), Inbox(), Inbox()
        router = UnixRouter(loop, path, inbox)
        old = UnixDealer(loop, path, b"fe-0", old_inbox)
        old.put(None, [contract.PUBLISH, "old"])
        await until(lambda: len(inbox.items) == 1, "the old connection's batch")
        new = UnixDealer(loop, path, b"fe-0", new_inbox)  # a restarted frontend with the same identity
        new.put(None, [contract.PUBLISH, "new"])
        await until(lambda: len(inbox.items) == 2, "the new connection's batch")
        router.put(b"fe-0", [contract.DELIVER, 1])
        await until(lambda: new_inbox.items == [[contract.DELIVER, 1]], "delivery to the newest connection")
        assert old_inbox.items == []
        old.close()
        new.close()
        router.close()

    run(scenario)


def test_a_batch_for_an_identity_that_is_not_connected_is_dropped(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        at_dealer = Inbox()
        router = UnixRouter(loop, path, Inbox())
        router.put(b"fe-9", [contract.DELIVER, "lost"])  # ROUTER_MANDATORY 0: nobody by that name
        dealer = UnixDealer(loop, path, b"fe-0", at_dealer)
        dealer.put(None, [contract.PUBLISH, 1])
        await until(lambda: b"fe-0" in router._peers, "the hello")
        router.put(b"fe-0", [contract.DELIVER, "kept"])
        await until(lambda: at_dealer.items == [[contract.DELIVER, "kept"]], "the routed batch")
        dealer.close()
        router.close()

    run(scenario)


def test_big_frames_and_a_flood_arrive_whole_and_in_order(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        router = UnixRouter(loop, path, inbox)
        dealer = UnixDealer(loop, path, b"fe-0", Inbox())
        big = bytes(range(256)) * (3 * 4096)  # 3 MiB: bigger than the read buffer
        dealer.put(None, [contract.PUBLISH, 0, big])
        n = 10 * MAX_BATCH_ITEMS + 7  # one turn: full batches go out at once, more than a read turn's budget
        for i in range(1, n + 1):
            dealer.put(None, [contract.PUBLISH, i, b"x" * 16])
        await until(lambda: len(inbox.items) == n + 1, "every item", timeout=15)
        assert inbox.items[0][2] == big
        assert [item[1] for item in inbox.items] == list(range(n + 1))
        assert max(len(items) for _i, _h, items in inbox.batches) == MAX_BATCH_ITEMS
        dealer.close()
        router.close()

    run(scenario)


def test_a_read_buffer_grown_for_a_big_frame_shrinks_when_idle_and_frames_still_arrive_whole(path, monkeypatch):
    """A worker kept the 7 MB buffer its boot SNAPSHOT grew for good; now it goes back to the
    starting size once empty for a while, and later frames, big ones too, still arrive whole."""
    from broker import unixio

    monkeypatch.setattr(unixio, "_SHRINK_AFTER_S", 0.05)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        router = UnixRouter(loop, path, inbox)
        dealer = UnixDealer(loop, path, b"fe-0", Inbox())
        big = bytes(range(256)) * (3 * 4096)  # 3 MiB
        dealer.put(None, [contract.PUBLISH, 0, big])
        await until(lambda: len(inbox.items) == 1, "the big frame")
        (stream,) = router._streams
        assert len(stream._buf) > unixio._KEEP_BUFFER
        await until(lambda: len(stream._buf) == unixio._READ_BUFFER, "the buffer to shrink")
        for i in range(1, 4):
            dealer.put(None, [contract.PUBLISH, i, big if i == 2 else b"small"])
            await asyncio.sleep(0)
        await until(lambda: len(inbox.items) == 4, "the later frames")
        assert [item[2] for item in inbox.items[1:]] == [b"small", big, b"small"]
        await until(lambda: len(stream._buf) == unixio._READ_BUFFER, "the buffer to shrink again")
        dealer.close()
        router.close()

    run(scenario)


def test_a_connection_that_does_not_say_hello_is_closed(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        router = UnixRouter(loop, path, inbox)
        await asyncio.sleep(0)  # the listener is served from the next turn
        reader, writer = await asyncio.open_unix_connection(path)
        payload = contract.pack(0, [[contract.PUBLISH, 1]])
        writer.write(contract.STREAM_FRAME.pack(len(payload)) + payload)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
        writer.close()
        assert inbox.items == []
        router.close()

    run(scenario)


def test_the_listener_replaces_a_dead_predecessors_socket_file(path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # left behind by a shard killed with -9
    stale.close()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        router = UnixRouter(loop, path, inbox)
        dealer = UnixDealer(loop, path, b"sh-1", Inbox())
        dealer.put(None, [contract.PUBLISH, 1])
        await until(lambda: inbox.batches == [(b"sh-1", 0, [[contract.PUBLISH, 1]])], "the batch")
        dealer.close()
        router.close()

    run(scenario)


def test_read_until_handles_held_and_unread_frames_at_once_and_in_order(path):
    """The definitions fence's catch-up (UnixDealer.read_until, broker/defs_fence.py): frames the
    stream holds (here by the test-only read delay) and frames still in the socket are handled
    synchronously, in order, up to the one asked for; what is left follows from the loop; and it
    gives up after its timeout when what it waits for is not sent."""
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        router = UnixRouter(loop, path, Inbox())
        dealer = UnixDealer(loop, path, b"fe-0", inbox)
        dealer.read_delay_s = 60.0  # the loop never handles what it reads within this test
        await until(lambda: b"fe-0" in router._peers, "the dealer's hello")
        router.send_now(b"fe-0", [[contract.DEFS, 1, []], [contract.DEFS, 2, []]])
        await until(lambda: dealer._stream._end > dealer._stream._start, "the first frame read (and held)")
        assert inbox.items == []
        router.send_now(b"fe-0", [[contract.DEFS, 3, []]])  # in the socket, not read yet
        assert dealer.read_until(lambda: len(inbox.items) == 3, 5.0)
        assert [item[1] for item in inbox.items] == [1, 2, 3]
        # Nothing more comes: False after the timeout.
        assert not dealer.read_until(lambda: len(inbox.items) == 4, 0.1)
        # Two frames read in one go, the first one asked for: the second is handled from the loop.
        router.send_now(b"fe-0", [[contract.DEFS, 4, []]])
        router.send_now(b"fe-0", [[contract.DEFS, 5, []]])
        assert dealer.read_until(lambda: len(inbox.items) >= 4, 5.0)
        await until(lambda: len(inbox.items) == 5, "the frame left after the one asked for")
        assert [item[1] for item in inbox.items] == [1, 2, 3, 4, 5]


def test_on_drained_runs_once_after_the_batches_of_one_read_were_handled(path):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        at_router = Inbox()
        router = UnixRouter(loop, path, at_router)
        drained: list[int] = []  # how many batches the router had handled when it was called
        router.on_drained = lambda: drained.append(len(at_router.batches))
        dealer = UnixDealer(loop, path, b"fe-0", Inbox())
        await until(lambda: dealer.connected, "the connection")
        await until(lambda: drained == [0] or drained == [], "the hello read")
        drained.clear()
        dealer.send_now(None, [[contract.PUBLISH, 1]])
        dealer.send_now(None, [[contract.PUBLISH, 2]])  # both written before the router can read
        await until(lambda: len(at_router.batches) == 2, "both batches")
        await until(lambda: drained, "on_drained")
        assert drained == [2]  # once, after both
        dealer.send_now(None, [[contract.PUBLISH, 3]])
        await until(lambda: len(drained) == 2, "the next read")
        assert drained == [2, 3]
        dealer.close()
        router.close()

    run(scenario)
