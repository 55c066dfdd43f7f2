"""Persistent MQTT sessions whose session records sit on different shards survive a restart.

The session records of a vhost are kept by the shard ``session_shard`` picks per client id, so
every shard writes some of them: each shard must have its own log (one writer per file), else
their appends overwrite each other's and a restart reads a corrupt log (subscriptions lost).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys

import pytest

from frontend.mqtt.messages import SESSIONS, session_shard
from tests.harness import free_port
from tests.test_mqtt import Paho

WAIT = 20.0
SHARDS = 2


def _client_ids(per_shard: int, shards: int = SHARDS) -> list[str]:
    """Client ids whose sessions land on every shard, per_shard each, interleaved by shard."""
    found: dict[int, list[str]] = {i: [] for i in range(shards)}
    n = 0
    while any(len(v) < per_shard for v in found.values()):
        cid = f"kv-sess-{n}"
        n += 1
        ids = found[session_shard("/", cid, shards)]
        if len(ids) < per_shard:
            ids.append(cid)
    # Interleaved (shard 0, shard 1, shard 0, ...): the shards' writes alternate.
    return [cid for row in zip(*found.values(), strict=True) for cid in row]


def _make_sessions(node, ids: list[str]) -> None:
    """Each client subscribes to two topics (QoS 1, one SUBSCRIBE each: two record writes), then
    disconnects; one QoS 1 message per topic is then queued for it."""
    for cid in ids:
        c = Paho(node.mqtt_port, cid, clean=False)
        assert c.subscribe((f"kv/{cid}/a", 1)) == [1]
        assert c.subscribe((f"kv/{cid}/b", 1)) == [1]
        c.client.disconnect()
        c.client.loop_stop()
    _queue_messages(node, ids)


def _queue_messages(node, ids: list[str]) -> None:
    pub = Paho(node.mqtt_port, "kv-pub")
    for cid in ids:
        pub.publish(f"kv/{cid}/a", b"queued-a " + cid.encode(), qos=1)
        pub.publish(f"kv/{cid}/b", b"queued-b " + cid.encode(), qos=1)
    pub.client.disconnect()
    pub.client.loop_stop()


def _check_sessions(node, ids: list[str]) -> None:
    """Every session is present, gets its queued messages, and both subscriptions still route."""
    pub = Paho(node.mqtt_port, "kv-pub2")
    for cid in ids:
        c = Paho(node.mqtt_port, cid, clean=False)
        try:
            assert c.session_present, cid
            got = set()
            for _ in range(2):
                try:
                    t, payload, qos, _r = c.get(timeout=WAIT)
                except queue.Empty:
                    raise AssertionError(f"{cid}: queued messages not delivered (got {got})") from None
                got.add((t, payload, qos))
            assert got == {(f"kv/{cid}/a", b"queued-a " + cid.encode(), 1),
                           (f"kv/{cid}/b", b"queued-b " + cid.encode(), 1)}, cid
            for leaf in ("a", "b"):
                pub.publish(f"kv/{cid}/{leaf}", b"live", qos=1)
                assert c.get(timeout=WAIT)[:3] == (f"kv/{cid}/{leaf}", b"live", 1), cid
        finally:
            c.client.disconnect()
            c.client.loop_stop()
    pub.client.disconnect()
    pub.client.loop_stop()


def _kv_logs(node) -> list[str]:
    root = os.path.join(node.data_dir, "kv")
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _s, names in os.walk(root) for n in names)


@pytest.mark.parametrize("colocate", ["off", "on"])
@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_persistent_sessions_on_every_shard_survive_a_restart(node_factory, colocate, how):
    node = node_factory(name="node", frontends=1, shards=SHARDS, mqtt_port=free_port(),
                        extra_args=["--colocate", colocate])
    ids = _client_ids(3)
    _make_sessions(node, ids)
    if how == "stop":
        node.stop()
        # shardmq verify reads the KV logs too: on the shared log of before it found the damage.
        done = subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(node.data_dir)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "KV logs" in done.stdout and "damaged:" not in done.stdout, done.stdout
    else:
        node.kill9()
    node.restart()
    _check_sessions(node, ids)
    assert "torn or corrupt record" not in node.log_text()


@pytest.mark.parametrize("shards", [1, 3])
def test_persistent_sessions_survive_a_shard_count_change(node_factory, shards):
    node = node_factory(name="node", frontends=1, shards=SHARDS, mqtt_port=free_port())
    ids = _client_ids(3)
    _make_sessions(node, ids)
    node.stop()
    node.shards = shards
    node.start()
    _check_sessions(node, ids)
    _queue_messages(node, ids)
    # Each session record is in the log of the shard that now owns it, and nowhere else.
    logs = _kv_logs(node)
    assert not [p for p in logs if p.endswith(".log") and ".shard-" not in p], logs
    node.stop()
    node.shards = SHARDS
    node.start()
    _check_sessions(node, ids)


def test_sessions_written_in_the_old_shared_log_are_read_after_an_upgrade(node_factory):
    """A data dir of the one-log-per-vhost layout (written by a single shard, so intact): its
    sessions are found again, and the old log is gone once it was read."""
    from broker.datadir import name_hash
    from broker.kv_log import read_log

    node = node_factory(name="node", frontends=1, shards=SHARDS, mqtt_port=free_port())
    ids = _client_ids(2)
    _make_sessions(node, ids)
    node.stop()
    # Rewrite the per-shard logs as the old layout's one log per (vhost, space).
    vdir = os.path.join(node.data_dir, "kv", name_hash("/"))
    for space in (SESSIONS,):
        prefix = name_hash(space)
        parts = sorted(n for n in os.listdir(vdir) if n.startswith(prefix + ".shard-"))
        assert len(parts) == SHARDS, os.listdir(vdir)
        data = b""
        for name in parts:
            with open(os.path.join(vdir, name), "rb") as fh:
                data += fh.read()
            os.unlink(os.path.join(vdir, name))
        with open(os.path.join(vdir, prefix + ".log"), "wb") as fh:
            fh.write(data)
        assert {k for k, _v in read_log(os.path.join(vdir, prefix + ".log"))[0]} == set(ids)
    node.start()
    _check_sessions(node, ids)
    assert not os.path.exists(os.path.join(vdir, name_hash(SESSIONS) + ".log"))
