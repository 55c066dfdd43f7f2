"""The shard's small durable key-value store (retained messages, MQTT session records) without a broker."""

from __future__ import annotations

import os

from shard.kvstore import KVStore


def test_puts_deletes_and_reopen(tmp_path):
    path = str(tmp_path / "kv" / "s.log")
    st = KVStore(path)
    st.put("a/b", [1, b"x"])
    st.put("c", {"subs": {"a/#": 2}, "in2": [3]})
    st.put("a/b", [0, b"y"])
    st.put("c", None)
    st.put("gone", None)  # deleting a missing key writes nothing
    st.close()
    again = KVStore(path)
    assert again.items == {"a/b": [0, b"y"]}
    assert again.records == 4
    again.close()


def test_a_torn_or_corrupt_tail_is_cut_and_the_rest_kept(tmp_path):
    path = str(tmp_path / "s.log")
    st = KVStore(path)
    st.put("k1", b"v1")
    st.put("k2", b"v2")
    st.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - 3)  # the last record torn
    st = KVStore(path)
    assert st.items == {"k1": b"v1"}
    st.put("k3", b"v3")  # appended after the cut, not after the torn bytes
    st.close()
    with open(path, "r+b") as fh:
        fh.seek(10)
        byte = fh.read(1)
        fh.seek(10)
        fh.write(bytes([byte[0] ^ 0xFF]))  # the first record corrupt: nothing after it is trusted
    assert KVStore(path).items == {}


def test_compaction_keeps_live_keys_only(tmp_path):
    path = str(tmp_path / "s.log")
    st = KVStore(path)
    for i in range(300):
        st.put("k", i)
        if st.wants_compaction:
            st.compact()
    st.put("other", "x")
    assert st.records < 70
    st.close()
    assert KVStore(path).items == {"k": 299, "other": "x"}


def test_writes_are_reported_to_the_write_observer_for_replication(tmp_path):
    from broker import write_observer

    class Recorder:
        def __init__(self) -> None:
            self.calls: list = []

        def append(self, path, offset, data):
            self.calls.append(("append", path, offset, data))

        def replace(self, path, data):
            self.calls.append(("replace", path, data))

        def delete(self, path):
            self.calls.append(("delete", path))

    rec = Recorder()
    path = str(tmp_path / "s.log")
    write_observer.subscribe(rec)
    try:
        st = KVStore(path)
        st.put("a", 1)
        st.put("b", 2)
        st.compact()
    finally:
        write_observer.subscribe(None)
    with open(path, "rb") as fh:
        on_disk = fh.read()
    created, first, second, replaced = rec.calls
    assert created == ("replace", path, b"")  # a new store's empty log reaches followers too
    assert first[:3] == ("append", path, 0) and second[:3] == ("append", path, len(first[3]))
    assert replaced == ("replace", path, on_disk)  # a follower applying these holds the same bytes
    st.close()
