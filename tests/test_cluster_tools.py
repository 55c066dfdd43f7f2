"""The cluster measurement tools run and report what they say (not how fast: benchmarks are not tests)."""

from __future__ import annotations

import pytest

from loadtest import cluster_idle_cpu, cluster_takeover

pytestmark = pytest.mark.integration


def test_cluster_idle_cpu_reports_every_node_and_etcd(tmp_path, capsys):
    # --colocate off: the frontend and the shard are processes of their own (with pairs, one "pair").
    r = cluster_idle_cpu.measure(tmp_path / "idle", nodes_n=2, seconds=1.0, ttl=10, node_args=["--colocate", "off"])
    assert set(r["per_s_ms"]) == {"n1", "n2", "etcd"}
    assert {"node", "shard", "frontend"} <= set(r["per_s_ms"]["n1"])  # the leader runs the workers
    assert set(r["per_s_ms"]["n2"]) == {"node"}  # a follower runs none
    assert r["cluster_ms_per_s"] == pytest.approx(
        sum(sum(v.values()) for k, v in r["per_s_ms"].items() if k != "etcd"), abs=0.2)
    assert r["seconds"] >= 1.0 and len(r["loadavg"]) == 3
    assert "cluster" in cluster_idle_cpu._fmt(r) and "load" in cluster_idle_cpu._fmt(r)


def test_cluster_takeover_kills_the_leader_and_times_the_follower(tmp_path):
    r = cluster_takeover.measure(tmp_path / "takeover", nodes_n=2, ttl=1)
    assert r["new_leader"] == "n2"
    assert r["key_gone_s"] > 0 and r["taken_s"] >= 0
