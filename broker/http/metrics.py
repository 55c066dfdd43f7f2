"""Prometheus metrics on ``--prometheus-port`` (15692, RabbitMQ's): ``/metrics`` and ``/metrics/per-object``.

With ``--tls-cert`` the same endpoints are also served over HTTPS on ``--prometheus-tls-port`` (15691, RabbitMQ's
``prometheus.ssl.port``), with the node's TLS context (broker/tls.py: TLS 1.2+, reloaded on SIGHUP).

Multiprocess choice: the node renders everything from what it already has (its definitions and the
workers' periodic STATS, see broker/node_stats.py) with a prometheus-client Collector. We do not use
prometheus-client's multiprocess mode: it has every process write its own mmap'd files (a write per
metric update in the shards' and frontends' hot paths, files left behind by killed workers), while the
workers already send the node batched counts once per stats_interval.

Names follow RabbitMQ's Prometheus plugin where one exists, so existing Grafana dashboards work:
``/metrics`` carries the aggregated series (cheap at 100,000 queues: a sum, no label per queue);
``/metrics/per-object`` adds one series per queue, as RabbitMQ's endpoint of that name does.
ShardMQ's own series are named ``shardmq_*``.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from broker.node_stats import (
    C_CHANNELS,
    C_RECV,
    C_SEND,
    KEYS,
    Q_ACKED,
    Q_BYTES,
    Q_CONSUMERS,
    Q_NAME,
    Q_PUBLISHED,
    Q_READY,
    Q_UNACKED,
    Q_VHOST,
    counts,
)

log = logging.getLogger("shardmq.metrics")

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def node_processes(node: Any) -> list[tuple[str, int]]:
    """(label, pid) of the node and its live worker processes (a pair's: "shard 0+frontend 0")."""
    procs = [("node", os.getpid())]
    seen: dict[int, int] = {}
    for w in node.sup.workers:
        if w.proc is not None and w.proc.returncode is None:
            at = seen.get(w.proc.pid)
            if at is None:
                seen[w.proc.pid] = len(procs)
                procs.append((w.name, w.proc.pid))
            else:  # a paired process (--colocate) runs two workers: one row, its memory counted once
                procs[at] = (f"{procs[at][0]}+{w.name}", w.proc.pid)
    return procs


# RabbitMQ's global counters from the shards' totals (node_stats.KEYS positions; each shard's part
# restarts from 0 with the shard, as a counter reset).
_SHARD_COUNTERS = (
    ("rabbitmq_global_messages_delivered", "Total number of messages delivered to consumers", ("deliver_get",)),
    ("rabbitmq_global_messages_delivered_consume_manual_ack",
     "Total number of messages delivered to consumers using manual acknowledgement mode", ("deliver",)),
    ("rabbitmq_global_messages_delivered_consume_auto_ack",
     "Total number of messages delivered to consumers using automatic acknowledgement mode", ("deliver_no_ack",)),
    ("rabbitmq_global_messages_delivered_get_manual_ack",
     "Total number of messages fetched with basic.get using manual acknowledgement mode", ("get",)),
    ("rabbitmq_global_messages_delivered_get_auto_ack",
     "Total number of messages fetched with basic.get using automatic acknowledgement mode", ("get_no_ack",)),
    ("rabbitmq_global_messages_redelivered", "Total number of messages redelivered to consumers", ("redeliver",)),
    ("rabbitmq_global_messages_acknowledged", "Total number of messages acknowledged by consumers", ("ack",)),
)
# ... and from the frontends' counters (per publish, counted where the publish is handled).
_FRONTEND_COUNTERS = (
    ("rabbitmq_global_messages_received", "Total number of messages received from publishers", "received"),
    ("rabbitmq_global_messages_received_confirm",
     "Total number of messages received from publishers expecting confirmations", "received_confirm"),
    ("rabbitmq_global_messages_confirmed", "Total number of messages confirmed to publishers", "confirmed"),
    ("rabbitmq_global_messages_unroutable_dropped",
     "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
     "unroutable_dropped"),
    ("rabbitmq_global_messages_unroutable_returned",
     "Total number of messages published as mandatory into an exchange and returned to the publisher as unroutable",
     "unroutable_returned"),
)


def _global_counters(stats: Any) -> Iterator[Metric]:
    sums = dict.fromkeys(KEYS, 0)
    for payload in stats.shards.values():
        cur = counts(payload.get("totals") or ())
        if cur is not None:
            for key, n in zip(KEYS, cur, strict=True):
                sums[key] += n
    for name, doc, (key,) in _SHARD_COUNTERS:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], sums[key])
        yield c
    fe = {counter: stats.frontend_counter(counter) for _, _, counter in _FRONTEND_COUNTERS}
    for name, doc, counter in _FRONTEND_COUNTERS:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], fe[counter])
        yield c
    routed = CounterMetricFamily("rabbitmq_global_messages_routed", "Total number of messages routed to queues")
    routed.add_metric([], max(0, fe["received"] - fe["unroutable_dropped"] - fe["unroutable_returned"]))
    yield routed
    for name, doc, value in (
            ("rabbitmq_global_publishers", "Current number of publishers (connections that published)",
             stats.frontend_counter("publishers")),
            ("rabbitmq_global_consumers", "Current number of consumers",
             len(stats.consumers()))):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        yield g


class NodeCollector:
    def __init__(self, node: Any, per_object: bool) -> None:
        self.node = node
        self.per_object = per_object

    def collect(self) -> Iterator[Metric]:
        node = self.node
        defs = node.defs
        stats = node.stats
        queues = stats.queues()
        conns = stats.connections()

        def gauge(name: str, doc: str, value: float, labels: dict | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            g.add_metric(list((labels or {}).values()), value)
            return g

        yield gauge("rabbitmq_identity_info", "RabbitMQ node & cluster identity info", 1,
                    {"rabbitmq_node": "shardmq", "rabbitmq_cluster": "shardmq"})
        yield gauge("rabbitmq_connections", "Connections currently open", len(conns))
        yield gauge("rabbitmq_channels", "Channels currently open", sum(len(r[C_CHANNELS]) for _, r in conns))
        yield gauge("rabbitmq_consumers", "Consumers currently connected", sum(r[Q_CONSUMERS] for r in queues.values()))
        yield gauge("rabbitmq_queues", "Queues available", sum(len(v.queues) for v in defs.vhosts.values()))
        if not self.per_object:  # per-object: the same names carry one series per queue instead
            yield gauge("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers",
                        sum(r[Q_READY] for r in queues.values()))
            yield gauge("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged",
                        sum(r[Q_UNACKED] for r in queues.values()))
            yield gauge("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages",
                        sum(r[Q_READY] + r[Q_UNACKED] for r in queues.values()))
        yield gauge("rabbitmq_queue_messages_ready_bytes", "Size in bytes of ready messages",
                    sum(r[Q_BYTES] for r in queues.values()))
        yield from _global_counters(stats)
        for key, name, doc in (("connections_opened", "rabbitmq_connections_opened", "Total number of connections opened"),
                               ("connections_closed", "rabbitmq_connections_closed",
                                "Total number of connections closed or terminated")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], sum(p.get("counters", {}).get(key, 0) for p in stats.frontends.values()))
            yield c
        yield gauge("shardmq_publish_bytes_in_flight_peak",
                    "Most bytes of publishes a frontend had sent to one shard and not yet seen processed "
                    "(bounded by contract.MAX_BYTES_IN_FLIGHT plus one loop turn's reads)",
                    max((p.get("counters", {}).get("publish_bytes_in_flight_peak", 0)
                         for p in stats.frontends.values()), default=0))
        yield gauge("shardmq_read_bytes_per_turn_peak",
                    "Most bytes a frontend read from one AMQP connection in one event-loop turn (bounded by "
                    "frontend/amqp/connection.py TURN_READ_BYTES plus one socket read)",
                    max((p.get("counters", {}).get("read_bytes_per_turn_peak", 0)
                         for p in stats.frontends.values()), default=0))
        yield gauge("rabbitmq_connection_incoming_bytes_total", "Total number of bytes received on connections",
                    sum(r[C_RECV] for _, r in conns))
        yield gauge("rabbitmq_connection_outgoing_bytes_total", "Total number of bytes sent on connections",
                    sum(r[C_SEND] for _, r in conns))
        alarms = set(node.alarms)
        yield gauge("rabbitmq_alarms_memory_used_watermark",
                    "is 1 if VM memory watermark alarm is in effect", int("memory" in alarms))
        yield gauge("rabbitmq_alarms_free_disk_space_watermark",
                    "is 1 if free disk space watermark alarm is in effect", int("disk" in alarms))
        procs = node_processes(node)
        yield gauge("rabbitmq_process_resident_memory_bytes", "Memory used in bytes (all processes of the node)",
                    sum(rss_bytes(pid) for _, pid in procs))
        rss = GaugeMetricFamily("shardmq_process_resident_memory_bytes", "Resident memory per process",
                                labels=["process"])
        for label, pid in procs:
            rss.add_metric([label], rss_bytes(pid))
        yield rss
        per_shard = GaugeMetricFamily("shardmq_shard_queues", "Queues owned by each shard", labels=["shard"])
        rows_sent = CounterMetricFamily("shardmq_shard_stats_rows_sent",
                                        "Queue rows a shard sent in its STATS reports since it started (only "
                                        "changed rows after the first report)", labels=["shard"])
        reports = CounterMetricFamily("shardmq_shard_stats_reports", "STATS reports a shard sent since it started",
                                      labels=["shard"])
        for index, payload in sorted(stats.shards.items()):
            per_shard.add_metric([str(index)], len(stats.rows.get(index, ())))
            rows_sent.add_metric([str(index)], payload.get("rows_sent", 0))
            reports.add_metric([str(index)], payload.get("seq", 0))
        yield per_shard
        yield rows_sent
        yield reports
        seg = GaugeMetricFamily("shardmq_shard_segment_bytes", "Bytes written into the segments of each shard's queues",
                                labels=["shard"])
        fsync = HistogramMetricFamily("shardmq_shard_fsync_seconds", "Duration of each group sync (fsync batch)",
                                      labels=["shard"])
        for index, payload in sorted(stats.shards.items()):
            seg.add_metric([str(index)], payload.get("segment_bytes", 0))
            h = payload.get("fsync")
            if h:
                cumulative, buckets = 0, []
                for le, n in zip([*h["buckets"], float("inf")], h["counts"], strict=True):
                    cumulative += n
                    buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
                fsync.add_metric([str(index)], buckets, h["sum"])
        yield seg
        yield fsync
        dl = GaugeMetricFamily("shardmq_shard_dead_letters_unconfirmed",
                               "Dead letters sent to other shards and not yet confirmed by them (kept in the "
                               "sending shard's outbox)", labels=["shard"])
        for index, payload in sorted(stats.shards.items()):
            dl.add_metric([str(index)], payload.get("dead_letters_unconfirmed", 0))
        yield dl
        # Storage damage found by recovery or lazy verification (docs/storage.md "Recovery"), counted
        # since each shard opened its queues: records lost (bytes set aside) and ack entries ignored.
        damaged = stats.damaged()
        for name, doc, i in (("shardmq_damaged_records", "Stored messages lost to damaged bytes (set aside)", 0),
                             ("shardmq_damaged_ack_entries", "Ack entries ignored because their checksum failed", 1)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], sum(v[i] for v in damaged.values()))
            yield c
        per_fe = GaugeMetricFamily("shardmq_frontend_connections", "Client connections per frontend",
                                   labels=["frontend"])
        fe_in = GaugeMetricFamily("shardmq_frontend_incoming_bytes", "Bytes received per frontend (open connections)",
                                  labels=["frontend"])
        fe_out = GaugeMetricFamily("shardmq_frontend_outgoing_bytes", "Bytes sent per frontend (open connections)",
                                   labels=["frontend"])
        fe_rows = CounterMetricFamily("shardmq_frontend_stats_rows_sent",
                                      "Connection rows a frontend sent in its STATS reports since it started "
                                      "(only opened or changed connections after the first report)",
                                      labels=["frontend"])
        fe_reports = CounterMetricFamily("shardmq_frontend_stats_reports",
                                         "STATS reports a frontend sent since it started", labels=["frontend"])
        fe_trims = CounterMetricFamily("shardmq_frontend_heap_trims",
                                       "Times a frontend collected garbage and gave free heap back to the kernel "
                                       "after a wave of closed connections (broker/heap_trim.py)", labels=["frontend"])
        for index, payload in sorted(stats.frontends.items()):
            rows = stats.frontend_connections(index)
            per_fe.add_metric([str(index)], len(rows))
            fe_in.add_metric([str(index)], sum(r[C_RECV] for r in rows))
            fe_out.add_metric([str(index)], sum(r[C_SEND] for r in rows))
            fe_rows.add_metric([str(index)], payload.get("rows_sent", 0))
            fe_reports.add_metric([str(index)], payload.get("seq", 0))
            fe_trims.add_metric([str(index)], payload.get("counters", {}).get("heap_trims", 0))
        yield per_fe
        yield fe_in
        yield fe_out
        yield fe_rows
        yield fe_reports
        yield fe_trims
        if self.per_object:
            yield from self._per_queue(queues, damaged)

    @staticmethod
    def _per_queue(queues: dict, damaged: dict) -> Iterator[Metric]:
        labels = ["vhost", "queue"]
        families = {
            "ready": GaugeMetricFamily("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers",
                                       labels=labels),
            "unacked": GaugeMetricFamily("rabbitmq_queue_messages_unacked",
                                         "Messages delivered to consumers but not yet acknowledged", labels=labels),
            "messages": GaugeMetricFamily("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages",
                                          labels=labels),
            "consumers": GaugeMetricFamily("rabbitmq_queue_consumers", "Consumers on a queue", labels=labels),
        }
        published = CounterMetricFamily("rabbitmq_queue_messages_published", "Messages published into a queue",
                                        labels=labels)
        acked = CounterMetricFamily("rabbitmq_queue_messages_acked", "Messages acknowledged on a queue", labels=labels)
        lost = CounterMetricFamily("shardmq_queue_damaged_records", "Messages of a queue lost to damaged bytes",
                                   labels=labels)
        lost_acks = CounterMetricFamily("shardmq_queue_damaged_ack_entries",
                                        "Ack entries of a queue ignored because their checksum failed", labels=labels)
        for (vhost, name), (records, acks) in damaged.items():
            lost.add_metric([vhost, name], records)
            lost_acks.add_metric([vhost, name], acks)
        for row in queues.values():
            key = [row[Q_VHOST], row[Q_NAME]]
            families["ready"].add_metric(key, row[Q_READY])
            families["unacked"].add_metric(key, row[Q_UNACKED])
            families["messages"].add_metric(key, row[Q_READY] + row[Q_UNACKED])
            families["consumers"].add_metric(key, row[Q_CONSUMERS])
            if len(row) > Q_ACKED:
                published.add_metric(key, row[Q_PUBLISHED])
                acked.add_metric(key, row[Q_ACKED])
        yield from families.values()
        yield published
        yield acked
        yield lost
        yield lost_acks


def _render(node: Any, per_object: bool) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, per_object))
    return generate_latest(registry)


class MetricsServer:
    """The Prometheus listeners of one node: HTTP on ``port``, HTTPS on ``tls_port`` with a TLS context; 0 = off."""

    def __init__(self, node: Any, bind: str, port: int, tls_port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.node = node
        self.bind = bind
        self.port = port
        self.tls_port = tls_port if tls is not None else 0
        self.tls = tls
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        per_object = request.path.rstrip("/").endswith("per-object")
        body = _render(self.node, per_object)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        if not self.port and not self.tls_port:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/per-object", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        if self.port:
            await web.TCPSite(self._runner, self.bind, self.port, reuse_address=True).start()
            log.info("Prometheus metrics on %s:%d", self.bind, self.port)
        if self.tls_port:
            await web.TCPSite(self._runner, self.bind, self.tls_port, reuse_address=True, ssl_context=self.tls).start()
            log.info("Prometheus metrics over HTTPS on %s:%d", self.bind, self.tls_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
