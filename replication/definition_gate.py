"""Durable definition changes on a leader whose ISR is below ``--min-isr``: held, then refused.

A publish below min-isr is nacked (the shards do it). A durable declare, delete or bind has no
nack: its ``*-Ok`` would promise a definition that only the leader has, which a failover loses.
So the node holds such a change up to ``HOLD_S`` for the ISR to recover (a follower resyncing
after a blip is back within a second or two), and otherwise refuses it before applying anything:
the channel is closed with 406 PRECONDITION_FAILED (RabbitMQ's code for "the broker's state does
not allow this now"; a channel error, so the client keeps its connection and may retry). The
change is not applied. Transient definitions (exclusive or non-durable queues, ...) pass.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from broker.amqp.errors import AMQPError

HOLD_S = 5.0
_POLL_S = 0.05

# AMQP class and method ids of the requests that change definitions (for the channel.close).
_METHOD_IDS = {"queue.declare": (50, 10), "queue.bind": (50, 20), "queue.unbind": (50, 50),
               "queue.delete": (50, 40), "exchange.declare": (40, 10), "exchange.delete": (40, 20),
               "exchange.bind": (40, 30), "exchange.unbind": (40, 40)}


def below_min_isr(repl_leader: Any) -> bool:
    return repl_leader is not None and len(repl_leader.isr) < repl_leader.min_isr


async def wait_for_min_isr(repl_leader: Any, hold_s: float = HOLD_S) -> bool:
    """True once the ISR has at least min-isr followers (at once when it has); False after hold_s."""
    deadline = time.monotonic() + hold_s
    while below_min_isr(repl_leader):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


def refusal(repl_leader: Any, op: str | None, applied: bool = False) -> AMQPError:
    """The 406 that closes the client's channel (the management API answers it as a 400)."""
    class_id, method_id = _METHOD_IDS.get(op or "", (0, 0))
    isr = ", ".join(sorted(repl_leader.isr)) or "none"
    if applied:
        what = "applied on the leader but not acknowledged by the in-sync followers"
    else:
        what = f"refused after waiting {HOLD_S:.0f} s"
    return AMQPError(406, f"PRECONDITION_FAILED - durable definition change {what}: "
                          f"{len(repl_leader.isr)} in-sync followers ({isr}) < --min-isr "
                          f"{repl_leader.min_isr}; retry when the cluster has recovered",
                     class_id, method_id)
