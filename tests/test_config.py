"""Node settings: precedence of the four sources, validation messages, --help."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from broker.config import OPTIONS, Settings, default_data_dir, load_settings, setup_logging
from broker.cpus import available_cpus, default_frontends, default_shards

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_ini(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "shardmq.ini"
    path.write_text(text)
    return path


def load_error(capsys, argv, environ=None) -> str:
    with pytest.raises(SystemExit) as exc_info:
        load_settings(argv, environ or {})
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardmq")
    return err.strip().splitlines()[-1]


def test_defaults(tmp_path):
    s = load_settings([], {"SHARDMQ_DATA_DIR": str(tmp_path)})
    assert s.data_dir == str(tmp_path)
    assert (s.bind, s.port, s.heartbeat, s.frame_max, s.channel_max) == ("127.0.0.1", 5672, 60, 131072, 2047)
    assert (s.frontends, s.shards) == (default_frontends(available_cpus()), default_shards(available_cpus()))
    assert (s.max_message_size, s.segment_size) == (134217728, 8388608)
    assert (s.default_user, s.default_pass, s.loopback_users) == ("guest", "guest", ["guest"])
    assert (s.sync, s.log_level, s.config_file) == ("fsync", "info", None)
    assert s.run_dir == os.path.join(str(tmp_path), "run")
    assert s.pids_file == os.path.join(str(tmp_path), "run", "pids.json")


def test_default_data_dir_without_env():
    path = default_data_dir({})
    if os.geteuid() == 0 and os.access("/var/lib", os.W_OK):
        assert path == "/var/lib/shardmq"
    else:
        assert path == os.path.expanduser("~/.local/share/shardmq")
    assert load_settings([], {}).data_dir == path


def test_precedence_defaults_ini_env_flags(tmp_path):
    ini = write_ini(tmp_path, """
[main]
frontends = 3
shards = 5
log_level = warning
sync = none
[amqp]
port = 1111
bind = 0.0.0.0
heartbeat = 10
default_pass = from-ini
""")
    environ = {"SHARDMQ_PORT": "2222", "SHARDMQ_SHARDS": "6", "SHARDMQ_HEARTBEAT": "20"}
    s = load_settings(["--config", str(ini), "--port", "3333", "--data-dir", str(tmp_path / "d")], environ)
    assert s.port == 3333  # flag > env > ini
    assert s.shards == 6 and s.heartbeat == 20  # env > ini
    assert (s.frontends, s.log_level, s.sync, s.bind, s.default_pass) == (3, "warning", "none", "0.0.0.0", "from-ini")
    assert s.frame_max == 131072  # untouched by any source: default
    assert s.data_dir == str(tmp_path / "d")
    assert s.config_file == str(ini)


def test_config_file_from_env_and_empty_env_is_unset(tmp_path):
    ini = write_ini(tmp_path, "[amqp]\nport = 1234\n")
    s = load_settings([], {"SHARDMQ_CONFIG_FILE": str(ini), "SHARDMQ_PORT": "", "SHARDMQ_DATA_DIR": "x"})
    assert s.port == 1234
    assert s.data_dir == os.path.abspath("x")


# A value per option that differs from its default; a new option must be added here.
SAMPLES = {
    "data_dir": "/tmp/shardmq-sample", "frontends": "3", "shards": "7", "segment_size": "1048576",
    "sync": "none", "log_level": "debug", "bind": "0.0.0.0", "port": "4000", "heartbeat": "5",
    "frame_max": "8192", "channel_max": "16", "max_message_size": "1000", "default_user": "bob",
    "default_pass": "secret", "loopback_users": "none", "definitions": "/tmp/shardmq-defs.json",
    "set_timestamp": "1", "consumer_timeout": "60000", "http_port": "8080", "http_bind": "0.0.0.0", "https_port": "0",
    "stats_interval": "250", "shard_hang_timeout": "12.5", "trace_stages": "/tmp/trace", "ipc_transport": "zmq", "colocate": "on", "queue_placement": "hash", "delete_rate": "500", "prometheus_port": "9999", "prometheus_tls_port": "9998",
    "disk_free_limit": "mem_relative:1.5",
    "vm_memory_high_watermark": "2GB",
    "mqtt_port": "0", "mqtt_max_packet_size": "4096",
    "mqtt_max_inflight": "7", "mqtt_allow_anonymous": "1", "amqps_port": "0", "mqtts_port": "0", "tls_cert": "/tmp/c.pem",
    "tls_key": "/tmp/k.pem", "tls_ca": "/tmp/ca.pem", "tls_verify_peer": "1",
    "proxy_protocol": "1", "ws_port": "0", "wss_port": "0",
    "cluster": "true", "etcd_endpoints": "10.0.0.1:2379,10.0.0.2:2379", "etcd_prefix": "mq1",
    "node_name": "n1", "advertised_host": "n1.example", "lease_ttl": "3",
    "cluster_secret_file": "/tmp/shardmq-secret", "replication_port": "6000", "replication_bind": "0.0.0.0",
    "min_isr": "2", "replication_ack_timeout": "7", "replication_file_list_timeout": "90", "follow": "h1:5679",
    "replication_heartbeat": "0.5", "replication_heartbeat_timeout": "30",
}
# Settings some samples need to be valid (a cluster node needs a secret; --follow needs --cluster).
NEEDS = {"cluster": {"SHARDMQ_CLUSTER_SECRET": "s"}, "follow": {"SHARDMQ_CLUSTER": "1", "SHARDMQ_CLUSTER_SECRET": "s"}}


@pytest.mark.parametrize("opt", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_option_settable_from_ini_env_and_flag(tmp_path, opt):
    raw = SAMPLES[opt.name]
    base = NEEDS.get(opt.name, {})
    ini = write_ini(tmp_path, f"[{opt.section}]\n{opt.ini_key} = {raw}\n")
    from_ini = getattr(load_settings(["--config", str(ini)], base), opt.name)
    from_env = getattr(load_settings([], {**base, opt.env: raw}), opt.name)
    assert from_ini == from_env != getattr(Settings(), opt.name)
    if opt.has_flag:
        argv = [opt.flag] if opt.kind == "bool" else [opt.flag, raw]
        assert getattr(load_settings(argv, base), opt.name) == from_env
    assert set(SAMPLES) == {o.name for o in OPTIONS}


def test_mqtt_section_uses_the_design_key_names(tmp_path):
    ini = write_ini(tmp_path, "[mqtt]\nport = 1999\nmax_inflight = 3\n")
    s = load_settings(["--config", str(ini)], {})
    assert (s.mqtt_port, s.mqtt_max_inflight, s.port) == (1999, 3, 5672)
    assert load_settings(["--mqtt-port", "0"], {}).mqtt_port == 0
    bad = write_ini(tmp_path, "[mqtt]\nmqtt_port = 1\n")
    result = run_cli("--config", str(bad))
    assert result.returncode == 2 and "unknown key [mqtt] mqtt_port" in result.stderr


def test_lists_and_choices_are_normalised():
    assert load_settings(["--loopback-users", " a , b,,"], {}).loopback_users == ["a", "b"]
    assert load_settings(["--loopback-users", "none"], {}).loopback_users == []
    assert load_settings(["--log-level", "DEBUG", "--sync", "None"], {}).log_level == "debug"


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--frontends", "0"], {}, "shardmq: error: --frontends must be >= 1"),
        (["--shards", "-1"], {}, "shardmq: error: --shards must be >= 1"),
        (["--port", "abc"], {}, "shardmq: error: --port: invalid int 'abc'"),
        (["--port", "70000"], {}, "shardmq: error: --port must be <= 65535"),
        (["--frame-max", "100"], {}, "shardmq: error: --frame-max must be >= 4096"),
        (["--channel-max", "0"], {}, "shardmq: error: --channel-max must be >= 1"),
        (["--heartbeat", "-5"], {}, "shardmq: error: --heartbeat must be >= 0"),
        (["--max-message-size", "0"], {}, "shardmq: error: --max-message-size must be >= 1"),
        (["--segment-size", "10"], {}, "shardmq: error: --segment-size must be >= 65536"),
        (["--sync", "always"], {}, "shardmq: error: --sync: invalid choice 'always' (choose from fsync, none)"),
        (["--log-level", "loud"], {}, "shardmq: error: --log-level: invalid choice 'loud'"),
        (["--ipc-transport", "tcp"], {}, "shardmq: error: --ipc-transport: invalid choice 'tcp' (choose from unix, zmq)"),
        (["--bind", " "], {}, "shardmq: error: --bind must not be empty"),
        (["--nope"], {}, "shardmq: error: unrecognized arguments: --nope"),
        (["--lease-ttl", "0"], {}, "shardmq: error: --lease-ttl must be >= 1"),
        ([], {"SHARDMQ_CLUSTER": "maybe"}, "shardmq: error: SHARDMQ_CLUSTER: invalid boolean 'maybe'"),
        ([], {"SHARDMQ_FRONTENDS": "0"}, "shardmq: error: SHARDMQ_FRONTENDS must be >= 1"),
        ([], {"SHARDMQ_PORT": "x1"}, "shardmq: error: SHARDMQ_PORT: invalid int 'x1'"),
        ([], {"SHARDMQ_SYNC": "sometimes"}, "shardmq: error: SHARDMQ_SYNC: invalid choice 'sometimes'"),
        (["--consumer-timeout", "-1"], {}, "shardmq: error: --consumer-timeout must be >= 0"),
        ([], {"SHARDMQ_CONSUMER_TIMEOUT": "30m"},
         "shardmq: error: SHARDMQ_CONSUMER_TIMEOUT: invalid int '30m'"),
        (["--replication-heartbeat", "-1"], {}, "shardmq: error: --replication-heartbeat must be >= 0"),
        (["--replication-heartbeat", "1s"], {}, "shardmq: error: --replication-heartbeat: invalid number '1s'"),
        ([], {"SHARDMQ_REPLICATION_HEARTBEAT_TIMEOUT": "nan"},
         "shardmq: error: SHARDMQ_REPLICATION_HEARTBEAT_TIMEOUT: invalid number 'nan'"),
        (["--replication-heartbeat-timeout", "0"], {},
         "shardmq: error: --replication-heartbeat-timeout must be >= 0.1"),
        (["--replication-heartbeat", "5"], {},
         "shardmq: error: --replication-heartbeat-timeout (10) must be at least 3 x --replication-heartbeat (5)"),
    ],
)
def test_invalid_values_exit_2_naming_the_source(capsys, argv, environ, message):
    assert load_error(capsys, argv, environ).startswith(message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[amqp]\nport = abc\n", "[amqp] port: invalid int 'abc'"),
        ("[main]\nfrontends = 0\n", "[main] frontends must be >= 1"),
        ("[main]\nport = 1\n", "unknown key [main] port (known: data_dir,"),
        ("[amqp]\nprot = 1\n", "unknown key [amqp] prot"),
        ("[storage]\nx = 1\n", "unknown section [storage] (known: [main], [amqp], [mqtt]"),
        ("port = 1\n", "File contains no section headers"),
        ("[amqp]\nport = 1\nport = 2\n", "option 'port' in section 'amqp' already exists"),
    ],
)
def test_invalid_ini_exit_2_naming_file_section_and_key(capsys, tmp_path, monkeypatch, text, message):
    write_ini(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    line = load_error(capsys, ["--config", "shardmq.ini"])
    assert line.startswith("shardmq: error: config file shardmq.ini: ")
    assert message in line


def test_missing_config_file(capsys, tmp_path):
    line = load_error(capsys, ["--config", str(tmp_path / "nope.ini")])
    assert line == f"shardmq: error: config file {tmp_path / 'nope.ini'}: cannot read: No such file or directory"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_")}
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *args], cwd=REPO_ROOT, env={**clean, **(env or {})},
        capture_output=True, text=True, timeout=30,
    )


def test_cli_rejects_bad_flag_with_status_2():
    result = run_cli("--frontends", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "shardmq: error: --frontends must be >= 1"
    assert result.stdout == ""


def test_cli_rejects_bad_env_with_status_2():
    result = run_cli(env={"SHARDMQ_PORT": "abc"})
    assert result.returncode == 2
    assert "shardmq: error: SHARDMQ_PORT: invalid int 'abc'" in result.stderr


def test_cli_help_lists_every_flag_ini_section_and_env_var():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: shardmq")
    for opt in OPTIONS:
        if opt.has_flag:
            help_lines = [line for line in out.splitlines() if line.strip().startswith(opt.flag + " ")]
            assert help_lines and len(help_lines[0].split(None, 2)) == 3, f"{opt.flag} has no one-line help"
        assert opt.env in out
        assert f"[{opt.section}] {opt.ini_key}" in out
    assert "--config FILE" in out and "SHARDMQ_CONFIG_FILE" in out


def test_readme_documents_every_setting():
    readme = (REPO_ROOT / "README.md").read_text()
    for opt in OPTIONS:
        assert opt.env in readme, opt.env
        assert f"[{opt.section}] {opt.ini_key}" in readme or f"`{opt.name}`" in readme, opt.name
        if opt.has_flag:
            assert opt.flag in readme, opt.flag


def test_replication_heartbeat_takes_fractions_and_0_turns_it_off():
    s = load_settings(["--replication-heartbeat", "0.25", "--replication-heartbeat-timeout", "0.75"], {})
    assert (s.replication_heartbeat, s.replication_heartbeat_timeout) == (0.25, 0.75)
    # Off: no heartbeat to compare the timeout with.
    assert load_settings(["--replication-heartbeat", "0", "--replication-heartbeat-timeout", "0.5"],
                         {}).replication_heartbeat == 0
    assert (Settings().replication_heartbeat, Settings().replication_heartbeat_timeout) == (2.0, 10.0)


def test_shard_hang_timeout_defaults_to_30_s_takes_fractions_and_0_turns_it_off():
    assert Settings().shard_hang_timeout == 30.0
    assert load_settings(["--shard-hang-timeout", "1.5"], {}).shard_hang_timeout == 1.5
    assert load_settings(["--shard-hang-timeout", "0"], {}).shard_hang_timeout == 0


def test_consumer_timeout_defaults_to_rabbitmqs_30_minutes_and_0_turns_it_off():
    assert Settings().consumer_timeout == 30 * 60 * 1000
    assert load_settings(["--consumer-timeout", "0"], {}).consumer_timeout == 0


def test_settings_round_trip_through_msgpack(tmp_path):
    s = load_settings(["--data-dir", str(tmp_path), "--loopback-users", "a,b", "--port", "1"], {})
    assert Settings.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict()))) == s
    assert Settings.from_dict({**s.to_dict(), "added_later": 1}) == s


def test_setup_logging_names_the_process_role(capfd):
    try:
        setup_logging("debug", "shard-3")
        logging.getLogger("shardmq.test").debug("hello %s", "there")
        err = capfd.readouterr().err
        assert " DEBUG [shard-3] shardmq.test: hello there" in err
        setup_logging("warning", "frontend-0")
        logging.getLogger("shardmq.test").info("hidden")
        assert "hidden" not in capfd.readouterr().err
    finally:
        logging.basicConfig(force=True, level=logging.WARNING)
