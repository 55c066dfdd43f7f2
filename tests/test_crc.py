"""broker/crc.py (ISA-L's CRC32 when installed) has zlib's values: the replication stream's CRCs and
the shard's record headers stay what zlib computed, so segments written before the switch still
verify and a node without isal reads what one with isal wrote."""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.crc import crc32
from shard import record

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)


@SETTINGS
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_stream_crc_is_zlibs_crc32(d, start):
    assert crc32(d) == zlib.crc32(d)
    assert crc32(d, start) == zlib.crc32(d, start)
    assert crc32(memoryview(d)) == zlib.crc32(d)


@SETTINGS
@given(st.binary(max_size=3000), st.text(max_size=60).map(str.encode), st.booleans())
def test_record_header_crc_is_zlibs_and_verifies(body, rk, persistent):
    payload = record.encode_payload(1234, record.FLAG_PERSISTENT if persistent else 0, b"ex", rk, b"", body)
    buf = bytearray(len(payload) + record.HEADER_SIZE + 64)
    size = record.write(buf, 0, payload)
    length, crc = record.HEADER.unpack_from(buf, 0)
    assert (length, crc) == (len(payload), zlib.crc32(payload))
    res = record.ScanResult()
    assert [pos for pos, *_ in record.scan(buf, 0, len(buf), True, res)] == [0]
    assert record.read(buf, 0)[5] == body and size == record.HEADER_SIZE + len(payload)
