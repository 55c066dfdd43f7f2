#!/usr/bin/env python3
"""CPU of the AMQP codec for one pipelined queue.delete: its parse and its delete-ok's encoding.

    scripts/delete-codec.py TREE [TREE ...]

Per TREE (its code first on the path, in a child process of its own): FrameParser.feed of 37
queue.delete frames at once (~one 1 KiB parse slice of the deleting connection,
frontend/amqp/connection.py PARSE_SLICE), 2,000 times, and encode_method of a Queue.DeleteOk;
process_time, best of 5. Trees alternate when run twice (`for i in 1 2; do ...; done`).
"""

from __future__ import annotations

import subprocess
import sys

CODE = r'''
import time
from pamqp import commands, frame as pf
from broker.amqp.parser import FrameParser
from broker.amqp.encoder import encode_method
from broker.amqp import constants as C
frames = b"".join(pf.marshal(commands.Queue.Delete(queue=f"delete-stall-{i}"), 1) for i in range(37))
N = 2000
best_p = best_e = 1e9
for _ in range(5):
    p = FrameParser()
    p.feed(C.PROTOCOL_HEADER)
    t = time.process_time()
    for _ in range(N):
        ev = p.feed(frames)
    assert len(ev) == 37
    best_p = min(best_p, (time.process_time() - t) / (N * 37) * 1e6)
    m = commands.Queue.DeleteOk(0)
    t = time.process_time()
    for _ in range(N * 37):
        encode_method(1, m)
    best_e = min(best_e, (time.process_time() - t) / (N * 37) * 1e6)
print(f"parse of a queue.delete {best_p:.2f} us, encode of a delete-ok {best_e:.2f} us")
'''


def main() -> int:
    for tree in sys.argv[1:]:
        out = subprocess.run([sys.executable, "-c", CODE], cwd=tree, env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True).stdout.strip()
        print(f"{tree}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
