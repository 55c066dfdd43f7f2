"""Entry point of a frontend process: `python -m frontend.main --index K --run-dir DIR`."""

from __future__ import annotations

import argparse
import asyncio
import signal

from broker.config import setup_logging
from broker.process import die_with_parent, install_uvloop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardmq-frontend")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent()
    install_uvloop()
    setup_logging(args.log_level, f"frontend-{args.index}")
    return asyncio.run(_run(args.index, args.run_dir))


async def _run(index: int, run_dir: str) -> int:
    from frontend.worker import FrontendWorker

    loop = asyncio.get_running_loop()
    worker = FrontendWorker(index, run_dir, loop)
    # The node stops workers with STOP; SIGTERM from outside does the same. Ctrl-C in a terminal
    # reaches the whole process group: the node decides, not us.
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(worker.stop()))
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    await worker.start()
    await worker.stopped.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
