"""Node settings: defaults < INI file < SHARDMQ_* environment < command-line flags.

Every option is described once in OPTIONS; the flag, the INI key, the env var,
the --help line and the validation all come from that one row, so the four
sources cannot drift apart. Errors go through argparse's ``error()`` so they
look like any other usage error: ``shardmq: error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker import cpus
from broker.logs import LOG_FORMAT, setup_logging  # noqa: F401 - the CLI's and tests' names for them

PROG = "shardmq"
ENV_PREFIX = "SHARDMQ_"
SYNC_POLICIES = ("fsync", "none")
IPC_TRANSPORTS = ("unix", "zmq")
COLOCATE = ("auto", "on", "off")
QUEUE_PLACEMENTS = ("balanced", "hash")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def default_data_dir(environ: Mapping[str, str] | None = None) -> str:
    """$SHARDMQ_DATA_DIR, else /var/lib/shardmq for a root that can write there, else ~/.local/share/shardmq."""
    environ = os.environ if environ is None else environ
    if environ.get("SHARDMQ_DATA_DIR"):
        return os.path.abspath(os.path.expanduser(environ["SHARDMQ_DATA_DIR"]))
    system_dir = "/var/lib/shardmq"
    if os.geteuid() == 0:
        probe = system_dir if os.path.exists(system_dir) else os.path.dirname(system_dir)
        if os.access(probe, os.W_OK):
            return system_dir
    return os.path.join(os.path.expanduser("~"), ".local", "share", "shardmq")


def _default_frontends() -> int:
    return cpus.default_frontends(cpus.available_cpus())


def _default_shards() -> int:
    return cpus.default_shards(cpus.available_cpus())


@dataclass
class Settings:
    data_dir: str = field(default_factory=default_data_dir)
    bind: str = "127.0.0.1"
    port: int = 5672
    frontends: int = field(default_factory=_default_frontends)
    shards: int = field(default_factory=_default_shards)
    heartbeat: int = 60
    frame_max: int = 131072
    channel_max: int = 2047
    max_message_size: int = 134217728
    segment_size: int = 8388608
    default_user: str = "guest"
    default_pass: str = "guest"
    loopback_users: list[str] = field(default_factory=lambda: ["guest"])
    # "fsync": confirm after a batched fsync; "none": confirm after the page-cache write.
    sync: str = "fsync"
    log_level: str = "info"
    # RabbitMQ-style definitions JSON (policies, operator policies, vhost limits), re-read on SIGHUP.
    definitions: str | None = None
    # 1: the frontend sets the timestamp property (seconds) of a published message that has none.
    set_timestamp: int = 0
    # RabbitMQ's consumer_timeout (ms): an unacked delivery older than this closes its channel with
    # 406. On by default like RabbitMQ's 30 minutes; it costs the plain path nothing (a periodic scan,
    # see shard/ack_timeouts.py). 0 = off.
    consumer_timeout: int = 1800000
    # MQTT 3.1.1 listener (frontend/mqtt/); 0 = off.
    mqtt_port: int = 1883
    # Largest MQTT packet accepted (bytes); a bigger one closes that connection.
    mqtt_max_packet_size: int = 134217728
    # QoS 1/2 messages sent to one MQTT client and not yet acknowledged by it (the consumer's prefetch).
    mqtt_max_inflight: int = 1000
    # 1: an MQTT CONNECT without a user name logs in as --default-user (vhost /), as RabbitMQ's
    # mqtt.allow_anonymous; 0 refuses it with return code 5.
    mqtt_allow_anonymous: int = 0
    # TLS listeners (AMQPS, MQTTS) are on when a certificate is set; 0 turns one off.
    amqps_port: int = 5671
    mqtts_port: int = 8883
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # 1: clients must present a certificate signed by --tls-ca.
    tls_verify_peer: int = 0
    # 1: every client listener (TCP and TLS) expects a PROXY protocol v1/v2 header first (frontend/proxy.py).
    proxy_protocol: int = 0
    # MQTT (/ws) and AMQP (/amqp) over WebSocket (frontend/ws.py); 0 = off.
    ws_port: int = 15675
    # WebSocket over TLS (as RabbitMQ's web-mqtt TLS listener), on when --tls-cert is set; 0 = off.
    wss_port: int = 15676
    # The node's HTTP server (broker/http/): management API, UI and health checks on one port.
    http_port: int = 15672
    http_bind: str = "127.0.0.1"
    # HTTPS for the same application (management API, UI, health), on when --tls-cert is set; 0 = off.
    https_port: int = 15671
    # ms between the periodic statistics each worker sends the node (RabbitMQ's
    # collect_statistics_interval): queue counts, connections, counters for the API and Prometheus.
    stats_interval: int = 5000
    # Seconds a running shard may send the node nothing (it reports every stats_interval; at least 3
    # intervals are waited) before the node calls it hung, kills it and lets the supervisor restart it
    # (broker/shard_watchdog.py); 0 = off.
    shard_hang_timeout: float = 30.0
    # Debug: a directory where frontends and shards write a per-stage latency trace of a sample of
    # messages (broker/stage_trace.py, python -m loadtest.trace_stages); None = off.
    trace_stages: str | None = None
    # The data plane between frontends and shards (broker/data_sockets.py): "unix" stream sockets
    # written and read by the workers' event loops (broker/unixio.py), or "zmq" (ZeroMQ ROUTER/DEALER,
    # broker/zmqio.py: two I/O-thread handoffs per hop). The control plane to the node is ZeroMQ either way.
    ipc_transport: str = "unix"
    # Frontend K and shard K in one process, talking in-process (shard/pair_main.py,
    # broker/local_link.py): "on", "off", or "auto" (broker/cpus.py colocated_pairs); cluster members too
    # (a fenced leader stops a pair's frontend part alone: broker/supervisor.py stop_frontends_now).
    # Default auto: paired on at most 2 cores (docs/benchmarks.md "Frontend and shard in one process").
    colocate: str = "auto"
    # Where a new queue goes (broker/definitions/entities.py place_queue): "balanced" = the shard with
    # the fewest queues of its vhost, "hash" = crc32(vhost, name) % shards. Recorded in the queue's
    # definition either way: a queue keeps its shard across restarts and shard-count changes.
    queue_placement: str = "balanced"
    # Queue deletions per second beyond a burst of 32 (broker/delete_pacer.py): a vhost of 100,000
    # queues, or 100,000 pipelined queue.delete, is deleted at this pace so that publishing on the
    # other queues keeps its cores (docs/benchmarks.md "Paced deletes"); a ceiling: the pacer slows
    # below it while its shard round trips or its own wake-ups are delayed; 0 = as fast as possible.
    delete_rate: int = 2000
    # Resource alarms (broker/alarms.py): publishers are blocked while free disk space of the data dir is
    # below disk_free_limit or the node's memory is above vm_memory_high_watermark (RabbitMQ's syntax).
    disk_free_limit: str = "50MB"
    vm_memory_high_watermark: str = "0.4"
    # Prometheus /metrics and /metrics/per-object (broker/http/metrics.py), bound to http_bind; 0 = off.
    prometheus_port: int = 15692
    # Prometheus over HTTPS (RabbitMQ's prometheus.ssl listener, 15691), on when --tls-cert is set; 0 = off.
    prometheus_tls_port: int = 15691
    # Cluster (replication/): off = today's standalone node, no etcd needed.
    cluster: bool = False
    etcd_endpoints: list[str] = field(default_factory=lambda: ["127.0.0.1:2379"])
    etcd_prefix: str = "shardmq"
    node_name: str = field(default_factory=socket.gethostname)
    # Host other nodes and proxies use to reach this node (its AMQP, replication and HTTP ports).
    advertised_host: str = field(default_factory=socket.gethostname)
    # Seconds of the node's etcd lease: a dead leader is replaced after at most this long.
    lease_ttl: int = 10
    # File holding the cluster's shared secret (SHARDMQ_CLUSTER_SECRET may hold the secret itself).
    cluster_secret_file: str | None = None
    replication_port: int = 5679
    replication_bind: str = "127.0.0.1"
    # Confirms and declare-oks need at least this many in-sync followers (below: nacks, logged).
    min_isr: int = 0
    # A follower that is behind and has not acked for this many seconds is disconnected.
    replication_ack_timeout: int = 3
    # A follower that got no file list this many seconds after the leader welcomed it on a stream
    # drops its session and reconnects (the leader's shard may be stopped or hung).
    replication_file_list_timeout: int = 60
    # Seconds between heartbeats on an idle replication stream, both ways (0 = off; replication/protocol.py).
    replication_heartbeat: float = 2.0
    # A stream from which nothing (data, acks, heartbeats) arrived for this many seconds is dropped: the
    # follower reconnects, the leader takes the follower out of the ISR.
    replication_heartbeat_timeout: float = 10.0
    # HOST:PORT: follow that leader's replication port without etcd (static/manual mode, tests).
    follow: str | None = None
    config_file: str | None = None

    @property
    def run_dir(self) -> str:
        """Sockets and pids.json live here (see broker/contract.py)."""
        return os.path.join(self.data_dir, "run")

    @property
    def pids_file(self) -> str:
        return os.path.join(self.run_dir, "pids.json")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the SNAPSHOT message (msgpack-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Settings:
        """Inverse of to_dict; keys this version does not know are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Option:
    name: str  # Settings field
    kind: str  # "int" | "float" | "str" | "list" | "path" | "bool" (a flag without value; 1/0/true/false elsewhere)
    section: str | None  # INI section, None when the option cannot be set from a file
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    has_flag: bool = True
    # INI key inside ``section`` when it differs from the field name (DESIGN: `[http] port` is
    # --http-port, `[clustering] enabled` is --cluster).
    key: str | None = None
    # Flag spelling when it differs from the field name (--cluster for `cluster_enabled`).
    flag_name: str | None = None

    @property
    def flag(self) -> str:
        return "--" + (self.flag_name or self.name).replace("_", "-")

    @property
    def ini_key(self) -> str:
        return self.key or self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("data_dir", "path", "main", "queues, definitions, run/ (sockets, pids.json)"),
    Option("frontends", "int", "main", "frontend (protocol) processes", 1, 1024),
    Option("shards", "int", "main", "shard (queue storage) processes", 1, 1024),
    Option("segment_size", "int", "main", "bytes per message segment file", 65536, 2**32 - 1),
    Option("sync", "str", "main", "confirm after a batched fsync or after the page-cache write",
           choices=SYNC_POLICIES),
    Option("log_level", "str", "main", "log level of the node and its workers", choices=LOG_LEVELS),
    Option("definitions", "path", "main",
           "definitions JSON (policies, operator_policies, vhost-limits) loaded at boot and on SIGHUP"),
    Option("bind", "str", "amqp", "address the AMQP listener binds"),
    Option("port", "int", "amqp", "AMQP port", 1, 65535),
    Option("heartbeat", "int", "amqp", "heartbeat seconds offered to clients (0 = off)", 0, 65535),
    Option("frame_max", "int", "amqp", "largest frame in bytes offered to clients", 4096, 2**31 - 1),
    Option("channel_max", "int", "amqp", "most channels per connection", 1, 65535),
    Option("max_message_size", "int", "amqp", "largest message body accepted, bytes", 1, 536870912),
    Option("default_user", "str", "amqp", "user created on first boot"),
    # No flag: a password on the command line is visible to every user through ps.
    Option("default_pass", "str", "amqp", "password of the user created on first boot", has_flag=False),
    Option("loopback_users", "list", "amqp",
           "users that may log in from loopback only ('none' = no one)"),
    Option("set_timestamp", "int", "amqp", "1 = stamp published messages that have no timestamp", 0, 1),
    Option("consumer_timeout", "int", "amqp",
           "ms a delivery may stay unacked before its channel is closed with 406 (0 = off)", 0, 2**31 - 1),
    Option("mqtt_port", "int", "mqtt", "MQTT 3.1.1 port (0 = off)", 0, 65535, key="port"),
    Option("mqtt_max_packet_size", "int", "mqtt", "largest MQTT packet accepted, bytes", 64, 268435455,
           key="max_packet_size"),
    Option("mqtt_max_inflight", "int", "mqtt", "unacknowledged QoS 1/2 messages per MQTT client", 1, 65535,
           key="max_inflight"),
    Option("mqtt_allow_anonymous", "int", "mqtt", "1 = MQTT clients without a user name log in as --default-user",
           0, 1, key="allow_anonymous"),
    Option("amqps_port", "int", "amqp", "AMQP over TLS port, on when --tls-cert is set (0 = off)", 0, 65535,
           key="tls_port"),
    Option("mqtts_port", "int", "mqtt", "MQTT over TLS port, on when --tls-cert is set (0 = off)", 0, 65535,
           key="tls_port"),
    Option("tls_cert", "path", "tls", "server certificate chain (PEM) for the TLS listeners", key="cert"),
    Option("tls_key", "path", "tls", "private key (PEM) of --tls-cert", key="key"),
    Option("tls_ca", "path", "tls", "CA bundle (PEM) that client certificates must chain to", key="ca"),
    Option("tls_verify_peer", "int", "tls", "1 = require a client certificate signed by --tls-ca", 0, 1,
           key="verify_peer"),
    Option("proxy_protocol", "int", "main",
           "1 = client listeners (also TLS) require a PROXY protocol v1/v2 header (haproxy send-proxy)", 0, 1),
    Option("ws_port", "int", "ws", "WebSocket port: MQTT at /ws, AMQP at /amqp (0 = off)", 0, 65535, key="port"),
    Option("wss_port", "int", "ws", "WebSocket over TLS port, on when --tls-cert is set (0 = off)", 0, 65535,
           key="tls_port"),
    Option("http_port", "int", "http", "HTTP port: management API, UI, health checks (0 = off)", 0, 65535,
           key="port"),
    Option("http_bind", "str", "http", "address the HTTP listener binds", key="bind"),
    Option("https_port", "int", "http", "HTTPS port of the same API/UI, on when --tls-cert is set (0 = off)", 0,
           65535, key="tls_port"),
    Option("disk_free_limit", "str", "main",
           "free disk space of the data dir below which publishers are blocked: bytes with a unit (50MB) "
           "or mem_relative:F (F x RAM)"),
    Option("vm_memory_high_watermark", "str", "main",
           "node memory above which publishers are blocked: a fraction of RAM (0.4) or an amount (2GB)"),
    Option("prometheus_port", "int", "http", "Prometheus metrics port (0 = off)", 0, 65535),
    Option("prometheus_tls_port", "int", "http",
           "Prometheus metrics over HTTPS, on when --tls-cert is set (0 = off)", 0, 65535),
    Option("stats_interval", "int", "http", "ms between the statistics reports of the workers", 100, 3600000),
    Option("shard_hang_timeout", "float", "main",
           "seconds a running shard may send the node nothing before it is killed and restarted (0 = off)",
           0, 86400),
    Option("trace_stages", "path", "main",
           "debug: directory for a per-stage latency trace of sampled messages (python -m loadtest.trace_stages)"),
    Option("ipc_transport", "str", "main",
           "frontend<->shard data plane: unix stream sockets on the event loops, or ZeroMQ",
           choices=IPC_TRANSPORTS),
    Option("colocate", "str", "main",
           "frontend K and shard K in one process with an in-process link (fewer process hops); "
           "auto: on when the node may use at most 2 cores",
           choices=COLOCATE),
    Option("queue_placement", "str", "main",
           "shard of a new queue: the one with the fewest queues of its vhost, or by a hash of its name",
           choices=QUEUE_PLACEMENTS),
    Option("delete_rate", "int", "main",
           "the most queue deletions per second beyond a burst of 32 (a vhost delete, pipelined "
           "queue.delete; fewer while the cores are busy); 0 = unpaced", 0, 10**9),
    Option("cluster", "bool", "clustering", "run as a cluster member (etcd election, replication)",
           key="enabled"),
    Option("etcd_endpoints", "list", "clustering", "etcd endpoints HOST:PORT, comma separated"),
    Option("etcd_prefix", "str", "clustering", "prefix of this cluster's keys in etcd"),
    Option("node_name", "str", "clustering", "this node's name in the cluster (unique)"),
    Option("advertised_host", "str", "clustering", "host the other nodes reach this node at"),
    Option("lease_ttl", "int", "clustering", "seconds of the etcd lease (failover detection time)", 1, 3600),
    Option("cluster_secret_file", "path", "clustering",
           "file with the cluster's shared secret (or SHARDMQ_CLUSTER_SECRET)", key="secret_file"),
    Option("replication_port", "int", "clustering", "replication stream port (leader)", 1, 65535, key="port"),
    Option("replication_bind", "str", "clustering", "address the replication listener binds", key="bind"),
    Option("min_isr", "int", "clustering", "confirms need this many in-sync followers (fewer: nack)", 0, 1000),
    Option("replication_ack_timeout", "int", "clustering",
           "seconds a lagging follower may go without acking before it is dropped", 1, 3600,
           key="ack_timeout"),
    Option("replication_file_list_timeout", "int", "clustering",
           "seconds a follower waits for a stream's file list before it reconnects", 1, 86400,
           key="file_list_timeout"),
    Option("replication_heartbeat", "float", "clustering",
           "seconds between heartbeats on an idle replication stream, both ways (0 = off)", 0, 3600,
           key="heartbeat"),
    Option("replication_heartbeat_timeout", "float", "clustering",
           "seconds without a frame from the peer before a replication stream is dropped", 0.1, 86400,
           key="heartbeat_timeout"),
    Option("follow", "str", "clustering",
           "HOST:PORT of a leader to follow without etcd (static/manual mode, tests)"),
)
OPTIONS_BY_NAME = {opt.name: opt for opt in OPTIONS}
INI_SECTIONS = ("main", "amqp", "mqtt", "tls", "ws", "http", "clustering")
BOOL_TRUE = ("1", "true", "yes", "on")
BOOL_FALSE = ("0", "false", "no", "off")
SECRET_ENV = ENV_PREFIX + "CLUSTER_SECRET"
CONFIG_ENV = ENV_PREFIX + "CONFIG_FILE"
_INI_OPTIONS = {(opt.section, opt.ini_key): opt for opt in OPTIONS if opt.section}


class _Invalid(ValueError):
    """A value that does not fit its option; the caller adds where it came from."""

    def located(self, where: str) -> str:
        # "--frontends must be >= 1" reads as a sentence; "--port: invalid int 'x'" needs the colon.
        text = str(self)
        return f"{where} {text}" if text.startswith("must") else f"{where}: {text}"


def _convert(opt: Option, raw: str) -> Any:
    raw = raw.strip()
    if opt.kind == "int":
        try:
            value = int(raw)
        except ValueError:
            raise _Invalid(f"invalid int {raw!r}") from None
        if opt.minimum is not None and value < opt.minimum:
            raise _Invalid(f"must be >= {opt.minimum}")
        if opt.maximum is not None and value > opt.maximum:
            raise _Invalid(f"must be <= {opt.maximum}")
        return value
    if opt.kind == "float":
        try:
            value = float(raw)
        except ValueError:
            raise _Invalid(f"invalid number {raw!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise _Invalid(f"invalid number {raw!r}")
        if opt.minimum is not None and value < opt.minimum:
            raise _Invalid(f"must be >= {opt.minimum:g}")
        if opt.maximum is not None and value > opt.maximum:
            raise _Invalid(f"must be <= {opt.maximum:g}")
        return value
    if opt.kind == "bool":
        low = raw.lower()
        if low in BOOL_TRUE:
            return True
        if low in BOOL_FALSE:
            return False
        raise _Invalid(f"invalid boolean {raw!r} (use true or false)")
    if opt.kind == "list":
        if raw.lower() == "none":
            return []
        return [item.strip() for item in raw.split(",") if item.strip()]
    if opt.kind == "path":
        if not raw:
            raise _Invalid("must not be empty")
        return os.path.abspath(os.path.expanduser(raw))
    if opt.choices is not None:
        raw = raw.lower()
        if raw not in opt.choices:
            raise _Invalid(f"invalid choice {raw!r} (choose from {', '.join(opt.choices)})")
        return raw
    if opt.name in ("disk_free_limit", "vm_memory_high_watermark"):
        from broker.alarms import parse_disk_limit, parse_memory_watermark

        try:
            (parse_disk_limit if opt.name == "disk_free_limit" else parse_memory_watermark)(raw)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
    if opt.name in ("bind", "http_bind", "default_user", "etcd_prefix", "node_name", "advertised_host",
                    "replication_bind") \
            and not raw:
        raise _Invalid("must not be empty")
    return raw


def _describe_default(opt: Option) -> str:
    defaults = {
        "data_dir": "/var/lib/shardmq (root) or ~/.local/share/shardmq",
        "frontends": "1 per 2 cores the node may use (min 1)",
        "shards": "1 per 2 cores the node may use (min 1)",
        "loopback_users": "guest",
        "node_name": "hostname",
        "advertised_host": "hostname",
        "etcd_endpoints": "127.0.0.1:2379",
    }
    if opt.name in defaults:
        return defaults[opt.name]
    return str(getattr(Settings, opt.name))


_METAVARS = {"int": "N", "float": "SECS", "path": "DIR", "list": "USERS", "str": "VALUE", "bind": "ADDR", "http_bind": "ADDR",
             "default_user": "USER", "sync": "POLICY", "log_level": "LEVEL",
             "definitions": "FILE", "tls_cert": "FILE", "tls_key": "FILE", "tls_ca": "FILE",
             "etcd_endpoints": "HOSTS",
             "cluster_secret_file": "FILE", "node_name": "NAME", "advertised_host": "HOST",
             "follow": "HOST:PORT", "replication_bind": "ADDR"}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    # Wide enough that every flag's help is one line.
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=max(110, _terminal_width()))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120


def option_table() -> list[tuple[str, str, str, str]]:
    """(flag, INI key, env var, default) for every setting: the --help epilog and the README show this."""
    rows = [("--config FILE", "-", CONFIG_ENV, "none")]
    for opt in OPTIONS:
        rows.append((opt.flag if opt.has_flag else "-", f"[{opt.section}] {opt.ini_key}", opt.env,
                     _describe_default(opt)))
    return rows


def build_parser() -> argparse.ArgumentParser:
    rows = option_table()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    table = "\n".join(
        f"  {flag:<{widths[0]}}  {key:<{widths[1]}}  {env:<{widths[2]}}  {default}"
        for flag, key, env, default in [("flag", "INI [section] key", "environment", "default"), *rows]
    )
    epilog = (
        "Precedence: defaults < INI file (--config) < SHARDMQ_* environment < flags.\n"
        "An empty environment variable counts as unset. default_pass has no flag (ps would show it).\n\n"
        + table + "\n"
    )
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="ShardMQ broker node: an AMQP 0-9-1 broker spread over frontend and shard processes.",
        epilog=epilog,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="INI file with [main], [amqp], [http], ... sections")
    for opt in OPTIONS:
        if not opt.has_flag:
            continue
        text = opt.help + (f" ({'|'.join(opt.choices)})" if opt.choices else "")
        if opt.kind == "bool":
            # A bare switch (`--cluster`); INI and env take true/false.
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const="true",
                                default=argparse.SUPPRESS, help=text.replace("%", "%%"))
            continue
        metavar = _METAVARS.get(opt.name) or _METAVARS[opt.kind]
        parser.add_argument(opt.flag, dest=opt.name, metavar=metavar, default=argparse.SUPPRESS,
                            help=text.replace("%", "%%"))
    return parser


def _read_ini(parser: argparse.ArgumentParser, path: str, shown: str) -> dict[str, Any]:
    """Values from the INI file at ``path``; errors name it as ``shown`` (what the user typed)."""
    ini = configparser.ConfigParser(interpolation=None, default_section="\x00no-default")
    try:
        with open(path, encoding="utf-8") as fh:
            ini.read_file(fh, source=path)
    except OSError as exc:
        parser.error(f"config file {shown}: cannot read: {exc.strerror or exc}")
    except configparser.Error as exc:
        parser.error(f"config file {shown}: {' '.join(str(exc).split())}")
    values: dict[str, Any] = {}
    for section in ini.sections():
        if section not in INI_SECTIONS:
            parser.error(f"config file {shown}: unknown section [{section}] "
                         f"(known: {', '.join('[' + s + ']' for s in INI_SECTIONS)})")
        for key, raw in ini.items(section):
            opt = _INI_OPTIONS.get((section, key))
            if opt is None:
                known = ", ".join(o.ini_key for o in OPTIONS if o.section == section)
                parser.error(f"config file {shown}: unknown key [{section}] {key} (known: {known})")
            try:
                values[opt.name] = _convert(opt, raw)
            except _Invalid as exc:
                parser.error(f"config file {shown}: " + exc.located(f"[{section}] {key}"))
    return values


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Parse argv (default sys.argv[1:]) and environ (default os.environ) into Settings.

    Any invalid value exits with status 2 and a message naming the flag, INI key or env var.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = vars(parser.parse_args(argv))

    values: dict[str, Any] = {}
    shown = args.pop("config", None) or environ.get(CONFIG_ENV) or None
    if shown:
        config_file = os.path.abspath(os.path.expanduser(shown))
        values.update(_read_ini(parser, config_file, shown))
        values["config_file"] = config_file

    for opt in OPTIONS:
        raw = environ.get(opt.env)
        if raw:
            try:
                values[opt.name] = _convert(opt, raw)
            except _Invalid as exc:
                parser.error(exc.located(opt.env))

    for name, raw in args.items():
        opt = OPTIONS_BY_NAME[name]
        try:
            values[name] = _convert(opt, raw)
        except _Invalid as exc:
            parser.error(exc.located(opt.flag))

    if "data_dir" not in values:
        values["data_dir"] = default_data_dir(environ)
    settings = Settings(**values)
    _check_cluster(parser, settings, environ)
    return settings


def _check_cluster(parser: argparse.ArgumentParser, s: Settings, environ: Mapping[str, str]) -> None:
    if s.follow is not None:
        host, sep, port = s.follow.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--follow: expected HOST:PORT, got {s.follow!r}")
        if not s.cluster:
            parser.error("--follow needs --cluster")
    if s.replication_heartbeat and s.replication_heartbeat_timeout < 3 * s.replication_heartbeat:
        # Up to 1.5 heartbeats may pass between two frames of an idle stream (the follower checks every
        # half heartbeat): a timeout shorter than three would drop healthy idle streams now and then.
        parser.error(f"--replication-heartbeat-timeout ({s.replication_heartbeat_timeout:g}) must be at least "
                     f"3 x --replication-heartbeat ({s.replication_heartbeat:g}), or set the heartbeat to 0 (off)")
    if s.cluster and not s.cluster_secret_file and not environ.get(SECRET_ENV):
        parser.error(f"--cluster needs --cluster-secret-file (or {SECRET_ENV})")


def cluster_secret(s: Settings, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret: $SHARDMQ_CLUSTER_SECRET, else the content of --cluster-secret-file (stripped)."""
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_ENV):
        return environ[SECRET_ENV].encode()
    if not s.cluster_secret_file:
        raise ValueError(f"no cluster secret: set --cluster-secret-file or {SECRET_ENV}")
    with open(s.cluster_secret_file, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"cluster secret file {s.cluster_secret_file} is empty")
    return secret


def tls_problem(s: Settings) -> str | None:
    """Why the TLS settings cannot work (naming the flag), or None. Loads the files once to be sure."""
    if not (s.tls_cert or s.tls_key or s.tls_ca or s.tls_verify_peer):
        return None
    if not s.tls_cert or not s.tls_key:
        return "--tls-cert and --tls-key go together"
    if s.tls_verify_peer and not s.tls_ca:
        return "--tls-verify-peer needs --tls-ca"
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(s.tls_cert, s.tls_key)
    except (OSError, ssl.SSLError) as exc:
        return f"--tls-cert/--tls-key: cannot load {s.tls_cert} / {s.tls_key}: {exc}"
    if s.tls_ca:
        try:
            ctx.load_verify_locations(s.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            return f"--tls-ca: cannot load {s.tls_ca}: {exc}"
    return None


