"""The AMQP connection layer of a real node: protocol header, start/tune/open, heartbeats, close, channels.

pika where a client library can say it; tests/raw_amqp.py (pamqp frames on a raw socket)
where the test needs bytes or timing no library produces.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import time

import pika
import pika.exceptions
import pytest
from pamqp import commands as C
from pamqp import encode as pencode

from tests.raw_amqp import PROTOCOL_HEADER, RawClient

CAPABILITIES = ("publisher_confirms", "exchange_exchange_bindings", "basic.nack", "consumer_cancel_notify",
                "connection.blocked", "authentication_failure_close", "per_consumer_qos")


def _uid(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"


def _assert_node_serves(node) -> None:
    """A fresh pika client can still declare, publish and get."""
    conn = node.connect()
    try:
        ch = conn.channel()
        q = ch.queue_declare(_uid("alive"), auto_delete=True).method.queue
        ch.basic_publish("", q, b"still here")
        method, _props, body = ch.basic_get(q, auto_ack=True)
        assert method is not None and body == b"still here"
    finally:
        conn.close()


# ------------------------------------------------------------------ protocol header
@pytest.mark.parametrize("header", [
    b"AMQP\x01\x01\x00\x0a",  # AMQP 0-10
    b"AMQP\x00\x01\x00\x00",  # AMQP 1.0
    b"AMQP\x00\x00\x09\x00",  # 0-9-0
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
])
def test_wrong_protocol_header_gets_ours_back_and_the_socket_closed(shared_node, header):
    with RawClient(shared_node.port) as raw:
        raw.send(header)
        deadline = time.monotonic() + 5.0
        while not raw.eof and time.monotonic() < deadline:
            raw._fill(deadline)
        assert raw.eof, "node kept the socket open after a bad protocol header"
        assert raw.buf == PROTOCOL_HEADER


def test_header_in_pieces_is_accepted(shared_node):
    with RawClient(shared_node.port) as raw:
        for byte in PROTOCOL_HEADER:
            raw.send(bytes((byte,)))
        start = raw.expect(C.Connection.Start)
        assert (start.version_major, start.version_minor) == (0, 9)


# ------------------------------------------------------------------ start / start-ok
def test_start_advertises_mechanisms_locales_and_capabilities(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.send_header()
        start = raw.expect(C.Connection.Start)
    assert set(start.mechanisms.split()) == {"PLAIN", "AMQPLAIN"}
    assert "en_US" in start.locales.split()
    props = start.server_properties
    assert props["product"] and props["version"] and props["platform"]
    caps = props["capabilities"]
    for cap in CAPABILITIES:
        assert caps.get(cap) is True, cap


def test_pika_sees_the_capabilities(shared_node):
    conn = shared_node.connect()
    try:
        caps = conn._impl.server_capabilities
        assert all(caps.get(cap) is True for cap in CAPABILITIES)
        assert conn._impl.publisher_confirms and conn._impl.basic_nack and conn._impl.consumer_cancel_notify
    finally:
        conn.close()


def _amqplain(login: str, password: str) -> bytes:
    # AMQPLAIN's response is a field table without its 4-byte length, as py-amqp and pika send it.
    return pencode.field_table({"LOGIN": login, "PASSWORD": password})[4:]


def test_amqplain_login_over_a_raw_socket(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake(mechanism="AMQPLAIN", response=_amqplain("guest", "guest"))
        raw.open_channel(1)
        raw.send_method(1, C.Queue.Declare(queue=_uid("amqplain"), auto_delete=True))
        assert raw.expect(C.Queue.DeclareOk, channel=1).message_count == 0


@pytest.mark.parametrize("mechanism,response", [
    ("PLAIN", b"\0guest\0wrong"),
    ("PLAIN", b"\0nobody\0guest"),
    ("PLAIN", b"garbage-without-nuls"),
    ("AMQPLAIN", _amqplain("guest", "wrong")),
    ("AMQPLAIN", b"\xff\xff not a table"),
    ("EXTERNAL", b""),
])
def test_refused_login_is_403_connection_close(shared_node, mechanism, response):
    with RawClient(shared_node.port) as raw:
        raw.send_header()
        raw.expect(C.Connection.Start)
        raw.send_start_ok(mechanism, response)
        close = raw.connection_close()
        assert close.reply_code == 403
        assert close.reply_text.startswith("ACCESS_REFUSED - ")
        assert (close.class_id, close.method_id) == (10, 11)
        assert raw.read_until_eof(5.0)


def test_pika_bad_password_raises_authentication_error(shared_node):
    params = pika.ConnectionParameters("127.0.0.1", shared_node.port, connection_attempts=1,
                                       credentials=pika.PlainCredentials("guest", "not-the-password"))
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)) as info:
        pika.BlockingConnection(params)
    assert "403" in str(info.value) and "ACCESS_REFUSED" in str(info.value)
    _assert_node_serves(shared_node)


def test_unknown_vhost_is_530_not_allowed(shared_node):
    params = pika.ConnectionParameters("127.0.0.1", shared_node.port, connection_attempts=1,
                                       virtual_host="no-such-vhost",
                                       credentials=pika.PlainCredentials("guest", "guest"))
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as info:
        pika.BlockingConnection(params)
    assert "530" in str(info.value) and "NOT_ALLOWED" in str(info.value)
    with RawClient(shared_node.port) as raw:
        raw.send_header()
        raw.expect(C.Connection.Start)
        raw.send_start_ok()
        raw.expect(C.Connection.Tune)
        raw.send_method(0, C.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0))
        raw.send_method(0, C.Connection.Open(virtual_host="no-such-vhost"))
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (530, 10, 40)
        assert "no-such-vhost" in close.reply_text


def _non_loopback_local_address() -> str | None:
    """An IPv4 address of this host's own interfaces that is not 127/8 (SIOCGIFADDR, no traffic)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            addr = socket.inet_ntoa(packed[20:24])
            if not addr.startswith("127."):
                return addr
    finally:
        probe.close()
    return None


def test_loopback_user_is_accepted_from_127_0_0_1_and_refused_from_elsewhere(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=["--loopback-users", "guest"])
    _assert_node_serves(node)
    source = _non_loopback_local_address()
    if source is None:
        pytest.skip("this host has no non-loopback address to bind a client socket to")
    # Destination stays 127.0.0.1 (the packets never leave the lo device), but the node sees a
    # peer address that is not loopback: exactly the case loopback_users exists for.
    with RawClient(node.port, source=source) as raw:
        raw.send_header()
        raw.expect(C.Connection.Start)
        raw.send_start_ok()
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (403, 10, 11)
    # the same credentials from 127.0.0.1 still work: the refusal was the loopback rule
    _assert_node_serves(node)


# ------------------------------------------------------------------ tune
def test_small_client_frame_max_splits_a_1mib_delivery(shared_node):
    body = bytes(range(256)) * 4096  # 1 MiB
    conn = shared_node.connect(frame_max=4096)
    try:
        ch = conn.channel()
        q = ch.queue_declare(_uid("big"), auto_delete=True).method.queue
        ch.basic_publish("", q, body)
        for method, _props, got in ch.consume(q, auto_ack=True, inactivity_timeout=10):
            assert method is not None, "1 MiB message not delivered"
            assert got == body
            break
        ch.cancel()
    finally:
        conn.close()


def test_deliveries_respect_the_negotiated_frame_max_on_the_wire(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake(frame_max=4096)
        raw.open_channel(1)
        q = _uid("frames")
        raw.send_method(1, C.Queue.Declare(queue=q, auto_delete=True))
        raw.expect(C.Queue.DeclareOk)
        body = b"x" * 20000
        raw.publish(1, "", q, body)
        raw.send_method(1, C.Basic.Get(queue=q, no_ack=True))
        raw.expect(C.Basic.GetOk)
        raw.expect(object)  # content header
        got = b""
        while len(got) < len(body):
            before = len(raw.buf)
            part = raw.expect(object)
            assert before >= len(part.value) + 8
            assert len(part.value) <= 4096 - 8, f"body frame of {len(part.value)} bytes over frame_max 4096"
            got += part.value
        assert got == body


@pytest.mark.parametrize("frame_max,expected", [(1024, "lower than the minimum"), (0, "higher than the maximum"),
                                                (1 << 30, "higher than the maximum")])
def test_tune_ok_frame_max_outside_limits_is_530(shared_node, frame_max, expected):
    with RawClient(shared_node.port) as raw:
        raw.send_header()
        raw.expect(C.Connection.Start)
        raw.send_start_ok()
        raw.expect(C.Connection.Tune)
        raw.send_method(0, C.Connection.TuneOk(channel_max=0, frame_max=frame_max, heartbeat=0))
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (530, 10, 30)
        assert expected in close.reply_text


def test_more_open_channels_than_channel_max_closes_the_connection(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake(channel_max=3)
        # RabbitMQ 3.10 limits the count of open channels, not their numbers: aiormq opens 65535.
        for number in (65535, 11, 7):
            raw.open_channel(number)
        raw.send_method(1, C.Channel.Open())
        close = raw.connection_close()
        # rabbit_reader:create_channel, byte for byte (compared with a private RabbitMQ 3.10.8)
        assert (close.reply_code, close.class_id, close.method_id) == (530, 0, 0)
        assert close.reply_text == "NOT_ALLOWED - number of channels opened (3) has reached the negotiated " \
                                   "channel_max (3)"
        assert raw.read_until_eof(5.0)
    conn = shared_node.connect(channel_max=3)
    try:
        assert conn._impl.params.channel_max == 3
        chans = [conn.channel() for _ in range(3)]
        assert all(c.is_open for c in chans)
    finally:
        conn.close()


# ------------------------------------------------------------------ heartbeats
def test_heartbeat_1_keeps_an_idle_pika_connection_alive(shared_node):
    conn = shared_node.connect(heartbeat=1)
    try:
        assert conn._impl.params.heartbeat == 1
        conn.sleep(3.5)  # pika answers/sends heartbeats while it sleeps; several intervals pass
        assert conn.is_open
        ch = conn.channel()
        ch.queue_declare(_uid("hb"), auto_delete=True)
    finally:
        conn.close()


def test_silent_client_is_dropped_after_missed_heartbeats(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake(heartbeat=1)
        heartbeats = 0
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            got = raw.next_frame(max(0.0, deadline - time.monotonic()))
            if got is None:
                break
            if got[1].__class__.__name__ == "Heartbeat":
                heartbeats += 1
        assert raw.eof, "node kept a client that sent nothing for 8 heartbeat intervals"
        assert heartbeats >= 1, "node sent no heartbeat while the client was idle"
    _assert_node_serves(shared_node)


def test_client_sending_heartbeats_is_kept(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake(heartbeat=1)
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            raw.send(b"\x08\x00\x00\x00\x00\x00\x00\xce")
            got = raw.next_frame(0.4)
            assert not raw.eof, "node dropped a client that sent heartbeats"
            assert got is None or got[1].__class__.__name__ == "Heartbeat"
        raw.open_channel(1)


# ------------------------------------------------------------------ handshake timeout
def test_clients_stuck_in_the_handshake_are_closed_after_the_timeout(shared_node):
    idle = RawClient(shared_node.port, timeout=15.0)
    header_only = RawClient(shared_node.port, timeout=15.0)
    after_start_ok = RawClient(shared_node.port, timeout=15.0)
    clients = (idle, header_only, after_start_ok)
    try:
        header_only.send_header()
        header_only.expect(C.Connection.Start)
        after_start_ok.send_header()
        after_start_ok.expect(C.Connection.Start)
        after_start_ok.send_start_ok()
        after_start_ok.expect(C.Connection.Tune)
        # RabbitMQ's handshake_timeout is 10 s; allow a generous bound on a loaded machine.
        for client in clients:
            assert client.read_until_eof(20.0), "node kept a connection that never finished the handshake"
    finally:
        for client in clients:
            client.close()


# ------------------------------------------------------------------ close
def test_client_initiated_close_gets_close_ok_then_eof(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(0, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
        raw.expect(C.Connection.CloseOk, channel=0)
        assert raw.read_until_eof(5.0)
    conn = shared_node.connect()
    conn.channel()
    conn.close()
    assert conn.is_closed


def test_node_initiated_close_waits_for_close_ok(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.send_method(5, C.Queue.Declare(queue="x"))  # channel 5 never opened
        close = raw.connection_close(answer=False)
        assert close.reply_code == 504
        # Until close-ok only close/close-ok count: a channel.open now gets no open-ok.
        raw.send_method(1, C.Channel.Open())
        assert raw.next_frame(0.3) is None and not raw.eof, "node did not wait for close-ok"
        raw.send_method(0, C.Connection.CloseOk())
        assert raw.read_until_eof(5.0)


def test_node_closes_the_socket_when_close_ok_never_comes(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.send_method(0, C.Basic.Qos(prefetch_count=1))  # a basic method on channel 0
        close = raw.connection_close(answer=False)
        assert close.reply_code in (503, 504)
        assert raw.read_until_eof(10.0), "node waited forever for close-ok"


def test_pika_close_is_clean(shared_node):
    conn = shared_node.connect()
    ch = conn.channel()
    ch.queue_declare(_uid("close"), auto_delete=True)
    conn.close()
    assert conn.is_closed and ch.is_closed


# ------------------------------------------------------------------ channels
def test_channel_open_close_and_reuse_of_the_number(shared_node):
    conn = shared_node.connect()
    try:
        ch = conn.channel(channel_number=7)
        ch.close()
        assert ch.is_closed
        again = conn.channel(channel_number=7)
        again.queue_declare(_uid("reuse"), auto_delete=True)
        assert again.is_open
    finally:
        conn.close()


def test_two_hundred_channels_on_one_connection(shared_node):
    conn = shared_node.connect()
    try:
        q = conn.channel().queue_declare(_uid("many"), auto_delete=True).method.queue
        chans = [conn.channel() for _ in range(200)]
        for i, ch in enumerate(chans):
            ch.basic_publish("", q, str(i).encode())
        getter = chans[-1]
        got = set()
        while (msg := getter.basic_get(q, auto_ack=True))[0] is not None:
            got.add(int(msg[2]))
        assert got == set(range(200))
        for ch in chans[::2]:
            ch.close()
        assert all(ch.is_open for ch in chans[1::2])
    finally:
        conn.close()


def test_channel_flow(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(1, C.Channel.Flow(active=True))
        assert raw.expect(C.Channel.FlowOk, channel=1).active is True
        raw.send_method(1, C.Channel.Flow(active=False))
        close = raw.connection_close()
        # rabbit_channel: flow active=false is not implemented (540) since 3.3
        assert (close.reply_code, close.class_id, close.method_id) == (540, 20, 20)


def test_reopening_an_open_channel_is_504(shared_node):
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.open_channel(3)
        raw.send_method(3, C.Channel.Open())
        close = raw.connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (504, 20, 10)
        assert "second 'channel.open' seen" in close.reply_text
    _assert_node_serves(shared_node)


def test_close_pipelined_behind_pending_work_loses_nothing(shared_node):
    """declare, publish, connection.close in one write: the publish must land before close-ok."""
    q = _uid("pipelined")
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(1, C.Queue.Declare(queue=q))  # the channel waits for the node here
        for i in range(3):
            raw.publish(1, "", q, f"m{i}".encode())
        raw.send_method(0, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
        raw.expect(C.Queue.DeclareOk, channel=1)
        raw.expect(C.Connection.CloseOk, channel=0)
        assert raw.read_until_eof(5.0)
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        bodies = [ch.basic_get(q, auto_ack=True)[2] for _ in range(3)]
        assert bodies == [b"m0", b"m1", b"m2"]
        ch.queue_delete(q)
    finally:
        conn.close()
