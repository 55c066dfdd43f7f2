"""Temp files a writer killed between its write and its rename left behind (broker/temp_files.py).

Every writer that writes a temp file and renames it over the real one (the definitions snapshot, a
segment's acks rewrite, delivery counts, name files, stream offsets, the idle index, MQTT KV log
compaction and ``kv/placed-for``) leaves ``<path>.tmp`` or ``<path>.tmp-<pid>`` when it is killed
(kill -9) in between. Only a replication follower's start removed them; on a standalone node or a
leader they stayed for good, and the ``.tmp-<pid>`` ones were replicated as data. Here they are
planted, garbage inside, where such a writer leaves them, and the node restarted: it comes up with
its data intact, and the writer's owner removed them where it lists or opens anyway.
"""

from __future__ import annotations

import re
from pathlib import Path

import pika
import pytest

from broker.datadir import name_hash
from broker.kv_layout import PLACED_FOR
from broker.kv_log import KV_DIR
from tests.harness import free_port, wait_until
from tests.test_mqtt_session_kv import SHARDS, _check_sessions, _client_ids, _kv_logs, _make_sessions
from tests.test_replication import follower_node, leader_node, wait_identical, wait_in_sync

GARBAGE = b"\x00\xffnot data, a writer's half-written temp file\n" * 20
_TEMP = re.compile(r"\.tmp(-\d+)?$")


def temps(root: Path) -> list[str]:
    """Temp files under the data dir (run/ aside: the node empties it at each start)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and _TEMP.search(p.name) and p.relative_to(root).parts[0] != "run")


def plant(path: Path) -> str:
    path.write_bytes(GARBAGE)
    return str(path)


def qdir(node, queue: str, vhost: str = "/") -> Path:
    return node.data_dir / name_hash(vhost) / name_hash(queue)


def publish(ch, queue: str, bodies: list[bytes], **props) -> None:
    for body in bodies:
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2, **props))


@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_stale_temp_files_in_store_and_vhost_dirs_are_removed_and_never_read(node_factory, how):
    node = node_factory(frontends=1, shards=2)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("plain", durable=True)
    publish(ch, "plain", [b"p%d" % i for i in range(5)])
    method, _p, body = ch.basic_get("plain")
    assert body == b"p0"
    ch.basic_ack(method.delivery_tag)  # an acks file: its rewrite's temp sits beside it
    ch.queue_declare("counted", durable=True, arguments={"x-delivery-limit": 5})
    publish(ch, "counted", [b"c0"])
    method, _p, _b = ch.basic_get("counted")
    ch.basic_nack(method.delivery_tag, requeue=True)  # a delivery count (delivery-counts file)
    ch.queue_declare("prio", durable=True, arguments={"x-max-priority": 5})
    publish(ch, "prio", [b"lo"], priority=1)
    publish(ch, "prio", [b"hi"], priority=4)
    ch.queue_declare("st", durable=True, arguments={"x-queue-type": "stream"})
    publish(ch, "st", [b"s%d" % i for i in range(3)])
    ch.queue_declare("idle", durable=True)  # never holds a message: the idle index's kind of queue
    conn.close()
    # What a kill -9 must not take: the ack written, the count saved (the periodic sync writes it).
    wait_until(lambda: (qdir(node, "plain") / "acks.0000000001").exists()
               and (qdir(node, "counted") / "delivery-counts").exists(), 30, "the ack and the count written")
    if how == "stop":
        node.stop()
    else:
        node.kill9()
    vdir = node.data_dir / name_hash("/")
    planted = [
        plant(node.data_dir / "definitions.json.tmp"),
        plant(vdir / ".vhost.tmp-999999"),
        plant(vdir / ".idle-at-stop.shard-0.tmp-999999"),
        plant(qdir(node, "plain") / "acks.0000000001.tmp"),
        plant(qdir(node, "plain") / ".queue.tmp-999999"),
        plant(qdir(node, "plain") / "msgs.0000000001.damaged-64.tmp"),
        plant(qdir(node, "counted") / "delivery-counts.tmp"),
        plant(qdir(node, "prio") / "delivery-counts.tmp"),
        plant(qdir(node, "prio") / ".queue.tmp-999999"),
        plant(qdir(node, "st") / "offsets.tmp"),
        plant(qdir(node, "idle") / ".queue.tmp-999999"),
    ]
    assert len(temps(node.data_dir)) == len(planted)
    node.start()
    assert temps(node.data_dir) == [], node.log_tail()
    conn = node.connect()
    ch = conn.channel()
    assert [ch.basic_get("plain", auto_ack=True)[2] for _ in range(4)] == [b"p%d" % i for i in range(1, 5)]
    assert ch.basic_get("plain")[0] is None
    method, props, body = ch.basic_get("counted", auto_ack=True)
    assert body == b"c0" and method.redelivered
    assert (props.headers or {}).get("x-delivery-count") == 1  # the count kept, not the temp's garbage
    assert [ch.basic_get("prio", auto_ack=True)[2] for _ in range(2)] == [b"hi", b"lo"]
    assert ch.queue_declare("st", passive=True).method.message_count == 3
    assert ch.queue_declare("idle", passive=True).method.message_count == 0
    conn.close()
    assert "Traceback" not in node.log_text()


def test_stale_temp_files_of_the_mqtt_kv_logs_are_removed_and_never_read(node_factory):
    node = node_factory(name="node", frontends=1, shards=SHARDS, mqtt_port=free_port())
    ids = _client_ids(2)
    _make_sessions(node, ids)
    node.restart()  # places the logs (kv/placed-for written)
    node.kill9()
    kv = node.data_dir / KV_DIR
    assert (kv / PLACED_FOR).exists()
    logs = [kv / rel for rel in _kv_logs(node) if rel.endswith(".log")]
    assert logs
    planted = [plant(kv / (PLACED_FOR + ".tmp"))] + [plant(Path(f"{log}.tmp")) for log in logs]
    assert len(temps(node.data_dir)) == len(planted)
    node.start()
    assert temps(node.data_dir) == [], node.log_tail()
    assert (kv / PLACED_FOR).read_text().strip() == str(SHARDS)
    _check_sessions(node, ids)


def test_a_leaders_stale_temp_files_are_never_replicated(node_factory):
    """A ``.tmp-<pid>`` name file a killed shard left in a queue directory and in the vhost directory
    (its restart has not listed them yet: planted on the running leader) used to be replicated to a
    follower as data, where even its start would not remove them."""
    leader = leader_node(node_factory)
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("kept", durable=True)
    publish(ch, "kept", [b"k%d" % i for i in range(3)])
    conn.close()
    plant(qdir(leader, "kept") / ".queue.tmp-999999")
    plant(leader.data_dir / name_hash("/") / ".vhost.tmp-999999")
    plant(qdir(leader, "kept") / "acks.0000000001.tmp")
    follower = follower_node(node_factory, leader)
    wait_in_sync(leader)
    wait_identical(leader, follower)  # compares everything but temp files
    assert temps(follower.data_dir) == []
    assert (qdir(follower, "kept") / ".queue").read_bytes() == b"kept"
