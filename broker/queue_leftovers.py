"""Where a deleted queue's directory may still be: a queue of the same name declared meanwhile goes there.

Every shard keeps a queue in `<data>/<sha1(vhost)>/<sha1(name)>/`, whichever shard it is on, and a
shard removes a deleted queue's directory later, by that path (its reaper thread,
shard/segment_dir.py; a shard that has not yet read the delete still uses it). A queue of the same
name declared on *another* shard meanwhile found the old directory there, took its files over (the
deleted queue's messages came back) and then lost its directory to the first shard's removal under
it (a live queue's `FileNotFoundError`, tests/test_queue_redeclare.py). Within one shard the order
holds: a shard applies definitions in order, and its `claim_path` takes a directory its reaper has
not moved yet over first.

So the node places such a declare on the shard of the deleted queue for as long as that shard may
still hold the directory: until the shard has applied the delete *and* the directory is gone from its
path. After that no process names it again, and placement is free.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable

from broker.datadir import name_hash

# Entries checked (and dropped once done) per delete recorded (one lstat, ~3 us of the node's CPU):
# with the node's periodic prune() the map holds the deletions whose directories are not gone yet,
# plus a few, not every queue ever deleted.
_CHECK_PER_DELETE = 1


class QueueLeftovers:
    """Deleted queues whose directory may still be on their shard: (vhost, name) -> (shard, version)."""

    def __init__(self, data_dir: str, applied: Callable[[int], int]) -> None:
        """applied(shard): the highest definitions version that shard has applied (-1: none yet,
        or not connected)."""
        self._data_dir = data_dir
        self._applied = applied
        # Oldest first. An OrderedDict, not a dict: prune takes the oldest entry and puts it back at the
        # end, and a dict's first entry after many such pops is found by skipping the freed slots
        # before it (next(iter(d)) scans them): with 30,000 deleted queues waiting for their directories'
        # removal that was 12-17 us per delete, 17 % of the node's CPU while deleting (docs/benchmarks.md
        # "A deleting connection's slices behind the pair's data").
        self._where: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def deleted(self, vhost: str, name: str, shard: int, version: int) -> None:
        """The delete of queue (vhost, name), on `shard`, is definitions version `version`."""
        key = (vhost, name)
        where = self._where
        if key in where:
            del where[key]  # to the end: the newest
        where[key] = (shard, version)
        self.prune(_CHECK_PER_DELETE)

    def shard_of(self, vhost: str, name: str) -> int | None:
        """The shard a queue (vhost, name) declared now must go to, or None (any)."""
        key = (vhost, name)
        entry = self._where.get(key)
        if entry is None:
            return None
        if self._held(key, entry):
            return entry[0]
        del self._where[key]
        return None

    def prune(self, budget: int) -> None:
        """Check up to `budget` of the oldest entries: drop those done, move the others to the end."""
        where = self._where
        for _ in range(min(budget, len(where))):
            key, entry = where.popitem(last=False)
            if self._held(key, entry):
                where[key] = entry

    def _held(self, key: tuple[str, str], entry: tuple[int, int]) -> bool:
        shard, version = entry
        if self._applied(shard) < version:
            return True  # the shard has not read the delete: it still uses the directory
        return os.path.lexists(os.path.join(self._data_dir, _vhost_hash(key[0]), name_hash(key[1])))


@functools.lru_cache(maxsize=64)
def _vhost_hash(vhost: str) -> str:
    return name_hash(vhost)  # a vhost delete checks thousands of queues of one vhost
