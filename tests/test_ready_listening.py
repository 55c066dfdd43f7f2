"""The health checks a load balancer goes by (/api/health/checks/ready and /leader) say 200 only once
the node's frontends listen: a frontend reported its snapshot applied before it bound its listeners,
and a client that connected on the first 200 (a failover test in a loaded suite run; haproxy's
check does the same) was refused."""

from __future__ import annotations

import socket
import time

from tests.cluster_helpers import http_get
from tests.harness import wait_until

HELD = "listeners held while"


def test_ready_and_leader_say_200_only_once_the_frontends_listen(node_factory, tmp_path):
    hold = tmp_path / "hold-listeners"
    hold.touch()
    node = node_factory(start=False, frontends=2, shards=2, env={"SHARDMQ_TEST_HOLD_LISTEN_WHILE": str(hold)})
    node.start(wait=False)
    try:
        # Both frontends have their snapshot and wait before binding.
        wait_until(lambda: node.log_text().count(HELD) >= 2, 30, "both frontends holding their listeners",
                   context=node.log_tail)
        wait_until(lambda: http_get(node.http_port, "/api/health/checks/ready", 1.0)[0] != 0, 30,
                   "the health checks to answer", context=node.log_tail)
        # Before the fix the frontends' APPLIED had reached the node by now (sent before the hold):
        # ready and leader turned 200 within milliseconds. Give the node a second to show it.
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            for check in ("ready", "leader"):
                status, body = http_get(node.http_port, f"/api/health/checks/{check}", 1.0)
                assert status == 503, (check, body)
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", node.port)) != 0  # nobody listens: right to say 503
            time.sleep(0.05)
    finally:
        hold.unlink()
    wait_until(lambda: http_get(node.http_port, "/api/health/checks/leader", 1.0)[0] == 200, 30,
               "leader to say 200", context=node.log_tail)
    # At the first 200 every frontend listens: a client connects at once, without a retry.
    assert http_get(node.http_port, "/api/health/checks/ready", 1.0)[0] == 200
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare("after-ready")
    conn.close()
