"""Resource alarms: a data dir on a small tmpfs fills until the disk alarm fires; publishers are blocked
(connection.blocked), nothing confirmed is lost, consumers drain, the alarm clears, publishing resumes."""

from __future__ import annotations

import subprocess
import threading
import time

import pika
import pytest

from broker.alarms import parse_disk_limit, parse_memory_watermark
from tests.harness import NodeFactory, wait_until
from tests.mgmt_api import Api

pytestmark = pytest.mark.integration


def test_limit_syntax():
    assert parse_disk_limit("50MB") == 50_000_000
    assert parse_disk_limit("1GiB") == 1 << 30
    assert parse_disk_limit("mem_relative:1.5", ram=1000) == 1500
    assert parse_memory_watermark("0.4", ram=1000) == 400
    assert parse_memory_watermark("2GB") == 2_000_000_000
    for bad in ("lots", "5XB", "mem_relative:x"):
        with pytest.raises(ValueError):
            parse_disk_limit(bad)
    with pytest.raises(ValueError):
        parse_memory_watermark("1.5")


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "node" / "data"
    mount.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(mount)], check=True)  # a data dir others can write is refused (issue #9)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _wait(predicate, timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what, 0.05)


class Publisher(threading.Thread):
    """Publishes 64 KiB persistent messages with confirms until stopped; records what the broker confirmed."""

    def __init__(self, port: int, queue: str) -> None:
        super().__init__(daemon=True)
        self.port, self.queue = port, queue
        self.confirmed: list[int] = []
        self.blocked = threading.Event()
        self.unblocked = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                host="127.0.0.1", port=self.port, credentials=pika.PlainCredentials("guest", "guest"),
                client_properties={"connection_name": "filler"}))
            conn.add_on_connection_blocked_callback(lambda *_: self.blocked.set())
            conn.add_on_connection_unblocked_callback(lambda *_: self.unblocked.set())
            ch = conn.channel()
            ch.confirm_delivery()
            body = b"x" * 65536
            n = 0
            while not self.stop.is_set():
                n += 1
                ch.basic_publish("", self.queue, body, pika.BasicProperties(delivery_mode=2, message_id=str(n)))
                self.confirmed.append(n)
                # pika's BlockingConnection dispatches blocked/unblocked callbacks here, not while
                # basic_publish waits for a confirm (which a blocked connection does).
                conn.process_data_events(0)
                time.sleep(0.002)  # ~30 MB/s: the 0.25 s check cannot overshoot the tmpfs
            conn.process_data_events(0)
            conn.close()
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_disk_alarm_blocks_publishers_consumers_drain_and_it_clears(tmp_path, tmpfs):
    factory = NodeFactory(tmp_path)
    try:
        node = factory(name="node", frontends=1, shards=1, extra_args=[
            "--segment-size", "1048576", "--disk-free-limit", "32MB", "--stats-interval", "200"])
        assert node.data_dir == tmpfs
        api = Api(node.http_port)
        setup = node.connect()
        setup.channel().queue_declare("fill", durable=True)
        pub = Publisher(node.port, "fill")
        pub.start()
        _wait(lambda: api.call("GET", "/api/health/checks/alarms")[0] == 503 or pub.error is not None, 60,
              "the disk alarm")
        assert pub.error is None, pub.error
        status, body = api.call("GET", "/api/health/checks/alarms")
        assert status == 503 and "disk" in body["reason"]
        assert api.get("/api/nodes")[0]["disk_free_alarm"] is True
        assert "disk" in api.get("/api/overview")["alarms"]
        api.wait_for("/api/connections", lambda d: any(c["client_properties"].get("connection_name") == "filler"
                                                       and c["state"] == "blocked" for c in d))
        # Blocked: no confirm progress while the alarm holds.
        before = len(pub.confirmed)
        time.sleep(0.5)
        assert len(pub.confirmed) <= before + 1
        # A consumer keeps working and drains the queue; the alarm clears; the publisher resumes.
        consumer = node.connect()
        cch = consumer.channel()
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while api.call("GET", "/api/health/checks/alarms")[0] != 200:
            method, props, _body = cch.basic_get("fill", auto_ack=True)
            if method is not None:
                seen.add(props.message_id)
            else:
                time.sleep(0.02)
            assert time.monotonic() < deadline, "the alarm did not clear after draining"
        resumed_from = len(pub.confirmed)
        _wait(lambda: len(pub.confirmed) > resumed_from + 3, 20, "publishing to resume")
        pub.stop.set()
        pub.join(30)
        assert pub.error is None, pub.error
        assert pub.blocked.is_set() and pub.unblocked.is_set()  # connection.blocked, then unblocked
        # Nothing confirmed is lost: every confirmed id is either consumed or still in the queue.
        while True:
            method, props, _body = cch.basic_get("fill", auto_ack=True)
            if method is None:
                break
            seen.add(props.message_id)
        missing = [n for n in pub.confirmed if str(n) not in seen]
        assert missing == []
        assert "alarm set" in node.log_text() and "alarm cleared" in node.log_text()
        consumer.close()
        setup.close()
        node.stop()
    finally:
        factory.cleanup()


def test_memory_alarm_blocks_publishers_not_consumers(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--vm-memory-high-watermark", "1MB"])
    api = Api(node.http_port)
    _wait(lambda: api.call("GET", "/api/health/checks/alarms")[0] == 503, 10, "the memory alarm")
    blocked = threading.Event()
    conn = node.connect()
    conn.add_on_connection_blocked_callback(lambda *_: blocked.set())
    ch = conn.channel()
    ch.queue_declare("mem")  # not a publisher yet: still served
    ch.basic_publish("", "mem", b"first")  # this one is read; then the connection is blocked
    deadline = time.monotonic() + 10
    while not blocked.is_set():
        conn.process_data_events(time_limit=0.1)
        assert time.monotonic() < deadline, "no connection.blocked"
    other = node.connect()
    och = other.channel()
    method, _props, body = och.basic_get("mem", auto_ack=True)  # consumers keep working
    assert body == b"first"
    other.close()


def test_memory_alarm_blocks_mqtt_publishers(tmp_path):
    from broker.mqtt import codec as M
    from tests.harness import free_port
    from tests.raw_mqtt import RawMQTT

    factory = NodeFactory(tmp_path)
    try:
        node = factory(name="node", frontends=1, shards=1, mqtt_port=free_port(),
                       extra_args=["--vm-memory-high-watermark", "1MB"])
        api = Api(node.http_port)
        _wait(lambda: api.call("GET", "/api/health/checks/alarms")[0] == 503, 10, "the memory alarm")
        sub = RawMQTT(node.mqtt_port)
        sub.connect("alarm-sub")
        assert sub.subscribe(1, [("alarm/#", 1)]) == [1]  # not a publisher: still served
        pub = RawMQTT(node.mqtt_port)
        pub.connect("alarm-pub")
        pub.publish("alarm/a", b"first", qos=1, pid=1)  # read, then the session is blocked
        ack = pub.recv()
        assert isinstance(ack, M.Ack) and ack.packet_id == 1
        pub.publish("alarm/a", b"second", qos=1, pid=2)
        with pytest.raises(AssertionError):
            pub.recv(timeout=1.0)  # not read while the alarm holds: no PUBACK
        got = sub.recv()
        assert isinstance(got, M.Publish) and got.payload == b"first"
    finally:
        factory.cleanup()
