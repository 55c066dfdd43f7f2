"""One narrow interface through which every store reports its file writes (for replication).

A store that appends to, replaces or deletes a file in the data dir reports it here, after the
write, with the absolute path. The replication sender of the process subscribes; with no
subscriber (a standalone node, a follower) the cost on the hot path is one attribute load and a
``None`` check. Stores call ``write_observer.current`` directly for that reason.

Offsets are byte offsets of the written region in the file as a reader sees it (a sparse mmap'd
segment's logical content), so a follower can apply an append idempotently with ``pwrite``.
Calls may come from a store's sync thread (e.g. a stream's tracked offsets), so a subscriber
must accept calls from any thread.
"""

from __future__ import annotations

from typing import Protocol


class WriteObserver(Protocol):
    def append(self, path: str, offset: int, data: bytes) -> None:
        """``data`` was written at ``offset`` of ``path`` (created if it was missing)."""

    def replace(self, path: str, data: bytes) -> None:
        """``path`` now holds exactly ``data`` (written whole, or tmp + rename)."""

    def delete(self, path: str) -> None:
        """``path`` (a file, or a directory with everything under it) was removed."""


current: WriteObserver | None = None


def subscribe(observer: WriteObserver | None) -> None:
    """Make ``observer`` receive this process's writes (None: no one; at most one subscriber)."""
    global current
    current = observer
