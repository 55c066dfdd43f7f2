"""The partition drill's quick variant (network namespaces, as root): one partition of the leader."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from deploy.drill import netns
from deploy.drill.partition import run_partition_drill

pytestmark = pytest.mark.integration


def _netns_names() -> set[str]:
    out = subprocess.run([netns.IP, "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_partitioned_leader_fences_a_follower_takes_over_nothing_confirmed_is_lost_and_it_rejoins(tmp_path):
    lines: list[str] = []
    result = run_partition_drill(tmp_path, partitions=1, ttl=1, interval=1.5, log=lines.append)
    print("\n".join(lines))
    print(result.table())
    (cut,) = result.partitions
    # The old leader fenced itself (its direct client's connection was closed) and never confirmed
    # after the new leader's first confirm; a follower took over and clients confirm through haproxy.
    assert cut.fenced_s is not None and cut.direct_confirmed > 0, result.table()
    assert not cut.overlap, result.table()
    assert cut.new_leader not in ("?", cut.victim) and cut.first_confirm_s is not None, result.table()
    # After the heal: nothing confirmed (through haproxy or straight to the old leader) is lost, and
    # the old leader is a follower again, back in the ISR.
    assert result.drill.confirmed > 0
    assert result.lost == 0, result.table()
    assert cut.rejoined_s is not None, result.table()
    # The namespaces are gone with the run.
    assert not [n for n in _netns_names() if n.startswith(f"shardmq-{os.getpid() % 100000}-")]
    assert not (netns.REGISTRY / f"{os.getpid() % 100000}.json").exists()


def test_namespaces_left_by_a_dead_run_are_removed_by_the_next_one():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the "killed run"
    topo = netns.Topology(1, run_id=f"t{dead.pid % 100000}")
    topo.create()
    # Pretend the run died without cleaning up: its record names a dead pid.
    topo.record["pid"] = dead.pid
    (netns.REGISTRY / f"{topo.run_id}.json").write_text(json.dumps(topo.record))
    assert topo.netns(0) in _netns_names()
    try:
        assert netns.cleanup_stale() >= 1
        assert topo.netns(0) not in _netns_names()
        links = subprocess.run([netns.IP, "-o", "link", "show"], capture_output=True, text=True).stdout
        assert topo.bridge not in links
        assert not (netns.REGISTRY / f"{topo.run_id}.json").exists()
    finally:
        topo.close()
