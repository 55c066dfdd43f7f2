"""Boot time of a node holding many durable queues (issue #15).

    python -m loadtest.boot_time --queues 100000 --data-dir /tmp/boot100k [--boots 3] [-- NODE ARGS]

Starts this checkout's node on free loopback ports with DATA_DIR, declares durable queues until
there are --queues of them (pipelined on one channel; kept across runs, so a second run only
measures), stops it (SIGTERM), then --boots times: starts it, measures the wall time until an AMQP
handshake succeeds (``amqp_s``: a frontend listens, which it does once every shard has loaded its
queues) and a passive declare of the last queue is answered (``ready_s``), and stops it again.
Prints one JSON line per boot: those wall seconds, the CPU seconds the node and its workers used
to get there (``cpu_s``, and per process in ``cpu``: node, shard-N, frontend-N, pair-N) and the
load average.

``--mqtt-sessions N`` writes, before each timed boot, N MQTT session records in the old shared KV
log of the default vhost (as before the per-shard logs, broker/kv_layout.py): each boot then reads
and places them all, as the first boot after an upgrade (or a shard-count change) does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pamqp import commands

from loadtest.amqp_client import AMQPClient, AMQPClosed
from loadtest.node_process import spawn_node
from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


_ROLES = {"shard.main": "shard", "frontend.main": "frontend", "shard.pair_main": "pair"}


def _process_name(pid: int) -> str:
    """node, or the worker's role and index from its command line (broker/supervisor.py)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    role = next((_ROLES[a] for a in argv if a in _ROLES), None)
    if role is None:
        return "node"
    index = argv[argv.index("--index") + 1] if "--index" in argv[:-1] else "?"
    return f"{role}-{index}"


def _cpu_by_process(pid: int) -> dict[str, float]:
    """utime + stime of pid and of its live children, in seconds, by process name."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    out: dict[str, float] = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "node" if p == pid else _process_name(p)
        out[name] = round(out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks, 2)
    return out


def _start(data_dir: Path, port: int, extra: list[str], root: Path = ROOT) -> subprocess.Popen:
    argv = [sys.executable, "-m", "broker.cli", "--data-dir", str(data_dir), "--port", str(port),
            "--http-port", "0", "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0", *extra]
    return spawn_node(argv, data_dir.parent / f"{data_dir.name}-logs", root)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _ready(uri: str, last_queue: str, deadline: float) -> float:
    """Wait until a passive declare of last_queue is answered; the time the first handshake succeeded."""
    handshake = None
    while time.monotonic() < deadline:
        try:
            with AMQPClient(uri, timeout=5).connect() as c:
                if handshake is None:
                    handshake = time.monotonic()
                c.queue_declare(last_queue, passive=True, durable=True)
                return handshake
        except (OSError, AMQPClosed):
            time.sleep(0.05)
    raise SystemExit("the node did not become ready")


def _old_shared_session_log(data_dir: Path, sessions: int) -> None:
    """kv/ holding only an old shared log of `sessions` session records of vhost "/" (see the module doc)."""
    import shutil

    from broker.datadir import name_hash
    from broker.kv_log import KV_DIR, encode
    from broker.mqtt.placement import SESSIONS

    root = data_dir / KV_DIR
    shutil.rmtree(root, ignore_errors=True)
    vdir = root / name_hash("/")
    vdir.mkdir(parents=True, mode=0o700)
    with open(vdir / f"{name_hash(SESSIONS)}.log", "wb") as f:
        for start in range(0, sessions, 10_000):
            f.write(b"".join(encode(f"boot-session-{i}", {"subs": {f"boot/{i}/#": 1}, "out2": [], "pub2": []})
                             for i in range(start, min(sessions, start + 10_000))))


def _declare(uri: str, names: list[str]) -> None:
    from broker.amqp import encoder

    with AMQPClient(uri).connect() as c:
        for start in range(0, len(names), 500):
            chunk = names[start : start + 500]
            c.send(b"".join(encoder.encode_method(1, commands.Queue.Declare(queue=q, durable=True))
                            for q in chunk))
            for _ in chunk:
                c._wait_method(1, commands.Queue.DeclareOk)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.boot_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--queues", type=int, default=100_000, help="durable queues the node holds (default 100000)")
    p.add_argument("--data-dir", required=True, help="the node's data dir (kept: later runs reuse the queues)")
    p.add_argument("--boots", type=int, default=1, help="boots to time (default 1)")
    p.add_argument("--prefix", default="boot-q", help="queue name prefix (default boot-q)")
    p.add_argument("--mqtt-sessions", type=int, default=0,
                   help="MQTT session records to place at each boot (old shared KV log, see above; default 0)")
    p.add_argument("--checkout", default=str(ROOT),
                   help="the checkout whose node is timed (default: this one; another for an A/B)")
    p.add_argument("node_args", nargs=argparse.REMAINDER, help="after --: more node arguments")
    args = p.parse_args(argv)
    extra = [a for a in args.node_args if a != "--"]
    data_dir = Path(args.data_dir).resolve()
    port = free_port()
    uri = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    names = [f"{args.prefix}-{i}" for i in range(args.queues)]
    root = Path(args.checkout).resolve()
    proc = _start(data_dir, port, extra, root)
    try:
        _ready_handshake(uri, time.monotonic() + 120)
        with AMQPClient(uri).connect() as c:
            held = c.queue_exists(names[-1])
        if not held:  # declared in order: the last one exists once all do
            t = time.monotonic()
            _declare(uri, names)
            print(json.dumps({"declared": len(names), "declare_s": round(time.monotonic() - t, 2)}), flush=True)
    finally:
        _stop(proc)
    for i in range(args.boots):
        if args.mqtt_sessions:
            _old_shared_session_log(data_dir, args.mqtt_sessions)
        t0 = time.monotonic()
        proc = _start(data_dir, port, extra, root)
        try:
            handshake = _ready(uri, names[-1], t0 + 600)
            wall = time.monotonic() - t0
            cpu = _cpu_by_process(proc.pid)
            print(json.dumps({"boot": i + 1, "queues": len(names), "mqtt_sessions": args.mqtt_sessions,
                              "amqp_s": round(handshake - t0, 2),
                              "ready_s": round(wall, 2), "cpu_s": round(sum(cpu.values()), 2), "cpu": cpu,
                              "load": os.getloadavg()[0]}), flush=True)
        finally:
            _stop(proc)
    return 0


def _ready_handshake(uri: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            AMQPClient(uri, timeout=5).connect().close()
            return
        except (OSError, AMQPClosed):
            time.sleep(0.05)
    raise SystemExit("the node did not start")


if __name__ == "__main__":
    raise SystemExit(main())
