#!/usr/bin/env python3
"""The data plane's transports alone, zmq vs unix: msg/s through a two-process pipeline.

A dealer process sends 512-item PUBLISH-like batches with at most 8 unanswered (MAX_BATCHES_IN_FLIGHT),
a router process answers PROCESSED per batch, through broker/data_sockets.py (the workers' socket
classes, on uvloop). No broker logic: what the transport itself can move.
    scripts/ab-transport.py [ROUNDS]
"""
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import uvloop  # noqa: E402


def router(run_dir, transport):
    os.environ["SHARDMQ_IPC_TRANSPORT"] = transport
    from broker import data_sockets
    async def main():
        loop = asyncio.get_running_loop()
        box = {}
        def on_batch(ident, header, items):
            box["s"].put(ident, [22, header[1]])
        box["s"] = data_sockets.shard_listener(loop, run_dir, 0, on_batch)
        await asyncio.sleep(30)
    uvloop.run(main())

def dealer(run_dir, transport, n_batches, out):
    os.environ["SHARDMQ_IPC_TRANSPORT"] = transport
    from broker import data_sockets
    async def main():
        loop = asyncio.get_running_loop()
        seq = [0]
        done = [0]
        fut = loop.create_future()
        item = [1, "/", ["q"], "", "q", b"\x00\x00", b"x" * 16, False, 0, 0, None]
        def header(_d):
            seq[0] += 1
            return [0, seq[0], 0, 1]
        def send():
            while seq[0] - done[0] < 8 and seq[0] < n_batches:
                for _ in range(512):
                    s.put(None, item)
        def on_batch(ident, h, items):
            for it in items:
                done[0] = max(done[0], it[1])
            if done[0] >= n_batches:
                if not fut.done():
                    fut.set_result(None)
            else:
                send()
        s = data_sockets.shard_connection(loop, run_dir, 0, b"fe-0", on_batch, header)
        await asyncio.sleep(0.5)
        t = time.perf_counter()
        send()
        await fut
        out.put(n_batches * 512 / (time.perf_counter() - t))
    uvloop.run(main())

if __name__ == "__main__":
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for transport in ("zmq", "unix"):
            d = tempfile.mkdtemp()
            q = multiprocessing.Queue()
            pr = multiprocessing.Process(target=router, args=(d, transport))
            pr.start()
            time.sleep(0.3)
            pd = multiprocessing.Process(target=dealer, args=(d, transport, 2000, q))
            pd.start()
            rate = q.get(timeout=60)
            pd.join()
            pr.kill()
            pr.join()
            print(f"r{r+1} {transport}: {rate:,.0f} msgs/s (load {open('/proc/loadavg').read().split()[0]})", flush=True)
