"""A full disk never crashes a shard (issue #9, item 2).

The data dir is an 8 MiB tmpfs (mounting needs root: the test containers and CI run as root).
Segments used to be sparse files written through mmap: when the file system had no block for a
page, the store was a SIGBUS that killed the shard, and the restarted shard died the same way.
Now segment blocks are allocated before they are mapped, a failed allocation refuses the publish
(basic.nack under confirms), and the shard, the queue and the connection go on.
"""

from __future__ import annotations

import os
import subprocess

import pika
import pika.exceptions
import pytest

from tests.harness import Node

PERSISTENT = pika.BasicProperties(delivery_mode=2)
BODY = b"x" * 60_000


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs and must run as root (as CI does)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_nacks_publishes_and_the_shard_lives(node_factory, small_disk):
    node: Node = node_factory(start=False, frontends=1, shards=1,
                              # The disk alarm (management's part) would block publishers long before
                              # the disk is full; this test is about what happens when it gets full anyway.
                              extra_args=["--segment-size", str(1 << 20), "--disk-free-limit", "0"])
    node.data_dir = small_disk / "data"
    node.start()
    shard_pid = node.worker_pid("shard", 0)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("fill", durable=True)
    stored = 0
    nacks = 0
    for _ in range(400):  # 24 MB: far more than the disk holds
        try:
            ch.basic_publish("", "fill", BODY, PERSISTENT)
            stored += 1
        except pika.exceptions.NackError:
            nacks += 1
            if nacks >= 5:
                break
    assert nacks >= 5, f"stored {stored} x 60 kB on an 8 MiB disk without a nack"
    assert 50 < stored < 140, stored
    # No SIGBUS: the same shard process, the connection open, the queue holds exactly what was acked.
    assert node.worker_pid("shard", 0) == shard_pid
    assert "exited with signal" not in node.log_text()
    assert "message not stored" in node.log_text()
    assert ch.queue_declare("fill", passive=True).method.message_count == stored
    # A queue declared on the full disk exists; what cannot be stored in it is nacked.
    ch.queue_declare("late", durable=True)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "late", BODY, PERSISTENT)
    assert ch.queue_declare("late", passive=True).method.message_count == 0
    assert node.worker_pid("shard", 0) == shard_pid
    # Space comes back when messages are consumed (whole segments are deleted); publishing works again.
    for _ in range(stored):
        method, _props, body = ch.basic_get("fill")
        assert body == BODY
        ch.basic_ack(method.delivery_tag)
    for _ in range(20):
        ch.basic_publish("", "fill", BODY, PERSISTENT)
    assert ch.queue_declare("fill", passive=True).method.message_count == 20
    ch.basic_publish("", "late", BODY, PERSISTENT)  # the late queue's segment grows now
    assert ch.queue_declare("late", passive=True).method.message_count == 1
    conn.close()
    node.restart()
    conn = node.connect()
    assert conn.channel().queue_declare("fill", passive=True).method.message_count == 20
    conn.close()
    node.stop()
