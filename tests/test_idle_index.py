"""A shard's boot opens the queues a clean stop found idle without listing their directories, and only
while each directory is as that stop left it (shard/idle_index.py, issue #15)."""

from __future__ import annotations

import os
import re
import shutil
import time

import pika

from broker.datadir import name_hash
from shard import idle_index
from tests.harness import wait_until
from tests.test_recovery import passive_count

IDLE = [f"idle-{i}" for i in range(10)]
PERSISTENT = pika.BasicProperties(delivery_mode=2)


# ------------------------------------------------------------------ the index itself
def _queue_dir(vdir, name: str):
    path = vdir / name_hash(name)
    path.mkdir(parents=True)
    (path / ".queue").write_text(name)
    return path


def test_a_directory_is_noted_only_if_it_did_not_change_since_it_was_listed(tmp_path):
    vdir = tmp_path / "v"
    old, changed, young = (_queue_dir(vdir, n) for n in ("old", "changed", "young"))
    # "young" changed less than MIN_AGE_NS before the listing, "changed" after it
    listed = max(idle_index.stamp(str(p))[1] for p in (old, changed)) + idle_index.MIN_AGE_NS + 1
    young_ctime = idle_index.stamp(str(young))[1]
    wait_until(lambda: time.time_ns() > listed, 10, "the clock past the listing time")
    (changed / "msgs.0000000001").write_bytes(b"x")
    young_listed = young_ctime + idle_index.MIN_AGE_NS // 2  # listed too soon after its last change
    assert idle_index.write(str(vdir), 0, [str(old), str(changed)], listed) == 1
    assert idle_index.write(str(vdir), 1, [str(young)], young_listed) == 0
    assert not os.path.exists(idle_index.path_of(str(vdir), 1))
    taken = idle_index.take(str(vdir), 0)
    assert taken == {name_hash("old"): idle_index.stamp(str(old))}
    assert not os.path.exists(idle_index.path_of(str(vdir), 0))  # read once: a crash later leaves none
    assert idle_index.take(str(vdir), 0) == {}


def test_a_damaged_index_is_ignored(tmp_path):
    vdir = tmp_path / "v"
    old = _queue_dir(vdir, "old")
    listed = idle_index.stamp(str(old))[1] + idle_index.MIN_AGE_NS + 1
    assert idle_index.write(str(vdir), 0, [str(old)], listed) == 1
    path = idle_index.path_of(str(vdir), 0)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert idle_index.take(str(vdir), 0) == {}
    open(path, "wb").write(b"SMQ")
    assert idle_index.take(str(vdir), 0) == {}


# ------------------------------------------------------------------ a node's boots
def _idle_counts(node, since: int) -> tuple[int, int]:
    """(queues opened without a listing at the boots, directories noted at the stops) since offset."""
    text = node.log_text()[since:]
    opened = sum(int(n) for n in re.findall(r"queues \((\d+) idle at the last stop", text))
    noted = sum(int(n) for n in re.findall(r"(\d+) idle queue directories noted", text))
    return opened, noted


def test_idle_queues_open_unlisted_after_a_clean_stop_and_a_changed_directory_is_listed(node_factory):
    node = node_factory(name="node", frontends=1, shards=2)
    ch = node.connect().channel()
    ch.confirm_delivery()
    for name in [*IDLE, "full"]:
        ch.queue_declare(name, durable=True)
    for i in range(3):
        ch.basic_publish("", "full", f"m{i}".encode(), PERSISTENT)
    ch.connection.close()
    vdir = node.data_dir / name_hash("/")
    dirs = {name: vdir / name_hash(name) for name in [*IDLE, "full"]}
    assert node.stop() == 0
    # A boot lists a directory it finds in no index and notes it at the next stop if it did not change
    # for MIN_AGE_NS before that boot's listing: the clock must be that far past the declares.
    newest = max(idle_index.stamp(str(d))[1] for d in dirs.values())
    wait_until(lambda: time.time_ns() > newest + idle_index.MIN_AGE_NS, 10, "the declares MIN_AGE_NS old")
    mark = len(node.log_text())
    node.start()
    assert passive_count(node, "full") == 3 and passive_count(node, IDLE[0]) == 0
    assert node.stop() == 0
    assert _idle_counts(node, mark) == (0, len(IDLE))  # "full" holds a segment: never noted

    # Behind the broker's back (a replication follower, an operator), idle-0 gets full's segments.
    for f in os.listdir(dirs["full"]):
        if f != ".queue":
            shutil.copy2(dirs["full"] / f, dirs[IDLE[0]] / f)
    mark = len(node.log_text())
    node.start()
    assert _idle_counts(node, mark)[0] == len(IDLE) - 1
    assert not list(vdir.glob(idle_index.PREFIX + "*"))  # taken: a crash from here on leaves no index
    assert passive_count(node, IDLE[0]) == 3 and passive_count(node, "full") == 3
    assert all(passive_count(node, name) == 0 for name in IDLE[1:])

    # After a kill -9 no index is there: every directory is listed, nothing is lost.
    node.kill9()
    mark = len(node.log_text())
    node.restart()
    assert _idle_counts(node, mark)[0] == 0
    assert passive_count(node, IDLE[0]) == 3 and passive_count(node, "full") == 3
    ch = node.connect().channel()
    method, _props, body = ch.basic_get(IDLE[0], auto_ack=True)
    assert method is not None and body == b"m0"
    ch.connection.close()
