"""Deleting many queues at once: a vhost of hundreds of queues (applied in slices, broker/node.py
_commit) and a pipelined burst of queue.delete. The delete must complete whole: every queue gone,
its files removed (by the shard's reaper thread), and the queues of others untouched."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pika
from pamqp import commands as C
from pamqp import frame as pframe

from tests.helpers import uid
from tests.mgmt_api import Api, connect
from tests.raw_amqp import FrameClient

# Many of the node's commit slices (broker/node.py _COMMIT_SLICE ops each).
COUNT = 600


def _vhost_dir(node, vhost: str) -> str:
    return os.path.join(str(node.data_dir), hashlib.sha1(vhost.encode()).hexdigest())


def _queue_dirs(node, vhost: str) -> list[str]:
    """The queue directories (live or being removed) left in a vhost's directory."""
    try:
        return [e for e in os.listdir(_vhost_dir(node, vhost)) if not e.startswith(".")]
    except FileNotFoundError:
        return []


def _wait_no_queue_dirs(node, vhost: str) -> None:
    deadline = time.monotonic() + 30
    while left := _queue_dirs(node, vhost):
        assert time.monotonic() < deadline, f"{len(left)} queue dirs of {vhost!r} still on disk"
        time.sleep(0.05)


def _keep_queue(node, n: int) -> tuple[pika.BlockingConnection, str]:
    """A durable queue of the default vhost holding n confirmed persistent messages."""
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    name = uid("keep")
    ch.queue_declare(name, durable=True)
    for i in range(n):
        ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    return conn, name


def _assert_intact(conn: pika.BlockingConnection, name: str, n: int) -> None:
    ch = conn.channel()
    got = []
    while (m := ch.basic_get(name, auto_ack=True))[0] is not None:
        got.append(m[2])
    assert got == [f"m{i}".encode() for i in range(n)]


def _declare_pipelined(port: int, vhost: str, names: list[str], with_message: bool) -> None:
    raw = FrameClient(port, vhost=vhost)
    try:
        raw.open_channel(1)
        raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Declare(queue=n, durable=True), 1) for n in names))
        for n in names:
            assert raw.expect(1, C.Queue.DeclareOk).queue == n
        if with_message:  # every tenth queue holds a message, so it has segment files too
            raw.sock.sendall(b"".join(raw.publish_frames(1, "", n, b"doomed") for n in names[::10]))
            raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Declare(queue=n, passive=True), 1)
                                      for n in names[::10]))
            for _ in names[::10]:
                assert raw.expect(1, C.Queue.DeclareOk).message_count == 1
    finally:
        raw.close()


def _vhost_of_many_queues(node, prefix: str) -> tuple[Api, str]:
    """A new vhost with COUNT queues q0.. declared pipelined, one message in each."""
    api = Api(node.http_port)
    vhost = uid(prefix)
    api.put(f"/api/vhosts/{vhost}", {})
    api.put(f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    _declare_pipelined(node.port, vhost, [f"q{i}" for i in range(COUNT)], with_message=True)
    return api, vhost


def test_deleting_a_vhost_of_many_queues_removes_them_all_and_keeps_the_others(node):
    api, vhost = _vhost_of_many_queues(node, "bulk")
    assert len(_queue_dirs(node, vhost)) == COUNT
    keep_conn, keep = _keep_queue(node, 50)
    try:
        api.delete(f"/api/vhosts/{vhost}")
        assert api.call("GET", f"/api/vhosts/{vhost}")[0] == 404
        _wait_no_queue_dirs(node, vhost)
        # Recreated, the vhost is empty (no queue of the old one came back).
        api.put(f"/api/vhosts/{vhost}", {})
        api.put(f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        conn = connect(node, "guest", "guest", vhost=vhost)
        try:
            ch = conn.channel()
            try:
                ch.queue_declare("q0", passive=True)
                raise AssertionError("a queue of the deleted vhost still exists")
            except pika.exceptions.ChannelClosedByBroker as exc:
                assert exc.reply_code == 404
        finally:
            conn.close()
        _assert_intact(keep_conn, keep, 50)
    finally:
        keep_conn.close()


def test_pipelined_deletes_of_many_queues_remove_them_all(node):
    names = [uid("many") for _ in range(COUNT)]
    _declare_pipelined(node.port, "/", names, with_message=True)
    keep_conn, keep = _keep_queue(node, 50)
    raw = FrameClient(node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(b"".join(pframe.marshal(C.Queue.Delete(queue=n), 1) for n in names))
        counts = [raw.expect(1, C.Queue.DeleteOk).message_count for _ in names]
        assert counts == [1 if i % 10 == 0 else 0 for i in range(COUNT)]
        # A queue deleted and declared again in one write comes back empty, whether or not the
        # reaper has removed the old directory yet.
        again = names[0]
        raw.sock.sendall(b"".join((
            raw.publish_frames(1, "", keep, b"unrelated"),
            pframe.marshal(C.Queue.Declare(queue=again, durable=True), 1),
            raw.publish_frames(1, "", again, b"fresh"),
            pframe.marshal(C.Queue.Delete(queue=again), 1),
            pframe.marshal(C.Queue.Declare(queue=again, durable=True), 1),
        )))
        raw.expect(1, C.Queue.DeclareOk)
        assert raw.expect(1, C.Queue.DeleteOk).message_count == 1
        assert raw.expect(1, C.Queue.DeclareOk).message_count == 0
        raw.send(1, C.Queue.Delete(queue=again))
        raw.expect(1, C.Queue.DeleteOk)
    finally:
        raw.close()
    _wait_no_queue_dirs_except(node, "/", keep)
    try:
        ch = keep_conn.channel()
        got = []
        while (m := ch.basic_get(keep, auto_ack=True))[0] is not None:
            got.append(m[2])
        assert got == [f"m{i}".encode() for i in range(50)] + [b"unrelated"]
    finally:
        keep_conn.close()


def _wait_no_queue_dirs_except(node, vhost: str, keep: str) -> None:
    keep_dir = hashlib.sha1(keep.encode()).hexdigest()
    deadline = time.monotonic() + 30
    while left := [d for d in _queue_dirs(node, vhost) if d != keep_dir]:
        assert time.monotonic() < deadline, f"{len(left)} queue dirs still on disk"
        time.sleep(0.05)


def test_publishes_to_another_vhost_flow_on_while_a_vhost_of_many_queues_is_deleted(node):
    """A confirming publisher of the default vhost keeps publishing through a vhost delete (the
    delete is applied in slices between which the workers serve other queues): it makes progress
    after the delete began, and every message it got a confirm for is in its queue, in order, once."""
    api, vhost = _vhost_of_many_queues(node, "bulkflow")
    keep = uid("flow")
    confirmed: list[int] = []
    started = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            conn = node.connect()
            ch = conn.channel()
            ch.queue_declare(keep, durable=True)
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                ch.basic_publish("", keep, b"%d" % i, pika.BasicProperties(delivery_mode=2))
                confirmed.append(i)  # basic_publish returned: the broker confirmed it
                i += 1
                started.set()
            conn.close()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            started.set()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    assert started.wait(30)
    before = len(confirmed)
    api.delete(f"/api/vhosts/{vhost}")
    assert api.call("GET", f"/api/vhosts/{vhost}")[0] == 404
    # The publisher goes on: 100 more confirms after the delete was asked for.
    deadline = time.monotonic() + 30
    while len(confirmed) < before + 100 and not errors:
        assert time.monotonic() < deadline, f"publisher stuck at {len(confirmed)} (from {before})"
        time.sleep(0.01)
    stop.set()
    t.join(30)
    assert not errors, errors
    _wait_no_queue_dirs(node, vhost)
    conn = node.connect()
    try:
        ch = conn.channel()
        got = []
        while (m := ch.basic_get(keep, auto_ack=True))[0] is not None:
            got.append(int(m[2]))
        assert got == confirmed == list(range(len(confirmed)))
        ch.queue_delete(keep)
    finally:
        conn.close()


def test_a_vhost_deleted_just_before_a_crash_is_gone_after_the_restart(node):
    """The node dies (SIGKILL, its workers with it) right after a vhost delete was applied, while
    the shard's reaper is still moving and removing the queue directories: after the restart the
    vhost stays deleted, no directory of it (queue or trash) is left, and a durable queue of another
    vhost still holds every confirmed message, once, in order."""
    api, vhost = _vhost_of_many_queues(node, "crash")
    keep_conn, keep = _keep_queue(node, 50)
    keep_conn.close()
    api.delete(f"/api/vhosts/{vhost}")
    node.kill9()
    node.restart()
    _wait_no_queue_dirs(node, vhost)
    assert api.call("GET", f"/api/vhosts/{vhost}")[0] == 404
    conn = node.connect()
    try:
        _assert_intact(conn, keep, 50)
    finally:
        conn.close()
