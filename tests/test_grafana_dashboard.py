"""deploy/grafana/shardmq-overview.json: a Grafana dashboard over the node's Prometheus metrics
(RabbitMQ's names, plus shardmq_* per process). Every metric a panel queries must be one the node
serves: checked against a real node's /metrics and /metrics/per-object where the node has
--prometheus-port, and against the names RabbitMQ's exporter defines always."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "shardmq-overview.json"
# RabbitMQ's rabbitmq_prometheus names the dashboard may use, and ShardMQ's per-process additions.
RABBITMQ_NAMES = {
    "rabbitmq_identity_info", "rabbitmq_connections", "rabbitmq_channels", "rabbitmq_consumers",
    "rabbitmq_queues", "rabbitmq_queue_messages", "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked", "rabbitmq_queue_messages_ready_bytes", "rabbitmq_queue_consumers",
    "rabbitmq_connection_incoming_bytes_total", "rabbitmq_connection_outgoing_bytes_total",
    "rabbitmq_alarms_memory_used_watermark", "rabbitmq_alarms_free_disk_space_watermark",
    "rabbitmq_process_resident_memory_bytes",
}
SHARDMQ_NAMES = {"shardmq_process_resident_memory_bytes", "shardmq_shard_queues", "shardmq_frontend_connections"}
METRIC = re.compile(r"\b((?:rabbitmq|shardmq)_[a-z_]+)\b")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def used_metrics(dash: dict) -> set[str]:
    return {m for expr in queries(dash) for m in METRIC.findall(expr)}


def test_dashboard_is_grafana_json_with_a_sane_layout():
    dash = dashboard()
    assert dash["uid"] == "shardmq-overview" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= names
    # Every panel query is scoped by the job and node variables.
    for expr in queries(dash):
        if "label_values" not in expr:
            assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, expr


def test_dashboard_uses_only_rabbitmq_and_shardmq_names():
    used = used_metrics(dashboard())
    assert used and used <= RABBITMQ_NAMES | SHARDMQ_NAMES, used - RABBITMQ_NAMES - SHARDMQ_NAMES
    # The aggregated totals and the per-queue series share names: totals are selected by queue="".
    for expr in queries(dashboard()):
        if re.search(r"rabbitmq_queue_messages(_ready|_unacked|_ready_bytes)?\{", expr) and "topk" not in expr:
            assert 'queue=""' in expr, expr


@pytest.mark.integration
def test_every_metric_the_dashboard_queries_is_served_by_a_node(node_factory):
    node = node_factory(frontends=1, shards=1)
    with node.connect() as conn:
        conn.channel().queue_declare("grafana-q")
        served = set()
        for path in ("/metrics", "/metrics/per-object"):
            url = f"http://127.0.0.1:{node.prometheus_port}{path}"
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
            served |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                       if line and not line.startswith("#")}
    missing = used_metrics(dashboard()) - served
    assert not missing, f"the dashboard queries metrics no node serves: {sorted(missing)}"
