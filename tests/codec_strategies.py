"""Hypothesis strategies shared by the codec tests (no tests here): names, properties, bodies."""

from __future__ import annotations

import datetime

from hypothesis import strategies as st
from pamqp import commands

# pamqp validates exchange names against the spec's pattern when it marshals
EXCHANGE_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:@#,/+ "


def shortstr(max_bytes: int = 255) -> st.SearchStrategy[str]:
    return st.text(max_size=max_bytes // 4)


exchange_names = st.text(alphabet=EXCHANGE_ALPHABET, max_size=127)
routing_keys = st.one_of(shortstr(), st.text(alphabet="abc.#*", max_size=20))
tags = st.integers(min_value=0, max_value=2**63 - 1)  # pamqp packs longlong signed

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(max_size=20),
    st.binary(max_size=10).map(bytearray),
)
table_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(alphabet="abcxyz", min_size=1, max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
headers = st.dictionaries(st.text(alphabet="abcdefgh-_", min_size=1, max_size=10), table_values, max_size=5)
timestamps = st.integers(min_value=0, max_value=2**32 - 1).map(
    lambda s: datetime.datetime.fromtimestamp(s, tz=datetime.UTC)
)


def _opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


# pamqp writes "" as an absent property, so property strings are never empty
prop_str = st.text(min_size=1, max_size=15)


properties = st.builds(
    commands.Basic.Properties,
    content_type=_opt(prop_str),
    content_encoding=_opt(prop_str),
    headers=_opt(headers),
    delivery_mode=_opt(st.sampled_from([1, 2])),
    priority=_opt(st.integers(0, 9)),
    correlation_id=_opt(prop_str),
    reply_to=_opt(prop_str),
    expiration=_opt(st.integers(0, 10**9).map(str)),
    message_id=_opt(prop_str),
    timestamp=_opt(timestamps),
    message_type=_opt(prop_str),
    user_id=_opt(prop_str),
    app_id=_opt(prop_str),
)

bodies = st.one_of(st.just(b""), st.binary(max_size=40), st.binary(min_size=100, max_size=3000))
frame_maxes = st.sampled_from([0, 4096, 131072, 9 + 8, 50, 128])
channels = st.integers(min_value=1, max_value=65535)
