"""Durable persistence of the definitions in the data dir.

Two files, both JSON:

* ``definitions.json`` - a snapshot, ``Definitions.to_dict(durable_only=True)``:
  vhosts with their durable exchanges, queues and bindings, users,
  permissions. Written tmp + fsync + rename (+ fsync of the directory), so it
  is always either the old or the new one.
* ``definitions.log`` - ops applied since that snapshot, one JSON array per
  line, appended by :meth:`DefStore.record` (written to the file at once,
  unbuffered: a replication follower's full sync reads the file) and made
  durable by :meth:`DefStore.sync` (the node calls it from a worker thread,
  batched).

``load()`` reads the snapshot, replays the log (a torn last line, left by a
crash mid-append, is ignored), adds the default user when there is no user,
then compacts: writes a new snapshot and truncates the log. Transient
entities never reach the files: declares of non-durable exchanges/queues are
not recorded, and bindings whose ends are missing on replay are skipped by
``Definitions.apply``; exclusive queues are never durable, so at boot they are
gone. Queue shard placement is recomputed by the node (``rebalance``).

Non-JSON values in arguments (bytes that are not UTF-8) are stored as
``{"$bytes": base64}``.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from broker import temp_files, write_observer
from broker.definitions import Definitions
from broker.dirsync import fsync_dir

SNAPSHOT = "definitions.json"
LOG = "definitions.log"

_TRANSIENT_UNLESS_DURABLE = ("exchange.declare", "queue.declare")
_NOT_RECORDED = ("queue.shard",)


def _bytes_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _bytes_hook(d: dict) -> Any:
    if len(d) == 1 and "$bytes" in d:
        return base64.b64decode(d["$bytes"])
    return d


def _dumps(value: Any) -> str:
    # json calls the default only for what it cannot encode (bytes): no Python walk of 100,000
    # queue definitions before encoding them (bytes anywhere become {"$bytes": base64}).
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_bytes_default)


def _loads(text: str | bytes) -> Any:
    # {"$bytes": b64} back to bytes, in the parser's walk; a text without that key skips the hook, a
    # Python call per object (200,000 of them in the definitions of 100,000 queues).
    if ("$bytes" if isinstance(text, str) else b"$bytes") not in text:
        return json.loads(text)
    return json.loads(text, object_hook=_bytes_hook)


def is_durable_relevant(op: Sequence) -> bool:
    """Whether an op can change what survives a restart."""
    if op[0] in _NOT_RECORDED:
        return False
    if op[0] in _TRANSIENT_UNLESS_DURABLE:
        return bool(op[3].get("durable"))
    return True


def durable_ops(defs: Definitions, ops: Sequence[Sequence]) -> list[Sequence]:
    """The ops worth logging, judged against defs *before* they are applied.

    Beyond is_durable_relevant: a binding with a transient end, and the deletion of a transient
    queue or exchange, change nothing that survives a restart, so they are not logged (and their
    *-Ok does not wait for an fsync, as RabbitMQ keeps transient bindings in memory only). An end
    this batch itself declares is unknown yet: such ops are logged, which is always safe.
    """
    out = []
    for op in ops:
        kind = op[0]
        if kind in ("bind", "unbind"):
            src = defs.exchange(op[1], op[2])
            dst = defs.queue(op[1], op[4]) if op[3] == "queue" else defs.exchange(op[1], op[4])
            if src is not None and dst is not None and not (src.durable and dst.durable):
                continue
        elif kind == "queue.delete":
            q = defs.queue(op[1], op[2])
            if q is not None and not q.durable:
                continue
        elif kind == "exchange.delete":
            x = defs.exchange(op[1], op[2])
            if x is not None and not x.durable:
                continue
        if is_durable_relevant(op):
            out.append(op)
    return out


def write_json_atomic(path: str, value: Any) -> None:
    """Write JSON so that path holds either the old or the new content after a crash."""
    tmp = path + ".tmp"
    data = _dumps(value).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
    if write_observer.current is not None:
        write_observer.current.replace(os.path.abspath(path), data)


class DefStore:
    """The definitions files of one data dir. record() from the loop, sync() from a thread."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.snapshot_path = os.path.join(data_dir, SNAPSHOT)
        self.log_path = os.path.join(data_dir, LOG)
        self._log = None
        self._lock = threading.Lock()  # record() and sync() may run on different threads

    def load(self, default_user: str = "guest", default_pass: str = "guest") -> Definitions:
        """Read snapshot + log, add the default user if there is none, compact."""
        os.makedirs(self.data_dir, exist_ok=True)
        self.close()
        # A snapshot's temp file a process killed before its rename left (write_json_atomic): nothing
        # else writes it now (the node loads before anything records, a follower's stream is over).
        temp_files.remove(self.snapshot_path + ".tmp")
        had_snapshot = os.path.exists(self.snapshot_path)
        if had_snapshot:
            with open(self.snapshot_path, encoding="utf-8") as f:
                defs = Definitions.from_dict(_loads(f.read()))
        else:
            defs = Definitions()
        ops = self._read_log()
        for op in ops:
            defs.apply(op)
        if not defs.users:
            defs.apply_all(defs.default_user_ops(default_user, default_pass))
        elif had_snapshot and os.path.exists(self.log_path) and os.path.getsize(self.log_path) == 0:
            # Nothing happened since the last compaction (a clean restart): the snapshot is the
            # durable state as it stands; rewriting it would cost seconds at 100,000 queues.
            return defs
        write_json_atomic(self.snapshot_path, defs.to_dict(durable_only=True))
        with open(self.log_path, "w", encoding="utf-8") as f:
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.data_dir)
        if write_observer.current is not None:
            write_observer.current.replace(os.path.abspath(self.log_path), b"")
        # What the other processes get is the durable state: transient entities died with the old node.
        return Definitions.from_dict(defs.to_dict(durable_only=True))

    def _read_log(self) -> list[list]:
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path, "rb") as f:
            data = f.read()
        ops = []
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                ops.append(_loads(line))
            except (ValueError, UnicodeDecodeError):
                if i == len(lines) - 1:
                    break  # torn last append: the op was never acknowledged
                raise
        return ops

    def record(self, ops: Iterable[Sequence]) -> int:
        """Append the durable-relevant ops to the log (not yet synced). Returns how many."""
        lines = [_dumps(op) + "\n" for op in ops if is_durable_relevant(op)]
        if not lines:
            return 0
        data = "".join(lines).encode()
        with self._lock:
            if self._log is None:
                # Unbuffered: the bytes are in the file (the OS's page cache) before the write
                # observer hears of them. Replication relies on that: a follower's full sync lists
                # and reads the file itself, and the appends reported before it attached went to the
                # other followers only; bytes still in a Python buffer (written by the next sync, in
                # a thread) were missing from both, and the next append left a hole of zeros in the
                # follower's copy (a line _read_log refuses once it is promoted).
                self._log = open(self.log_path, "ab", buffering=0)
            offset = self._log.tell()
            view = memoryview(data)
            while view:
                view = view[self._log.write(view):]
        if write_observer.current is not None:
            write_observer.current.append(os.path.abspath(self.log_path), offset, data)
        return len(lines)

    def flush(self) -> None:
        """Hand what was recorded to the OS (survives this process being killed; not yet synced).
        record() does so already (see there); kept for the callers that say what they rely on."""

    def sync(self) -> None:
        """Make everything recorded so far durable."""
        with self._lock:
            f = self._log
            if f is None:
                return
            # fsync a duplicate outside the lock: record() on the loop must not wait for the disk,
            # and a concurrent close() must not pull the descriptor from under us.
            fd = os.dup(f.fileno())
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                os.fsync(self._log.fileno())
                self._log.close()
                self._log = None
