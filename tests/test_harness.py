"""The real-node harness, exercised against a small stand-in node (this file run as a script).

The stand-in takes the node's flags, completes the AMQP handshake with pamqp, keeps
``sleep`` children as its "workers", respawns them and rewrites run/pids.json like the
real node does. It lets the harness's own waiting, killing and cleanup be tested
without depending on the broker being finished.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT, Node, NodeError, group_members, pid_alive, sweep_stale_nodes

pytestmark = pytest.mark.integration  # starts stand-in node processes

STAND_IN = [sys.executable, "-m", "tests.test_harness"]  # the harness runs commands from the repo root


def stand_in(tmp_path, **kwargs) -> Node:
    kwargs.setdefault("command", STAND_IN)
    kwargs.setdefault("startup_timeout", 10.0)
    kwargs.setdefault("orphan_grace", 0.5)
    return Node(tmp_path / "n", frontends=2, shards=3, **kwargs)


@pytest.fixture
def fake(tmp_path):
    node = stand_in(tmp_path)
    try:
        yield node.start()
    finally:
        node.cleanup()


def test_start_waits_for_amqp_handshake_and_reads_pids(fake):
    pids = fake.pids()
    assert pids["node"] == fake.pid
    assert sorted(pids["frontend"]) == ["0", "1"] and sorted(pids["shard"]) == ["0", "1", "2"]
    assert all(pid_alive(int(p)) for role in ("frontend", "shard") for p in pids[role].values())
    assert fake.url == f"amqp://guest:guest@127.0.0.1:{fake.port}/"
    conn = fake.connect()
    assert conn.is_open
    conn.close()
    assert f"--port {fake.port} --frontends 2 --shards 3" in fake.log_text()


def test_kill_worker_and_wait_for_its_replacement(fake):
    old = fake.kill_worker("shard", 1)
    new = fake.wait_worker_restarted("shard", 1, old)
    assert new != old and pid_alive(new) and not pid_alive(old)
    assert fake.worker_pid("shard", 1) == new
    assert f"SIGKILL shard 1 pid {old}" in fake.log_text()


def test_stop_terminates_node_and_workers(fake):
    workers = [int(p) for role in ("frontend", "shard") for p in fake.pids()[role].values()]
    assert fake.stop() == 0
    assert not fake.running()
    assert not group_members(fake.pgids[-1])
    assert not any(pid_alive(pid) for pid in workers)
    assert fake.orphans_killed == []  # the stand-in stops its own workers on SIGTERM


def test_kill9_then_restart_on_same_port_and_data_dir(fake):
    port, data_dir, first_pid = fake.port, fake.data_dir, fake.pid
    workers = [int(p) for p in fake.pids()["frontend"].values()]
    fake.kill9()
    assert not fake.running()
    fake.restart()
    # The stand-in's workers do not die with their node: the harness swept them and said so.
    assert set(workers) <= set(fake.orphans_killed)
    assert (fake.port, fake.data_dir) == (port, data_dir)
    assert fake.pid != first_pid and fake.pids()["node"] == fake.pid
    assert fake.log_text().count("=== harness: start #") == 2


def test_startup_failure_reports_exit_status_and_log(tmp_path):
    node = stand_in(tmp_path, command=[sys.executable, "-c", "import sys; print('no broker here'); sys.exit(3)"])
    with pytest.raises(NodeError, match=r"(?s)exited with status 3.*no broker here"):
        node.start()
    node.cleanup()


def test_port_without_amqp_is_not_ready(tmp_path):
    listener = (
        "import socket, sys, time; s = socket.socket(); "
        "s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1]))); s.listen(); time.sleep(60)"
    )
    node = stand_in(tmp_path, command=[sys.executable, "-c", listener], startup_timeout=1.5)
    try:
        with pytest.raises(NodeError, match="not ready after"):
            node.start()
    finally:
        node.cleanup()
    assert not group_members(node.pgids[-1])


KILLED_RUN = """
import sys, time
from pathlib import Path
from tests.harness import Node
node = Node(Path(sys.argv[1]), frontends=1, shards=1, command=[sys.executable, "-m", "tests.test_harness"],
            startup_timeout=10.0, registry=Path(sys.argv[2])).start()
print(node.pid, flush=True)
time.sleep(3600)  # killed here, as a test run killed mid-test: no teardown runs
"""


def test_a_killed_runs_nodes_are_swept_by_the_next_run_by_recorded_pid(tmp_path):
    registry = tmp_path / "registry"
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tmp_path / "n"), str(registry)],
                           stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO_ROOT)
    try:
        pgid = int(run.stdout.readline())
        assert group_members(pgid), "the stand-in node did not start"
        other = stand_in(tmp_path / "alive", registry=registry).start()  # a live run's node
        try:
            assert sweep_stale_nodes(registry) == []  # its owner (the "run") is still alive
            run.kill()
            run.wait()
            assert group_members(pgid), "the node should outlive its killed test run"
            assert sweep_stale_nodes(registry) == [pgid]
            assert not group_members(pgid)
            assert other.running(), "a live run's node (this test's) was swept"
            assert sorted(p.name for p in registry.glob("*.json")) == [f"{other.pid}.json"]
        finally:
            other.cleanup()
        assert list(registry.glob("*.json")) == []
    finally:
        run.kill()
        run.wait()
        if group_members(pgid):
            os.killpg(pgid, 9)


# ---------------------------------------------------------------------------- the stand-in node
def _serve_stand_in() -> None:
    import argparse
    import asyncio
    import json
    import signal

    from pamqp import commands, frame

    parser = argparse.ArgumentParser()
    for flag in ("--data-dir", "--port", "--frontends", "--shards", "--log-level"):
        parser.add_argument(flag)
    # Every listener's port flag the harness passes (--http-port, --mqtt-port, ...) is not the stand-in's business.
    args, _listener_ports = parser.parse_known_args()
    run_dir = os.path.join(args.data_dir, "run")
    os.makedirs(run_dir, exist_ok=True)
    workers: dict[tuple[str, int], subprocess.Popen] = {}

    def spawn(role: str, index: int) -> None:
        workers[role, index] = subprocess.Popen(["sleep", "3600"])
        pids: dict = {"node": os.getpid(), "frontend": {}, "shard": {}}
        for (r, i), proc in workers.items():
            pids[r][str(i)] = proc.pid
        with open(os.path.join(run_dir, "pids.json.tmp"), "w") as fh:
            json.dump(pids, fh)
        os.replace(os.path.join(run_dir, "pids.json.tmp"), os.path.join(run_dir, "pids.json"))

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handshake(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the harness's bare TCP probe connects and leaves

    async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(8)
        writer.write(frame.marshal(commands.Connection.Start(), 0))
        buf = b""
        while True:
            data = await reader.read(65536)
            if not data:
                return
            buf += data
            while buf:
                try:
                    used, channel, method = frame.unmarshal(buf)
                except Exception:  # incomplete frame: read more
                    break
                buf = buf[used:]
                reply = {
                    "Connection.StartOk": commands.Connection.Tune(2047, 131072, 0),
                    "Connection.Open": commands.Connection.OpenOk(),
                    "Channel.Open": commands.Channel.OpenOk(),
                    "Channel.Close": commands.Channel.CloseOk(),
                    "Connection.Close": commands.Connection.CloseOk(),
                }.get(method.name)
                if reply is not None:
                    writer.write(frame.marshal(reply, channel))
                if method.name == "Connection.Close":
                    await writer.drain()
                    writer.close()
                    return

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        for role, count in (("frontend", int(args.frontends)), ("shard", int(args.shards))):
            for index in range(count):
                spawn(role, index)
        server = await asyncio.start_server(connection, "127.0.0.1", int(args.port))
        print("stand-in node up", flush=True)
        while not stop.is_set():
            for (role, index), proc in list(workers.items()):
                if proc.poll() is not None:
                    spawn(role, index)
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass
        server.close()
        for proc in workers.values():
            proc.kill()
            proc.wait()

    asyncio.run(main())


if __name__ == "__main__":
    _serve_stand_in()
