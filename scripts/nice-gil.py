"""Does a niced renaming thread hold a Python process's main thread up (the GIL held while preempted)?

The main thread sleeps 1 ms at a time and records its gaps (an event loop's view); another thread
renames directories back and forth (shard/segment_dir.py's reaper: a syscall with the GIL released,
a few bytecodes with it held), niced by NICE or not. Run alternating, e.g.:

    for r in 1 2 3; do for n in 0 10; do python scripts/nice-gil.py $n 10; done; done

Usage: nice-gil.py NICE SECONDS (its directories in a temp dir, removed at the end).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

DIRS = 200


def _renamer(root: str, nice: int, stop: threading.Event) -> None:
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    n = 0
    while not stop.is_set():
        a, b = os.path.join(root, f"q{n % DIRS}"), os.path.join(root, f"t{n % DIRS}")
        os.rename(a, b)
        os.rename(b, a)
        pending = {a}  # a few bytecodes with the GIL held, as the reaper's bookkeeping
        pending.discard(a)
        n += 1
        if n % DIRS == 0:
            time.sleep(0.002)  # a rest between rounds (the reaper's is 100 ms)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> None:
    nice, duration = int(sys.argv[1]), float(sys.argv[2])
    root = tempfile.mkdtemp(prefix="nice-gil-")
    try:
        for i in range(DIRS):
            os.mkdir(os.path.join(root, f"q{i}"))
        stop = threading.Event()
        thread = threading.Thread(target=_renamer, args=(root, nice, stop), daemon=True)
        thread.start()
        gaps = []
        last = time.monotonic()
        end = last + duration
        while last < end:
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        stop.set()
        thread.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gaps.sort()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"nice {nice}: n={len(gaps)} p50={_ms(gaps[len(gaps) // 2])} p99={_ms(gaps[int(len(gaps) * .99)])} "
          f"p999={_ms(gaps[int(len(gaps) * .999)])} max={_ms(gaps[-1])} ms; load {load}")


if __name__ == "__main__":
    main()
