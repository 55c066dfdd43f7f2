"""The write observer sees every write of the stores: replaying what it reports (through the wire
format and the follower's FileWriter) onto an empty directory rebuilds the same files."""

from __future__ import annotations

import os
import zlib

import pytest

from broker import write_observer
from broker.defstore import DefStore
from replication import protocol as p
from replication.files import FileWriter
from shard import delivery_counts
from shard.kvstore import KVStore
from shard.priority_store import open_store
from shard.store import QueueStore, queue_dir
from shard.stream_store import StreamStore


class Mirror:
    """A subscriber that sends each write through the protocol codec and applies it elsewhere."""

    def __init__(self, src: str, dst: str) -> None:
        self.src = src + os.sep
        self.writer = FileWriter(dst)
        self.decoder = p.Decoder()
        self.actions = 0

    def _apply(self, frame: bytes) -> None:
        (ev,) = self.decoder.feed(frame)
        self.actions += 1
        if isinstance(ev, p.Append):
            self.writer.write_at(ev.path, ev.offset, ev.data)
        elif isinstance(ev, p.Replace):
            self.writer.replace(ev.path, ev.data)
        else:
            self.writer.delete(ev.path)

    def rel(self, path: str) -> str:
        assert path.startswith(self.src), path
        return path[len(self.src):]

    def append(self, path, offset, data):
        self._apply(p.encode_append(self.rel(path), offset, bytes(data)))

    def replace(self, path, data):
        self._apply(p.encode_replace(self.rel(path), bytes(data)))

    def delete(self, path):
        self._apply(p.encode_delete(self.rel(path)))


def listing(root) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            if n.endswith(".tmp"):
                continue
            with open(os.path.join(dirpath, n), "rb") as f:
                data = f.read().rstrip(b"\0")  # a write segment is sparse: its used part counts
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (len(data), zlib.crc32(data))
    return out


@pytest.fixture
def mirror(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    m = Mirror(str(src), str(dst))
    write_observer.subscribe(m)
    yield m, str(src), str(dst)
    write_observer.subscribe(None)
    m.writer.close()


def test_queue_stream_priority_counts_and_definitions_are_mirrored(mirror):
    m, src, dst = mirror
    body = b"b" * 300
    q = QueueStore(queue_dir(src, "/", "q"), segment_size=4096)
    ids = [q.append(1, 1, "", "q", b"", body) for _ in range(40)]  # several sealed segments
    for _ in range(30):
        msg = q.shift()
        q.ack(msg[0])  # acks; whole segments dropped
    q.flush_acks()
    assert q.holds(ids[35])
    q.sync()

    s = StreamStore(queue_dir(src, "/", "s"), segment_size=4096, max_length=25)
    for i in range(60):  # rolls, smeta files, retention drops the oldest segments
        s.append(i, 1, "", "s", b"", body)
    s.track("ctag", 30)
    s._tracked_at = 0  # no rate limit for the test
    s.flush_acks()
    s.sync()  # writes the offsets file (in a sync thread in the shard; here inline)

    pq = open_store(queue_dir(src, "/", "prio"), {"x-max-priority": 5}, 4096)
    for _ in range(3):
        pq.append(1, 1, "", "prio", b"", body)  # no properties: priority 0, its level's directory
    pq.sync()

    delivery_counts.save(queue_dir(src, "/", "q"), {ids[31]: 2})
    q.add_marker(".expiring")

    gone = QueueStore(queue_dir(src, "/", "gone"), segment_size=4096)
    gone.append(1, 1, "", "gone", b"", body)
    gone.delete()

    os.makedirs(os.path.join(src, "kv", "v"), exist_ok=True)
    kv = KVStore(os.path.join(src, "kv", "v", "space.log"))
    for i in range(100):
        kv.put(f"k{i % 7}", {"n": i})  # appends
    kv.compact()  # a replace
    kv.put("after", 1)
    kv.close()

    ds = DefStore(src)
    defs = ds.load()
    ds.record(defs.default_user_ops("other", "pw"))
    ds.sync()
    ds.close()

    for store in (q, s, pq):
        store.close()
    assert m.actions > 50
    assert listing(dst) == listing(src)
    # The synced mark (what recovery tells damage from a torn tail by) is replicated like the data.
    assert os.path.relpath(os.path.join(queue_dir(src, "/", "q"), "synced"), src) in listing(dst)


def test_no_subscriber_costs_nothing_but_a_check(tmp_path):
    assert write_observer.current is None
    q = QueueStore(str(tmp_path / "q"), segment_size=4096)
    q.append(1, 1, "", "q", b"", b"x")  # no subscriber: nothing else to call
    q.close()
