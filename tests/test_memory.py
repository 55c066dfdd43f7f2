"""A queue's length does not cost the shard process memory.

The store keeps no per-message state in memory (docs/storage.md, "Memory"): messages live in
mmap'd segment files. So the shard's anonymous memory (heap; RssAnon, which leaves out the file
pages of the mapped segments that the kernel may drop at will) must not grow with the number of
stored messages. This test asserts that in a bounded way; it does not measure speed. The measured
numbers for 1M and 10M messages are in docs/storage.md.
"""

from __future__ import annotations

from broker.amqp import encoder, events
from broker.definitions import queue_shard
from loadtest.amqp_client import AMQPClient
from tests.harness import wait_until

PERSISTENT_RAW = b"\x10\x00\x02"  # property flags: delivery-mode only; delivery-mode 2
# 200k more messages; with any per-message object (>= 32 bytes each) the heap would grow >= 6.1 MB.
MAX_GROWTH_KB = 3 * 1024
# The warm-up: the pair's heap reaches its working size within ~100k messages and stays (RssAnon of a
# 1+1 node at 20k, 40k, 80k, 140k, 200k, 300k, 400k, 600k stored: 23.1, 25.9, 27.1, 27.4, 27.6, 27.7,
# 27.8, 27.8 MB). 20k was enough only while every process compiled its modules from source at start
# (scripts/_common.sh compile_sources), whose garbage left the arenas that later growth reused.
WARM_UP = 100_000
WINDOW = 4000
CHUNK = 500


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class WindowedPublisher:
    """Confirm-mode publisher keeping at most WINDOW messages unconfirmed.

    The window keeps the data in flight between frontend and shard small: an unthrottled
    publisher fills the ZeroMQ pipes and batch buffers, which the allocator keeps afterwards and
    which would hide what the stored messages themselves cost.
    """

    def __init__(self, client: AMQPClient, queue: str) -> None:
        self.client = client
        self.queue = queue
        client.confirm_select()
        self.sent = 0
        self.confirmed = 0  # highest delivery tag acked (a single queue confirms in order)

    def publish(self, count: int) -> None:
        c = self.client
        end = self.sent + count
        while self.confirmed < end:
            if self.sent < end and self.sent - self.confirmed < WINDOW:
                n = min(CHUNK, end - self.sent)
                c.send(b"".join(encoder.encode_publish(1, "", self.queue, False, PERSISTENT_RAW,
                                                       b"%016d" % (self.sent + i)) for i in range(n)))
                self.sent += n
                continue
            ev = c.next_event()
            c._handle_close(ev)
            assert not isinstance(ev, events.Nack), ev
            if isinstance(ev, events.Ack):
                self.confirmed = max(self.confirmed, ev.delivery_tag)


def wait_count(client: AMQPClient, queue: str, n: int, timeout: float = 60.0) -> None:
    wait_until(lambda: client.queue_declare(queue, passive=True)[1] == n, timeout, f"{queue} to hold {n} messages",
               0.1, context=lambda: f"it has {client.queue_declare(queue, passive=True)[1]}")


def test_shard_heap_does_not_grow_with_queue_length(node_factory):
    node = node_factory(frontends=1, shards=1)
    queue = "long"
    assert queue_shard("/", queue, 1) == 0
    shard_pid = node.worker_pid("shard", 0)
    with AMQPClient(node.url, timeout=30.0).connect() as client:
        client.queue_declare(queue, durable=True)
        pub = WindowedPublisher(client, queue)
        # Warm-up: allocator arenas, socket buffers and batch sizes reach their working size.
        pub.publish(WARM_UP)
        wait_count(client, queue, WARM_UP)
        before = status_kb(shard_pid, "RssAnon")
        pub.publish(200_000)
        wait_count(client, queue, WARM_UP + 200_000)
        after = status_kb(shard_pid, "RssAnon")
    print(f"RssAnon {before} -> {after} kB")
    assert after - before <= MAX_GROWTH_KB, (
        f"shard heap grew {after - before} kB from {WARM_UP} to {WARM_UP + 200_000} stored messages ({before} -> {after} kB)")
    # The messages are really there, in order, after all that.
    conn = node.connect()
    ch = conn.channel()
    first = [ch.basic_get(queue, auto_ack=True)[2] for _ in range(3)]
    assert first == [b"%016d" % i for i in range(3)]
    conn.close()
