"""Encoding and decoding AMQP methods leaves no strings behind (broker/amqp/pamqp_types.py).

pamqp's own ``amqp_type`` built ``'_' + name`` per argument, and CPython's type attribute cache kept
the last of them per cache slot alive: thousands of strings made by connections that were long
gone, scattered over the allocator's arenas so that none could be returned after a wave of closes.
"""

from __future__ import annotations

import gc
import tracemalloc

from pamqp import commands

from broker.amqp import encoder, pamqp_types, parser
from broker.amqp.events import MethodFrame


def _handshake_methods(i: int) -> list:
    return [
        commands.Connection.StartOk(client_properties={"product": f"client-{i}"}, mechanism="PLAIN",
                                    response=f"\0guest\0guest{i}", locale="en_US"),
        commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=60),
        commands.Connection.Open(virtual_host="/"),
        commands.Channel.Open(),
        commands.Queue.Declare(queue=f"q-{i}", durable=True, arguments={"x-max-length": i}),
        commands.Basic.Qos(prefetch_count=i % 100),
        commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0),
        commands.Connection.Close(reply_code=200, reply_text=f"bye {i}", class_id=0, method_id=0),
    ]


def test_encode_and_decode_keep_no_attribute_name_strings():
    p = parser.FrameParser(role="client")  # parses frames from the first byte, any method

    def round_trip(n: int) -> int:
        decoded = 0
        for i in range(n):
            for method in _handshake_methods(i):
                decoded += sum(isinstance(ev, MethodFrame) for ev in p.feed(encoder.encode_method(1, method)))
        return decoded

    assert round_trip(5) == 5 * 8  # warm up: caches, interned names, the parser's first-use state
    gc.collect()
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        assert round_trip(500) == 500 * 8
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = [s for s in after.compare_to(before, "filename")
            if s.traceback[0].filename.endswith("pamqp/base.py") and s.count_diff > 0]
    assert not kept, kept  # with pamqp's own amqp_type: thousands of '_<name>' strings kept


def test_the_table_covers_every_method_and_the_properties():
    for cls in (*commands.INDEX_MAPPING.values(), commands.Basic.Properties):
        for name in cls.__slots__:
            assert pamqp_types._TYPES[cls, name] == getattr(cls, "_" + name)
            assert cls.amqp_type(name) == getattr(cls, "_" + name)
