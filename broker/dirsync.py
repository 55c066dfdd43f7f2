"""fsync of a directory: makes a rename, create or unlink in it durable (POSIX leaves that to the
directory's own fsync, not the file's)."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
