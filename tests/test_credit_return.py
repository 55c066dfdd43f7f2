"""When the frontend gives a consumer's delivery credit back to its shard (frontend/amqp/connection.py).

Credit is returned in CREDIT_RETURN_AT lumps, not after every written delivery: a lone message at
a steady rate then costs the shard no extra wake-up. Against the recording stand-in worker of
test_channel_generations (no sockets); tests/test_basic.py's 10,000-message no-ack test shows the
window still turns over end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

from pamqp import commands as C

from broker import contract
from broker.amqp import events as E
from frontend.amqp.channel import Consumer
from frontend.amqp.connection import CREDIT_RETURN_AT
from frontend.paused_credit import GIVE_BACK_STEP, START_WINDOW

from .test_channel_generations import _frames, _running


class _Transport:
    """A transport stand-in: ``buffered`` bytes it could not send yet (no kernel socket to ask)."""

    def __init__(self, buffered: int = 0) -> None:
        self.buffered = buffered

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, _name: str, default=None):
        return default

    def is_closing(self) -> bool:
        return False

    def write(self, _data: bytes) -> None:
        pass

    def writelines(self, _chunks) -> None:
        pass


def _consuming(tags=("ctag",)):
    conn, worker = _running()
    conn.transport = _Transport()  # a client that takes what is written
    conn._open_channel(1)
    ch = conn.channels[1]
    for tag in tags:
        consumer = Consumer(tag, "q", 0, True)
        consumer.ready = True
        ch.consumers[tag] = consumer
    _frames(conn)
    return conn, worker, ch


def _deliver(conn, ch, shard=0, tag="ctag", body=b"x"):
    conn.on_deliver(shard, [contract.DELIVER, 7, ch.key, tag, 1, 1, False, "", "q", b"\x00\x00", body])


def _credits(worker):
    return [(shard, item[2], item[3], item[4]) for shard, item in worker.put if item[0] == contract.CREDIT]


def test_credit_goes_back_in_lumps_and_every_delivery_is_written():
    assert 1 < CREDIT_RETURN_AT <= contract.CREDIT_WINDOW // 2  # the shard always keeps room to deliver
    conn, worker, ch = _consuming()
    _deliver(conn, ch)
    assert [f for _c, f in _frames(conn)] == ["Deliver", "ContentHeader", "ContentBody"]  # a lone message goes out
    conn.flush_turn()
    assert _credits(worker) == []  # but its credit stays here
    for _ in range(CREDIT_RETURN_AT - 2):
        _deliver(conn, ch)
        conn.flush_turn()
    assert _credits(worker) == []
    _deliver(conn, ch)
    conn.flush_turn()
    assert _credits(worker) == [(0, ch.key, "ctag", CREDIT_RETURN_AT)]  # everything held, in one item
    _deliver(conn, ch)
    conn.flush_turn()
    assert len(_credits(worker)) == 1  # counting starts again


def test_credit_is_counted_per_shard_and_consumer():
    conn, worker, ch = _consuming(("a", "b"))
    for _ in range(CREDIT_RETURN_AT - 1):
        _deliver(conn, ch, 0, "a")
        _deliver(conn, ch, 1, "a")
        _deliver(conn, ch, 0, "b")
    conn.flush_turn()
    assert _credits(worker) == []
    _deliver(conn, ch, 1, "a")
    conn.flush_turn()
    assert _credits(worker) == [(1, ch.key, "a", CREDIT_RETURN_AT)]


def test_a_big_body_returns_its_credit_at_once():
    conn, worker, ch = _consuming()
    big = bytes(CREDIT_RETURN_AT << contract.CREDIT_BYTES_SHIFT)  # costs 1 + CREDIT_RETURN_AT credits
    _deliver(conn, ch, body=big)
    conn.flush_turn()
    assert _credits(worker) == [(0, ch.key, "ctag", 1 + CREDIT_RETURN_AT)]


def test_a_paused_connection_takes_its_credit_back_and_gives_it_back_in_steps():
    """frontend/paused_credit.py: no credit goes back while the client's socket is paused, and what the
    shard has not spent yet is taken back at once; after the resume it comes back in steps, and the
    window is conserved."""
    window = contract.CREDIT_WINDOW
    conn, worker, ch = _consuming()
    for _ in range(10):
        _deliver(conn, ch)
    conn.flush_turn()
    conn.pause_writing()
    assert _credits(worker) == [(0, ch.key, "ctag", -(window - 10))]  # all but the 10 seen delivered
    for _ in range(CREDIT_RETURN_AT):  # in flight at the pause: written, not credited back
        _deliver(conn, ch)
    conn.flush_turn()
    conn.pause_writing()  # a second pause before the resume: nothing more is outstanding
    assert len(_credits(worker)) == 1
    conn.resume_writing()
    conn.flush_turn()  # the held lump goes back, and a step: the socket took this turn's deliveries
    assert _credits(worker)[1:] == [(0, ch.key, "ctag", GIVE_BACK_STEP), (0, ch.key, "ctag", CREDIT_RETURN_AT + 10),
                                    (0, ch.key, "ctag", GIVE_BACK_STEP)]
    delivered = CREDIT_RETURN_AT + 10
    while conn._taken is not None:  # then a step per turn that wrote deliveries, while the client keeps up
        _deliver(conn, ch)
        delivered += 1
        conn.flush_turn()
    assert max(n for _s, _c, _t, n in _credits(worker)) == CREDIT_RETURN_AT + 10
    assert len(_credits(worker)) == 1 + 1 + 1 + (window - 10) // GIVE_BACK_STEP  # take, lump, steps
    # The window is conserved: what the shard spent minus what came back is what the frontend holds.
    assert delivered - sum(n for _s, _c, _t, n in _credits(worker)) == sum(conn._credit.values())


def test_credit_taken_back_from_a_cancelled_consumer_is_not_given_back():
    conn, worker, ch = _consuming(("a", "b"))
    conn.pause_writing()
    assert {(t, n) for _s, _c, t, n in _credits(worker)} == {("a", -contract.CREDIT_WINDOW), ("b", -contract.CREDIT_WINDOW)}
    conn.drop_credit(ch.key, "a")  # the shard dropped consumer a
    conn.resume_writing()
    assert [(t, n) for _s, _c, t, n in _credits(worker)[2:]] == [("b", GIVE_BACK_STEP)]


def test_held_credit_of_a_cancelled_consumer_or_closed_channel_is_forgotten():
    """A connection that consumes and cancels for hours keeps no entry per consumer tag it ever had."""
    conn, worker, ch = _consuming(("a", "b"))
    _deliver(conn, ch, 0, "a")
    _deliver(conn, ch, 0, "b")
    conn.flush_turn()
    assert set(conn._credit) == {(0, ch.key, "a"), (0, ch.key, "b")}
    ch.handle(E.MethodFrame(1, C.Basic.Cancel("a")))
    [(_shard, _item, answered)] = worker.requests
    answered(True, {})  # the shard dropped consumer a
    assert set(conn._credit) == {(0, ch.key, "b")}
    conn.on_cancel_notify(ch.key, "b")  # the shard cancelled b (its queue was deleted)
    assert conn._credit == {}
    ch.consumers["c"] = Consumer("c", "q", 0, True)
    ch.consumers["c"].ready = True
    _deliver(conn, ch, 0, "c")
    conn.flush_turn()
    assert conn._credit
    conn.forget_channel(ch)
    assert conn._credit == {}
    assert _credits(worker) == []  # nothing was due: none of it went to the shard


def _reusing(shards: dict[str, int]):
    """A running connection whose queues (name -> shard) are known and whose user may consume them."""
    conn, worker, ch = _consuming(())
    worker.defs = SimpleNamespace(queue=lambda _vhost, name: SimpleNamespace(shard=shards[name], exclusive_owner=None))
    conn.access = SimpleNamespace(check=lambda *_args: None)
    return conn, worker, ch


def _method(ch, method) -> None:
    ch.handle(E.MethodFrame(1, method))


def test_a_reused_tag_gets_only_its_own_deliveries_and_credit():
    """basic.cancel nowait then basic.consume with the same tag before the shard answered the cancel
    (tests/test_consumer_tag_reuse.py runs it end to end). The shard delivers in order, so what comes
    for the tag from the old instance's shard before its cancel answer is the old instance's: written
    with its ack mode, credited to no one (a CREDIT for the tag would reach the new instance). The new
    instance's deliveries (here from another shard) wait until the old one is done."""
    conn, worker, ch = _reusing({"qa": 0, "qb": 1})
    _method(ch, C.Basic.Consume(queue="qa", consumer_tag="t", no_ack=False))
    worker.requests[-1][2](True, {})  # consume-ok
    for mid in (1, 2, 3):
        conn.on_deliver(0, [contract.DELIVER, 7, ch.key, "t", 1, mid, False, "", "qa", b"\x00\x00", b"x"])
    assert conn._credit == {(0, ch.key, "t"): 3}
    _method(ch, C.Basic.Cancel(consumer_tag="t", nowait=True))
    _method(ch, C.Basic.Consume(queue="qb", consumer_tag="t", no_ack=True))  # was 530 NOT_ALLOWED
    cancel, consume = worker.requests[-2:]
    assert (cancel[0], cancel[1][0], consume[0], consume[1][0]) == (0, contract.CANCEL, 1, contract.CONSUME)
    assert conn._credit == {}  # the old instance's held-back credit is gone with it
    _frames(conn)
    conn.on_deliver(0, [contract.DELIVER, 7, ch.key, "t", 1, 4, False, "", "qa", b"\x00\x00", b"x"])  # old's, in flight
    consume[2](True, {})  # the new one's consume-ok
    conn.on_deliver(1, [contract.DELIVER, 7, ch.key, "t", 2, 1, False, "", "qb", b"\x00\x00", b"y"])  # new's: waits
    assert [f for _c, f in _frames(conn)] == ["Deliver", "ContentHeader", "ContentBody", "ConsumeOk"]
    assert [ref[2] for ref in ch.tags.unacked.values()] == [1, 2, 3, 4]  # the old one's ack mode: ackable
    assert conn._credit == {}
    cancel[2](True, {})  # the shard removed the old instance: the new one's deliveries go out
    assert [f for _c, f in _frames(conn)] == ["Deliver", "ContentHeader", "ContentBody"]
    assert len(ch.tags.unacked) == 4  # no-ack
    assert conn._credit == {(1, ch.key, "t"): 1} and ch.cancelling is None


def test_a_consumer_starts_with_a_small_window_that_grows_while_its_client_keeps_up():
    """frontend/paused_credit.py START_WINDOW: right behind the CONSUME the frontend takes back all of
    the window but START_WINDOW; it comes back a step per turn that wrote the consumer's deliveries
    while the socket took them at once, and while a window is not whole its credit goes back in lumps
    of a quarter of what it has (no stall with a small window)."""
    window = contract.CREDIT_WINDOW
    conn, worker, ch = _reusing({"q": 0})
    _method(ch, C.Basic.Consume(queue="q", consumer_tag="t", no_ack=True))
    worker.requests[-1][2](True, {})  # consume-ok
    assert _credits(worker) == [(0, ch.key, "t", -(window - START_WINDOW))]  # same lane, after the CONSUME
    conn.flush_turn()  # a turn without deliveries (the consume-ok) grows nothing
    conn.transport = _Transport(buffered=1 << 20)  # the client does not take what is written
    for _ in range(START_WINDOW // 4):
        _deliver(conn, ch, tag="t")
    conn.flush_turn()
    assert _credits(worker)[1:] == [(0, ch.key, "t", START_WINDOW // 4)]  # returned (no stall), no growth
    conn.transport = _Transport()  # now it does
    delivered = START_WINDOW // 4
    turns = 0
    while conn._taken is not None:
        _deliver(conn, ch, tag="t")
        delivered += 1
        conn.flush_turn()
        turns += 1
    assert turns == -(-(window - START_WINDOW) // GIVE_BACK_STEP)
    credits = [n for _s, _c, _t, n in _credits(worker)]
    assert delivered - sum(credits) == sum(conn._credit.values())  # the whole window is back, nothing more


def test_a_resume_gives_back_only_up_to_the_start_window_while_the_client_takes_nothing():
    """A WebSocket's transport resumes as soon as its sends reach the kernel: a client that has not
    taken those gets no more than START_WINDOW back at the resume (a full step per resume grew the
    window of a client that never read); one that keeps up gets a step."""
    window = contract.CREDIT_WINDOW
    conn, worker, ch = _consuming()
    conn.transport = _Transport(buffered=1 << 20)
    conn.pause_writing()
    conn.resume_writing()
    assert _credits(worker) == [(0, ch.key, "ctag", -window), (0, ch.key, "ctag", START_WINDOW)]
    conn.pause_writing()  # the next pause takes that back, the next resume gives START_WINDOW again
    conn.resume_writing()
    assert _credits(worker)[2:] == [(0, ch.key, "ctag", -START_WINDOW), (0, ch.key, "ctag", START_WINDOW)]
    conn.transport = _Transport()
    conn.pause_writing()
    conn.resume_writing()
    assert _credits(worker)[4:] == [(0, ch.key, "ctag", -START_WINDOW), (0, ch.key, "ctag", GIVE_BACK_STEP)]
