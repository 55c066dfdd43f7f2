"""Temporary files of the writers that write to a temp file and rename it over the real one.

Every such writer in the data dir names its temp file ``<path>.tmp`` (the definitions snapshot, a
segment's rewritten acks, delivery counts, stream offsets, KV log compaction, ``kv/placed-for``, a
damaged record's copy, a replication follower's rewrites) or ``<path>.tmp-<pid>`` (name files and the
idle index, which two shard processes may write at once). A process killed between the write and
the rename leaves the temp file behind: never data (nothing reads it), never replicated
(replication/files.py skips it), and removed by the writer's owner the next time it opens or lists
the place it lives in, so a crash loop cannot pile them up (docs/architecture.md, "Temp files").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger("shardmq.temp_files")

_PID_SUFFIX = ".tmp-"


def is_temp(name: str) -> bool:
    """Whether a file name is a writer's temp file (``*.tmp`` or ``*.tmp-<pid>``)."""
    if ".tmp" not in name:  # nearly every name a store's listing holds: one test (a boot lists 100,000)
        return False
    if name.endswith(".tmp"):
        return True
    at = name.rfind(_PID_SUFFIX)
    return at > 0 and name[at + len(_PID_SUFFIX):].isdigit()


def remove(path: str) -> bool:
    """Remove the temp file ``path`` if it is there (logged); whether it was."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.info("removed %s, a temporary file a killed writer left", path)
    return True


def remove_found(directory: str, name: str) -> bool:
    """Remove the temp file ``name`` that a listing of ``directory`` the caller made anyway found
    (logged); whether it did. Only where no writer of this directory can be between its write and
    its rename now (a store's recovery, a node's boot before its shards touch the directory)."""
    path = os.path.join(directory, name)
    try:
        os.unlink(path)
    except OSError:  # gone meanwhile, or a directory of that name: not ours to remove
        return False
    log.info("removed %s, a temporary file a killed writer left", path)
    return True


def remove_listed(directory: str, names: Iterable[str]) -> list[str]:
    """``remove_found`` for every temp file among ``names``; the names removed."""
    return [name for name in names if is_temp(name) and remove_found(directory, name)]
