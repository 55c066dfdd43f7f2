"""broker/local_link.py: what a pair's link hands over as is, what it copies, and its test-mode check.

End to end (real pairs, the check on in every test node): tests/test_colocate.py and every module
whose nodes are paired (the default on the suite's 2-core machines)."""

from __future__ import annotations

import asyncio

import pytest

from broker import contract, local_link
from broker.turn_batch import MAX_BATCH_ITEMS, TurnBatcher


def test_hot_kinds_go_as_they_are_and_every_other_kind_as_a_socket_would_carry_it():
    publish = [contract.PUBLISH, "/", ["q"], "", "q", b"\x00\x00", b"body" * 10, False, 1, 65537, 7]
    ack = [contract.ACK, 1, 65537, [3, 4294967296]]
    kept = {"items": [["k", bytearray(b"v")]], "pair": (1, 2)}  # e.g. a shard's KV values, kept by it
    reply = [contract.REPLY_DATA, 9, True, kept]
    items = [publish, reply, ack]
    size = local_link._own(items)
    assert items[0] is publish and items[2] is ack
    assert items[1] is not reply
    # As msgpack gives it: lists for tuples, bytes for a bytearray, nothing shared with the sender.
    assert items[1] == [contract.REPLY_DATA, 9, True, {"items": [["k", b"v"]], "pair": [1, 2]}]
    assert local_link._same(items[1], contract.unpack(contract.pack(0, [reply]))[1][0])
    kept["items"][0][1][:] = b"X"
    assert items[1][3]["items"][0][1] == b"v"
    # on_sent's bytes: the body and properties at least, the copied item's packed size.
    assert size >= len(publish[6]) + len(publish[5]) + len(contract.pack(0, [reply])) - 8


def test_the_check_tells_types_apart_as_unpacking_would():
    same = local_link._same
    assert same([1, "a", b"b", None, True, 1.5, {"k": [2]}], [1, "a", b"b", None, True, 1.5, {"k": [2]}])
    assert not same(["q"], ("q",))
    assert not same(b"body", bytearray(b"body"))
    assert not same(b"body", memoryview(b"body"))
    assert not same(True, 1)
    assert not same({"k": [1]}, {"k": [2]})
    assert not same([1, 2], [1, 2, 3])


# ------------------------------------------------------------------ when a batch is handed over
class _Router(local_link.PairedRouterMixin, TurnBatcher):
    """The paired shard's listener without a socket (every destination here is the local lane)."""

    is_router = True

    def _send(self, dest, payload):  # noqa: ANN001 - not reached: the tests' lanes are all local
        raise AssertionError("a local lane's batch went to the socket")


def _pair(loop: asyncio.AbstractEventLoop, log: list, on_shard=None, on_frontend=None):  # noqa: ANN001, ANN202
    """A paired frontend lane and shard listener on ``loop`` whose on_batch calls append to ``log``."""

    def shard_batch(ident, header, items):  # noqa: ANN001, ANN202
        log.append(("shard", [item[1] for item in items]))
        if on_shard is not None:
            on_shard(items)

    def frontend_batch(ident, header, items):  # noqa: ANN001, ANN202
        log.append(("frontend", [item[1] for item in items]))
        if on_frontend is not None:
            on_frontend(items)

    router = _Router(loop, shard_batch, None)
    router._init_local()
    lane = local_link.LocalDealer(loop, router, b"fe-0", frontend_batch)
    router.on_drained = router.send_pending  # as the shard: what a read's batches produced leaves then
    lane.on_drained = lambda: log.append(("frontend drained", None))
    return lane, router


def _item(n: int) -> list:
    return [contract.CREDIT, n, 1, "tag", 1]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_the_frontends_turn_end_hands_over_at_once_and_so_does_the_shards_answer_but_no_deeper(loop):
    """The frontend's end of turn (its lane's flush) hands a publish to the shard at once; the
    shard's answer, sent when that batch is handled (its send_pending), comes back at once; what the
    frontend sends while handling the answer waits for the loop (MAX_DEPTH)."""
    log: list = []
    lane: local_link.LocalDealer
    router: _Router

    def answer(items):  # noqa: ANN001, ANN202
        router.put(b"fe-0", _item(100 + items[0][1]))

    def reply(items):  # noqa: ANN001, ANN202
        if items[0][1] < 200:
            lane.put(None, _item(200 + items[0][1]))
            lane.flush()

    lane, router = _pair(loop, log, on_shard=answer, on_frontend=reply)

    async def go() -> list:
        lane.put(None, _item(1))
        lane.flush()
        at_once = list(log)
        for _ in range(20):  # the rest from call_soon
            await asyncio.sleep(0)
        return at_once

    at_once = loop.run_until_complete(go())
    assert at_once == [("shard", [1]), ("frontend", [101]), ("frontend drained", None)]
    assert log[len(at_once):] == [("shard", [301]), ("frontend", [401]), ("frontend drained", None)]


def test_a_frontends_send_at_the_end_of_one_read_waits_for_the_loop(loop):
    """send_pending (send_early: the end of one client read) stays queued, so the other reads of the
    loop iteration find the shard busy and their publishes batch at the turn's end."""
    log: list = []
    lane, _router = _pair(loop, log)

    async def go() -> list:
        lane.put(None, _item(1))
        lane.send_pending()
        at_once = list(log)
        for _ in range(20):
            await asyncio.sleep(0)
        return at_once

    assert loop.run_until_complete(go()) == []
    assert log == [("shard", [1])]


def test_a_full_batch_cut_inside_a_put_waits_for_the_loop_and_what_follows_keeps_its_order(loop):
    log: list = []
    lane, _router = _pair(loop, log)

    async def go() -> list:
        for n in range(MAX_BATCH_ITEMS + 1):  # the 512th put sends a full batch from inside put()
            lane.put(None, _item(n))
        after_put = list(log)
        lane.flush()  # at rest, but the full batch is still queued: this one goes behind it
        at_rest = list(log)
        for _ in range(20):
            await asyncio.sleep(0)
        return [after_put, at_rest]

    after_put, at_rest = loop.run_until_complete(go())
    assert after_put == [] and at_rest == []
    assert log == [("shard", list(range(MAX_BATCH_ITEMS))), ("shard", [MAX_BATCH_ITEMS])]


def test_the_turns_flush_hands_over_at_once(loop):
    log: list = []
    lane, _router = _pair(loop, log)

    async def go() -> None:
        lane.put(None, _item(7))  # schedules the turn's flush
        await asyncio.sleep(0)
        assert log == [("shard", [7])]  # handled inside that flush, not one more loop iteration later

    loop.run_until_complete(go())


def test_a_receiver_that_raises_does_not_fail_its_sender(loop):
    log: list = []
    errors: list = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context["exception"]))

    def boom(items):  # noqa: ANN001, ANN202
        raise RuntimeError("receiver bug")

    lane, _router = _pair(loop, log, on_shard=boom)

    async def go() -> None:
        lane.put(None, _item(1))
        lane.flush()  # returns: the receiver's error is the loop's to report
        lane.put(None, _item(2))
        lane.flush()

    loop.run_until_complete(go())
    assert log == [("shard", [1]), ("shard", [2])]
    assert [str(e) for e in errors] == ["receiver bug", "receiver bug"]
