"""Small durable key-value stores on a shard: MQTT retained messages and persistent-session state.

One store per (vhost, space) and shard, in ``<data>/kv/<sha1(vhost)>/<sha1(space)>.shard-N.log``
(broker/kv_log.py): an append-only log of ``[u32 length][u32 crc32][msgpack [key, value]]``
records (value None deletes the key), written by shard N alone: the shards that keep keys
of one store (session records are placed per client id) each have their own log. Loading replays the log and stops at the first torn or corrupt
record (and cuts the file there), as the queue segments do. The log is rewritten
(tmp, fsync, rename) once it holds three times more records than live keys.

Which shard keeps a key is the frontend's choice (frontend/mqtt/messages.py); when the shard
count changes, the node moves the keys to the logs of their new shards at boot, before any
shard opens a log (broker/kv_layout.py). A put is answered (REPLY_DATA) once it is
fsynced; puts arriving while a sync runs go with the next one (one fsync per store
per round, never per put). Rates are those of retained messages and QoS 2 handshakes,
not the publish path, so values are kept in memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker import contract, temp_files, write_observer
from broker.fsync_beacon import stall_for_tests
from broker.kv_log import encode, log_path, read_log, replay

if TYPE_CHECKING:
    from broker.fsync_beacon import FsyncBeacon
    from shard.replication_stream import ShardReplication

log = logging.getLogger("shardmq.shard")


class KVStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self.items: dict[str, Any] = {}
        self.records = 0
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # A compaction's temp file a killed shard left (compact): this shard alone writes it.
        temp_files.remove(path + ".tmp")
        good, data = self._load()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if write_observer.current is not None:
            # The followers get the log as it is now: a store opened only to read (is_marked, an
            # UNMARK of nothing) creates an empty log, which nothing appended would announce; and a
            # shard restarted after a crash may open a log whose last records its dead predecessor
            # wrote and never got acked: a follower that has a shorter copy would get the next
            # appends after a hole (read back as a torn record: the records after it lost). Once
            # per store and shard life; the stream's file list covers the stores open when it starts.
            write_observer.current.replace(path, data[:good])
        if os.fstat(self.fd).st_size != good:
            os.ftruncate(self.fd, good)  # a torn tail from a crash
        os.lseek(self.fd, good, os.SEEK_SET)

    def _load(self) -> tuple[int, bytes]:
        """The size of the valid records (what follows is a torn tail) and the file's bytes."""
        records, good, data = read_log(self.path)
        if good != len(data):
            log.warning("kv store %s: stopping at a torn or corrupt record at offset %d", self.path, good)
        replay(records, self.items)
        self.records = len(records)
        return good, data

    def put(self, key: str, value: Any) -> None:
        if value is None:
            if key not in self.items:
                return
            self.items.pop(key, None)
        else:
            self.items[key] = value
        data = encode(key, value)
        os.write(self.fd, data)
        self.records += 1
        if write_observer.current is not None:
            write_observer.current.append(self.path, os.lseek(self.fd, 0, os.SEEK_CUR) - len(data), data)

    @property
    def wants_compaction(self) -> bool:
        return self.records > 3 * len(self.items) + 64

    def compact(self) -> None:
        """Rewrite the log with the live keys only. Not while a sync of this fd runs (KVStores sees to it)."""
        tmp = self.path + ".tmp"
        data = b"".join(encode(key, value) for key, value in self.items.items())
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        if write_observer.current is not None:
            write_observer.current.replace(self.path, data)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.records = len(self.items)

    def close(self) -> None:
        os.close(self.fd)


class KVShard(Protocol):
    """What the stores use of the shard that opened them (shard/worker.py ShardWorker)."""

    index: int
    settings: dict
    loop: asyncio.AbstractEventLoop
    data: Any  # its data socket: put(identity, item)
    fsync_beacon: FsyncBeacon
    repl: ShardReplication | None  # a cluster leader's: confirms also wait for the followers


class KVStores:
    """The stores a shard has opened, and their batched fsync."""

    def __init__(self, worker: KVShard) -> None:
        self.worker = worker
        self.stores: dict[tuple[str, str], KVStore] = {}
        self._dirty: set[KVStore] = set()
        self._waiting: list = []  # (fe, req_id) to answer, or then(ok) to call, after the running round
        self._syncing = False

    def store(self, vhost: str, space: str) -> KVStore:
        st = self.stores.get((vhost, space))
        if st is None:
            # This shard's own log of the store: no other process writes it (broker/kv_log.py).
            path = log_path(self.worker.settings["data_dir"], vhost, space, self.worker.index)
            st = self.stores[(vhost, space)] = KVStore(path)
        return st

    def handle_put(self, fe: bytes, item: list) -> None:
        """[KV_PUT, req_id|None, vhost, space, key, value|None]"""
        _, req_id, vhost, space, key, value = item
        st = self.store(vhost, space)
        st.put(key, value)
        self._written(st, fe, req_id)

    def mark(self, vhost: str, space: str, key: str, mark: Any, fe: bytes | None = None,
             req_id: int | None = None, then: Callable[[bool], None] | None = None) -> bool:
        """Add mark to key's list of marks (MARKED_PUBLISH); False when it was there already.

        Written (os.write) now, so a kill -9 after this returns keeps it; synced with the next round,
        after which req_id is answered and ``then(ok)`` called.
        """
        st = self.store(vhost, space)
        marks = st.items.get(key)
        if marks is not None and mark in marks:
            self._written(st, fe, req_id, then)
            return False
        st.put(key, [*(marks or ()), mark])
        self._written(st, fe, req_id, then)
        return True

    def sync_then(self, vhost: str, space: str, then: Callable[[bool], None] | None) -> None:
        """Call ``then(ok)`` once what the store holds now is durable (it syncs in the next round, written
        since or not: what an earlier round is still syncing must not count as durable yet)."""
        self._written(self.store(vhost, space), None, None, then)

    def is_marked(self, vhost: str, space: str, key: str, mark: Any) -> bool:
        marks = self.store(vhost, space).items.get(key)
        return marks is not None and mark in marks

    def handle_unmark(self, fe: bytes, item: list) -> None:
        """[UNMARK, req_id|None, vhost, space, key, mark|None]"""
        _, req_id, vhost, space, key, mark = item
        st = self.store(vhost, space)
        marks = st.items.get(key)
        if marks is not None and (mark is None or mark in marks):
            rest = [] if mark is None else [m for m in marks if m != mark]
            st.put(key, rest or None)
        self._written(st, fe, req_id)

    def _written(self, st: KVStore, fe: bytes | None, req_id: int | None,
                 then: Callable[[bool], None] | None = None) -> None:
        if st.wants_compaction and not self._syncing:
            # Small stores (retained messages, session records): the rewrite's fsync is short, and a
            # sync thread never holds this fd at the same time.
            st.compact()
        self._dirty.add(st)
        if req_id is not None:
            self._waiting.append((fe, req_id))
        if then is not None:
            self._waiting.append(then)
        self._start_sync()

    def handle_get(self, fe: bytes, item: list) -> None:
        """[KV_GET, req_id, vhost, space, key|None] -> REPLY_DATA {"items": [[key, value], ...]}"""
        _, req_id, vhost, space, key = item
        items = self.store(vhost, space).items
        if key is None:
            found = [[k, v] for k, v in items.items()]
        else:
            found = [[key, items[key]]] if key in items else []
        self.worker.data.put(fe, [contract.REPLY_DATA, req_id, True, {"items": found}])

    def _start_sync(self) -> None:
        if self._syncing or not self._dirty:
            return
        self._syncing = True
        fds = [st.fd for st in self._dirty]
        waiting = self._waiting
        self._dirty = set()
        self._waiting = []
        # In a cluster the replies also wait for the ISR followers (as publish confirms do).
        repl = self.worker.repl
        target = repl.position() if waiting and repl is not None and repl.gating else -1
        # The node's fence watchdog sees a KV fsync that does not return, as it sees a group sync's.
        self.worker.fsync_beacon.started("kv")
        fut = self.worker.loop.run_in_executor(None, _fsync_all, fds, True)
        fut.add_done_callback(lambda f: self._synced(f, waiting, target))

    def _synced(self, fut: asyncio.Future, waiting: list, target: int = -1) -> None:
        self._syncing = False
        self.worker.fsync_beacon.done("kv")
        for st in self.stores.values():
            if st.wants_compaction:
                st.compact()
        exc = fut.exception()
        repl = self.worker.repl
        if exc is None and target >= 0 and waiting and repl is not None:
            repl.when_replicated(target, lambda ok: self._reply(waiting, None if ok else "too few in-sync followers"))
        else:
            self._reply(waiting, None if exc is None else f"kv sync failed: {exc}")
        self._start_sync()

    def _reply(self, waiting: list, error: str | None) -> None:
        put = self.worker.data.put
        for waiter in waiting:
            if callable(waiter):  # then(ok) of mark / sync_then
                try:
                    waiter(error is None)
                except Exception:
                    log.exception("kv store: a sync callback failed")
                continue
            fe, req_id = waiter
            if error is None:
                put(fe, [contract.REPLY_DATA, req_id, True, {}])
            else:
                put(fe, [contract.REPLY_DATA, req_id, False, [541, f"INTERNAL_ERROR - {error}", 0, 0]])

    def close(self) -> None:
        fds = [st.fd for st in self.stores.values()]
        _fsync_all(fds)
        for st in self.stores.values():
            st.close()
        self.stores.clear()


def _fsync_all(fds: list[int], stall: bool = False) -> None:
    if stall:
        stall_for_tests("kv")
    for fd in fds:
        os.fsync(fd)
