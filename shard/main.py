"""Entry point of a shard process: `python -m shard.main --index N --run-dir DIR`."""

from __future__ import annotations

from broker.process import run_worker


def _worker_class():
    from shard.worker import ShardWorker

    return ShardWorker


def main(argv: list[str] | None = None) -> int:
    return run_worker("shard", argv, _worker_class)


if __name__ == "__main__":
    raise SystemExit(main())
