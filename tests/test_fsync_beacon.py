"""broker/fsync_beacon.py: the shared-memory beacon shows the start of the oldest running sync of
either kind (group, kv), so the node's watchdog sees a stalled KV fsync beside a running group sync."""

from __future__ import annotations

import os

from broker.fsync_beacon import FsyncBeacon, running_since


def test_beacon_shows_the_oldest_running_sync_of_any_kind(tmp_path) -> None:
    run = str(tmp_path)
    beacon = FsyncBeacon(run, 0)
    try:
        assert running_since(run, 0) == (os.getpid(), 0.0)
        beacon.started("kv")
        kv_start = running_since(run, 0)[1]
        assert kv_start > 0
        beacon.started("group")  # a later group sync does not hide the older KV one
        assert running_since(run, 0)[1] == kv_start
        beacon.done("group")  # nor does its end
        assert running_since(run, 0)[1] == kv_start
        beacon.done("kv")
        assert running_since(run, 0)[1] == 0.0
        beacon.started()  # the group sync (shard/worker.py's calls take no kind)
        group_start = running_since(run, 0)[1]
        beacon.started("kv")
        beacon.done("kv")  # the group sync still runs: its start stays visible
        assert running_since(run, 0)[1] == group_start > 0
        beacon.done()
        assert running_since(run, 0)[1] == 0.0
    finally:
        beacon.close()
