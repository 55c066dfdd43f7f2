"""The node's HTTP server answers the health checks that load balancers and Kubernetes probe."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from broker.config import load_settings

pytestmark = pytest.mark.integration


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_standalone_node_is_ready_leader_and_without_alarms(shared_node):
    # The harness is satisfied by one frontend's handshake; ready waits for every frontend.
    deadline = time.monotonic() + 10
    while _get(shared_node.http_port, "/api/health/checks/ready")[0] != 200:
        assert time.monotonic() < deadline, "node never became ready"
        time.sleep(0.05)
    for check in ("ready", "leader", "alarms"):
        assert _get(shared_node.http_port, f"/api/health/checks/{check}") == (200, {"status": "ok"})


def test_unknown_path_is_404(shared_node):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{shared_node.http_port}/api/health/checks/nope", timeout=5)
    assert info.value.code == 404


def test_http_port_from_ini_section_and_bool_kind(tmp_path):
    ini = tmp_path / "s.ini"
    ini.write_text("[http]\nport = 0\nbind = 0.0.0.0\n")
    settings = load_settings(["--config", str(ini)], {})
    assert (settings.http_port, settings.http_bind) == (0, "0.0.0.0")
