"""replication/proxy.py with real sockets: byte-for-byte relay, PROXY v2, leader change."""

from __future__ import annotations

import asyncio
import struct

from replication.coordination import NodeInfo
from replication.proxy import ClientProxy, proxy_v2_header
from tests.harness import async_wait_until, free_port

SIG = b"\r\n\r\n\x00\r\nQUIT\n"


def test_proxy_v2_header_ipv4_and_ipv6():
    h = proxy_v2_header(("10.1.2.3", 40000), ("10.9.8.7", 5672))
    assert h[:12] == SIG and h[12] == 0x21 and h[13] == 0x11
    assert struct.unpack("!H", h[14:16])[0] == 12 == len(h) - 16
    assert h[16:20] == bytes([10, 1, 2, 3]) and h[20:24] == bytes([10, 9, 8, 7])
    assert struct.unpack("!HH", h[24:28]) == (40000, 5672)
    h6 = proxy_v2_header(("::1", 1), ("10.0.0.1", 2))
    assert h6[13] == 0x21 and struct.unpack("!H", h6[14:16])[0] == 36


async def _echo_server(tag: bytes, seen: list):
    async def handle(reader, writer):
        while data := await reader.read(65536):
            seen.append(data)
            writer.write(tag + data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_relays_bytes_and_closes_connections_when_the_leader_changes():
    async def main():
        seen_a: list = []
        seen_b: list = []
        a = await _echo_server(b"A:", seen_a)
        b = await _echo_server(b"B:", seen_b)
        port_a = a.sockets[0].getsockname()[1]
        port_b = b.sockets[0].getsockname()[1]
        listen = free_port()
        proxy = ClientProxy({"amqp": ("127.0.0.1", listen)}, wait_for_leader=2)
        await proxy.start()
        proxy.set_target(NodeInfo("a", "127.0.0.1", port_a))
        r, w = await asyncio.open_connection("127.0.0.1", listen)
        payload = bytes(range(256)) * 1000
        w.write(payload)
        got = b""
        while len(got) < len(payload) + 2:
            got += await asyncio.wait_for(r.read(1 << 20), 5)
        assert got[:2] == b"A:" and b"".join(seen_a) == payload  # byte for byte, no header
        # A new leader: the relayed connection is closed, the next one reaches the new leader.
        proxy.set_target(NodeInfo("b", "127.0.0.1", port_b, proxy_protocol=True))
        assert await asyncio.wait_for(r.read(), 5) == b""
        r2, w2 = await asyncio.open_connection("127.0.0.1", listen)
        w2.write(b"hello")
        data = b""
        while not data.endswith(b"hello"):
            data += await asyncio.wait_for(r2.read(100), 5)
        assert data.startswith(b"B:" + SIG)  # this leader accepts PROXY v2: the header goes first
        # No leader: a connection waits, then is served once one is known.
        proxy.set_target(None)
        r3, w3 = await asyncio.open_connection("127.0.0.1", listen)
        w3.write(b"late")
        await async_wait_until(lambda: proxy._waiting, 10, "the connection to wait for a leader")
        proxy.set_target(NodeInfo("a", "127.0.0.1", port_a))
        assert (await asyncio.wait_for(r3.read(6), 5)) == b"A:late"
        for writer in (w, w2, w3):
            writer.close()
        await proxy.stop()
        a.close()
        b.close()

    asyncio.run(main())
