"""Process-level helpers shared by every worker process (frontends and shards)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the node that spawned it dies.

    A `kill -9` of the node must not leave orphan frontends holding the AMQP port
    or orphan shards writing to the data dir the next node will open.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent may have died between fork and prctl.
    if os.getppid() == 1:
        os._exit(1)


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, but keep the node up
        return
    uvloop.install()
