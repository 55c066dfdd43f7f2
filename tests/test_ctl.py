"""shardmqctl against a real node: tables, --format json, exit statuses, credentials from flags/env/INI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from tests.helpers import uid
from tests.mgmt_api import connect

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cnode(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("ctl_node"))
    try:
        yield factory(name="node", extra_args=["--stats-interval", "200"])
    finally:
        factory.cleanup()


@pytest.fixture
def ctl(cnode, tmp_path):
    home = tmp_path / "home"
    home.mkdir()

    def run(*args: str, env: dict | None = None, ok: bool | None = True) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQCTL_")}
        full_env.update(HOME=str(home), PYTHONPATH=str(REPO_ROOT),
                        SHARDMQCTL_URL=f"http://127.0.0.1:{cnode.http_port}")
        full_env.update(env or {})
        proc = subprocess.run([sys.executable, "-m", "broker.ctl", *args], capture_output=True, text=True,
                              env=full_env, timeout=30, cwd=str(REPO_ROOT))
        if ok is True:
            assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc
    run.home = home
    return run


def test_status_and_lists(cnode, ctl):
    qn = uid("ctlq")
    conn = cnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn)
    ch.basic_publish("", qn, b"x")
    out = ctl("status").stdout
    assert "queues:" in out and "alarms:" in out
    lines = ctl("list_queues", "name", "messages").stdout.splitlines()
    assert lines[0].split() == ["name", "messages"]
    rows = json.loads(ctl("list_queues", "--format", "json").stdout)
    assert any(r["name"] == qn for r in rows)
    assert "amq.topic" in ctl("list_exchanges").stdout
    assert json.loads(ctl("list_connections", "--format", "json").stdout)[0]["user"] == "guest"
    conn.close()


def test_users_vhosts_permissions_policies(cnode, ctl):
    ctl("add_vhost", "ctlv")
    assert "ctlv" in ctl("list_vhosts").stdout
    ctl("add_user", "ctluser", "pw1", "--tags", "management")
    assert ctl("add_user", "ctluser", "pw1", ok=None).returncode == 1
    ctl("-p", "ctlv", "set_permissions", "ctluser", ".*", ".*", ".*")  # -p before the command works too
    perms = json.loads(ctl("list_permissions", "-p", "ctlv", "--format", "json").stdout)
    assert {"user": "ctluser", "configure": ".*", "write": ".*", "read": ".*"} in perms
    connect(cnode, "ctluser", "pw1", vhost="ctlv").close()
    ctl("change_password", "ctluser", "pw2")
    connect(cnode, "ctluser", "pw2", vhost="ctlv").close()
    ctl("set_user_tags", "ctluser", "monitoring")
    users = json.loads(ctl("list_users", "--format", "json").stdout)
    assert {"name": "ctluser", "tags": ["monitoring"]} in users
    connect(cnode, "ctluser", "pw2", vhost="ctlv").close()  # tags kept the password
    ctl("set_policy", "-p", "ctlv", "cap", "^c-", '{"max-length": 5}', "--apply-to", "queues")
    assert "cap" in ctl("list_policies", "-p", "ctlv").stdout
    ctl("clear_policy", "-p", "ctlv", "cap")
    ctl("set_vhost_limits", "-p", "ctlv", '{"max-connections": 10}')
    ctl("clear_permissions", "-p", "ctlv", "ctluser")
    ctl("delete_user", "ctluser")
    ctl("delete_vhost", "ctlv")
    assert "ctlv" not in ctl("list_vhosts").stdout


def test_queue_commands_and_connection_close(cnode, ctl):
    qn = uid("ctlp")
    conn = cnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn)
    ch.basic_publish("", qn, b"x")
    ctl("purge_queue", qn)
    assert ch.queue_declare(qn, passive=True).method.message_count == 0
    ctl("delete_queue", qn)
    # Connections reach the node in the frontends' periodic STATS: wait for ours to be listed.
    deadline = time.monotonic() + 10
    while not (conns := json.loads(ctl("list_connections", "--format", "json").stdout)):
        assert time.monotonic() < deadline, "the connection was never listed"
        time.sleep(0.1)
    ctl("close_connection", conns[0]["name"], "maintenance")
    assert ctl("delete_queue", uid("nope"), ok=None).returncode == 1


def test_export_import_definitions(cnode, ctl, tmp_path):
    path = tmp_path / "defs.json"
    ctl("export_definitions", str(path))
    data = json.loads(path.read_text())
    data["vhosts"].append({"name": "from-file"})
    path.write_text(json.dumps(data))
    ctl("import_definitions", str(path))
    assert "from-file" in ctl("list_vhosts").stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    proc = ctl("import_definitions", str(bad), ok=None)
    assert proc.returncode == 1 and "not JSON" in proc.stderr
    ctl("delete_vhost", "from-file")


def test_errors_and_credentials(cnode, ctl):
    proc = ctl("list_queues", env={"SHARDMQCTL_PASSWORD": "wrong"}, ok=None)
    assert proc.returncode == 1 and "401" in proc.stderr
    proc = ctl("no_such_command", ok=None)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = ctl("set_policy", "onlyname", ok=None)
    assert proc.returncode == 2 and "required" in proc.stderr
    proc = ctl("status", env={"SHARDMQCTL_URL": "http://127.0.0.1:1"}, ok=None)
    assert proc.returncode == 1 and "cannot reach" in proc.stderr
    # ~/.shardmqctl.ini supplies credentials; flags win over it.
    Path(ctl.home, ".shardmqctl.ini").write_text("[shardmqctl]\nusername = guest\npassword = wrong\n")
    assert ctl("status", ok=None).returncode == 1
    ctl("status", "--password", "guest")
    Path(ctl.home, ".shardmqctl.ini").write_text("[shardmqctl]\nusername = guest\npassword = guest\n")
    ctl("status")
