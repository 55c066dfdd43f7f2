"""replication/sender.py: when frames go to the followers. Writes nobody waits for are sent within
FLUSH_DELAY_S (or at once when FLUSH_BYTES are pending); a caller of position() is about to wait
for the followers' acks, so everything pending is sent right then."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from replication import protocol as p
from replication import sender as smod


async def _frames_until(sock: socket.socket, dec: p.Decoder, pred, deadline_s: float = 5.0) -> list:
    loop = asyncio.get_running_loop()
    got: list = []
    end = time.monotonic() + deadline_s
    while not pred(got):
        left = end - time.monotonic()
        assert left > 0, f"timed out; got {[type(e).__name__ for e in got]}"
        data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), left)
        assert data, "sender closed the connection"
        got.extend(dec.feed(data))
    return got


def _appends(evs: list) -> list[p.Append]:
    return [e for e in evs if isinstance(e, p.Append)]


@contextlib.asynccontextmanager
async def _attached(root):
    """A sender for the queue dir ``q`` under root, attached to one end of a socket pair; yields the
    sender, the follower's end, its decoder and the first frames (the file listing)."""
    sender = smod.StreamSender(asyncio.get_running_loop(), str(root), "shard-0", lambda: ["q"])
    leader_end, follower_end = socket.socketpair()
    follower_end.setblocking(False)
    dec = p.Decoder()
    try:
        sender.attach_socket(leader_end, "f1")
        first = await _frames_until(follower_end, dec, lambda g: g)
        yield sender, follower_end, dec, first
    finally:
        sender.close()
        follower_end.close()


def test_flush_on_position_on_delay_and_on_size(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(smod, "FLUSH_DELAY_S", 0.05)
    root = tmp_path / "data"
    (root / "q").mkdir(parents=True)

    async def scenario() -> None:
        async with _attached(root) as (sender, follower_end, dec, first):
            (listing,) = first
            assert isinstance(listing, p.FileList)
            path = str(root / "q" / "msgs")

            # 1. A confirm is about to wait: position() sends what is pending, in this very call.
            sender.append(path, 0, b"a" * 100)
            sender.append(path, 100, b"b" * 100)  # contiguous: coalesced into one frame
            target = sender.position()
            evs = await _frames_until(follower_end, dec, lambda g: _appends(g))
            (a,) = _appends(evs)
            assert (a.path, a.offset, a.data) == ("q/msgs", 0, b"a" * 100 + b"b" * 100)
            assert target == sender.seq == a.size

            # 2. Nobody waits: the write still goes out, FLUSH_DELAY_S later.
            t0 = time.monotonic()
            sender.append(path, 200, b"c" * 10)
            evs = await _frames_until(follower_end, dec, lambda g: _appends(g))
            assert _appends(evs)[0].data == b"c" * 10
            assert time.monotonic() - t0 >= smod.FLUSH_DELAY_S * 0.9

            # 3. FLUSH_BYTES pending: sent on the next loop turn, without waiting for the delay.
            monkeypatch.setattr(smod, "FLUSH_DELAY_S", 30.0)
            big = b"d" * smod.FLUSH_BYTES
            sender.append(path, 210, big)
            evs = await _frames_until(follower_end, dec, lambda g: sum(len(x.data) for x in _appends(g)) >= len(big),
                                      deadline_s=5.0)
            assert b"".join(x.data for x in _appends(evs)) == big

    asyncio.run(scenario())


def test_appends_coalesce_per_run_and_keep_their_order_across_files(tmp_path) -> None:
    root = tmp_path / "data"
    (root / "q").mkdir(parents=True)

    async def scenario() -> None:
        async with _attached(root) as (sender, follower_end, dec, _first):
            msgs, acks = str(root / "q" / "msgs"), str(root / "q" / "acks")
            sender.append(msgs, 0, b"1")
            sender.append(msgs, 1, b"2")  # the same path object: the fast path
            sender.append(str(root / "q" / "msgs"), 2, b"3")  # an equal path, another object
            sender.append(acks, 0, b"a")  # another file: the run ends here
            sender.append(msgs, 3, b"4")  # a new run (after the acks, in that order)
            sender.append(msgs, 10, b"5")  # not contiguous: a new frame
            sender.position()
            evs = _appends(await _frames_until(follower_end, dec, lambda g: len(_appends(g)) >= 4))
            assert [(e.path, e.offset, e.data) for e in evs] == [
                ("q/msgs", 0, b"123"), ("q/acks", 0, b"a"), ("q/msgs", 3, b"4"), ("q/msgs", 10, b"5")]
            assert sender.seq == sum(e.size for e in evs)

    asyncio.run(scenario())


def test_heartbeats_go_to_idle_followers_that_announced_them_and_a_silent_one_is_dropped(tmp_path) -> None:
    """Three followers: one that announced heartbeats and sends its own, one that announced them and
    then falls silent (a hung process, a dead host), one of an older version (announced none). The
    first gets HEARTBEAT while the stream is idle and none while data flows; the silent one is
    dropped after the heartbeat timeout and no sooner; the old one gets no HEARTBEAT (it would not
    know the kind) and is never dropped for silence."""
    root = tmp_path / "data"
    (root / "q").mkdir(parents=True)
    hb, timeout = 0.2, 1.0

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sender = smod.StreamSender(loop, str(root), "shard-0", lambda: ["q"], heartbeat=hb, heartbeat_timeout=timeout)
        ends, decs, got = {}, {}, {}
        for name, announced in (("live", hb), ("silent", hb), ("old", 0.0)):
            leader_end, ends[name] = socket.socketpair()
            ends[name].setblocking(False)
            decs[name] = p.Decoder()
            sender.attach_socket(leader_end, name, announced)
            got[name] = await _frames_until(ends[name], decs[name], lambda g: g)
            assert isinstance(got[name][0], p.FileList)
        t_attached = time.monotonic()
        received: dict[str, list[tuple[float, object]]] = {n: [] for n in ends}
        closed: dict[str, float] = {}

        async def follower(name: str, answer: bool) -> None:
            next_beat = time.monotonic()
            while name not in closed:
                if answer and time.monotonic() >= next_beat:
                    await loop.sock_sendall(ends[name], p.encode_heartbeat())
                    next_beat += hb
                try:
                    data = await asyncio.wait_for(loop.sock_recv(ends[name], 1 << 16), 0.05)
                except TimeoutError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed[name] = time.monotonic()
                    return
                received[name].extend((time.monotonic(), ev) for ev in decs[name].feed(data))

        tasks = [loop.create_task(follower("live", True)), loop.create_task(follower("silent", False)),
                 loop.create_task(follower("old", False))]
        try:
            # Idle for a while: heartbeats to "live", the silent one dropped.
            deadline = time.monotonic() + 10
            while "silent" not in closed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert "silent" in closed, "the silent follower was never dropped"
            assert closed["silent"] - t_attached >= timeout * 0.9
            assert "silent" not in sender.links
            # Busy: a write every 50 ms, never a heartbeat in between.
            path = str(root / "q" / "msgs")
            writes = []
            for i in range(20):
                sender.append(path, i, b"x")
                writes.append(time.monotonic())
                await asyncio.sleep(0.05)
            # Idle again: heartbeats resume (waited for with a deadline).
            deadline = time.monotonic() + 10
            while (not any(t > writes[-1] and isinstance(ev, p.Heartbeat) for t, ev in received["live"])
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            attached = set(sender.links)
        finally:
            closed.update({n: time.monotonic() for n in ends})
            await asyncio.gather(*tasks, return_exceptions=True)
            sender.close()
            for end in ends.values():
                end.close()
        beats = {n: [t for t, ev in received[n] if isinstance(ev, p.Heartbeat)] for n in ends}
        assert len([t for t in beats["live"] if t < writes[0]]) >= 2, beats["live"]
        # While data flows nothing else is sent: a heartbeat only after a whole check period without a
        # write (this loop held up on a loaded machine), never more of them than such gaps.
        gaps = sum(b - a >= smod._CHECK_S for a, b in zip(writes, writes[1:], strict=False))
        busy = [t for t in beats["live"] if writes[0] + smod._CHECK_S < t < writes[-1]]
        assert len(busy) <= gaps, (busy, writes)
        assert [t for t in beats["live"] if t > writes[-1]], "no heartbeat once idle again"
        assert beats["old"] == [] and attached == {"live", "old"}
        assert sum(isinstance(ev, p.Append) for _t, ev in received["old"]) > 0

    asyncio.run(scenario())
