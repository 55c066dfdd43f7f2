"""Private data files whatever the umask; no start on a data dir others can write (issue #9, item 7)."""

from __future__ import annotations

import os
import stat

import pika

from tests.test_worker_crash import name_on_shard


def _modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    out["."] = stat.S_IMODE(os.stat(root).st_mode)
    return out


def test_data_files_private_under_permissive_umask(node_factory):
    node = node_factory(start=False, frontends=1, shards=2)
    # A data dir of an older version: world-readable.
    node.data_dir.mkdir(parents=True)
    os.chmod(node.data_dir, 0o755)
    old = os.umask(0o002)
    try:
        node.start()
    finally:
        os.umask(old)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for shard in (0, 1):
        queue = name_on_shard("private", shard, 2)
        ch.queue_declare(queue, durable=True)
        for i in range(5):
            ch.basic_publish("", queue, b"secret %d" % i, pika.BasicProperties(delivery_mode=2))
        method, _p, _b = ch.basic_get(queue)
        ch.basic_ack(method.delivery_tag)
    ch.exchange_declare("private-x", "fanout", durable=True)
    conn.close()
    node.stop()
    modes = _modes(node.data_dir)
    assert any(p.startswith("msgs.") or "/msgs." in p for p in modes), modes
    assert any("acks." in p for p in modes), modes
    assert "definitions.log" in modes or "definitions.json" in modes, modes
    leaked = {p: f"{m:04o}" for p, m in modes.items() if m & 0o077}
    assert not leaked, f"readable or writable by others: {leaked}"
    assert "changed to 0700" in node.log_text()


def test_refuses_data_dir_others_can_write(node_factory):
    node = node_factory(start=False, frontends=1, shards=1)
    node.data_dir.mkdir(parents=True)
    os.chmod(node.data_dir, 0o777)
    node.start(wait=False)
    assert node.proc.wait(20) == 1
    text = node.log_text()
    assert "is writable by other users (mode 0777)" in text, text
    assert "chmod 700" in text
    assert "Traceback" not in text
    os.chmod(node.data_dir, 0o775)  # group-writable is refused too
    node.start(wait=False)
    assert node.proc.wait(20) == 1
    assert "(mode 0775)" in node.log_text()
