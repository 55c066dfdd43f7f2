"""replication/follower.py: a shard stream that resyncs alone deletes the store directories it gave
the follower and the leader's shard no longer has, and only those (see StoreDirOwners)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from replication import protocol as p
from replication.follower import ReplicationFollower

V = "a" * 40


def _store(root: Path, name: str) -> str:
    rel = f"{V}/{name * 40}"
    (root / rel).mkdir(parents=True)
    (root / rel / "msgs.0000000001").write_bytes(b"x")
    return rel


def test_a_shard_stream_resyncing_alone_deletes_only_the_store_dirs_it_owned_that_the_leader_dropped(tmp_path):
    async def scenario() -> None:
        config = SimpleNamespace(replication_heartbeat=0, replication_heartbeat_timeout=0)
        f = ReplicationFollower(config, tmp_path, b"s", "n2", "127.0.0.1", 1)
        kept, dropped, moved, delayed = (_store(tmp_path, c) for c in "bcde")
        delay_rel = f"delayed/{V}/{'f' * 40}"
        (tmp_path / delay_rel).mkdir(parents=True)
        other = _store(tmp_path, "0")  # shard-0's all along
        s0 = f._receiver("shard-0")
        f._on_file_list(s0, p.FileList([other, "kv/x/y.log"], []))
        first = f._receiver("shard-1")
        f._on_file_list(first, p.FileList([kept, dropped, moved, delay_rel, "kv/x/y.log"], []))
        # A queue created on shard 1 after its file list: owned through its first write.
        first.writer.write_at(f"{delayed}/msgs.0000000001", 1, b"y")
        # A queue deleted on shard 1 and declared again on shard 0: shard 0 wrote to it since.
        s0.writer.write_at(f"{moved}/msgs.0000000002", 0, b"z")
        first.writer.close()
        # Shard 1 restarted; its stream reconnects alone and lists only `kept`.
        again = f._receiver("shard-1")
        f._on_file_list(again, p.FileList([kept], []))
        assert (tmp_path / kept).is_dir() and (tmp_path / other).is_dir()
        assert (tmp_path / moved / "msgs.0000000002").exists()
        assert not (tmp_path / dropped).exists()
        assert not (tmp_path / delayed).exists()
        assert not (tmp_path / delay_rel).exists()
        # A directory shard 1 deleted on the wire is no longer its own: listing again deletes nothing.
        again._apply(p.Decoder().feed(p.encode_delete(kept))[0])
        (tmp_path / kept).mkdir()
        f._on_file_list(f._receiver("shard-1"), p.FileList([], []))
        assert (tmp_path / kept).is_dir()
        for rec in f._receivers.values():
            rec.writer.close()
        s0.writer.close()

    asyncio.run(scenario())


def test_a_store_dir_declared_again_on_another_stream_drops_the_old_streams_late_actions_on_it(tmp_path):
    """Shard 0's queue deleted and declared again on shard 1 (the same directory): shard 1's first
    write removes shard 0's old files, and shard 0's late actions on it (writes, its DELETE) are
    dropped, not applied over the new queue. Shard 0 may declare it again once shard 1 deleted it."""
    async def scenario() -> None:
        config = SimpleNamespace(replication_heartbeat=0, replication_heartbeat_timeout=0)
        f = ReplicationFollower(config, tmp_path, b"s", "n2", "127.0.0.1", 1)
        d = f"{V}/{'b' * 40}"
        a, b = f._receiver("shard-0"), f._receiver("shard-1")
        f._on_file_list(a, p.FileList([], []))
        f._on_file_list(b, p.FileList([], []))
        a.writer.write_at(f"{d}/msgs.0000000001", 0, b"old" * 10)
        a.writer.write_at(f"{d}/msgs.0000000002", 0, b"old")
        b.writer.replace(f"{d}/.queue", b"q")
        b.writer.write_at(f"{d}/msgs.0000000001", 0, b"new")
        assert not (tmp_path / d / "msgs.0000000002").exists()  # the old queue's, removed
        assert (tmp_path / d / "msgs.0000000001").read_bytes() == b"new"  # not the old one's tail
        # Shard 0's late actions on the old queue: an append (on its open fd before), its DELETE.
        a.writer.write_at(f"{d}/msgs.0000000001", 30, b"late")
        a.writer.write_at(f"{d}/acks.0000000001", 0, b"late")
        a._apply(p.Decoder().feed(p.encode_delete(d))[0])
        assert (tmp_path / d / "msgs.0000000001").read_bytes() == b"new"
        assert (tmp_path / d / ".queue").read_bytes() == b"q"
        assert not (tmp_path / d / "acks.0000000001").exists()
        assert f.owners.owner(d) == "shard-1"
        # Shard 1 deletes it; shard 0 declares it again: its writes apply again.
        b._apply(p.Decoder().feed(p.encode_delete(d))[0])
        assert not (tmp_path / d).exists()
        a.writer.write_at(f"{d}/msgs.0000000001", 0, b"again")
        assert (tmp_path / d / "msgs.0000000001").read_bytes() == b"again"
        assert f.owners.owner(d) == "shard-0"
        for rec in (a, b):
            rec.writer.close()

    asyncio.run(scenario())
