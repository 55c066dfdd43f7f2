#!/usr/bin/env python3
"""Natural-timing probe (not a test): messages forwarded between shards right as the node stops.

    PYTHONPATH=$PWD .venv/bin/python scripts/stop-forward-probe.py delayed|ttl-dedup RUNS [WORKDIR]

Each run starts a 2-shard node of this tree, publishes messages that fall due (``delayed``: a delayed
exchange's store on one shard, fanout to a queue on each shard) or expire into a deduplicating
exchange owned by the other shard (``ttl-dedup``: dead letters source -> owner -> a queue on each
shard) across a 300 ms window around a clean stop, restarts the node and prints, per queue, the
distinct messages and the total: every message exactly once is `distinct == total`. Timing-dependent,
so it is a probe for a bug class (tests/test_forward_stop.py holds the deterministic tests). On main
before shard/forward_settle.py's PEER_DONE and settle of delayed/dedup forwards, 2 of 6 ``delayed``
runs and 6 of 6 ``ttl-dedup`` runs had duplicates.
"""
from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

import pika

sys.path.insert(0, ".")
from broker.dedup import exchange_shard  # noqa: E402
from tests.harness import NodeFactory  # noqa: E402
from tests.helpers import count, names_on_different_shards, uid  # noqa: E402

N = 2000


def _publish(ch, scenario: str, i: int, due: float) -> list[str]:
    queues = names_on_different_shards(uid("dq"))
    if scenario == "delayed":
        target = names_on_different_shards(uid("dx"))[i % 2]
        ch.exchange_declare(target, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    else:
        target = next(n for k in range(1000) if exchange_shard("/", n := uid(f"dd{k}"), 2) == 1 - i % 2)
        ch.exchange_declare(target, "fanout", durable=True, arguments={"x-message-deduplication": True})
    for q in queues:
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, target)
    if scenario != "delayed":
        src = names_on_different_shards(uid("src"))[i % 2]
        ch.queue_declare(src, durable=True, arguments={"x-dead-letter-exchange": target})
    for k in range(N + 1):
        ms = 1 if k == N else max(1, int((due + (k % 300) / 1000 - time.monotonic()) * 1000))
        if k == N:
            ch.confirm_delivery()  # same channel, same shard: after every publish before it
        if scenario == "delayed":
            ch.basic_publish(target, "", b"%d" % k, pika.BasicProperties(delivery_mode=2, headers={"x-delay": ms}))
        else:
            ch.basic_publish("", src, b"%d" % k, pika.BasicProperties(
                delivery_mode=2, expiration=str(ms), headers={"x-deduplication-header": f"k{k}"}))
    return queues


def run(base: Path, scenario: str, i: int) -> None:
    factory = NodeFactory(base / f"r{i}", ["--queue-placement", "hash"])
    try:
        node = factory(name="node", frontends=2, shards=2)
        conn = node.connect()
        due = time.monotonic() + 2.0
        queues = _publish(conn.channel(), scenario, i, due)
        conn.close()
        time.sleep(max(0.0, due + 0.05 * (i % 6) - time.monotonic()))  # stop while they fall due
        node.stop()
        node.start()
        conn = node.connect()
        ch = conn.channel()
        deadline = time.monotonic() + 15
        while any(count(ch, q) < N + 1 for q in queues) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a probe: late duplicates are what it looks for
        found = []
        for q in queues:
            got: collections.Counter = collections.Counter()
            while (msg := ch.basic_get(q, auto_ack=True))[0] is not None:
                got[msg[2]] += 1
            found.append((len(got), sum(got.values())))
        conn.close()
        print(scenario, i, "distinct/total per queue", found, flush=True)
    finally:
        factory.cleanup()


def main() -> None:
    scenario, runs = sys.argv[1], int(sys.argv[2])
    if scenario not in ("delayed", "ttl-dedup"):
        sys.exit("scenario: delayed or ttl-dedup")
    base = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="stop-forward-probe-"))
    base.mkdir(parents=True, exist_ok=True)
    for i in range(runs):
        run(base, scenario, i)


if __name__ == "__main__":
    main()
