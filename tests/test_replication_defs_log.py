"""The node stream's definitions.log reaches a follower whole, whenever the follower attaches.

A full sync relies on what the write observer reports being in the file already: the file list
(made when the follower attaches) and the file data (read when sent) come from the file, the
appends reported before the attach go to the followers attached then only, and a file's last chunk
cuts the follower's copy at the leader's size. ``DefStore.record`` reported an append that still
sat in its Python buffer (written to the file by the next sync, in a worker thread): a follower
attached in between never got those bytes, and the next append left a hole of zeros in its copy,
a line ``DefStore._read_log`` refused when the follower was promoted (UnicodeDecodeError, seen in
test_cluster_shard_restart's kill -9 of the leader)."""

from __future__ import annotations

import asyncio
import socket
import time

from broker.definitions import Definitions
from broker.defstore import LOG, DefStore
from replication import protocol as p
from replication import sender as smod
from replication.files import CrcCache, FileWriter

V = "/"


def _declare(store: DefStore, defs: Definitions, name: str) -> None:
    """What the node does on a durable queue.declare, up to the sync it starts in a worker thread
    (not run here: the window in which the follower attaches)."""
    ops, _ = defs.plan_queue_declare(V, name, False, True, False, False, {}, None, 2)
    defs.apply_all(ops)
    assert store.record(ops)


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


def _apply(writer: FileWriter, evs: list) -> None:
    """What the follower's receiver does with these events (replication/receiver.py _apply)."""
    for ev in evs:
        if isinstance(ev, p.Append):
            writer.write_at(ev.path, ev.offset, ev.data)
        elif isinstance(ev, p.Replace):
            writer.replace(ev.path, ev.data)
        elif isinstance(ev, p.FileData):
            if ev.total < 0:
                writer.delete(ev.path)
            else:
                writer.write_chunk(ev.path, ev.offset, ev.data, ev.total)


def _full_sync_then_declare(tmp_path, *, before_attach: list[str], before_request: list[str],
                            follower_log: bytes = b"") -> None:
    """The leader declares ``before_attach`` queues, a follower attaches (file list), the leader
    declares ``before_request``, the follower asks for the files that differ, and after its sync the
    leader declares one more: the follower's copy must load with every queue and equal the leader's."""
    lroot, froot = tmp_path / "leader", tmp_path / "follower"
    lstore = DefStore(str(lroot))
    defs = lstore.load()
    DefStore(str(froot)).load()  # the follower's own boot: an empty, compacted log ...
    (froot / LOG).write_bytes(follower_log)  # ... or what an earlier leader's stream left there

    async def scenario() -> None:
        sender = smod.StreamSender(asyncio.get_running_loop(), str(lroot), "node", lambda: None)
        leader_end, follower_end = socket.socketpair()
        follower_end.setblocking(False)
        dec = p.Decoder()
        writer = FileWriter(str(froot))
        try:
            for name in before_attach:
                _declare(lstore, defs, name)
            sender.attach_socket(leader_end, "f1")
            (listing,) = await _frames_until(follower_end, dec, lambda g: g)
            assert isinstance(listing, p.FileList)
            for name in before_request:
                _declare(lstore, defs, name)
            sender.position()
            # The follower's side of the full sync (replication/receiver.py _compare): what differs.
            theirs = {path: (size, crc) for path, size, crc in listing.files}
            local = {path: (size, crc) for path, size, crc in CrcCache().listing(str(froot), list(theirs))}
            wanted = [path for path, want in theirs.items() if local.get(path) != want]
            follower_end.sendall(p.encode_file_request(wanted))
            evs = await _frames_until(follower_end, dec, lambda g: any(isinstance(e, p.SyncDone) for e in g))
            _apply(writer, evs)
            _declare(lstore, defs, "after-sync")
            sender.position()
            evs = await _frames_until(follower_end, dec, lambda g: any(isinstance(e, p.Append) for e in g))
            _apply(writer, evs)
        finally:
            writer.close()
            sender.close()
            follower_end.close()

    asyncio.run(scenario())
    lstore.sync()
    lstore.close()
    assert (froot / LOG).read_bytes() == (lroot / LOG).read_bytes()
    promoted = DefStore(str(froot)).load()
    assert set(promoted.vhosts[V].queues) == {*before_attach, *before_request, "after-sync"}


def test_ops_recorded_before_a_follower_attaches_are_in_its_file_list(tmp_path) -> None:
    # Failed before the fix: the list said 0 bytes (the follower's empty copy matched), the
    # follower never got the first declare and its copy started with that many zeros.
    _full_sync_then_declare(tmp_path, before_attach=["q0", "q1"], before_request=[])


def test_ops_recorded_between_the_file_list_and_the_file_data_are_not_cut(tmp_path) -> None:
    # The follower's old copy differs, so definitions.log is sent whole; the declare made after the
    # list went out as an append first, then the file's last chunk cut the copy at the size the
    # file had on disk, without it (failed before the fix too).
    _full_sync_then_declare(tmp_path, before_attach=[], before_request=["q1"],
                            follower_log=b'["vhost.put","from-an-earlier-leader"]\n')
