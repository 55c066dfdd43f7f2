"""Entry point of a paired worker process (``--colocate``): frontend K and shard K on one event loop.

`python -m shard.pair_main --index K --run-dir DIR`. The two talk through broker/local_link.py
(no socket between them); to the node they are two workers as before (a control-plane connection
and a HELLO each), which share one pid (broker/supervisor.py ``Supervisor.partner``).
"""

from __future__ import annotations

from broker import local_link, stage_trace
from broker.process import run_workers


def _frontend_class():
    from frontend.worker import FrontendWorker

    return FrontendWorker


def _shard_class():
    from shard.worker import ShardWorker

    return ShardWorker


def _before(index: int) -> None:
    local_link.enable(index)
    # The stage trace is one per process (--trace-stages): opened here it is pair-PID.trace, the
    # frontend's and the shard's stages in one file.
    stage_trace.get("pair")


def main(argv: list[str] | None = None) -> int:
    return run_workers("shardmq-pair", "pair", argv, [("frontend", _frontend_class), ("shard", _shard_class)],
                       before=_before)


if __name__ == "__main__":
    raise SystemExit(main())
