"""What a frontend holds for consumers whose clients stop reading (docs/architecture.md "Delivery credit").

Starts a node (1 frontend, 1 shard) from this checkout, fills one queue per consumer with bodies of
--body bytes (more than a credit window), then starts --consumers raw AMQP consumers (no-ack, a
64 KiB receive buffer) that never read: the shard sends each one what its credit allows before the
frontend sees the connection pause. Prints the frontend's RSS before and after, the connections'
send_pend (bytes the frontend buffers for them) and the messages that left the queues.

    PYTHONPATH=$PWD .venv/bin/python scripts/paused_consumers.py --consumers 20 --body 65536
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pika
from pamqp import commands

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker import contract  # noqa: E402
from tests.harness import Node  # noqa: E402
from tests.mgmt_api import Api  # noqa: E402
from tests.test_paused_consumer_credit import TCPAMQP  # noqa: E402


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumers", type=int, default=20)
    ap.add_argument("--body", type=int, default=64 << 10)
    ap.add_argument("--per-queue", type=int, default=0, help="messages per queue (default: 1.5 credit windows)")
    ap.add_argument("--read-seconds", type=float, default=0.0,
                    help="the clients read at full speed this long before they stop (their windows have grown)")
    args = ap.parse_args()
    window = contract.CREDIT_WINDOW << contract.CREDIT_BYTES_SHIFT
    per_queue = args.per_queue or max(8, window * 3 // 2 // args.body)
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(tmp, frontends=1, shards=1, log_level="warning", extra_args=["--stats-interval", "100"])
        node.start()
        try:
            fe = node.worker_pid("frontend", 0)
            conn = pika.BlockingConnection(pika.URLParameters(node.url))
            ch = conn.channel()
            body = b"x" * args.body
            queues = [f"paused-{i}" for i in range(args.consumers)]
            for q in queues:
                ch.queue_declare(q)
                for _ in range(per_queue):
                    ch.basic_publish("", q, body)
            while any(ch.queue_declare(q, passive=True).method.message_count < per_queue for q in queues):
                time.sleep(0.1)
            before = rss(fe)
            clients = []
            for q in queues:
                c = TCPAMQP(node.port)
                c.open()
                c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                c.send(1, commands.Basic.Consume(queue=q, consumer_tag=q, no_ack=True))
                clients.append(c)
            if args.read_seconds:
                stop = time.monotonic() + args.read_seconds

                def drain(c: TCPAMQP) -> None:
                    c.sock.settimeout(0.2)
                    while time.monotonic() < stop:
                        try:
                            c.sock.recv(1 << 20)
                        except TimeoutError:
                            pass

                threads = [threading.Thread(target=drain, args=(c,)) for c in clients]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            api = Api(node.http_port)
            last, stable_since = None, time.monotonic()
            while time.monotonic() - stable_since < 1.5:  # until nothing moves for 1.5 s
                ready = [ch.queue_declare(q, passive=True).method.message_count for q in queues]
                if ready != last:
                    last, stable_since = ready, time.monotonic()
                time.sleep(0.2)
            time.sleep(0.3)  # two stats intervals
            pend = [r["send_pend"] for r in api.get("/api/connections")]
            after = rss(fe)
            left = [per_queue - r for r in last]  # with --read-seconds: read ones included
            print(json.dumps({
                "consumers": args.consumers, "body": args.body, "per_queue": per_queue,
                "frontend_rss_before_mib": round(before / 2**20, 1), "frontend_rss_after_mib": round(after / 2**20, 1),
                "send_pend_total_mib": round(sum(pend) / 2**20, 2), "send_pend_max_kib": round(max(pend) / 1024, 1),
                "left_queues_per_consumer_max": max(left), "left_queues_mib": round(sum(left) * args.body / 2**20, 1),
            }))
            for c in clients:
                c.sock.close()
            conn.close()
        finally:
            node.cleanup()


if __name__ == "__main__":
    main()
