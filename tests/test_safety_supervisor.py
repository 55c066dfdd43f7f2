"""A supervisor never loses a child, even when run/pids.json cannot be written (issue #9, item 3)."""

from __future__ import annotations

import os
import signal
import time

from tests.harness import Node, pid_alive, wait_until
from tests.test_worker_crash import connect_retry, name_on_shard

# Separate frontend and shard processes (--colocate off, tests/conftest.py): workers are found by their command line (shard.main) and killed one role at a time.
COLOCATE = "off"


def shard_children(node: Node, index: int) -> list[int]:
    """Live children of the node process running `shard.main --index <index>` (read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z" or int(fields[1]) != node.pid:
            continue
        if b"shard.main" in argv and argv[argv.index(b"--index") + 1] == str(index).encode():
            out.append(int(entry))
    return out


def wait_new_shard(node: Node, index: int, old: int, timeout: float = 20.0) -> int:
    pids = wait_until(lambda: [p for p in shard_children(node, index) if p != old and pid_alive(p)], timeout,
                      f"shard {index} restarted after killing pid {old}", 0.05, context=node.log_tail)
    return pids[0]


def test_shard_restarted_even_when_pids_json_cannot_be_written(node_factory):
    node = node_factory(frontends=1, shards=2)
    queue = name_on_shard("sup", 0, 2)
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    conn.close()
    # From now on writing run/pids.json fails (as on a full disk): its temp file name is a directory.
    os.mkdir(node.data_dir / "run" / "pids.json.tmp")
    first = node.worker_pid("shard", 0)
    os.kill(first, signal.SIGKILL)
    second = wait_new_shard(node, 0, first)
    # The supervisor logs the failed write after it started the new process: wait for the line, not for the pid.
    wait_until(lambda: "cannot write" in node.log_text(), 20, "the failed pids.json write logged", context=node.log_tail)
    # The second incarnation was started while pids.json failed: it must be watched all the same.
    os.kill(second, signal.SIGKILL)
    wait_new_shard(node, 0, second)
    deadline = time.monotonic() + 20
    while True:
        conn = connect_retry(node)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", queue, b"after", mandatory=True)
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            assert body == b"after"
            break
        except Exception:
            # Connections with state on the restarting shard may be closed while it comes back.
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)
        finally:
            if conn.is_open:
                conn.close()
