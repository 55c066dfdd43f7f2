"""Unix socket paths that fit ``sun_path`` whatever the length of the data dir holding them.

A unix socket's address is at most 107 bytes (``sockaddr_un.sun_path`` is 108 with its NUL), and the
node's sockets live in ``<data dir>/run/``: a data dir a little over 80 bytes deep
(``/var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~csi/<pvc>/mount/...``, a CI job's temp dir)
made every bind fail with "AF_UNIX path too long", and the node never came up. Such a path is
reached instead through a descriptor of its directory: ``/proc/self/fd/N/<name>`` names the same
file (the kernel resolves the magic link while looking the path up), in every process that opens
the directory itself. Linux only, as the rest of the node (mmap segments, ``/proc`` reads).
"""

from __future__ import annotations

import os

SUN_PATH_MAX = 107  # bytes, without the terminating NUL

# directory -> (O_PATH descriptor of it, its inode): opened once per process. The inode catches a
# directory removed and made again since (the node's run dir is recreated at each start).
_DIR_FDS: dict[str, tuple[int, int]] = {}


def fit(path: str) -> str:
    """``path`` itself when it fits ``sun_path``, otherwise a short name for the same file through a
    descriptor of its directory, held open by this process for its life."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path
    directory, name = os.path.split(path)
    ino = os.stat(directory).st_ino
    held = _DIR_FDS.get(directory)
    if held is None or held[1] != ino:
        if held is not None:
            os.close(held[0])
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        held = _DIR_FDS[directory] = (fd, os.fstat(fd).st_ino)
    short = f"/proc/self/fd/{held[0]}/{name}"
    if len(os.fsencode(short)) > SUN_PATH_MAX:
        raise ValueError(f"unix socket name {name!r} is too long even through its directory's descriptor")
    return short
