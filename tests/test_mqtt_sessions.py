"""MQTT QoS 2 exactly-once, persistent sessions and retained messages across reconnects and node restarts.

Every message is counted: none lost, none twice. The raw client stands for a client that
hands a QoS 2 message to its application when PUBREL arrives (as paho does), so a
message it received but had not yet acknowledged may come again under a new packet id.
"""

from __future__ import annotations

import os
import time

import pika
import pytest

from broker.mqtt import codec as M
from tests.harness import free_port
from tests.raw_mqtt import RawMQTT

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

N = 30


@pytest.fixture
def mnode(node_factory):
    return node_factory(name="node", frontends=2, shards=2, mqtt_port=free_port())


def _amqp_counter(node, key: str) -> tuple[pika.BlockingConnection, str]:
    conn = node.connect()
    ch = conn.channel()
    q = f"count-{key}"
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, "amq.topic", f"{key}.#")
    conn.close()
    return q


def _drain(node, q: str, want: int, timeout: float = 10.0) -> list[bytes]:
    conn = node.connect()
    ch = conn.channel()
    bodies: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        method, _props, body = ch.basic_get(q, auto_ack=True)
        if method is None:
            if len(bodies) >= want:
                time.sleep(0.3)  # and nothing more arrives
                method, _props, body = ch.basic_get(q, auto_ack=True)
                if method is None:
                    break
            else:
                time.sleep(0.05)
                continue
        bodies.append(body)
    conn.close()
    return bodies


@pytest.mark.parametrize("restart", [False, True], ids=["reconnect", "node-restart"])
def test_qos2_publish_from_client_is_routed_exactly_once(mnode, restart):
    q = _amqp_counter(mnode, "in2")
    name = "publisher-in2"
    pub = RawMQTT(mnode.mqtt_port)
    assert pub.connect(name, clean=False).return_code == 0
    for pid in range(1, N + 1):
        pub.publish("in2/x", b"m%d" % pid, qos=2, pid=pid)
        assert pub.recv() == M.Ack(M.PUBREC, pid)
    done = set()
    for pid in range(1, N // 2 + 1):  # half released and completed, half left waiting for PUBREL
        pub.ack(M.PUBREL, pid)
        assert pub.recv() == M.Ack(M.PUBCOMP, pid)
        done.add(pid)
    pub.close()
    if restart:
        mnode.restart()
    pub = RawMQTT(mnode.mqtt_port)
    ack = pub.connect(name, clean=False)
    assert (ack.session_present, ack.return_code) == (True, 0)
    for pid in range(N // 2 + 1, N + 1):
        # The client cannot know whether its PUBREC arrived: it may send the PUBLISH again (DUP).
        pub.publish("in2/x", b"m%d" % pid, qos=2, pid=pid, dup=True)
        assert pub.recv() == M.Ack(M.PUBREC, pid)
        pub.ack(M.PUBREL, pid)
        assert pub.recv() == M.Ack(M.PUBCOMP, pid)
    pub.disconnect()
    bodies = _drain(mnode, q, N)
    assert sorted(bodies) == sorted(b"m%d" % i for i in range(1, N + 1))


class _Receiver:
    """A raw QoS 2 subscriber that delivers to its application on PUBREL."""

    def __init__(self, node, name: str) -> None:
        self.raw = RawMQTT(node.mqtt_port)
        self.ack = self.raw.connect(name, clean=False)
        self.stored: dict[int, bytes] = {}

    def next(self):
        return self.raw.recv()


@pytest.mark.parametrize("restart", [False, True], ids=["reconnect", "node-restart"])
def test_qos2_delivery_to_client_is_exactly_once(mnode, restart):
    name = "receiver-out2"
    r = _Receiver(mnode, name)
    assert r.raw.subscribe(1, [("out2/#", 2)]) == [2]
    conn = mnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(N):
        ch.basic_publish("amq.topic", "out2.x", b"m%d" % i,
                         pika.BasicProperties(delivery_mode=2, headers={"x-mqtt-publish-qos": 2}))
    conn.close()
    delivered: list[bytes] = []
    publishes = []
    while len(publishes) < N:
        p = r.next()
        assert isinstance(p, M.Publish) and p.qos == 2
        publishes.append(p)
    group1, group2, group3 = publishes[:10], publishes[10:20], publishes[20:]
    for p in group1 + group2:
        r.raw.ack(M.PUBREC, p.packet_id)
    released = set()
    while len(released) < 20:
        p = r.next()
        assert p.__class__ is M.Ack and p.type == M.PUBREL
        released.add(p.packet_id)
    payload = {p.packet_id: p.payload for p in publishes}
    for pid in sorted(released):
        delivered.append(payload[pid])  # handed to the application on PUBREL
    for p in group1:
        r.raw.ack(M.PUBCOMP, p.packet_id)
    # group2: PUBREL seen, PUBCOMP never sent; group3: PUBLISH seen, PUBREC never sent
    # The PUBCOMPs of group 1 reach the broker before the socket goes: it reads a connection in order,
    # so its PINGRESP comes after it read them.
    r.raw.send(bytes((M.PINGREQ << 4, 0)))
    assert r.next() == M.Simple(M.PINGRESP)
    r.raw.close()
    if restart:
        mnode.restart()
    r = _Receiver(mnode, name)
    assert (r.ack.session_present, r.ack.return_code) == (True, 0)
    group2_ids = {p.packet_id for p in group2}
    rels = set()
    again = []
    while len(rels) < len(group2_ids) or len(again) < len(group3):
        p = r.next()
        if p.__class__ is M.Ack:
            assert p.type == M.PUBREL and p.packet_id in group2_ids  # PUBREL again, not the message
            rels.add(p.packet_id)
            r.raw.ack(M.PUBCOMP, p.packet_id)  # already handed over: nothing delivered now
        else:
            # sent again with its original packet identifier and DUP [MQTT-4.4.0-1]
            assert isinstance(p, M.Publish) and p.dup and p.payload in {x.payload for x in group3}, p
            assert p.packet_id == {x.payload: x.packet_id for x in group3}[p.payload]
            again.append(p)
            r.raw.ack(M.PUBREC, p.packet_id)
    done = 0
    while done < len(again):
        p = r.next()
        assert p.__class__ is M.Ack and p.type == M.PUBREL
        delivered.append({x.packet_id: x.payload for x in again}[p.packet_id])
        r.raw.ack(M.PUBCOMP, p.packet_id)
        done += 1
    r.raw.send(bytes((M.PINGREQ << 4, 0)))
    assert r.next() == M.Simple(M.PINGRESP)  # and nothing else came first
    r.raw.disconnect()
    assert sorted(delivered) == sorted(b"m%d" % i for i in range(N))


def test_session_subscriptions_retained_messages_and_retained_wills_survive_a_restart(mnode):
    raw = RawMQTT(mnode.mqtt_port)
    assert raw.connect("sleeper", clean=False).return_code == 0
    assert raw.subscribe(1, [("home/+/temp", 1)]) == [1]
    raw.disconnect()
    pub = RawMQTT(mnode.mqtt_port)
    assert pub.connect("pub").return_code == 0
    pub.publish("home/kitchen/temp", b"21", qos=1, pid=1, retain=True)
    assert pub.recv() == M.Ack(M.PUBACK, 1)
    pub.disconnect()
    sensor = RawMQTT(mnode.mqtt_port)  # its retained will says it went offline
    assert sensor.connect("sensor", will=M.Publish("status/sensor", b"offline", 1, True)).return_code == 0
    sensor.close()
    watch = RawMQTT(mnode.mqtt_port)
    assert watch.connect("watch").return_code == 0
    assert watch.subscribe(1, [("status/#", 0)]) == [0]
    p = watch.recv()  # the will is in the retained store before the restart
    assert (p.topic, p.payload, p.retain) == ("status/sensor", b"offline", True)
    watch.disconnect()
    mnode.restart()
    raw = RawMQTT(mnode.mqtt_port)
    ack = raw.connect("sleeper", clean=False)
    assert (ack.session_present, ack.return_code) == (True, 0)
    p = raw.recv()
    assert (p.topic, p.payload, p.qos, p.retain) == ("home/kitchen/temp", b"21", 1, False)  # queued while away
    raw.ack(M.PUBACK, p.packet_id)
    raw.disconnect()
    late = RawMQTT(mnode.mqtt_port)
    assert late.connect("late").return_code == 0
    assert late.subscribe(1, [("home/#", 0)]) == [0]
    p = late.recv()
    assert (p.topic, p.payload, p.qos, p.retain) == ("home/kitchen/temp", b"21", 0, True)
    assert late.subscribe(2, [("status/+", 1)]) == [1]
    p = late.recv()
    assert (p.topic, p.payload, p.qos, p.retain) == ("status/sensor", b"offline", 1, True)
    late.disconnect()


def test_a_shard_restart_closes_its_mqtt_consumers_and_the_session_goes_on(mnode):
    """The shard holding a persistent session's queue dies: the connection is closed (its consumer is
    gone), the client reconnects, and every QoS 1 message arrives (none lost, unacked ones again)."""
    from broker.definitions import queue_shard
    from frontend.mqtt.messages import session_queue

    sub = RawMQTT(mnode.mqtt_port)
    assert sub.connect("shard-victim", clean=False).return_code == 0
    assert sub.subscribe(1, [("sv/#", 1)]) == [1]
    pub = RawMQTT(mnode.mqtt_port)
    assert pub.connect("shard-pub").return_code == 0
    for i in range(1, 11):
        pub.publish("sv/x", b"%d" % i, qos=1, pid=i)
        assert pub.recv() == M.Ack(M.PUBACK, i)
    got = {sub.recv().payload for _ in range(10)}  # delivered, never acknowledged
    assert len(got) == 10
    shard = queue_shard("/", session_queue("shard-victim"), mnode.shards)  # the shard holding the session queue
    old = mnode.kill_worker("shard", shard)
    mnode.wait_worker_restarted("shard", shard, old)
    assert sub.closed_by_server(timeout=10)
    back = RawMQTT(mnode.mqtt_port)
    ack = back.connect("shard-victim", clean=False)
    assert (ack.session_present, ack.return_code) == (True, 0)
    again = set()
    while len(again) < 10:
        p = back.recv(timeout=10)
        again.add(p.payload)
        back.ack(M.PUBACK, p.packet_id)
    assert again == {b"%d" % i for i in range(1, 11)}
    back.disconnect()
    pub.disconnect()


@pytest.fixture
def one_frontend(node_factory):
    return node_factory(name="node", frontends=1, shards=2, mqtt_port=free_port())


def _connect_retrying(node, client_id: str, timeout: float = 30.0) -> tuple[RawMQTT, M.ConnAck]:
    """CONNECT until the node answers (a killed worker is restarted by the node meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            raw = RawMQTT(node.mqtt_port)
            return raw, raw.connect(client_id, clean=False)
        except (OSError, AssertionError):
            assert time.monotonic() < deadline, f"no CONNACK for {client_id} after a restart\n{node.log_tail()}"
            time.sleep(0.1)


@pytest.mark.parametrize("kill", ["frontend", "queue-shard", "session-shard", "frontend-and-session-shard", "node"])
def test_qos2_publish_is_stored_once_across_a_kill_9(one_frontend, kill):
    """A QoS 2 PUBLISH is stored, then a worker dies (kill -9) before the client got PUBREC: the client
    resends it (DUP) on its next connection, and exactly one copy is stored. The session shard is held
    stopped (SIGSTOP) from the publish to the kill, so the session record cannot have caught up with the
    queue's shard: the awkward moment, every time."""
    import signal

    from frontend.mqtt.messages import session_shard
    from tests.mgmt_api import Api

    node = one_frontend
    q = _amqp_counter(node, "once")
    _status, info = Api(node.http_port).call("GET", f"/api/queues/%2F/{q}")
    queue_shard = info["shard"]
    name = next(f"once-{i}" for i in range(100) if session_shard("/", f"once-{i}", 2) != queue_shard)
    session = 1 - queue_shard
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect(name, clean=False).return_code == 0
    stopped = node.worker_pid("shard", session)
    os.kill(stopped, signal.SIGSTOP)
    try:
        pub.publish("once/x", b"exactly once", qos=2, pid=7)
        counter = node.connect()
        ch = counter.channel()
        deadline = time.monotonic() + 10
        while ch.queue_declare(q, passive=True).method.message_count < 1:  # stored on the queue's shard
            assert time.monotonic() < deadline, "the QoS 2 message was not stored"
            time.sleep(0.02)
        counter.close()
        if kill == "frontend":
            node.wait_worker_restarted("frontend", 0, node.kill_worker("frontend", 0))
        elif kill == "queue-shard":
            node.wait_worker_restarted("shard", queue_shard, node.kill_worker("shard", queue_shard))
        elif kill == "session-shard":
            node.kill_worker("shard", session)
            node.wait_worker_restarted("shard", session, stopped)
        elif kill == "frontend-and-session-shard":
            # The session record's write dies with both: only the queue's shard knows the message.
            node.kill_worker("shard", session)
            node.wait_worker_restarted("frontend", 0, node.kill_worker("frontend", 0))
            node.wait_worker_restarted("shard", session, stopped)
        else:
            node.kill9()
            node.start()
    finally:
        if kill in ("frontend", "queue-shard"):
            os.kill(stopped, signal.SIGCONT)
    pub.close()
    pub, ack = _connect_retrying(node, name)
    assert (ack.session_present, ack.return_code) == (True, 0)
    pub.publish("once/x", b"exactly once", qos=2, pid=7, dup=True)  # no PUBREC seen: sent again
    assert pub.recv(timeout=10) == M.Ack(M.PUBREC, 7)
    pub.ack(M.PUBREL, 7)
    assert pub.recv(timeout=10) == M.Ack(M.PUBCOMP, 7)
    # The packet id is free again: a new message with it is stored, not taken for the old one.
    pub.publish("once/x", b"a new one", qos=2, pid=7)
    assert pub.recv(timeout=10) == M.Ack(M.PUBREC, 7)
    pub.ack(M.PUBREL, 7)
    assert pub.recv(timeout=10) == M.Ack(M.PUBCOMP, 7)
    pub.disconnect()
    assert sorted(_drain(node, q, 2)) == [b"a new one", b"exactly once"]


def _frontend_of(node, client_port: int) -> int | None:
    """Which frontend process holds the server side of the TCP connection from client_port (None: not
    accepted yet), from /proc/net/tcp and the frontends' open file descriptors."""
    inode = None
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == node.mqtt_port and int(f[2].rsplit(":", 1)[1], 16) == client_port:
                    inode = f[9]
    if inode is None:
        return None
    for index, pid in node.pids()["frontend"].items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(index)
            except OSError:
                continue
    return None


def _wait_frontend_of(node, raw: RawMQTT, timeout: float = 5.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _frontend_of(node, raw.sock.getsockname()[1])
        if found is not None:
            return found
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("round_", range(3))
def test_a_reconnect_on_another_frontend_resumes_the_latest_session_state(node_factory, round_):
    """The client acknowledges a QoS 2 delivery (PUBREC) and reconnects at once on the other frontend while
    the first one has not yet written that to the session record (it is held by SIGSTOP). The resumed
    session must go on from the PUBREC (PUBREL) or from before it (the PUBLISH again, DUP, same packet
    id), never lose the message: the new frontend reads the record only after the old one flushed it."""
    import signal

    node = node_factory(name="node", frontends=2, shards=1, mqtt_port=free_port())
    name = f"fast-{round_}"
    sub = RawMQTT(node.mqtt_port)
    assert sub.connect(name, clean=False).return_code == 0
    assert sub.subscribe(1, [("fast/t", 2)]) == [2]
    old = _wait_frontend_of(node, sub)
    assert old is not None
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect(f"pub-{round_}").return_code == 0
    pub.publish("fast/t", b"once", qos=2, pid=1)
    assert pub.recv() == M.Ack(M.PUBREC, 1)
    pub.ack(M.PUBREL, 1)
    assert pub.recv() == M.Ack(M.PUBCOMP, 1)
    pub.disconnect()
    msg = sub.recv()
    assert (msg.qos, msg.payload) == (2, b"once")
    stopped = node.worker_pid("frontend", old)
    os.kill(stopped, signal.SIGSTOP)
    try:
        sub.ack(M.PUBREC, msg.packet_id)
        sub.close()
        deadline = time.monotonic() + 20
        while True:  # a connection the stopped frontend's listener takes stays unaccepted: try again
            assert time.monotonic() < deadline, "never reached the other frontend"
            new = RawMQTT(node.mqtt_port)
            if _wait_frontend_of(node, new, 0.5) == 1 - old:
                break
            new.close()
        new.send(M.encode_connect(name, False, 60, "guest", b"guest"))
    finally:
        os.kill(stopped, signal.SIGCONT)
    ack = new.recv(timeout=10)
    assert (ack.session_present, ack.return_code) == (True, 0)
    got = new.recv(timeout=10)
    delivered = 0
    if got == M.Ack(M.PUBREL, msg.packet_id):  # the PUBREC was applied first
        delivered += 1
    else:  # the PUBREC was never read: the message again, same packet id [MQTT-4.4.0-1]
        assert (got.payload, got.packet_id, got.dup) == (b"once", msg.packet_id, True), got
        new.ack(M.PUBREC, got.packet_id)
        assert new.recv(timeout=10) == M.Ack(M.PUBREL, msg.packet_id)
        delivered += 1
    new.ack(M.PUBCOMP, msg.packet_id)
    assert delivered == 1
    new.disconnect()


def _queue_counts(node, name: str) -> tuple[int, int]:
    from tests.mgmt_api import Api

    _status, info = Api(node.http_port).call("GET", f"/api/queues/%2F/{name}")
    return info.get("messages_ready", 0), info.get("messages_unacknowledged", 0)


def test_qos2_pubrec_survives_a_kill_9_of_the_frontend_and_the_session_shard(node_factory):
    """The client PUBRECs a QoS 2 delivery; the message's ack reaches the queue's shard while the session
    record cannot be written (its shard held by SIGSTOP); then the frontend and the session shard die
    (kill -9). On reconnect the broker still owes PUBREL for that packet id (not the message again, not
    nothing): the queue's shard wrote the packet id with the ack."""
    import signal

    from frontend.mqtt.messages import session_queue, session_shard
    from tests.mgmt_api import Api

    node = node_factory(name="node", frontends=1, shards=2, mqtt_port=free_port(),
                        extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    for i in range(50):  # a client id whose session record and session queue are on different shards
        name = f"out2-{i}"
        sub = RawMQTT(node.mqtt_port)
        assert sub.connect(name, clean=False).return_code == 0
        assert sub.subscribe(1, [("out2/t", 2)]) == [2]
        queue_shard = api.call("GET", f"/api/queues/%2F/{session_queue(name)}")[1]["shard"]
        if session_shard("/", name, 2) != queue_shard:
            break
        sub.disconnect()
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect("out2-pub").return_code == 0
    pub.publish("out2/t", b"once", qos=2, pid=1)
    assert pub.recv() == M.Ack(M.PUBREC, 1)
    pub.ack(M.PUBREL, 1)
    assert pub.recv() == M.Ack(M.PUBCOMP, 1)
    msg = sub.recv()
    assert (msg.qos, msg.payload) == (2, b"once")
    deadline = time.monotonic() + 10
    while _queue_counts(node, session_queue(name)) != (0, 1):
        assert time.monotonic() < deadline, "the delivery is not counted as unacknowledged"
        time.sleep(0.05)
    stopped = node.worker_pid("shard", 1 - queue_shard)
    os.kill(stopped, signal.SIGSTOP)
    try:
        sub.ack(M.PUBREC, msg.packet_id)
        while _queue_counts(node, session_queue(name)) != (0, 0):  # acknowledged on the queue's shard
            assert time.monotonic() < deadline + 10, "the PUBREC did not acknowledge the message"
            time.sleep(0.05)
        node.kill_worker("shard", 1 - queue_shard)
        frontend = node.kill_worker("frontend", 0)
    except BaseException:
        os.kill(stopped, signal.SIGCONT)
        raise
    sub.close()
    node.wait_worker_restarted("frontend", 0, frontend)
    node.wait_worker_restarted("shard", 1 - queue_shard, stopped)
    sub, ack = _connect_retrying(node, name)
    assert (ack.session_present, ack.return_code) == (True, 0)
    assert sub.recv(timeout=10) == M.Ack(M.PUBREL, msg.packet_id)
    sub.ack(M.PUBCOMP, msg.packet_id)
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect("out2-pub").return_code == 0
    pub.publish("out2/t", b"next", qos=1, pid=2)
    assert pub.recv() == M.Ack(M.PUBACK, 2)
    pub.disconnect()
    nxt = sub.recv(timeout=10)  # the next message, not the old one again
    assert nxt.payload == b"next", nxt
    sub.disconnect()


def test_qos2_pubrec_waits_until_the_packet_id_mark_is_synced(node_factory, tmp_path):
    """PUBREC for a QoS 2 PUBLISH of a persistent session goes out only once the shard's packet-id mark
    (shard/kvstore.py, what makes a resend after a crash count once) is fsynced, not merely written: a
    power cut between an early PUBREC and that sync would let the client's resend be stored twice.

    The KV stores' sync is held (SHARDMQ_TEST_STALL_KV_FSYNC_WHILE) while the queues' group sync runs.
    A QoS 1 publish stored after the QoS 2 one gets its PUBACK: a group sync after the QoS 2 message's
    append has completed, so an early PUBREC would have been written by the frontend already (the
    same turn or before). No PUBREC may have come; it comes once the mark's sync is let go."""
    stall = tmp_path / "stall-kv"
    node = node_factory(name="node", frontends=1, shards=1, mqtt_port=free_port(),
                        env={"SHARDMQ_TEST_STALL_KV_FSYNC_WHILE": str(stall)})
    q = _amqp_counter(node, "synced")
    pub = RawMQTT(node.mqtt_port)
    assert pub.connect("qos2-synced", clean=False).return_code == 0  # its session record is synced
    other = RawMQTT(node.mqtt_port)
    assert other.connect("qos1-other", clean=True).return_code == 0
    counter = node.connect()
    ch = counter.channel()
    stall.touch()
    try:
        pub.publish("synced/x", b"qos2", qos=2, pid=5)
        deadline = time.monotonic() + 10
        while ch.queue_declare(q, passive=True).method.message_count < 1:  # stored, mark written
            assert time.monotonic() < deadline, "the QoS 2 message was not stored"
            time.sleep(0.02)
        other.publish("synced/y", b"qos1", qos=1, pid=9)
        assert other.recv(timeout=10) == M.Ack(M.PUBACK, 9)  # a group sync covering both is done
        pub.sock.settimeout(0.3)
        try:
            early = pub.sock.recv(64)
        except TimeoutError:
            early = b""
        assert early == b"", f"PUBREC before the packet-id mark was synced: {early!r}"
    finally:
        stall.unlink()
    assert pub.recv(timeout=10) == M.Ack(M.PUBREC, 5)
    pub.ack(M.PUBREL, 5)
    assert pub.recv(timeout=10) == M.Ack(M.PUBCOMP, 5)
    pub.disconnect()
    other.disconnect()
    counter.close()
    assert sorted(_drain(node, q, 2)) == [b"qos1", b"qos2"]
