"""--colocate: frontend K and shard K in one process, talking through the in-process link.

Real nodes, real clients (pika). A pair is one OS process (shard/pair_main.py) that the node treats
as both workers: one pid for both in pids.json, a kill -9 restarts both roles, memory counted once.
Between the pair's frontend and shard no socket carries data (broker/local_link.py); links to the
other pair's shard, shard-to-shard forwards and the control plane stay sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pika

from broker.config import load_settings
from broker.cpus import colocated_pairs
from tests.harness import REPO_ROOT, pid_alive, wait_until
from tests.helpers import connections_on_two_frontends, names_on_different_shards, uid

QUEUE_PLACEMENT = "hash"  # queue names picked per shard (names_on_different_shards)
ON = ["--colocate", "on"]

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def connected_streams(path: str) -> int:
    """Connected unix stream sockets bound to ``path`` (a listener's accepted connections)."""
    with open("/proc/net/unix") as fh:
        return sum(1 for line in fh.readlines()[1:]
                   if line.split()[-1] == path and line.split()[5] == "03")


def paired_pid(node, index: int) -> int:
    pids = node.pids()
    assert pids["frontend"][str(index)] == pids["shard"][str(index)], pids
    return int(pids["shard"][str(index)])


def consume_bodies(ch, queue: str, n: int, auto_ack: bool = True, ack: bool = False) -> list[tuple]:
    """``n`` deliveries of a consumer on ``queue``; ``ack``: acked (multiple) before the cancel."""
    got = []
    deadline = time.monotonic() + 15
    for method, props, body in ch.consume(queue, auto_ack=auto_ack, inactivity_timeout=0.5):
        if method is not None:
            got.append((method, props, body))
            if len(got) == n:
                break
        assert time.monotonic() < deadline, f"{len(got)} of {n} arrived"
    if ack:
        ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    ch.cancel()
    return got


def test_one_pair_serves_through_the_in_process_link(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=ON)
    pid = paired_pid(node, 0)
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        assert b"shard.pair_main" in fh.read()
    # The frontend's two lanes to its own shard are in-process: nothing connected to the shard's socket.
    assert connected_streams(str(node.data_dir / "run" / "shard-0.stream")) == 0

    conn = node.connect()
    ch = conn.channel()
    # No-ack: order kept across the link.
    q = uid("noack")
    ch.queue_declare(q)
    for i in range(300):
        ch.basic_publish("", q, str(i).encode())
    got = consume_bodies(ch, q, 300)
    assert [b for _m, _p, b in got] == [str(i).encode() for i in range(300)]

    # Manual ack, a nack with requeue: the message comes back redelivered, then the ack removes it.
    q2 = uid("ack")
    ch.queue_declare(q2)
    ch.basic_publish("", q2, b"once")
    (method, _p, body), = consume_bodies(ch, q2, 1, auto_ack=False)
    ch.basic_nack(method.delivery_tag, requeue=True)
    (method, _p, body), = consume_bodies(ch, q2, 1, auto_ack=False)
    assert body == b"once" and method.redelivered
    ch.basic_ack(method.delivery_tag)
    wait_until(lambda: ch.queue_declare(q2, passive=True).method.message_count == 0, 10, "ack handled")

    # Confirms of persistent messages, kept across a clean restart.
    q3 = uid("durable")
    ch.queue_declare(q3, durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", q3, f"p{i}".encode(), properties=PERSISTENT)  # raises if nacked
    conn.close()
    assert node.stop() == 0
    node.start()
    ch = node.connect().channel()
    got = consume_bodies(ch, q3, 50)
    assert [b for _m, _p, b in got] == [f"p{i}".encode() for i in range(50)]

    # One process, one row: its memory is counted once.
    pid = paired_pid(node, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        rows = [line for line in resp.read().decode().splitlines()
                if line.startswith("shardmq_process_resident_memory_bytes{")]
    assert len(rows) == 2 and any('process="shard 0+frontend 0"' in r for r in rows), rows

    # SIGUSR1: both workers log their state.
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: "shardmq.frontend: state:" in node.log_text() and "shardmq.shard: state:" in node.log_text(),
               10, "both workers' state logged")


def test_two_pairs_cross_to_the_other_pairs_shard(node_factory):
    node = node_factory(frontends=2, shards=2, extra_args=ON)
    assert paired_pid(node, 0) != paired_pid(node, 1)
    on0, on1 = names_on_different_shards(uid("x"))
    a, b = sorted(connections_on_two_frontends(node), key=lambda c: c._impl.server_properties["shardmq_frontend"])
    cha, chb = a.channel(), b.channel()
    for q in (on0, on1):
        cha.queue_declare(q)
    # Each connection publishes to both shards: one through its pair's link, one through a socket.
    for i in range(100):
        cha.basic_publish("", on0, b"a%d" % i)
        cha.basic_publish("", on1, b"a%d" % i)
        chb.basic_publish("", on0, b"b%d" % i)
        chb.basic_publish("", on1, b"b%d" % i)
    for ch, q in ((cha, on1), (chb, on0)):  # a on frontend 0, b on 1: each consumes from the other pair
        got = [body for _m, _p, body in consume_bodies(ch, q, 200, auto_ack=False, ack=True)]
        assert [x for x in got if x[:1] == b"a"] == [b"a%d" % i for i in range(100)]
        assert [x for x in got if x[:1] == b"b"] == [b"b%d" % i for i in range(100)]
    a.close()
    b.close()


def test_kill_9_of_a_pair_keeps_confirmed_messages_and_restarts_both(node_factory):
    node = node_factory(frontends=2, shards=2, extra_args=ON)
    on0, on1 = names_on_different_shards(uid("k"))
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for q in (on0, on1):
        ch.queue_declare(q, durable=True)
        for i in range(200):
            ch.basic_publish("", q, f"{q}-{i}".encode(), properties=PERSISTENT)
    old = paired_pid(node, 0)
    other = paired_pid(node, 1)
    node.kill_worker("shard", 0)
    new = node.wait_worker_restarted("shard", 0, old)
    wait_until(lambda: node.pids()["frontend"]["0"] == new, 15, "frontend 0 in the restarted pair")
    assert paired_pid(node, 0) == new and not pid_alive(old)
    assert paired_pid(node, 1) == other  # the other pair lived on
    # Clients reconnect (either frontend) and consume everything that was confirmed.
    deadline = time.monotonic() + 30
    while True:
        try:
            ch = node.connect().channel()
            got = consume_bodies(ch, on0, 200)
            break
        except (pika.exceptions.AMQPError, AssertionError):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
    assert [b for _m, _p, b in got] == [f"{on0}-{i}".encode() for i in range(200)]
    assert len(consume_bodies(ch, on1, 200)) == 200
    log = node.log_text()
    assert "frontend 0 runs in shard 0's process" in log


def test_clean_stop_stops_the_frontend_part_first(node_factory):
    node = node_factory(frontends=2, shards=2, extra_args=ON)
    started = time.monotonic()
    assert node.stop() == 0
    assert time.monotonic() - started < 10
    log = node.log_text()
    assert "did not stop" not in log
    for i in range(2):
        assert log.index(f"frontend {i} stopped") < log.index(f"shard {i} stopped"), log


def test_setting_from_flag_ini_env_and_bad_values(tmp_path, node_factory):
    ini = tmp_path / "shardmq.ini"
    ini.write_text("[main]\ncolocate = on\n")
    assert load_settings(["--config", str(ini)], {}).colocate == "on"
    assert load_settings([], {"SHARDMQ_COLOCATE": "auto"}).colocate == "auto"
    assert load_settings(["--colocate", "off"], {"SHARDMQ_COLOCATE": "on"}).colocate == "off"
    assert colocated_pairs("on", 2, 3) == 2 and colocated_pairs("off", 2, 2) == 0
    assert colocated_pairs("auto", 2, 2, cores=2) == 2 and colocated_pairs("auto", 2, 2, cores=4) == 0
    assert colocated_pairs("auto", 2, 2, cluster=True, cores=1) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_")}
    for argv, needle in ((["--colocate", "sometimes"], "--colocate"),
                         (["--colocate", "on", "--cluster"], "--colocate on cannot be used with --cluster")):
        run = subprocess.run([sys.executable, "-m", "broker.cli", "--data-dir", str(tmp_path / "d"), *argv],
                             cwd=REPO_ROOT, env={**env, "SHARDMQ_CLUSTER_SECRET": "s"}, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode == 2 and needle in run.stderr, run.stderr
    # The variable reaches a real node: frontends 2, shards 1 -> one pair, frontend 1 alone.
    node = node_factory(frontends=2, shards=1, env={"SHARDMQ_COLOCATE": "on"})
    pids = node.pids()
    assert pids["frontend"]["0"] == pids["shard"]["0"] != pids["frontend"]["1"]
