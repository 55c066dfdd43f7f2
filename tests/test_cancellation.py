"""Cancellation is never swallowed in a node's code.

In Python 3.11 ``asyncio.wait_for`` returns the inner result instead of raising CancelledError when
the awaited thing completes in the same loop turn as the cancellation: the cancelled task then goes
on (a relay connects, a stopping node waits for more). The node's packages use ``asyncio.timeout``
instead; a source scan keeps ``wait_for`` out, and a real proxy shows a cancelled wait ends.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from replication.coordination import NodeInfo
from replication.proxy import ClientProxy
from tests.harness import REPO_ROOT, free_port

# The packages whose code runs in a node's processes (the node, frontends, shards, the pipeline).
NODE_PACKAGES = ("broker", "frontend", "shard", "replication", "pipeline")


def _wait_for_calls(path: Path) -> list[int]:
    """Lines that call asyncio.wait_for (``asyncio.wait_for(...)`` or a ``wait_for`` imported from it)."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "asyncio"
                for alias in node.names if alias.name == "wait_for"}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "wait_for" and isinstance(f.value, ast.Name)
                and f.value.id == "asyncio") or (isinstance(f, ast.Name) and f.id in imported):
            lines.append(node.lineno)
    return lines


def test_no_asyncio_wait_for_in_the_node_packages():
    found = [f"{path.relative_to(REPO_ROOT)}:{line}"
             for pkg in NODE_PACKAGES for path in sorted((REPO_ROOT / pkg).rglob("*.py"))
             for line in _wait_for_calls(path)]
    assert not found, f"asyncio.wait_for can swallow a cancellation (3.11): use asyncio.timeout: {found}"


def test_the_scan_finds_wait_for(tmp_path):
    # The guard above must be able to fail: both spellings are found, a comment is not.
    src = tmp_path / "x.py"
    src.write_text("import asyncio\nfrom asyncio import wait_for as wf\n# asyncio.wait_for(x)\n"
                   "async def f(x):\n    await asyncio.wait_for(x, 1)\n    await wf(x, 1)\n")
    assert _wait_for_calls(src) == [5, 6]


def test_a_relay_cancelled_as_the_leader_becomes_known_ends():
    """A client connection waits in the follower's proxy for a leader; the leader becomes known and
    the relay task is cancelled in the same loop turn (a node shutting down as etcd answers). The
    task must end, close the client and never connect to the leader (wait_for would have returned
    normally and relayed the connection)."""

    async def main():
        accepted: list = []

        async def leader_conn(reader, writer):
            accepted.append(writer)
            await reader.read()
            writer.close()

        leader = await asyncio.start_server(leader_conn, "127.0.0.1", 0)
        leader_port = leader.sockets[0].getsockname()[1]
        listen = free_port()
        proxy = ClientProxy({"amqp": ("127.0.0.1", listen)}, wait_for_leader=30)
        await proxy.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            deadline = asyncio.get_running_loop().time() + 10
            while not proxy._waiting:  # the relay waits for a leader
                assert asyncio.get_running_loop().time() < deadline, "the relay never waited for a leader"
                await asyncio.sleep(0.01)
            (relay,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ClientProxy._relay"]
            proxy.set_target(NodeInfo("n1", "127.0.0.1", leader_port))
            relay.cancel()
            async with asyncio.timeout(10):
                await asyncio.gather(relay, return_exceptions=True)
            assert relay.cancelled(), f"the relay swallowed its cancellation: {relay!r}"
            async with asyncio.timeout(10):
                assert await reader.read() == b""  # the client connection is closed
            assert not accepted, "a cancelled relay connected to the leader"
            writer.close()
        finally:
            await proxy.stop()
            leader.close()

    asyncio.run(main())
