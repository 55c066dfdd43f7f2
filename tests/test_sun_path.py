"""A data dir deeper than a unix socket's address allows (107 bytes for ``<data>/run/<socket>``):
the node's sockets are named through a descriptor of the run dir (broker/sun_path.py). Before, every
bind failed with "AF_UNIX path too long" and the node never came up (found when pytest-xdist's
worker directory made the suite's temp paths a few bytes longer)."""

from __future__ import annotations

import asyncio
import os
import socket

import pika
import pytest

from broker import contract
from broker.sun_path import SUN_PATH_MAX, fit
from replication.handoff import HandoffReceiver, send_socket
from tests.harness import wait_until
from tests.test_worker_crash import name_on_shard

PERSISTENT = pika.BasicProperties(delivery_mode=2)
DEEP = "deep-" + "d" * 110  # one directory name: with it every run/ socket path is over SUN_PATH_MAX


def test_a_short_path_is_kept_and_a_long_one_names_the_same_file(tmp_path):
    short = str(tmp_path / "s.sock")
    assert fit(short) == short
    deep = tmp_path / DEEP
    deep.mkdir()
    path = str(deep / "x.sock")
    assert len(path) > SUN_PATH_MAX
    with pytest.raises(OSError, match="too long"):
        socket.socket(socket.AF_UNIX).bind(path)  # what the node ran into
    name = fit(path)
    assert len(name) <= SUN_PATH_MAX and name.startswith("/proc/self/fd/")
    with socket.socket(socket.AF_UNIX) as srv, socket.socket(socket.AF_UNIX) as cli:
        srv.bind(name)
        srv.listen(1)
        assert os.path.exists(path)  # the socket file is in the deep directory itself
        cli.connect(fit(path))
        srv.accept()[0].close()
    # The directory removed and made again (the node's run dir at each start): a fresh descriptor.
    os.unlink(path)
    deep.rmdir()
    deep.mkdir()
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(fit(path))
        assert os.path.exists(path)


def test_the_replication_handoff_passes_a_socket_under_a_deep_run_dir(tmp_path):
    run = tmp_path / DEEP / "run"
    run.mkdir(parents=True)
    assert len(os.path.join(run, "repl-shard-0.sock")) > SUN_PATH_MAX

    async def main() -> tuple[str, float, bytes]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future = loop.create_future()
        receiver = HandoffReceiver(loop, str(run), 0, lambda s, f, h: got.set_result((s, f, h)))
        a, b = socket.socketpair()
        try:
            send_socket(str(run), 0, a, "n2", 1.5)
            sock, follower, heartbeat = await asyncio.wait_for(got, 10)
            with sock:
                b.sendall(b"ping")
                return follower, heartbeat, sock.recv(4)
        finally:
            receiver.close()
            a.close()
            b.close()

    assert asyncio.run(main()) == ("n2", 1.5, b"ping")
    assert contract.repl_handoff_path(str(run), 0).startswith("/proc/self/fd/")


@pytest.mark.parametrize("transport", ["zmq", "unix"])
def test_a_node_with_a_deep_data_dir_confirms_and_delivers_across_shards(node_factory, transport):
    node = node_factory(name=DEEP, frontends=1, shards=2,
                        extra_args=["--ipc-transport", transport, "--colocate", "off"])
    assert len(str(node.data_dir / "run" / "node.sock")) > SUN_PATH_MAX
    q0, q1 = name_on_shard("deep0", 0, 2), name_on_shard("deep1", 1, 2)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q1, durable=True)
    # A dead letter from shard 0 to shard 1 crosses the shards' own data-plane connection.
    ch.queue_declare(q0, durable=True, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch.basic_publish("", q0, b"to-dead-letter", PERSISTENT)
    ch.basic_publish("", q1, b"direct", PERSISTENT)
    method, _props, body = ch.basic_get(q0)
    assert body == b"to-dead-letter"
    ch.basic_reject(method.delivery_tag, requeue=False)
    got = []

    def both() -> bool:
        body = ch.basic_get(q1, auto_ack=True)[2]
        if body is not None:
            got.append(body)
        return len(got) == 2

    wait_until(both, 15, "both messages in the dead-letter queue", pause=conn.sleep, context=node.log_tail)
    assert sorted(got) == [b"direct", b"to-dead-letter"]
    conn.close()
