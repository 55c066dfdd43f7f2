"""The drill's clients: a confirming publisher and a verifying consumer, both reconnecting.

Every message body is its sequence number. The publisher records when each one was confirmed;
the consumer records how often each one arrived and when it acked it. Comparing the two after
the drill gives lost (confirmed, never received) and duplicated (received more than once).
"""

from __future__ import annotations

import threading
import time

import pika
import pika.exceptions

QUEUE = "drill"
_ERRORS = (pika.exceptions.AMQPError, OSError, AttributeError, ValueError)


def _connect(host: str, port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=host, port=port, credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1, socket_timeout=2, blocked_connection_timeout=10, heartbeat=5))


class Publisher(threading.Thread):
    def __init__(self, host: str, port: int, rate: float = 0.0) -> None:
        super().__init__(name="drill-publisher", daemon=True)
        self.host, self.port = host, port
        self.rate = rate  # messages per second, 0 = as fast as confirms come back
        self.confirmed: dict[int, float] = {}  # seq -> monotonic time of its confirm
        self.connected_at: list[float] = []  # monotonic time each connection was opened
        self.first_on_connection: dict[int, float] = {}  # connection index -> time of its first confirm
        self.unconfirmed: set[int] = set()  # published, then the connection broke before the confirm
        self.reconnects = 0
        self.stop_event = threading.Event()
        self.next_seq = 1
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                conn = _connect(self.host, self.port)
            except _ERRORS:
                time.sleep(0.05)
                continue
            self.connected_at.append(time.monotonic())
            index = len(self.connected_at) - 1
            try:
                ch = conn.channel()
                ch.confirm_delivery()
                ch.queue_declare(QUEUE, durable=True)
                props = pika.BasicProperties(delivery_mode=2)
                while not self.stop_event.is_set():
                    seq = self.next_seq
                    self.next_seq += 1
                    self.unconfirmed.add(seq)
                    ch.basic_publish("", QUEUE, str(seq).encode(), props, mandatory=True)
                    self.unconfirmed.discard(seq)
                    now = self.confirmed[seq] = time.monotonic()
                    self.first_on_connection.setdefault(index, now)
                    if self.rate:
                        time.sleep(1.0 / self.rate)
            except _ERRORS as exc:
                self.errors.append(f"{time.monotonic():.3f} {type(exc).__name__}: {exc}")
                self.reconnects += 1
            finally:
                try:
                    conn.close()
                except _ERRORS:
                    pass


    def first_confirm_after(self, t: float) -> float | None:
        """When the first connection opened after ``t`` got its first confirm (a failover's end).

        Confirms on the connection of before ``t`` can still arrive just after it (written by the
        old leader before it died), so they do not count.
        """
        firsts = dict(self.first_on_connection)
        for index, opened in enumerate(list(self.connected_at)):
            if opened > t and index in firsts:
                return firsts[index]
        return None


class Consumer(threading.Thread):
    def __init__(self, host: str, port: int) -> None:
        super().__init__(name="drill-consumer", daemon=True)
        self.host, self.port = host, port
        self.received: dict[int, int] = {}  # seq -> times received
        self.acked_at: dict[int, float] = {}  # seq -> monotonic time its ack was sent
        # (seq, when its ack was sent, when it came again)
        self.redelivered_after_ack: list[tuple[int, float, float]] = []
        self.stop_event = threading.Event()
        self.last_receive = 0.0

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                conn = _connect(self.host, self.port)
            except _ERRORS:
                time.sleep(0.05)
                continue
            try:
                ch = conn.channel()
                ch.queue_declare(QUEUE, durable=True)
                ch.basic_qos(prefetch_count=200)
                for method, _props, body in ch.consume(QUEUE, inactivity_timeout=0.2):
                    if self.stop_event.is_set():
                        break
                    if method is None:
                        continue
                    seq = int(body)
                    now = time.monotonic()
                    self.last_receive = now
                    if seq in self.acked_at:
                        self.redelivered_after_ack.append((seq, self.acked_at[seq], now))
                    self.received[seq] = self.received.get(seq, 0) + 1
                    ch.basic_ack(method.delivery_tag)
                    self.acked_at[seq] = time.monotonic()
            except _ERRORS:
                pass
            finally:
                try:
                    conn.close()
                except _ERRORS:
                    pass
