"""A confirming publisher connected straight to one node, for the partition drill.

    ip netns exec NS python -m deploy.drill.direct_publisher HOST PORT QUEUE TAG

Run inside the leader's network namespace, it is a client on the leader's side of a partition
(the split-brain case: it can still reach the old leader). It publishes persistent messages
with confirms (bodies ``<TAG>-<seq>``) and prints ``C <seq> <monotonic time>`` for each confirm, then
``X <monotonic time> <reason>`` when the connection breaks, and exits: it never reconnects, so
every confirm it prints came from that one node. CLOCK_MONOTONIC is one clock for the whole host,
so the drill compares these times with its own.
"""

from __future__ import annotations

import sys
import time

import pika
import pika.exceptions


def main(argv: list[str]) -> int:
    host, port, queue, tag = argv[0], int(argv[1]), argv[2], argv[3]
    out = sys.stdout
    try:
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            host=host, port=port, credentials=pika.PlainCredentials("guest", "guest"),
            connection_attempts=1, socket_timeout=2, blocked_connection_timeout=30, heartbeat=0))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        props = pika.BasicProperties(delivery_mode=2)
        seq = 0
        while True:
            seq += 1
            ch.basic_publish("", queue, f"{tag}-{seq}".encode(), props, mandatory=True)
            out.write(f"C {seq} {time.monotonic():.6f}\n")
            out.flush()
    except (pika.exceptions.AMQPError, OSError) as exc:
        out.write(f"X {time.monotonic():.6f} {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n")
        out.flush()
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
