"""The failover drill's quick variant: real 3-member etcd, three nodes, haproxy, one leader kill."""

from __future__ import annotations

import pytest

from deploy.drill.failover import run_drill
from deploy.drill.haproxy import Backend, render_config

pytestmark = pytest.mark.integration


def test_haproxy_config_checks_the_leader_route_and_shuts_sessions_of_a_node_marked_down():
    cfg = render_config(5000, [Backend("n1", "127.0.0.1", 5001, 5002), Backend("n2", "127.0.0.1", 5003, 5004)])
    assert "option httpchk GET /api/health/checks/leader" in cfg
    assert "server n2 127.0.0.1:5003 check port 5004" in cfg
    assert cfg.count("on-marked-down shutdown-sessions") == 2
    assert "/api/health/checks/ready" in render_config(5000, [], via_followers=True)


def test_drill_one_kill_loses_nothing_and_confirms_again_quickly(tmp_path):
    lines: list[str] = []
    result = run_drill(tmp_path, kills=1, ttl=1, interval=1.5, log=lines.append)
    print("\n".join(lines))
    print(result.table())
    assert len(result.kills) == 1
    assert result.confirmed > 0
    assert result.lost == 0, result.table()
    assert result.redelivered_after_ack == 0, result.table()
    kill = result.kills[0]
    # The goal is < 3 s (docs/cluster.md has the drill's figures). On a starved machine a new
    # leader may fence itself needlessly while it spawns its workers (a keep-alive late by more than
    # TTL/2) and a second election follows: slower, never unsafe. The figure is printed.
    assert kill.first_confirm_s is not None and kill.first_confirm_s < 15, result.table()
