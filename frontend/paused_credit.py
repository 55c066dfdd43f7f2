"""Delivery credit taken back from the consumers of a connection whose writes are paused.

A consumer's shard holds up to ``contract.CREDIT_WINDOW`` credits (about 8 MiB of bodies) and
spends them without asking: the frontend returns credit only for deliveries it wrote to a transport
that is not paused, but what the shard still held when the client stopped reading was sent anyway
and piled up in the frontend's transport buffer, a whole window per consumer of every paused
connection (docs/architecture.md "Delivery credit").

So when a connection's transport pauses (TCP's or ``frontend/ws.py`` ``WSTransport``'s high-water
mark), the frontend takes back, with one negative CREDIT per consumer (same control lane as the
CONSUME and the credit before it, so the shard applies them in order), every credit it has not
received deliveries for: ``CREDIT_WINDOW`` minus what it holds unreturned and what it took before.
The shard's credit for that consumer then ends at minus the deliveries already on their way, and
it sends nothing more. What the frontend holds for a connection whose client stopped reading is its
transport's buffer (the high-water mark) plus the deliveries in flight when it paused, not the rest
of every consumer's window.

What was taken goes back in steps of ``GIVE_BACK_STEP``: one at resume_writing and one after each
loop turn whose writes the socket took at once (at most ``GIVE_BACK_BELOW`` left in the transport). Giving it all back at once let the shard send a window's
worth into the buffer the client had just drained (one turn's write of 5.6 MB, measured with a
WebSocket MQTT client reading slowly); in steps, a client that reads slowly gets a step per drain,
and a fast one has its whole window back within ``CREDIT_WINDOW / GIVE_BACK_STEP`` turns. The
window is conserved: nothing is lost, delivered twice or reordered, only held at the shard (in its
queue) instead of in the frontend's memory.

Nothing here runs per message: once per pause, and per turn only while something is to be given back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from broker import contract

_CREDIT = contract.CREDIT
_WINDOW = contract.CREDIT_WINDOW
# Credits given back per step (about 1 MiB of large bodies, 2,000 small ones).
GIVE_BACK_STEP = contract.CREDIT_WINDOW // 8
# A turn that leaves at most this many bytes in the transport earns the next step (asyncio's low-water mark).
GIVE_BACK_BELOW = 16 << 10

# (shard, channel, consumer tag)
Key = tuple[int, int, str]


def take_back(put: Callable[[int, list], None], conn_id: int, consumers: Iterable[tuple[Key, int]],
              taken: dict[Key, int]) -> None:
    """Revoke each consumer's credit not yet spent on deliveries the frontend has seen.

    ``consumers``: (key, credit the frontend holds unreturned for it); ``taken`` (updated): what is
    taken back and not yet given back, per key."""
    for key, unreturned in consumers:
        had = taken.get(key, 0)
        n = _WINDOW - unreturned - had
        if n > 0:
            put(key[0], [_CREDIT, conn_id, key[1], key[2], -n])
            taken[key] = had + n


def give_back(put: Callable[[int, list], None], conn_id: int, taken: dict[Key, int]) -> None:
    """Return a step of what :func:`take_back` took, per consumer (consumers gone since are removed
    from ``taken`` by their connection); keys fully returned leave ``taken``."""
    for key in list(taken):
        n = taken[key]
        step = n if n <= GIVE_BACK_STEP else GIVE_BACK_STEP
        put(key[0], [_CREDIT, conn_id, key[1], key[2], step])
        if step == n:
            del taken[key]
        else:
            taken[key] = n - step


def give_back_step(put: Callable[[int, list], None], conn_id: int, taken: dict[Key, int] | None,
                   is_open: bool) -> dict[Key, int] | None:
    """A connection's step of giving back (AMQP and MQTT alike): at resume, then after each turn
    whose writes the socket took at once. Returns what is still taken, None once all of it is back
    (a closed connection gives nothing back: its consumers are gone with it)."""
    if taken and is_open:
        give_back(put, conn_id, taken)
    return taken or None
