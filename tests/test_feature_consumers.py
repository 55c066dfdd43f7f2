"""Consumer priorities, single active consumer, consumer timeouts (consumer argument, node default,
policy) and x-expires renewal by redeclare, on real nodes driven by pika."""

from __future__ import annotations

import json
import socket
import time

import pytest
from pika.exceptions import ChannelClosedByBroker

from tests.helpers import (
    WAIT,
    channel_error,
    connections_on_two_frontends,
    control_lane_barrier,
    uid,
    wait_count,
    wait_queue_gone,
)

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


class Inbox:
    """Deliveries of several consumers, as (consumer name, body, redelivered)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes, bool]] = []

    def consume(self, channel, queue: str, name: str, auto_ack: bool = True, **kwargs) -> str:
        def on_message(_ch, method, _props, body):
            self.got.append((name, body, method.redelivered))
        return channel.basic_consume(queue, on_message, auto_ack=auto_ack, **kwargs)

    def by(self, name: str) -> list[bytes]:
        return [body for who, body, _r in self.got if who == name]

    def wait(self, connections, n: int, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"{len(self.got)} of {n} deliveries arrived: {self.got}"
            for c in connections:
                c.process_data_events(time_limit=0.02)

    def settle(self, connections, seconds: float = 0.3) -> None:
        """Let anything that should NOT arrive have its chance to arrive."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for c in connections:
                c.process_data_events(time_limit=0.02)


def publish(ch, queue: str, n: int, prefix: str = "m") -> list[bytes]:
    bodies = [f"{prefix}{i}".encode() for i in range(n)]
    for body in bodies:
        ch.basic_publish("", queue, body)
    return bodies


# ---------------------------------------------------------------- consumer priorities
def test_high_priority_consumer_with_room_gets_everything(conn, ch):
    q = uid()
    ch.queue_declare(q)
    inbox = Inbox()
    inbox.consume(conn.channel(), q, "low")  # registered first: order must not matter
    inbox.consume(conn.channel(), q, "high", arguments={"x-priority": 10})
    publish(ch, q, 30)
    inbox.wait([conn], 30)
    inbox.settle([conn])
    assert len(inbox.by("high")) == 30 and inbox.by("low") == []


def test_low_priority_consumer_gets_what_a_blocked_high_one_cannot_take(conn, ch):
    q = uid()
    ch.queue_declare(q)
    inbox = Inbox()
    high_ch = conn.channel()
    high_ch.basic_qos(prefetch_count=3)
    inbox.consume(high_ch, q, "high", auto_ack=False, arguments={"x-priority": 5})
    inbox.consume(conn.channel(), q, "low", arguments={"x-priority": -1})
    publish(ch, q, 10)
    inbox.wait([conn], 10)
    assert len(inbox.by("high")) == 3 and len(inbox.by("low")) == 7
    # Once the high one has room again it is first in line.
    high_ch.basic_ack(multiple=True, delivery_tag=3)
    # The ack (control lane) must reach the shard before the next publish (publish lane) does,
    # or the low consumer rightly gets it: wait for that instead of hoping.
    control_lane_barrier(conn, q)
    publish(ch, q, 3, "n")
    inbox.wait([conn], 13)
    assert inbox.by("high")[3:] == [b"n0", b"n1", b"n2"]


def test_equal_priorities_share_round_robin_and_starve_the_lower_group(conn, ch):
    q = uid()
    ch.queue_declare(q)
    inbox = Inbox()
    inbox.consume(conn.channel(), q, "a", arguments={"x-priority": 5})
    inbox.consume(conn.channel(), q, "zero")
    inbox.consume(conn.channel(), q, "b", arguments={"x-priority": 5})
    publish(ch, q, 10)
    inbox.wait([conn], 10)
    inbox.settle([conn])
    assert inbox.by("a") == [b"m0", b"m2", b"m4", b"m6", b"m8"]
    assert inbox.by("b") == [b"m1", b"m3", b"m5", b"m7", b"m9"]
    assert inbox.by("zero") == []


def test_plain_round_robin_is_unchanged(conn, ch):
    q = uid()
    ch.queue_declare(q)
    inbox = Inbox()
    for name in ("a", "b", "c"):
        inbox.consume(conn.channel(), q, name)
    publish(ch, q, 9)
    inbox.wait([conn], 9)
    assert [len(inbox.by(n)) for n in ("a", "b", "c")] == [3, 3, 3]


@pytest.mark.parametrize(("args", "err"), [
    ({"x-priority": "high"}, "invalid arg 'x-priority' for queue '{q}' in vhost '/': {{unacceptable_type,longstr}}"),
    ({"x-priority": True}, "invalid arg 'x-priority' for queue '{q}' in vhost '/': {{unacceptable_type,bool}}"),
    ({"x-consumer-timeout": -1}, "invalid arg 'x-consumer-timeout' for queue '{q}' in vhost '/': "
                                 "{{value_negative,-1}}"),
])
def test_bad_consumer_arguments_are_refused_with_406(conn, ch, args, err):
    q = uid()
    ch.queue_declare(q)
    code, text = channel_error(conn, lambda c: c.basic_consume(q, lambda *a: None, arguments=args))
    assert code == 406
    assert text == "PRECONDITION_FAILED - " + err.format(q=q)


# ---------------------------------------------------------------- single active consumer
def test_single_active_consumer_only_one_receives_also_after_a_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("sac")
    ch.queue_declare(q, durable=True, arguments={"x-single-active-consumer": True})
    for round_ in range(2):
        inbox = Inbox()
        inbox.consume(conn.channel(), q, "first")
        inbox.consume(conn.channel(), q, "second")
        inbox.consume(conn.channel(), q, "third", arguments={"x-priority": 9})  # joins late: stays idle
        assert ch.queue_declare(q, passive=True).method.consumer_count == 3  # idle ones count
        publish(ch, q, 10)
        inbox.wait([conn], 10)
        inbox.settle([conn])
        assert len(inbox.by("first")) == 10, inbox.got
        if round_ == 0:
            conn.close()
            node.restart()
            conn = node.connect()
            ch = conn.channel()
            ch.confirm_delivery()
    conn.close()


def test_single_active_consumer_hands_over_on_cancel(conn, ch):
    q = uid("sac")
    ch.queue_declare(q, arguments={"x-single-active-consumer": True})
    inbox = Inbox()
    first_ch = conn.channel()
    first = inbox.consume(first_ch, q, "first", auto_ack=False)
    inbox.consume(conn.channel(), q, "second")
    publish(ch, q, 2)
    inbox.wait([conn], 2)
    first_ch.basic_cancel(first)
    publish(ch, q, 3, "n")
    inbox.wait([conn], 5)
    assert inbox.by("first") == [b"m0", b"m1"] and inbox.by("second") == [b"n0", b"n1", b"n2"]
    # The cancelled consumer's unacked messages stay with its channel until it closes (AMQP 0-9-1)...
    first_ch.close()
    inbox.wait([conn], 7)
    # ...then go back to the queue and on to the new active consumer, redelivered.
    assert inbox.got[5:] == [("second", b"m0", True), ("second", b"m1", True)]


def test_single_active_consumer_hands_over_on_channel_close_with_unacked_first(conn, ch):
    q = uid("sac")
    ch.queue_declare(q, arguments={"x-single-active-consumer": True})
    inbox = Inbox()
    first_ch = conn.channel()
    first_ch.basic_qos(prefetch_count=2)
    inbox.consume(first_ch, q, "first", auto_ack=False)
    inbox.consume(conn.channel(), q, "second")
    publish(ch, q, 5)
    inbox.wait([conn], 2)
    inbox.settle([conn], 0.2)
    assert inbox.by("first") == [b"m0", b"m1"] and inbox.by("second") == []
    # A broker-side channel close (no basic.cancel first, unlike pika's channel.close()).
    with pytest.raises(ChannelClosedByBroker):
        first_ch.queue_declare(uid("missing"), passive=True)
    inbox.wait([conn], 7)
    assert inbox.got[2:] == [("second", b"m0", True), ("second", b"m1", True), ("second", b"m2", False),
                             ("second", b"m3", False), ("second", b"m4", False)]


def test_single_active_consumer_hands_over_on_connection_close_to_the_highest_priority(shared_node, ch):
    q = uid("sac")
    ch.queue_declare(q, arguments={"x-single-active-consumer": True})
    doomed = shared_node.connect()
    stays = shared_node.connect()
    try:
        inbox = Inbox()
        doomed_ch = doomed.channel()
        doomed_ch.basic_qos(prefetch_count=1)
        inbox.consume(doomed_ch, q, "doomed", auto_ack=False)
        inbox.consume(stays.channel(), q, "older", arguments={"x-priority": 1})
        inbox.consume(stays.channel(), q, "higher", arguments={"x-priority": 7})
        publish(ch, q, 3)
        inbox.wait([doomed, stays], 1)
        # The connection drops (no basic.cancel or channel.close first, unlike pika's close()).
        doomed._impl._transport._sock.shutdown(socket.SHUT_RDWR)
        inbox.wait([stays], 4)
        inbox.settle([stays])
        assert inbox.got[1:] == [("higher", b"m0", True), ("higher", b"m1", False), ("higher", b"m2", False)]
    finally:
        for c in (doomed, stays):
            if c.is_open:
                try:
                    c.close()
                except Exception:  # the dropped one may already know it is gone
                    pass


def test_single_active_consumer_hands_over_across_frontends(node):
    a, b = connections_on_two_frontends(node)
    try:
        ch = b.channel()
        ch.confirm_delivery()
        q = uid("sac")
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        inbox = Inbox()
        a_ch = a.channel()
        a_ch.basic_qos(prefetch_count=2)
        inbox.consume(a_ch, q, "a", auto_ack=False)
        inbox.consume(b.channel(), q, "b")
        publish(ch, q, 4)
        inbox.wait([a, b], 2)
        inbox.settle([a, b], 0.2)
        assert inbox.by("a") == [b"m0", b"m1"] and inbox.by("b") == []
        a.close()  # pika cancels the consumer, then closes the channel and the connection
        inbox.wait([b], 6)
        assert sorted(inbox.got[2:]) == [("b", b"m0", True), ("b", b"m1", True), ("b", b"m2", False),
                                         ("b", b"m3", False)]
    finally:
        for c in (a, b):
            if c.is_open:
                c.close()


def test_exclusive_consumer_on_single_active_consumer_queue_is_refused(conn, ch):
    q = uid("sac")
    ch.queue_declare(q, arguments={"x-single-active-consumer": True})
    code, text = channel_error(conn, lambda c: c.basic_consume(q, lambda *a: None, exclusive=True))
    assert (code, text) == (403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use")


# ---------------------------------------------------------------- consumer timeouts
def _held_until_closed(conn, queue: str, **consume_kwargs) -> tuple[int, str, float]:
    """Consume one message without acking; (code, text, seconds until the broker closed the channel)."""
    channel = conn.channel()
    start = time.monotonic()
    with pytest.raises(ChannelClosedByBroker) as info:
        for method, _props, _body in channel.consume(queue, inactivity_timeout=WAIT, **consume_kwargs):
            assert method is not None, "the channel was not closed"
    return info.value.reply_code, info.value.reply_text, time.monotonic() - start


def test_consumer_argument_timeout_closes_the_channel_with_406(conn, ch):
    q = uid()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"slow")
    code, text, took = _held_until_closed(conn, q, arguments={"x-consumer-timeout": 300})
    assert code == 406 and took >= 0.3
    assert text.startswith("PRECONDITION_FAILED - delivery acknowledgement on channel ")
    assert "Timeout value used: 300 ms." in text
    wait_count(ch, q, 1)  # the unacked message went back with the channel


def test_consumer_argument_beats_the_queue_argument(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-consumer-timeout": 150})
    ch.basic_publish("", q, b"slow")
    code, text, _took = _held_until_closed(conn, q, arguments={"x-consumer-timeout": 400})
    assert code == 406 and "Timeout value used: 400 ms." in text


def test_node_default_consumer_timeout(node_factory):
    node = node_factory(frontends=1, shards=2, extra_args=["--consumer-timeout", "400"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"slow")
    code, text, took = _held_until_closed(conn, q)
    assert code == 406 and "Timeout value used: 400 ms." in text and took >= 0.4
    wait_count(ch, q, 1)
    # basic.get deliveries are timed too.
    getter = conn.channel()
    method, _p, _b = getter.basic_get(q, auto_ack=False)
    assert method is not None
    deadline = time.monotonic() + WAIT
    while getter.is_open:
        assert time.monotonic() < deadline, "basic.get delivery was never timed out"
        conn.process_data_events(time_limit=0.05)
    wait_count(ch, q, 1)
    # A consumer that turns it off for itself (x-consumer-timeout 0) keeps its channel.
    keeper = conn.channel()
    inbox = Inbox()
    inbox.consume(keeper, q, "keeper", auto_ack=False, arguments={"x-consumer-timeout": 0})
    inbox.wait([conn], 1)
    inbox.settle([conn], 1.2)
    assert keeper.is_open
    conn.close()


def test_consumer_timeout_policy_takes_the_stricter_value(tmp_path, node_factory):
    defs = tmp_path / "definitions.json"
    defs.write_text(json.dumps({"policies": [{
        "vhost": "/", "name": "ct", "pattern": r"^ct\.", "apply-to": "queues", "priority": 0,
        "definition": {"consumer-timeout": 300}}]}))
    node = node_factory(frontends=1, shards=2, extra_args=["--definitions", str(defs), "--consumer-timeout", "0"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("ct.policy")
    ch.queue_declare("ct.arg", arguments={"x-consumer-timeout": 60000})
    for q in ("ct.policy", "ct.arg"):
        ch.basic_publish("", q, b"slow")
        code, text, _took = _held_until_closed(conn, q)
        assert code == 406 and "Timeout value used: 300 ms." in text, (q, text)
    conn.close()


def test_bad_consumer_timeout_policy_is_refused():
    from broker.policies import policy_attrs

    with pytest.raises(ValueError, match="consumer-timeout"):
        policy_attrs(".*", {"consumer-timeout": "86400000"})
    assert policy_attrs(".*", {"consumer-timeout": 86400000})["definition"] == {"consumer-timeout": 86400000}


# ---------------------------------------------------------------- x-expires
def test_redeclare_renews_x_expires(conn, ch):
    """Redeclared every 0.1 s, a queue with a 1.5 s x-expires outlives it (only a 1.4 s stall between two
    redeclares could let it go); once they stop, it goes, and not before 1.5 s after the last one."""
    q = uid()
    args = {"x-expires": 1500}
    ch.queue_declare(q, arguments=args)
    ch.basic_publish("", q, b"marker", mandatory=True)  # tells the original queue from a re-created one
    start = time.monotonic()
    while time.monotonic() - start < 2.5:  # past the expiry with 1 s to spare
        last = time.monotonic()
        assert ch.queue_declare(q, arguments=args).method.message_count == 1
        time.sleep(0.1)
    wait_queue_gone(ch, q)  # redeclares stopped: it goes (mandatory probes do not count as use)
    assert time.monotonic() - last >= 1.5 - 0.01  # the shard counts in whole milliseconds


@pytest.mark.parametrize("value, err", [
    ("60000", '{unacceptable_type,"expected integer"}'),
    (-5, "{value_negative,-5}"),
])
def test_bad_x_consumer_timeout_queue_argument_is_refused(conn, value, err):
    q = uid()
    code, text = channel_error(conn, lambda c: c.queue_declare(q, arguments={"x-consumer-timeout": value}))
    assert (code, text) == (406, f"PRECONDITION_FAILED - invalid arg 'x-consumer-timeout' for queue '{q}' "
                                 f"in vhost '/': {err}")
