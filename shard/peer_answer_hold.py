"""``SHARDMQ_TEST_HOLD_PEER_ANSWERS=N`` (tests only): a late CONFIRM from a target shard, made to order.

A shard with it set keeps the CONFIRM / CONFIRM_NACK answers it owes other shards (identities
``sh-M``) until it holds N of them, then sends them all, in order, and holds nothing more. A test
uses it to deliver a target's answer to a forward of a shard that has since been killed and
restarted, behind the answer to a forward of the new life (tests/test_forward_lives.py): the race
that shard/forward_lives.py closes, without a timing window. Unset (always, outside tests) the data
socket is left as it is.
"""

from __future__ import annotations

import os
from typing import Any

from broker import contract

ENV = "SHARDMQ_TEST_HOLD_PEER_ANSWERS"
_ANSWERS = (contract.CONFIRM, contract.CONFIRM_NACK)


def install(data: Any) -> None:
    """Wrap the data socket's ``put`` when the variable asks for it."""
    try:
        n = int(os.environ.get(ENV) or 0)
    except ValueError:
        n = 0
    if n <= 0:
        return
    put = data.put
    held: list[tuple[bytes, list]] = []
    done = False

    def holding_put(dest: bytes | None, item: list) -> None:
        nonlocal done
        if done or not dest or not dest.startswith(b"sh-") or item[0] not in _ANSWERS:
            put(dest, item)
            return
        held.append((dest, item))
        if len(held) >= n:
            done = True  # one round only
            for d, i in held:
                put(d, i)
            held.clear()

    data.put = holding_put
