"""Content properties: pamqp round trip, and the fast delivery_mode / decode_headers readers agree
with pamqp on valid input and raise only ValueError on anything else."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from broker.amqp.properties import (
    EMPTY_PROPS,
    decode_headers,
    decode_properties,
    delivery_mode,
    encode_properties,
    priority,
)
from tests.codec_strategies import headers, prop_str, properties

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(properties)
def test_properties_roundtrip(props):
    raw = encode_properties(props)
    assert raw == props.marshal()
    assert decode_properties(raw) == props


@SETTINGS
@given(properties)
def test_fast_readers_agree_with_pamqp(props):
    raw = encode_properties(props)
    assert delivery_mode(raw) == (props.delivery_mode or 0)
    assert decode_headers(raw) == props.headers


def test_empty_properties():
    assert EMPTY_PROPS == commands.Basic.Properties().marshal()
    assert delivery_mode(EMPTY_PROPS) == 0
    assert decode_headers(EMPTY_PROPS) is None
    assert decode_properties(EMPTY_PROPS) == commands.Basic.Properties()


def test_persistent_only_fast_shape():
    assert delivery_mode(commands.Basic.Properties(delivery_mode=2).marshal()) == 2


@SETTINGS
@given(st.one_of(st.none(), prop_str), st.one_of(st.none(), prop_str), st.one_of(st.none(), headers),
       st.sampled_from([1, 2]))
def test_truncated_before_delivery_mode_raises_value_error(content_type, content_encoding, hdrs, mode):
    # only fields up to delivery-mode, so every proper prefix cuts something delivery_mode needs
    raw = commands.Basic.Properties(content_type=content_type, content_encoding=content_encoding, headers=hdrs,
                                    delivery_mode=mode).marshal()
    assert delivery_mode(raw) == mode
    for cut in range(len(raw)):
        with pytest.raises(ValueError):
            delivery_mode(raw[:cut])
        with pytest.raises(ValueError):
            decode_properties(raw[:cut])


def test_continuation_flag_words_are_skipped():
    # a flag word with bit 0 set announces another flag word before the property list
    assert delivery_mode(b"\x10\x01\x00\x00\x02") == 2
    with pytest.raises(ValueError):
        delivery_mode(b"\x10\x01\x00")


@SETTINGS
@given(st.binary(max_size=64))
def test_garbage_raises_only_value_error(raw):
    for reader in (delivery_mode, decode_headers, decode_properties):
        try:
            reader(raw)
        except ValueError:
            pass


@SETTINGS
@given(properties)
def test_priority_reader_agrees_with_pamqp(props):
    raw = encode_properties(props)
    assert priority(raw) == (props.priority or 0)


@SETTINGS
@given(st.one_of(st.none(), prop_str), st.one_of(st.none(), headers), st.one_of(st.none(), st.sampled_from([1, 2])),
       st.integers(0, 255))
def test_priority_reader_truncated_raises_value_error(content_type, hdrs, mode, prio):
    raw = commands.Basic.Properties(content_type=content_type, headers=hdrs, delivery_mode=mode,
                                    priority=prio).marshal()
    assert priority(raw) == prio
    for cut in range(2, len(raw)):
        with pytest.raises(ValueError):
            priority(raw[:cut])


def test_a_long_string_that_is_not_utf8_survives_a_rewrite():
    """pamqp decodes such a header to bytes and could not encode it back (TypeError)."""
    import struct as _struct

    from broker.amqp.properties import decode_properties, encode_properties

    table = (b"\x01k" + b"S" + _struct.pack(">I", 2) + b"\xff\xfe"
             + b"\x01a" + b"A" + _struct.pack(">I", 7) + b"S" + _struct.pack(">I", 2) + b"\x80x")
    raw = _struct.pack(">HI", 0x2000, len(table)) + table
    props = decode_properties(raw)
    props.headers["added"] = 1
    again = decode_properties(encode_properties(props))
    assert again.headers == {"k": b"\xff\xfe", "a": [b"\x80x"], "added": 1}
