"""The node answers while it places the MQTT KV logs at boot (issue #15).

After an upgrade or a shard-count change the node rewrites every KV log (broker/kv_layout.py: 3-4.5 s
per 100,000 sessions). It does so in a thread: meanwhile its loop answers (the health checks, the
management API, the shards' HELLO: they recover their queues), and the frontends, which may open a KV
log on their first MQTT request, get their snapshot (so listen) only once the logs are placed.
``SHARDMQ_TEST_HOLD_KV_PLACEMENT_WHILE`` holds the placement while its file exists, so the test sees
that state for as long as it needs, whatever the machine's load.
"""

from __future__ import annotations

import re

from broker.kv_layout import HOLD_ENV, PLACED_FOR
from loadtest.ports import listening_sockets
from tests.harness import free_port, wait_until
from tests.mgmt_api import Api, q
from tests.test_mqtt_session_kv import SHARDS, _check_sessions, _client_ids, _kv_logs, _make_sessions

WAIT = 60.0


def test_the_node_answers_while_it_places_the_kv_logs_then_serves_the_sessions(node_factory, tmp_path):
    node = node_factory(name="node", frontends=1, shards=SHARDS, mqtt_port=free_port())
    ids = _client_ids(3)
    _make_sessions(node, ids)
    node.stop()
    placed_for = node.data_dir / "kv" / PLACED_FOR
    logs = _kv_logs(node)
    assert [p for p in logs if p.endswith(".shard-1.log")] and not placed_for.exists(), logs

    hold = tmp_path / "hold-kv-placement"
    hold.touch()
    node.env[HOLD_ENV] = str(hold)
    node.shards = SHARDS + 1  # a shard-count change: every log is read and rewritten
    log_start = len(node.log_text())
    node.start(wait=False)
    try:
        api = Api(node.http_port)

        def health(check: str) -> tuple[int, dict] | None:
            try:
                return api.call("GET", f"/api/health/checks/{check}")
            except OSError:  # not listening yet
                return None

        wait_until(lambda: health("ready") == (503, {"status": "failed", "reason": "node is not ready"}), WAIT,
                   "the ready check answering 503 while the KV placement is held", context=node.log_tail)
        # Every shard recovers its queues meanwhile (the loop answered their HELLO with the snapshot).
        wait_until(lambda: len(re.findall(r"shard \d+ \(pid \d+\) ready", node.log_text()[log_start:])) == SHARDS + 1,
                   WAIT, "every shard ready while the KV placement is held", context=node.log_tail)
        # A control request is answered: a durable queue declared and listed through the management API.
        api.put(f"/api/queues/{q('/')}/declared-during-placement", {"durable": True})
        names = {x["name"] for x in api.get("/api/queues?columns=name")}
        assert "declared-during-placement" in names and {f"mqtt-subscription-{c}qos1" for c in ids} <= names
        # Still held: the logs are as they were, and no frontend has its snapshot, so none listens.
        assert _kv_logs(node) == logs and not placed_for.exists()
        assert health("ready")[0] == 503
        assert listening_sockets(node.port) == 0 and listening_sockets(node.mqtt_port) == 0
    finally:
        hold.unlink()  # a node held there would not stop either
    node.wait_ready()
    assert placed_for.read_text().strip() == str(SHARDS + 1)
    assert [p for p in _kv_logs(node) if p.endswith(".shard-2.log")], _kv_logs(node)  # keys moved to the new shard
    wait_until(lambda: health("ready") == (200, {"status": "ok"}), WAIT, "the ready check answering 200")
    _check_sessions(node, ids)
    ch = node.connect().channel()
    ch.queue_declare("declared-during-placement", passive=True)
