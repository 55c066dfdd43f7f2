"""deploy/systemd/ and deploy/install.sh, checked by systemd's own verifier (Debian's systemd).

No systemd runs as PID 1 here, so the units are not started; `systemd-analyze verify` parses them
the way systemd does (unknown keys, bad values, missing binaries). The node's side of Type=notify
(READY/WATCHDOG/STOPPING on a real NOTIFY_SOCKET) is tested in tests/test_sdnotify.py.
"""

from __future__ import annotations

import configparser
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from broker.config import load_settings
from broker.datadir import DataDir
from tests.design_names import unknown_names

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "deploy" / "systemd"
INSTALL = REPO / "deploy" / "install.sh"
INSTALLED_BINARY = "/opt/shardmq/venv/bin/shardmq"


def analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze not found: scripts/test.sh installs Debian's systemd"
    return path


def verify(*units: Path) -> subprocess.CompletedProcess:
    # --man=no: the units' Documentation= are URLs, not man pages; no manager is asked for anything.
    return subprocess.run([analyze(), "verify", "--man=no", *map(str, units)],
                          capture_output=True, text=True, timeout=60)


def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)  # systemd allows repeated keys
    unit.optionxform = str
    unit.read(path)
    return unit


def staged_install(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    stage = tmp_path / "stage"
    proc = subprocess.run(["bash", str(INSTALL), "--dry-run", "--stage-dir", str(stage), *args],
                          capture_output=True, text=True, timeout=60)
    return proc, stage


def test_shipped_units_verify_except_for_the_not_yet_installed_binary():
    proc = verify(SYSTEMD / "shardmq.service", SYSTEMD / "shardmq-etcd.service")
    # Debian's etcd-server provides /usr/bin/etcd; ShardMQ is installed into /opt/shardmq by
    # install.sh, which is not done on a test machine: that path is the only complaint allowed.
    problems = [line for line in proc.stderr.splitlines() if line.strip()]
    assert problems == [f"shardmq.service: Command {INSTALLED_BINARY} is not executable: No such file or directory"] \
        or (Path(INSTALLED_BINARY).exists() and problems == []), proc.stderr


def test_unit_as_installed_for_a_prefix_verifies_cleanly(tmp_path):
    # install.sh rewrites ExecStart for --prefix: point it at a prefix whose shardmq is this repo's
    # console script, and the unit it would install passes systemd's verifier with no complaint.
    prefix = tmp_path / "prefix"
    (prefix / "venv" / "bin").mkdir(parents=True)
    script = Path(sys.executable).parent / "shardmq"
    os.symlink(script if script.exists() else sys.executable, prefix / "venv" / "bin" / "shardmq")
    proc, stage = staged_install(tmp_path, "--prefix", str(prefix))
    assert proc.returncode == 0, proc.stderr
    unit = stage / "shardmq.service"
    assert read_unit(unit)["Service"]["ExecStart"] == f"{prefix}/venv/bin/shardmq --config /etc/shardmq/shardmq.ini"
    check = verify(unit)
    assert check.returncode == 0 and check.stderr.strip() == "", check.stderr
    etcd = verify(SYSTEMD / "shardmq-etcd.service")
    assert etcd.returncode == 0 and etcd.stderr.strip() == "", etcd.stderr


def test_service_unit_settings():
    service = read_unit(SYSTEMD / "shardmq.service")["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) >= 10
    assert service["EnvironmentFile"] == "-/etc/shardmq/shardmq.env"
    assert int(service["LimitNOFILE"]) >= 65536
    assert service["ProtectSystem"] == "strict" and service["ReadWritePaths"] == "/var/lib/shardmq"
    assert service["NoNewPrivileges"] == "true" and service["PrivateTmp"] == "true"
    assert service["User"] == "shardmq" and service["Restart"] == "on-failure"
    assert service["KillMode"] == "mixed"
    argv = service["ExecStart"].split()
    assert argv[0] == INSTALLED_BINARY
    assert unknown_names(flags={a for a in argv[1:] if a.startswith("--")}) == []


def test_state_directories_are_as_private_as_the_node_requires(tmp_path, caplog):
    """systemd resets a StateDirectory to StateDirectoryMode at every start: it must be the 0700 the
    node requires (shardmq.service said 0750: the node chmodded it back and warned at every start)."""
    modes = {}
    for path in sorted(SYSTEMD.glob("*.service")):
        service = read_unit(path)["Service"]
        if "StateDirectory" in service:
            modes[path.name] = service.get("StateDirectoryMode", "0755")  # systemd's default
    assert set(modes) == {"shardmq.service", "shardmq-etcd.service"}
    assert modes == dict.fromkeys(modes, "0700"), modes
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, int(modes["shardmq.service"], 8))
    with caplog.at_level(logging.WARNING):
        DataDir(str(data)).check_private()  # the node's own check, as at start
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700 and "changed to 0700" not in caplog.text


def test_example_configs_use_design_names_and_known_keys_load(tmp_path):
    # The cluster example: every key is built already or fixed by DESIGN.
    example = configparser.ConfigParser(interpolation=None)
    example.read(SYSTEMD / "shardmq.ini.example")
    pairs = {(s, k) for s in example.sections() for k in example[s]}
    assert ("clustering", "etcd_endpoints") in pairs and ("tls", "cert") in pairs
    env_keys = {line.split("=", 1)[0].lstrip("#") for line in (SYSTEMD / "shardmq.env.example").read_text().splitlines()
                if line.strip() and "=" in line and line.lstrip("#").startswith("SHARDMQ_")}
    assert unknown_names(ini=pairs, env=env_keys) == []
    # The standalone INI install.sh writes loads through the node's config loader as it is today.
    settings = load_settings(["--config", str(SYSTEMD / "shardmq.ini")], {"SHARDMQ_DEFAULT_PASS": "pw"})
    assert (settings.bind, settings.port, settings.http_bind, settings.http_port) == ("0.0.0.0", 5672, "0.0.0.0", 15672)
    assert (settings.data_dir, settings.default_user, settings.default_pass) == ("/var/lib/shardmq", "admin", "pw")
    assert settings.loopback_users == []


def test_etcd_example_forms_a_three_member_cluster():
    env = dict(line.split("=", 1) for line in (SYSTEMD / "etcd.env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    members = env["ETCD_INITIAL_CLUSTER"].split(",")
    assert len(members) == 3 and f"{env['ETCD_NAME']}={env['ETCD_INITIAL_ADVERTISE_PEER_URLS']}" in members
    assert read_unit(SYSTEMD / "shardmq-etcd.service")["Service"]["EnvironmentFile"] == "/etc/shardmq/etcd.env"
    # Every ETCD_* variable is one of etcd's flags (etcd maps --foo-bar to ETCD_FOO_BAR).
    help_text = subprocess.run(["etcd", "--help"], capture_output=True, text=True, timeout=30)
    flags = help_text.stdout + help_text.stderr
    for key in env:
        assert "--" + key[len("ETCD_"):].lower().replace("_", "-") in flags, key


def test_install_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    wheel = tmp_path / "shardmq-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"stand-in: the dry run only names it")
    proc, stage = staged_install(tmp_path, "--wheel", str(wheel), "--prefix", "/srv/mq")
    assert proc.returncode == 0, proc.stderr
    plan = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    expected_in_order = [
        "install -d -m 0755 /srv/mq",
        "python3 -m venv /srv/mq/venv",
        f"/srv/mq/venv/bin/pip install --quiet {wheel}",
        "install -d -m 0700 -o shardmq -g shardmq /var/lib/shardmq",
        f"install -m 0644 {stage}/shardmq.service /etc/systemd/system/shardmq.service",
        "systemctl daemon-reload",
        "systemctl enable --now shardmq.service",
    ]
    positions = [plan.index(cmd) for cmd in expected_in_order]
    assert positions == sorted(positions), plan
    # A generated password, not the example's placeholder; nothing outside the stage dir was written.
    env = (stage / "shardmq.env").read_text()
    password = next(line.split("=", 1)[1] for line in env.splitlines() if line.startswith("SHARDMQ_DEFAULT_PASS="))
    assert password != "change-me" and len(password) >= 24
    assert not Path("/srv/mq").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--wheel", "/nonexistent.whl"], "--wheel /nonexistent.whl: no such file"),
    (["--prefix", "relative/dir"], "--prefix must be an absolute path"),
    (["--frobnicate"], "unknown argument: --frobnicate"),
])
def test_install_bad_arguments(args, message, tmp_path):
    proc, _stage = staged_install(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr



def test_install_script_passes_shellcheck():
    path = shutil.which("shellcheck")
    assert path, "shellcheck not found: scripts/test.sh installs Debian's shellcheck"
    proc = subprocess.run([path, "--shell=bash", str(INSTALL)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
