"""Entry point of a shard process: `python -m shard.main --index N --run-dir DIR`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from broker.process import die_with_parent, install_uvloop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardmq-shard")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent()
    install_uvloop()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [shard-{args.index}] %(name)s: %(message)s")
    return asyncio.run(_run(args.index, args.run_dir))


async def _run(index: int, run_dir: str) -> int:
    from shard.worker import ShardWorker

    loop = asyncio.get_running_loop()
    worker = ShardWorker(index, run_dir, loop)
    # The node stops workers with a STOP message; SIGTERM (a supervisor outside the node) does the same.
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(worker.stop()))
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    await worker.start()
    await worker.stopped.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
