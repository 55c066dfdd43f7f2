"""replication/receiver.py: durability batches overlap, but acks only name positions whose every
earlier batch is durable (a follower must never ack bytes it could still lose)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from replication import protocol as p
from replication import receiver as rmod
from replication.files import CrcCache, make_durable
from tests.harness import async_wait_until


class _AckSink:
    """Stands in for the stream's socket writer: collects the acks the receiver sends."""

    def __init__(self) -> None:
        self.acks: list[p.Ack] = []
        self._dec = p.Decoder()

    def write(self, data: bytes) -> None:
        self.acks.extend(self._dec.feed(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_overlapping_syncs_ack_in_order_and_only_what_is_durable(tmp_path, monkeypatch) -> None:
    gates: list[threading.Event] = []
    lock = threading.Lock()

    def gated_make_durable(fds: list[int], dirs: list[str]) -> None:
        gate = threading.Event()
        with lock:
            gates.append(gate)
        assert gate.wait(10)
        make_durable(fds, dirs)  # the real one, once the test lets this batch finish

    monkeypatch.setattr(rmod, "make_durable", gated_make_durable)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        rec = rmod.StreamReceiver(str(tmp_path), b"s", "f", "shard-0", CrcCache())
        sink = _AckSink()
        rec._writer_w = sink  # type: ignore[assignment]
        rec.sync_done = True  # streaming (the full sync is behind us)
        rec.synced = True

        async def until(pred, what: str) -> None:
            await async_wait_until(pred, 5, what)

        def append(offset: int, data: bytes) -> int:
            frame = p.encode_append("q/msgs.0000000001", offset, data)
            (ev,) = p.Decoder().feed(frame)
            rec._apply(ev)
            rec._maybe_sync(loop)
            return rec.position

        (tmp_path / "q").mkdir()
        first = append(0, b"a" * 100)
        second = append(100, b"b" * 100)
        third = append(200, b"c" * 100)  # two batches in flight already: waits for one to end
        await until(lambda: len(gates) == 2, "two syncs in flight")
        assert rec.acked == 0 and sink.acks == []

        # The second batch is durable first: nothing may be acked before the first. Callbacks run in
        # the order they were added: once ours has, the receiver's own (_synced) has run too.
        second_done = asyncio.Event()
        rec._inflight[1][0].add_done_callback(lambda _f: second_done.set())
        gates[1].set()
        await asyncio.wait_for(second_done.wait(), 10)
        assert sink.acks == [] and rec.acked == 0

        gates[0].set()  # now both: one ack for the newer position
        await until(lambda: sink.acks, "the ack of the first two batches")
        assert sink.acks[0].position == second > first
        await until(lambda: len(gates) == 3, "the third batch's sync")
        gates[2].set()
        await until(lambda: rec.acked == third, "the third ack")
        assert [a.position for a in sink.acks] == [second, third]
        with open(tmp_path / "q" / "msgs.0000000001", "rb") as f:
            assert f.read() == b"a" * 100 + b"b" * 100 + b"c" * 100
        rec.writer.close()

    asyncio.run(scenario())


def test_make_durable_with_several_files_syncs_and_closes_them(tmp_path) -> None:
    fds = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644) for i in range(3)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]) * 5000)
    make_durable(fds, [str(tmp_path)])
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError("make_durable left an fd open")
    assert [(tmp_path / f"f{i}").read_bytes() for i in range(3)] == [bytes([i]) * 5000 for i in range(3)]


def _fake_leader(secret: bytes, heartbeat: float, received: list):
    """A leader that shakes hands (announcing ``heartbeat``, 0 = as a node without heartbeats does),
    lists no files and then says nothing; what the follower sends lands in ``received``."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = p.Decoder()
        pending: list = []

        async def next_event():
            while not pending:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed")
                pending.extend(dec.feed(data))
            return pending.pop(0)
        try:
            hello = await next_event()
            nonce_l = p.new_nonce()
            writer.write(p.encode_challenge(nonce_l, p.leader_proof(secret, hello.stream, hello.nonce, nonce_l),
                                            heartbeat))
            await next_event()  # AUTH
            writer.write(p.encode_welcome(["node"], "old") + p.encode_file_list([], []))
            received.append(hello)
            while True:
                received.append(await next_event())
        except ConnectionError:
            pass
        finally:
            writer.close()
    return serve


def test_a_silent_leader_that_announced_heartbeats_times_out_and_an_older_one_never_does(tmp_path) -> None:
    """Against a leader that announced heartbeats and then sends nothing (hung, or the network path
    gone), the receiver sends its own heartbeats and ends the stream with HeartbeatTimeout after the
    timeout. Against a leader of a version without heartbeats (no "hb" in its CHALLENGE) it sends
    none (that leader would not know the frame) and never times out: replication works as before."""
    secret = b"s"
    hb, timeout = 0.1, 0.5

    async def scenario(leader_hb: float) -> tuple[list, BaseException | None, float]:
        received: list = []
        server = await asyncio.start_server(_fake_leader(secret, leader_hb, received), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        rec = rmod.StreamReceiver(str(tmp_path), secret, "n2", "node", CrcCache(), 5.0, hb, timeout)
        t0 = time.monotonic()
        task = asyncio.get_running_loop().create_task(rec.run("127.0.0.1", port))
        done, _ = await asyncio.wait([task], timeout=4 * timeout)
        elapsed = time.monotonic() - t0
        if not done:
            task.cancel()
        error = None
        try:
            await task
        except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - returned to the test
            error = exc
        server.close()
        await server.wait_closed()
        return received, error, elapsed

    received, error, elapsed = asyncio.run(scenario(hb))
    assert isinstance(error, rmod.HeartbeatTimeout), error
    assert "nothing from old on stream node for" in str(error)
    assert timeout * 0.9 <= elapsed < 4 * timeout
    assert received[0].heartbeat == hb  # announced in HELLO
    assert sum(isinstance(ev, p.Heartbeat) for ev in received) >= 2, received

    received, error, _elapsed = asyncio.run(scenario(0.0))
    assert isinstance(error, asyncio.CancelledError), error  # still running after 4 timeouts
    assert isinstance(received[1], p.FileRequest)
    assert not any(isinstance(ev, p.Heartbeat) for ev in received), received


def test_a_full_sync_rewrites_a_file_over_the_old_copy_never_shorter_until_its_last_chunk(tmp_path) -> None:
    """A follower's copy of a grown write segment is a prefix of the leader's (confirmed records):
    while the whole file comes again in chunks it must keep them. Emptied at the first chunk (as it
    was), a follower promoted in the middle (the leader gone while etcd still had it in the ISR) lost
    them."""
    mib = 1 << 20
    old = bytes(range(256)) * (3 * mib // 256)  # acked on an earlier connection
    new = old + b"n" * mib
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "msgs").write_bytes(old + b"torn")  # and an unacked tail the leader cut
    rec = rmod.StreamReceiver(str(tmp_path), b"s", "f", "shard-0", CrcCache())

    def chunk(offset: int, total: int, data: bytes) -> None:
        (ev,) = p.Decoder().feed(p.encode_file_data("q/msgs", offset, total, data))
        rec._apply(ev)

    for off in range(0, len(new), mib):
        chunk(off, len(new), new[off:off + mib])
        on_disk = (tmp_path / "q" / "msgs").read_bytes()
        if off + mib < len(new):
            assert on_disk[:len(old)] == old  # every confirmed record still there
    assert (tmp_path / "q" / "msgs").read_bytes() == new
    # Shorter on the leader (its recovery cut a torn tail): cut at the last chunk.
    chunk(0, 2 * mib, new[:mib])
    assert len((tmp_path / "q" / "msgs").read_bytes()) == len(new)
    chunk(mib, 2 * mib, new[mib:2 * mib])
    assert (tmp_path / "q" / "msgs").read_bytes() == new[:2 * mib]
    chunk(0, 0, b"")  # an empty file
    assert (tmp_path / "q" / "msgs").read_bytes() == b""
    rec.writer.close()


def test_a_full_sync_of_a_rewritten_file_leaves_the_old_copy_whole_until_its_last_chunk(tmp_path) -> None:
    """A file the leader rewrote (definitions.json, a meta file, a compacted acks file or KV log):
    the chunks that differ from the follower's copy go to a temporary file renamed over it at the
    last chunk. Written over the copy in place, a follower promoted or restarted in between read
    a file half new and half old (a snapshot that does not parse, ack positions of two files)."""
    mib = 1 << 20
    old = b"o" * (3 * mib)
    new = b"o" * mib + b"N" * mib + b"n" * (mib // 2)  # the same first chunk, then different, shorter
    path = tmp_path / "definitions.json"
    path.write_bytes(old)
    rec = rmod.StreamReceiver(str(tmp_path), b"s", "f", "node", CrcCache())

    def chunk(offset: int, data: bytes) -> None:
        (ev,) = p.Decoder().feed(p.encode_file_data("definitions.json", offset, len(new), data))
        rec._apply(ev)

    chunk(0, new[:mib])
    assert path.read_bytes() == old
    chunk(mib, new[mib:2 * mib])
    assert path.read_bytes() == old  # the old copy whole (a promotion now reads it, not a mix)
    chunk(2 * mib, new[2 * mib:])
    assert path.read_bytes() == new
    assert not (tmp_path / "definitions.json.tmp").exists()
    # The writer's fd is the new file's: an append after the full sync lands in it.
    rec.writer.write_at("definitions.json", len(new), b"+")
    assert path.read_bytes() == new + b"+"
    fds, dirs = rec.writer.take_dirty()
    assert str(tmp_path) in dirs  # the rename is made durable with the batch
    make_durable(fds, dirs)

    # A transfer cut short (the connection ends): the copy stays as it was, no temporary file left.
    chunk(0, b"x" * mib)
    chunk(mib, b"y" * mib)
    rec.writer.close()
    assert path.read_bytes() == new + b"+"
    assert not (tmp_path / "definitions.json.tmp").exists()
