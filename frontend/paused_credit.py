"""Delivery credit held back from consumers: those of a connection whose writes are paused, and new ones.

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

What was taken goes back in steps of ``GIVE_BACK_STEP``: one at resume_writing, then one per loop
turn that wrote the consumer's deliveries while the client keeps up (:func:`keeps_up`: at most
``GIVE_BACK_BELOW`` left in the transport and little the client has not taken in the kernel's send
queue); while a window is not whole, its credit goes back in lumps of a quarter of what it has
(:func:`return_lumps`), so a small window never stalls. Giving it all back at once let the shard
send a window's worth into the buffer the client had just drained (one turn's write of 5.6 MB,
measured with a WebSocket MQTT client reading slowly); in steps, a client that reads slowly gets a step per drain, and a fast
one has its whole window back within ``CREDIT_WINDOW / GIVE_BACK_STEP`` turns. A resume while the
kernel still holds what the client has not taken gives back no more than ``START_WINDOW``.

The same steps make a consumer's slow start: right behind its CONSUME the frontend takes back all of
its window but ``START_WINDOW``, so a consumer whose client never reads, started on a full queue, is
sent START_WINDOW and not a whole window before its connection pauses (20 such consumers, 64 KiB
bodies: frontend RSS +179 MiB before, +5 MiB now; ``scripts/paused_consumers.py``).

The window is conserved: nothing is lost, delivered twice or reordered, only held at the shard (in
its queue) instead of in the frontend's memory.

Nothing here runs per message: once per pause or CONSUME, and per turn only while something is to be
given back (then one SIOCOUTQ ioctl per turn of that connection).
"""

from __future__ import annotations

import fcntl
import struct
import termios
from collections.abc import Callable, Container, Iterable
from typing import Any

from broker import contract

_CREDIT = contract.CREDIT
_WINDOW = contract.CREDIT_WINDOW
# Credits given back per step (about 1 MiB of large bodies, 2,000 small ones).
GIVE_BACK_STEP = contract.CREDIT_WINDOW // 8
# A consumer starts with this much of its window (250 KiB of large bodies, 500 small ones); the frontend
# takes the rest back right behind its CONSUME and gives it back in steps, as after a pause, one per
# turn that wrote its deliveries while the client keeps up: a fast consumer has its whole window
# within CREDIT_WINDOW / GIVE_BACK_STEP such turns, and a client that never reads is sent this much
# and what its kernel took while it seemed to read, not a window (TCP's slow start; docs/architecture.md
# "Delivery credit").
START_WINDOW = contract.CREDIT_WINDOW // 32
# A turn that leaves at most this many bytes in the transport earns the next step (asyncio's low-water mark).
GIVE_BACK_BELOW = 16 << 10

# The kernel's send queue counts too: a client that does not read still lets the kernel take a few MB
# (the send buffer autotunes to 4 MB on Linux) before the transport's own buffer grows, so "the socket
# took it at once" alone let a window grow whole into the kernel. A window grows only while the bytes
# the client has not yet taken (SIOCOUTQ: unacknowledged) are at most this, or a quarter of all the
# connection wrote (a fast client far away always has a bandwidth-delay product in flight).
GROW_UNTAKEN_BELOW = 64 << 10
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on Linux
_INT = struct.Struct("i")
_ZERO = bytes(4)

# (shard, channel, consumer tag)
Key = tuple[int, int, str]


def take_back(put: Callable[[int, list], None], conn_id: int, consumers: Iterable[tuple[Key, int]],
              taken: dict[Key, int], keep: int = 0) -> None:
    """Revoke each consumer's credit not yet spent on deliveries the frontend has seen, but ``keep``
    (START_WINDOW for a consumer that starts).

    ``consumers``: (key, credit the frontend holds unreturned for it); ``taken`` (updated): what is
    taken back and not yet given back, per key."""
    for key, unreturned in consumers:
        had = taken.get(key, 0)
        n = _WINDOW - keep - unreturned - had
        if n > 0:
            put(key[0], [_CREDIT, conn_id, key[1], key[2], -n])
            taken[key] = had + n


def give_back(put: Callable[[int, list], None], conn_id: int, taken: dict[Key, int], grow: bool = True,
              moved: Container[Key] | None = None) -> None:
    """Return a step of what :func:`take_back` took, per consumer (consumers gone since are removed
    from ``taken`` by their connection); keys fully returned leave ``taken``. Without ``grow`` (the
    client has not taken what the kernel holds for it), only up to START_WINDOW: a WebSocket's
    transport resumes as soon as its sends reach the kernel, and a step per resume grew the window
    of a client that never read into the kernel's send buffer, megabytes. With ``moved``, only those
    consumers grow (they had deliveries written this turn): a turn that wrote a consume-ok is no sign
    that the client reads."""
    for key in list(taken):
        n = taken[key]
        step = n if n <= GIVE_BACK_STEP else GIVE_BACK_STEP
        if not grow or (moved is not None and key not in moved):
            step = min(step, START_WINDOW - (_WINDOW - n))  # what it has short of START_WINDOW
            if step <= 0:
                continue
        put(key[0], [_CREDIT, conn_id, key[1], key[2], step])
        if step == n:
            del taken[key]
        else:
            taken[key] = n - step


def give_back_step(put: Callable[[int, list], None], conn_id: int, taken: dict[Key, int] | None,
                   is_open: bool, grow: bool = True, moved: Container[Key] | None = None) -> dict[Key, int] | None:
    """A connection's step of giving back (AMQP and MQTT alike): at resume, and after each turn that
    wrote deliveries (``moved``: for whom) while the client keeps up. Returns what is still taken,
    None once all of it is back (a closed connection gives nothing back: its consumers are gone)."""
    if taken and is_open:
        give_back(put, conn_id, taken, grow, moved)
    return taken or None


def return_lumps(put: Callable[[int, list], None], conn_id: int, credit: dict[Key, int],
                 taken: dict[Key, int], lump: int) -> None:
    """Return credit (``credit``: what the frontend holds unreturned, per key) while some consumers'
    windows are not whole (``taken``), at the end of a turn of a connection that is not paused: such
    a consumer returns a lump at a quarter of what it has, not at ``lump`` (with a small window that
    would never come, and the consumer would stall)."""
    for key in list(credit):
        n = credit[key]
        if n >= lump or (key in taken and 4 * n >= _WINDOW - taken[key]):
            del credit[key]
            put(key[0], [_CREDIT, conn_id, key[1], key[2], n])


def keeps_up(transport: Any, written: int) -> bool:
    """The client takes what is written to it (a window not yet whole may grow): the transport's buffer
    is at most GIVE_BACK_BELOW and the kernel holds at most max(GROW_UNTAKEN_BELOW, written / 4) bytes
    the client has not taken. Once per turn, only while a window is not whole."""
    if transport is None or transport.get_write_buffer_size() > GIVE_BACK_BELOW:
        return False
    sock = transport.get_extra_info("socket")
    if sock is None or _OUTQ is None:
        return True  # a transport without a socket: its own buffer is all we know
    try:
        untaken = _INT.unpack(fcntl.ioctl(sock.fileno(), _OUTQ, _ZERO))[0]
    except (OSError, ValueError):
        return True
    return untaken <= GROW_UNTAKEN_BELOW or untaken <= written >> 2
