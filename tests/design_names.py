"""The flag and INI names DESIGN.md fixes ("Ports, flags and where new parts live").

The chart, the systemd units and the haproxy config are written against these names so they carry
the cluster, TLS, MQTT and metrics settings before every one of them exists in broker/config.py.
The deploy tests check each name they find: an option broker/config.py knows must load through it;
any other must be one of these (so a typo cannot hide behind "not built yet").
"""

from __future__ import annotations

from broker.config import OPTIONS

# (section, key) of the INI file.
DESIGN_INI_KEYS: frozenset[tuple[str, str]] = frozenset({
    ("mqtt", "port"), ("amqp", "tls_port"), ("mqtt", "tls_port"),
    ("tls", "cert"), ("tls", "key"), ("tls", "ca"), ("tls", "verify_peer"),
    ("ws", "port"), ("main", "proxy_protocol"),
    ("http", "port"), ("http", "bind"), ("http", "prometheus_port"),
    ("clustering", "enabled"), ("clustering", "etcd_endpoints"), ("clustering", "etcd_prefix"),
    ("clustering", "node_name"), ("clustering", "advertised_host"),
    ("clustering", "port"), ("clustering", "bind"), ("clustering", "secret_file"),
    ("clustering", "lease_ttl"), ("clustering", "min_isr"),
})

DESIGN_FLAGS: frozenset[str] = frozenset({
    "--mqtt-port", "--amqps-port", "--mqtts-port", "--tls-cert", "--tls-key", "--tls-ca",
    "--tls-verify-peer", "--ws-port", "--proxy-protocol", "--http-port", "--http-bind",
    "--prometheus-port", "--cluster", "--etcd-endpoints", "--etcd-prefix", "--node-name",
    "--advertised-host", "--replication-port", "--replication-bind", "--cluster-secret-file",
    "--lease-ttl", "--min-isr",
})

# Environment variables DESIGN names outright (others follow SHARDMQ_<FIELD> of broker/config.py).
DESIGN_ENV: frozenset[str] = frozenset({"SHARDMQ_CLUSTER_SECRET"})


def known_ini_keys() -> set[tuple[str, str]]:
    """(section, key) pairs broker/config.py accepts today."""
    return {(opt.section, opt.ini_key) for opt in OPTIONS if opt.section}


def known_flags() -> set[str]:
    return {opt.flag for opt in OPTIONS if opt.has_flag} | {"--config"}


def known_env() -> set[str]:
    return {opt.env for opt in OPTIONS} | {"SHARDMQ_CONFIG_FILE"}


def unknown_names(ini: set[tuple[str, str]] = frozenset(), flags: set[str] = frozenset(),
                  env: set[str] = frozenset()) -> list[str]:
    """Names that are neither in broker/config.py nor in DESIGN's table: these are mistakes."""
    bad = [f"[{s}] {k}" for s, k in sorted(ini - known_ini_keys() - DESIGN_INI_KEYS)]
    bad += sorted(flags - known_flags() - DESIGN_FLAGS)
    bad += sorted(env - known_env() - DESIGN_ENV)
    return bad

# Default ports of the listeners DESIGN's table names (the image exposes them, the chart maps them).
DESIGN_DEFAULT_PORTS: dict[str, int] = {
    "amqp": 5672, "amqps": 5671, "mqtt": 1883, "mqtts": 8883, "ws": 15675, "http": 15672,
    "prometheus": 15692, "replication": 5679,
}
