"""Paced queue deletions (--delete-rate, broker/delete_pacer.py): a vhost delete and pipelined
queue.delete are spread out in time so that other queues keep their cores. Pacing must never
change what a delete promises: every delete finishes and is answered, the queues are gone (API,
AMQP, disk), publishes to other queues lose or duplicate nothing, and a node killed half-way
through a paced delete restarts consistent (each queue either deleted with its files, or intact
with its messages; no trash left)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pika
from pamqp import commands as C
from pamqp import frame as pframe

from broker.delete_pacer import ADAPT_WINDOW_S, IDLE_RESET_S, LATE_S, MIN_RATE, MIN_SHARE, DeletePacer
from tests.helpers import uid
from tests.mgmt_api import Api
from tests.raw_amqp import FrameClient
from tests.test_delete_many import _queue_dirs, _wait_no_queue_dirs

# Slow enough that the deletes below take a few seconds (the pacer's bucket holds 32), so the
# publisher and the crash land in the middle of them.
RATE = 150
COUNT = 300


# ----------------------------------------------------------------- the pacer alone
def test_pacer_grants_a_burst_at_once_then_every_waiter_in_order():
    async def run() -> list[int]:
        pacer = DeletePacer(asyncio.get_running_loop(), rate=2000, burst=4)
        assert all(pacer.try_take(1) for _ in range(4))  # the burst goes without waiting
        assert not pacer.try_take(1)
        order: list[int] = []

        async def one(i: int, n: int) -> None:
            await pacer.take(n)
            order.append(i)

        # A take bigger than the bucket is granted too (once the bucket is full), in its turn.
        tasks = [asyncio.create_task(one(i, 10 if i == 3 else 1)) for i in range(12)]
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert pacer.waiting() == 0
        return order

    assert asyncio.run(run()) == list(range(12))


def test_callback_waiters_share_the_fifo_with_awaiting_ones():
    """when_granted (a pipelined queue.delete waiting without a task) keeps its place among take()s."""
    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        # A bucket of one: each timer grants one waiter, so a take()'s task has appended (it resumes in
        # the next loop turn) before the next grant, ~4 ms later (MIN_WAKE_S).
        pacer = DeletePacer(loop, rate=2000, burst=1)
        order: list[int] = []
        pacer.when_granted(1, lambda: order.append(0))  # the burst: called before when_granted returns
        assert order == [0]
        pacer.when_granted(1, lambda: order.append(1))

        async def one(i: int) -> None:
            await pacer.take(1)
            order.append(i)

        tasks = []
        for i in range(2, 14):
            if i % 3:
                pacer.when_granted(1, lambda i=i: order.append(i))
            else:
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0)  # its take() joins the queue now, in this order
        assert len(order) == 1  # the bucket is empty: the rest wait
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        while pacer.waiting():
            await asyncio.sleep(0.01)
        return order

    assert asyncio.run(run()) == list(range(14))


def test_a_cancelled_waiter_does_not_hold_the_others_and_rate_zero_never_waits():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        pacer = DeletePacer(loop, rate=1000, burst=1)
        assert pacer.try_take(1)
        first = asyncio.create_task(pacer.take(1000))  # owes a second's worth
        await asyncio.sleep(0)
        second = asyncio.create_task(pacer.take(1))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.wait_for(second, 30)
        off = DeletePacer(loop, rate=0)
        assert all(off.try_take(1000) for _ in range(100))
        await asyncio.wait_for(off.take(10**6), 1)

    asyncio.run(run())


def test_the_pace_halves_while_wake_ups_come_late_and_climbs_back_to_the_rate_given():
    """The adaptive pace (DeletePacer.adapt), fed wake-ups with made-up times: late windows halve the
    rate down to its floor, quiet ones bring it back to the rate given, never above; a fixed pacer
    (adaptive=False) ignores its wake-ups' lateness."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        pacer = DeletePacer(loop, rate=2000)
        seen: list[tuple[float, float]] = []
        pacer.on_adapt = lambda rate, late: seen.append((rate, late))
        now = 1000.0
        pacer.adapt(0.0, now)  # opens a window
        rates = []
        for _ in range(6):  # one late wake-up per window: 10x LATE_S
            now += ADAPT_WINDOW_S
            pacer.adapt(10 * LATE_S, now)
            rates.append(pacer.rate)
        assert rates == [1000, 500, 250, 250, 250, 250]  # halved down to MIN_SHARE of the rate
        assert [r for r, _ in seen] == rates and all(late == 10 * LATE_S for _, late in seen)
        for _ in range(20):  # punctual wake-ups: back up in steps, not beyond the rate given
            now += ADAPT_WINDOW_S
            pacer.adapt(0.0, now)
            rates.append(pacer.rate)
        assert rates[6:14] == [500, 750, 1000, 1250, 1500, 1750, 2000, 2000] and max(rates) == 2000
        pacer.adapt(10 * LATE_S, now + ADAPT_WINDOW_S)
        assert pacer.rate == 1000
        # No deletes for a while: the next run of them starts at the full rate.
        pacer.adapt(10 * LATE_S, now + ADAPT_WINDOW_S + 2 * IDLE_RESET_S)
        assert pacer.rate == 2000
        # A rate given below MIN_RATE is the floor too: such a pacer keeps it.
        low = DeletePacer(loop, rate=MIN_RATE / 2)
        low.adapt(0.0, now)
        for i in range(1, 5):
            low.adapt(10 * LATE_S, now + i * ADAPT_WINDOW_S)
        assert low.rate == MIN_RATE / 2
        fixed = DeletePacer(loop, rate=2000, adaptive=False)
        assert fixed.try_take(32)
        waiters = [asyncio.ensure_future(fixed.take(1)) for _ in range(40)]
        await asyncio.wait_for(asyncio.gather(*waiters), 30)
        assert fixed.rate == 2000

    asyncio.run(run())


def test_a_slowed_pace_still_grants_every_waiter_in_order():
    """While the pace is at its floor (busy cores), deletes still all go, first asked first granted."""
    async def run() -> list[int]:
        pacer = DeletePacer(asyncio.get_running_loop(), rate=4000, burst=1)
        now = time.monotonic()  # the windows its own wake-ups (below) fall in: no idle reset
        pacer.adapt(0.0, now)
        for i in range(1, 5):
            pacer.adapt(10 * LATE_S, now + i * ADAPT_WINDOW_S)
        assert pacer.rate == 4000 * MIN_SHARE
        order: list[int] = []
        for i in range(30):
            pacer.when_granted(1, lambda i=i: order.append(i))
        await asyncio.wait_for(_until(lambda: len(order) == 30), 30)
        assert pacer.waiting() == 0 and pacer.rate < 4000
        return order

    assert asyncio.run(run()) == list(range(30))


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.005)


# ----------------------------------------------------------------- a node pacing its deletes
def _paced_node(node_factory):
    return node_factory(name="paced", frontends=1, shards=2, extra_args=["--delete-rate", str(RATE)])


def _vhost_with_queues(node, prefix: str) -> tuple[Api, str, list[str]]:
    """A vhost of COUNT durable queues; every tenth holds one persistent message."""
    api = Api(node.http_port)
    vhost = uid(prefix)
    api.put(f"/api/vhosts/{vhost}", {})
    api.put(f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    names = [f"q{i}" for i in range(COUNT)]
    _declare_persistent(node.port, vhost, names)
    return api, vhost, names


def _declare_persistent(port: int, vhost: str, names: list[str]) -> None:
    """Durable queues declared pipelined; every tenth gets one persistent message, confirmed."""
    raw = FrameClient(port, timeout=60, vhost=vhost)
    try:
        raw.open_channel(1)
        raw.send(1, C.Confirm.Select())
        raw.expect(1, C.Confirm.SelectOk)
        raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Declare(queue=n, durable=True), 1) for n in names))
        for n in names:
            assert raw.expect(1, C.Queue.DeclareOk).queue == n
        persistent = C.Basic.Properties(delivery_mode=2)
        raw.sock.sendall(b"".join(raw.publish_frames(1, "", n, b"kept", persistent) for n in names[::10]))
        unacked = set(range(1, len(names[::10]) + 1))
        while unacked:
            ack = raw.expect(1, C.Basic.Ack)
            unacked -= set(range(1, ack.delivery_tag + 1)) if ack.multiple else {ack.delivery_tag}
    finally:
        raw.close()


class _ConfirmingPublisher(threading.Thread):
    """Publishes persistent messages 0, 1, 2... to a durable queue of the default vhost with
    confirms, one at a time, until stopped; ``confirmed`` holds those the broker confirmed."""

    def __init__(self, node, queue: str) -> None:
        super().__init__(daemon=True)
        self.node, self.queue = node, queue
        self.confirmed: list[int] = []
        self.started = threading.Event()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            conn = self.node.connect()
            ch = conn.channel()
            ch.queue_declare(self.queue, durable=True)
            ch.confirm_delivery()
            i = 0
            while not self.stop.is_set():
                ch.basic_publish("", self.queue, b"%d" % i, pika.BasicProperties(delivery_mode=2))
                self.confirmed.append(i)  # basic_publish returned: confirmed
                i += 1
                self.started.set()
            conn.close()
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
            self.started.set()

    def finish_after(self, more: int) -> None:
        """Let it confirm `more` messages from now, then stop it."""
        target = len(self.confirmed) + more
        deadline = time.monotonic() + 60
        while len(self.confirmed) < target and not self.errors:
            assert time.monotonic() < deadline, f"publisher stuck at {len(self.confirmed)}"
            time.sleep(0.01)
        self.stop.set()
        self.join(30)
        assert not self.errors, self.errors


def _drain(node, queue: str) -> list[int]:
    conn = node.connect()
    try:
        ch = conn.channel()
        got = []
        while (m := ch.basic_get(queue, auto_ack=True))[0] is not None:
            got.append(int(m[2]))
        return got
    finally:
        conn.close()


def test_paced_vhost_and_pipelined_deletes_finish_while_another_queue_loses_nothing(node_factory):
    """A paced vhost delete (API) and a paced burst of pipelined queue.delete run at once, sharing
    the rate, while a confirming publisher on a queue of the default vhost goes on: both deletes are
    answered whole (every DeleteOk with its queue's count), every queue and directory goes, and the
    publisher's queue holds each confirmed message once, in order."""
    node = _paced_node(node_factory)
    api, vhost, _ = _vhost_with_queues(node, "pacedv")
    names = [uid("pacedq") for _ in range(COUNT)]
    _declare_persistent(node.port, "/", names)
    keep = uid("keep")
    pub = _ConfirmingPublisher(node, keep)
    pub.start()
    assert pub.started.wait(30)
    result: list[int] = []
    deleter = threading.Thread(target=lambda: result.append(api.delete(f"/api/vhosts/{vhost}")), daemon=True)
    deleter.start()
    raw = FrameClient(node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Delete(queue=n), 1) for n in names))
        counts = [raw.expect(1, C.Queue.DeleteOk).message_count for _ in names]
        assert counts == [1 if i % 10 == 0 else 0 for i in range(COUNT)]
        # The deleted names are free again at once: declared anew, empty.
        raw.send(1, C.Queue.Declare(queue=names[0], durable=True, passive=False))
        assert raw.expect(1, C.Queue.DeclareOk).message_count == 0
        raw.send(1, C.Queue.Delete(queue=names[0]))
        raw.expect(1, C.Queue.DeleteOk)
    finally:
        raw.close()
    deleter.join(120)
    assert not deleter.is_alive() and result and 200 <= result[0] < 300, result
    assert api.call("GET", f"/api/vhosts/{vhost}")[0] == 404
    pub.finish_after(50)
    _wait_no_queue_dirs(node, vhost)
    keep_dir = hashlib.sha1(keep.encode()).hexdigest()
    deadline = time.monotonic() + 30
    while left := [d for d in _queue_dirs(node, "/") if d != keep_dir]:
        assert time.monotonic() < deadline, f"{len(left)} queue dirs of / still on disk"
        time.sleep(0.05)
    assert _drain(node, keep) == pub.confirmed == list(range(len(pub.confirmed)))


def _live_queues(api: Api, vhost: str) -> set[str]:
    return {q["name"] for q in api.get(f"/api/queues/{vhost}")}


def test_a_node_killed_during_a_paced_vhost_delete_restarts_consistent(node_factory):
    """SIGKILL of the node half-way through a paced vhost delete (not answered yet): after the
    restart every queue of the vhost is either gone (from the API and from disk, no trash left) or
    intact with its message; none half-deleted. Deleting the vhost again then finishes it."""
    node = _paced_node(node_factory)
    api, vhost, names = _vhost_with_queues(node, "crashv")
    def delete() -> None:
        try:
            api.call("DELETE", f"/api/vhosts/{vhost}")
        except OSError:
            pass  # the node was killed under it: never answered

    deleter = threading.Thread(target=delete, daemon=True)
    deleter.start()
    deadline = time.monotonic() + 60
    while len(_live_queues(api, vhost)) > COUNT - 60:  # past the pacer's burst: the delete is paced now
        assert time.monotonic() < deadline, "the vhost delete made no progress"
        time.sleep(0.02)
    node.kill9()
    node.restart()
    code, _ = api.call("GET", f"/api/vhosts/{vhost}")
    if code == 404:  # the whole delete had been applied before the kill: nothing of it may be left
        _wait_no_queue_dirs(node, vhost)
        return
    live = _live_queues(api, vhost)
    assert 0 < len(live) < COUNT, len(live)
    assert live <= set(names)
    # Every queue still defined holds exactly what it held (its files untouched by the delete)...
    raw = FrameClient(node.port, vhost=vhost)
    try:
        raw.open_channel(1)
        alive = sorted(live, key=lambda n: int(n[1:]))
        raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Declare(queue=n, durable=True, passive=True), 1)
                                  for n in alive))
        counts = {n: raw.expect(1, C.Queue.DeclareOk).message_count for n in alive}
        assert counts == {n: 1 if int(n[1:]) % 10 == 0 else 0 for n in alive}
    finally:
        raw.close()
    # ...and the disk holds exactly their directories: the deleted ones' (and any trash) are removed.
    wanted = {hashlib.sha1(n.encode()).hexdigest() for n in live}
    deadline = time.monotonic() + 30
    while extra := set(_queue_dirs(node, vhost)) - wanted:
        assert time.monotonic() < deadline, sorted(extra)[:5]
        time.sleep(0.05)
    assert wanted <= set(_queue_dirs(node, vhost))
    # Deleting it again completes the delete.
    assert api.delete(f"/api/vhosts/{vhost}") in (200, 204)
    assert api.call("GET", f"/api/vhosts/{vhost}")[0] == 404
    _wait_no_queue_dirs(node, vhost)
