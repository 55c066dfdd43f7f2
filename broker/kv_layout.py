"""Put every key of the shards' key-value logs in the log of the shard that owns it, at node boot.

Each shard writes only its own log per (vhost, space) (broker/kv_log.py). The node calls
``place_logs`` after loading the definitions and before any shard opens a log, and rewrites a
vhost's logs when they are not placed for this shard count:

* a log of the old shared layout (``<sha1(space)>.log``, one per vhost and space, which every
  shard appended at its own offset: records of one shard overwrote another's): read up to its
  first torn or corrupt record, once; what follows is lost and the WARNING says how many bytes.
  When per-shard logs are there too, the old log is a leftover (a follower's copy of a data dir
  placed since) and is dropped unread.
* a log of a shard this node no longer has (``--shards`` went down), or a key in a log of a shard
  that does not own it (``--shards`` changed): moved to its owner's log, as queues are placed
  again at boot (docs/storage.md "Another shard count").

A key whose ``owner`` is None stays in the log it is in (QoS 2 marks of inbound publishes belong
to the shard that stored the message, whatever the key); one left in a log no shard will write
is dropped and counted in the WARNING. Keys of an unknown space and vhosts the definitions do
not have are left as they are.

The shard count they were placed for is kept in ``kv/placed-for``: with the same count at the next
boot only the file names are checked, not every key.

A vhost's logs are written whole into ``<sha1(vhost)>.new/``, fsynced, then swapped in by
rename (the old directory renamed ``.old`` first and removed last); a boot after a crash in
between finishes or drops the swap, so a key is in one place at every step.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

from broker import temp_files
from broker.datadir import name_hash
from broker.dirsync import fsync_dir
from broker.kv_log import KV_DIR, encode, parse_name, read_log, replay

log = logging.getLogger("shardmq.kv")

# kv/placed-for: the shard count the logs were last placed for.
PLACED_FOR = "placed-for"

# (vhost, space, key) -> the owning shard, or None: the key stays in the log it is in.
Owner = Callable[[str, str, str], "int | None"]


# Tests only: while the file this names exists, hold_for_tests() blocks (the node's placement thread
# calls it first), so a test can see what the node does while a placement is under way.
HOLD_ENV = "SHARDMQ_TEST_HOLD_KV_PLACEMENT_WHILE"


def hold_for_tests() -> None:
    """Block while the file $SHARDMQ_TEST_HOLD_KV_PLACEMENT_WHILE exists (tests only; unset: nothing)."""
    path = os.environ.get(HOLD_ENV)
    while path and os.path.exists(path):
        time.sleep(0.02)


def place_logs(data_dir: str, shard_count: int, vhosts: Iterable[str], spaces: Iterable[str],
               owner: Owner) -> int:
    """Place the logs of every vhost for ``shard_count`` shards; the number of vhosts rewritten."""
    root = os.path.join(data_dir, KV_DIR)
    if not os.path.isdir(root):
        return 0
    _finish_swaps(root)
    names = {name_hash(v): v for v in vhosts}
    space_names = {name_hash(s): s for s in spaces}
    # Placed for this count at the last boot: each shard writes only keys it owns, so only the file names
    # can be wrong (a log of the old layout copied in). Saves reading every log at each boot (100,000
    # session records: about a second) and at each promotion.
    same_count = _placed_for(root) == shard_count
    rewritten = 0
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        vhost = names.get(entry.name)
        if vhost is None or not entry.is_dir():
            continue
        logs = _logs_of(entry.path)
        if _placed(entry.path, logs, vhost, space_names, shard_count, None if same_count else owner):
            continue
        _rewrite(entry.path, logs, vhost, space_names, shard_count, owner)
        rewritten += 1
    if not same_count:
        _write_placed_for(root, shard_count)
    return rewritten


def _placed_for(root: str) -> int | None:
    try:
        with open(os.path.join(root, PLACED_FOR)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _write_placed_for(root: str, shard_count: int) -> None:
    tmp = os.path.join(root, PLACED_FOR + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(f"{shard_count}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(root, PLACED_FOR))
    fsync_dir(root)


def _finish_swaps(root: str) -> None:
    """Complete or drop a swap a crash interrupted (see the module doc)."""
    # .new first: a live directory it finds means the swap never began, else it completes the swap;
    # an .old left after that goes if its live directory is there.
    temp_files.remove_listed(root, os.listdir(root))  # placed-for.tmp of a killed boot
    for wanted in ("new", "old"):
        for name in sorted(os.listdir(root)):
            base, dot, suffix = name.rpartition(".")
            if not dot or suffix != wanted:
                continue
            path, live = os.path.join(root, name), os.path.join(root, base)
            if os.path.exists(live):
                shutil.rmtree(path)  # .new: the live directory was not renamed yet, it is the whole truth
            else:
                # .new: renamed away, the new logs were complete, only their rename was left;
                # .old: not reached by the swap's order; keep the data rather than guess
                os.replace(path, live)


def _logs_of(vdir: str) -> dict[str, dict[int | None, str]]:
    """sha1(space) -> {shard index (None: old shared log): file name}."""
    out: dict[str, dict[int | None, str]] = {}
    for name in os.listdir(vdir):
        parsed = parse_name(name)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = name
        elif temp_files.is_temp(name):  # a log compaction a killed shard left (no shard has a log open now)
            temp_files.remove_found(vdir, name)
    return out


def _placed(vdir: str, logs: dict, vhost: str, spaces: dict[str, str], count: int, owner: Owner | None) -> bool:
    """Whether the logs are placed for count shards (by their names only when owner is None)."""
    for space_hash, files in logs.items():
        space = spaces.get(space_hash)
        if space is None:
            continue
        if None in files or any(i >= count for i in files):
            return False
        if owner is None:
            continue
        for i, name in files.items():
            items = replay(read_log(os.path.join(vdir, name))[0])
            if any(owner(vhost, space, key) not in (None, i) for key in items):
                return False
    return True


def _rewrite(vdir: str, logs: dict, vhost: str, spaces: dict[str, str], count: int, owner: Owner) -> None:
    new = vdir + ".new"
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(new, mode=0o700)
    for name in os.listdir(vdir):  # everything that is not a log of a known space goes over as it is
        parsed = parse_name(name)
        if parsed is None or parsed[0] not in spaces:
            src = os.path.join(vdir, name)
            if os.path.isfile(src) and not name.endswith(".tmp"):
                shutil.copy2(src, os.path.join(new, name))
    for space_hash, files in logs.items():
        space = spaces.get(space_hash)
        if space is None:
            continue
        placed: dict[int, dict[str, Any]] = {}
        dropped = 0
        sources: list[tuple[int | None, str]] = sorted(
            ((i, n) for i, n in files.items() if i is not None), key=lambda t: t[0])
        if None in files:
            if sources:
                log.warning("kv store %s: old shared log %s dropped unread: this vhost's logs are per shard "
                            "already (a leftover copy)", vdir, files[None])
            else:
                sources = [(None, files[None])]
        for i, name in sources:
            path = os.path.join(vdir, name)
            records, good, data = read_log(path)
            if i is None:
                lost = len(data) - good
                log.warning("kv store %s (space %s): reading the old shared log once: %d records; %s", path,
                            space, len(records), f"{lost} bytes after offset {good} not readable: lost" if lost
                            else "all readable")
            elif good != len(data):
                log.warning("kv store %s: stopping at a torn or corrupt record at offset %d", path, good)
            for key, value in replay(records).items():
                to = owner(vhost, space, key)
                if to is None:
                    to = i
                if to is None or not 0 <= to < count:
                    dropped += 1
                    continue
                placed.setdefault(to, {})[key] = value
        if dropped:
            log.warning("kv store %s (space %s): %d keys with no shard to keep them dropped", vdir, space, dropped)
        for i, items in placed.items():
            with open(os.path.join(new, f"{space_hash}.shard-{i}.log"), "wb") as fh:
                fh.write(b"".join(encode(k, v) for k, v in items.items()))
                fh.flush()
                os.fsync(fh.fileno())
    fsync_dir(new)
    old = vdir + ".old"
    os.replace(vdir, old)
    os.replace(new, vdir)
    fsync_dir(os.path.dirname(vdir))
    shutil.rmtree(old)
    log.info("kv stores of vhost %r placed for %d shards", vhost, count)
