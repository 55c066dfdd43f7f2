"""One AMQP connection is read at most TURN_READ_BYTES (plus the read that crossed it) per event-loop
turn: the loop would read a flooding publisher's socket up to 32 times a turn, megabytes that the
frontend parses while its other connections wait. The frontend reports the most it read from one
connection in one turn (STATS -> Prometheus ``shardmq_read_bytes_per_turn_peak``), a count of bytes,
not a time, so a loaded machine cannot make it pass or fail."""

from __future__ import annotations

import threading
import time

from broker.amqp import encoder
from frontend.amqp.connection import TURN_READ_BYTES
from loadtest.amqp_client import AMQPClient
from tests.test_metrics import scrape, value

# uvloop reads into a 256 KB buffer: the read that crosses the bound adds at most that much.
ONE_READ = 256 << 10
FLOOD = 48 << 20
CHUNK = 4 << 20


def _flood(url: str, queue: str, errors: list, done: threading.Event) -> None:
    try:
        with AMQPClient(url, timeout=120.0).connect() as c:
            frame = encoder.encode_publish(1, "", queue, False, b"\x00\x00", b"x" * 1000, c.frame_max)
            chunk = frame * (CHUNK // len(frame))
            for _ in range(FLOOD // len(chunk)):
                c.send(chunk)  # as fast as the socket takes it: the frontend's side is always full
            c.queue_declare(queue, passive=True)  # a round trip: every publish before it was read
    except Exception as exc:  # reported by the test thread
        errors.append(exc)
    finally:
        done.set()


def test_a_flooding_publisher_is_read_at_most_the_cap_per_turn(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    queue = "flood"
    with AMQPClient(node.url).connect() as c:
        c.queue_declare(queue)
        errors: list = []
        done = threading.Event()
        flooder = threading.Thread(target=_flood, args=(node.url, queue, errors, done))
        flooder.start()
        # Another connection on the same frontend keeps being answered while the flood goes on.
        while not done.is_set():
            assert c.queue_exists(queue)
        flooder.join(120)
        assert not errors, errors
    deadline = time.monotonic() + 30
    while (peak := value(scrape(node)["shardmq_read_bytes_per_turn_peak"])) == 0:
        assert time.monotonic() < deadline, "the frontend never reported its peak"
        time.sleep(0.1)
    # Without the cap this was 3.3 MB here (13 reads in one turn); with it, two reads of 256,000 bytes.
    assert peak <= TURN_READ_BYTES + ONE_READ, peak
