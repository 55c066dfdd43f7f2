"""`shardmq-perf mqtt throughput` works end to end against ShardMQ and a private mosquitto (loadtest/mosquitto.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loadtest.mosquitto import PrivateMosquitto
from tests.harness import REPO_ROOT, free_port


def _perf(uri: str, qos: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "loadtest.cli", "mqtt", "throughput", "--uri", uri, "--qos", str(qos),
                        "-x", "1", "-y", "1", "-s", "16", "--pmessages", "2000", "--verify", "--json"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("qos", [0, 1])
def test_perf_tool_against_shardmq_and_mosquitto(node_factory, qos):
    node = node_factory(name="perf", frontends=1, shards=1, mqtt_port=free_port())
    ours = _perf(f"mqtt://guest:guest@127.0.0.1:{node.mqtt_port}", qos)
    with PrivateMosquitto() as mosquitto:
        theirs = _perf(mosquitto.url, qos)
    for result in (ours, theirs):
        assert result["consumed"] == 2000 and result["verify"]["ok"], result
