"""A follower's CPU per replicated message, measured alone (no broker, no etcd, no load generator).

    python -m loadtest.repl_follower_cpu                      # from the repository root
    python -m loadtest.repl_follower_cpu --tree /tmp/base     # the receiver of another checkout

A stand-in leader (this process) runs the real handshake and an empty full sync, then streams
what a leader shard sends for a queue under confirmed load: per batch one APPEND run of
``--per-batch`` records of ``--size`` bytes to a segment, 8 bytes per record to the acks file,
the delivered mark; it keeps two batches unacked, as a leader whose group syncs overlap the
followers' would. The follower is the real ``replication.receiver.StreamReceiver`` (of ``--tree``)
in a child process writing to a temp dir, fdatasync and acks included. It prints the child's CPU
seconds per message from its full sync's end to the last ack: unlike msg/s on a shared machine
that figure hardly moves with the load, so two trees compare fairly (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from replication import protocol as p

REPO_ROOT = Path(__file__).resolve().parents[1]
_SECRET = b"repl-follower-cpu"
_SEGMENT = 64 << 20

# The follower: a StreamReceiver until the stream ends; prints its CPU seconds since the full sync.
_CHILD = r"""
import asyncio, resource, sys
try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
from replication.files import CrcCache
from replication.receiver import StreamReceiver

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def main():
    rec = StreamReceiver(sys.argv[1], sys.argv[2].encode(), "follower", "shard-0", CrcCache())
    start = []
    async def synced():
        await rec.synced_event.wait()
        start.append(cpu())
    asyncio.get_running_loop().create_task(synced())
    try:
        await rec.run("127.0.0.1", int(sys.argv[3]))
    except (OSError, EOFError):
        pass
    print(cpu() - start[0] if start else -1.0, flush=True)

asyncio.run(main())
"""


async def _lead(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, batches: int, per: int,
                size: int) -> float:
    """Serve one follower: handshake, empty full sync, ``batches`` batches; seconds streaming."""
    dec = p.Decoder()
    events: deque = deque()

    async def event() -> p.Event:
        while not events:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the follower closed the connection")
            events.extend(dec.feed(data))
        return events.popleft()

    hello = await event()
    nonce = p.new_nonce()
    writer.write(p.encode_challenge(nonce, p.leader_proof(_SECRET, hello.stream, hello.nonce, nonce)))
    auth = await event()
    if not p.check_proof(p.follower_proof(_SECRET, hello.stream, hello.name, nonce, hello.nonce), auth.proof):
        raise ConnectionError("the follower failed the handshake")
    writer.write(p.encode_welcome(["shard-0"], "leader"))
    writer.write(p.encode_file_list(["q"], []))
    await event()  # FILE_REQUEST (nothing: the follower's dir is empty)
    writer.write(p.encode_sync_done())
    await event()  # the full sync's ack
    record = os.urandom(size)
    sent = offset = 0
    unacked: deque[int] = deque()
    t0 = time.monotonic()
    for b in range(batches):
        run = record * per
        frames = [p.append_header(f"q/msgs.{offset // _SEGMENT:010d}", offset % _SEGMENT, run), run,
                  p.encode_append("q/acks", b * per * 8, bytes(per * 8)),
                  p.encode_append("q/delivered", 0, struct.pack("<Q", (b + 1) * per))]
        offset += len(run)
        sent += sum(len(f) for f in frames)
        writer.writelines(frames)
        unacked.append(sent)
        while len(unacked) >= 2 or (b == batches - 1 and unacked):
            ack = await event()
            while unacked and unacked[0] <= ack.position:
                unacked.popleft()
    return time.monotonic() - t0


async def measure(tree: Path, batches: int, per: int, size: int) -> dict:
    """Run one follower of ``tree`` against the stand-in leader; its CPU per message and the rate."""
    data_dir = tempfile.mkdtemp(prefix="shardmq-follower-cpu-")
    served: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            served.set_result(await _lead(reader, writer, batches, per, size))
        except Exception as exc:  # the child's output says the rest
            served.set_exception(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, data_dir, _SECRET.decode(), str(port), cwd=str(tree), env=env,
        stdout=subprocess.PIPE)
    try:
        seconds = await served
        out, _ = await child.communicate()
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        server.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    cpu = float(out.decode().strip().splitlines()[-1])
    msgs = batches * per
    return {"messages": msgs, "seconds": round(seconds, 3), "msg_per_s": round(msgs / seconds),
            "cpu_s": round(cpu, 3), "cpu_us_per_msg": round(cpu / msgs * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.repl_follower_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", help="run the receiver of this checkout (default: this one)")
    ap.add_argument("--batches", type=int, default=2000, help="batches to stream (default 2000)")
    ap.add_argument("--per-batch", type=int, default=100, help="records per batch (default 100)")
    ap.add_argument("--size", type=int, default=1100, help="bytes per record (default 1100: a 1 KiB body)")
    ap.add_argument("--runs", type=int, default=1, help="repeat (default 1)")
    args = ap.parse_args(argv)
    tree = Path(args.tree).resolve() if args.tree else REPO_ROOT
    for _ in range(args.runs):
        r = asyncio.run(measure(tree, args.batches, args.per_batch, args.size))
        print(f"{tree}: {r['messages']:,} messages in {r['seconds']} s ({r['msg_per_s']:,} msg/s), "
              f"follower CPU {r['cpu_s']} s = {r['cpu_us_per_msg']} us/msg", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
