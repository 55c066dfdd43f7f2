"""Routing of each exchange type, exchange-to-exchange bindings and caching."""

from __future__ import annotations

import pytest
from pamqp import commands

from broker.amqp.properties import EMPTY_PROPS, encode_properties
from broker.definitions import Definitions
from broker.routing import DirectTable, TopicTable, split_topic

V = "/"


def props(headers: dict | None) -> bytes:
    return encode_properties(commands.Basic.Properties(headers=headers))


def make(*queues: str) -> Definitions:
    d = Definitions()
    for q in queues:
        ops, _ = d.plan_queue_declare(V, q, False, True, False, False, {}, None, 4)
        d.apply_all(ops)
    return d


def x(d: Definitions, name: str, type: str, **args) -> None:
    d.apply_all(d.plan_exchange_declare(V, name, type, False, True, False, False, args))


def bind(d: Definitions, source: str, dest: str, key: str = "", kind: str = "queue", **args) -> None:
    d.apply_all(d.plan_bind(V, source, kind, dest, key, args, None))


def unbind(d: Definitions, source: str, dest: str, key: str = "", kind: str = "queue", **args) -> None:
    d.apply_all(d.plan_unbind(V, source, kind, dest, key, args, None))


def routed(d: Definitions, exchange: str, key: str, props_raw: bytes = EMPTY_PROPS) -> set[str]:
    result = d.route(V, exchange, key, props_raw)
    assert len(result) == len(set(result)), "route must deduplicate"
    return set(result)


def test_default_exchange_routes_by_queue_name():
    d = make("q1")
    assert routed(d, "", "q1") == {"q1"}
    assert routed(d, "", "nope") == set()


def test_direct_exact_key_and_dedup():
    d = make("q1", "q2")
    bind(d, "amq.direct", "q1", "k")
    bind(d, "amq.direct", "q2", "k")
    bind(d, "amq.direct", "q1", "other")
    assert routed(d, "amq.direct", "k") == {"q1", "q2"}
    assert routed(d, "amq.direct", "other") == {"q1"}
    assert routed(d, "amq.direct", "K") == set()
    unbind(d, "amq.direct", "q2", "k")
    assert routed(d, "amq.direct", "k") == {"q1"}


def test_same_destination_bound_twice_survives_one_unbind():
    d = make("q1")
    bind(d, "amq.direct", "q1", "k", a=1)
    bind(d, "amq.direct", "q1", "k", a=2)
    assert routed(d, "amq.direct", "k") == {"q1"}
    unbind(d, "amq.direct", "q1", "k", a=1)
    assert routed(d, "amq.direct", "k") == {"q1"}
    unbind(d, "amq.direct", "q1", "k", a=2)
    assert routed(d, "amq.direct", "k") == set()


def test_fanout_ignores_key():
    d = make("q1", "q2")
    bind(d, "amq.fanout", "q1", "x")
    bind(d, "amq.fanout", "q2", "")
    assert routed(d, "amq.fanout", "anything") == {"q1", "q2"}
    unbind(d, "amq.fanout", "q1", "x")
    assert routed(d, "amq.fanout", "") == {"q2"}


@pytest.mark.parametrize(
    "pattern, key, expected",
    [
        ("#", "", True),
        ("#", "a.b.c", True),
        ("a.#", "a", True),  # '#' matches zero words
        ("a.#", "a.b.c", True),
        ("a.#", "b.a", False),
        ("#.a", "a", True),
        ("a.#.b", "a.b", True),
        ("a.#.b", "a.x.y.b", True),
        ("a.#.b", "a.x.y", False),
        ("a.#.b", "a.b.b", True),
        ("*", "", False),  # "" is zero words, '*' needs exactly one
        ("*", "a", True),
        ("*", "a.b", False),
        ("a.*", "a.", True),  # '*' matches an empty word
        ("a.*", "a", False),
        ("*.*", ".", True),
        ("", "", True),
        ("", "a", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.b.c", False),
        ("#.*", "", False),
        ("#.*", "a", True),
        ("*.#", "a.b", True),
        ("#.#", "", True),
        ("a.#.#.b", "a.b", True),
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*.#", "a", False),
        ("a.*.#", "a.b", True),
        ("*.b.#", "x.b.y.z", True),
    ],
)
def test_topic_patterns(pattern, key, expected):
    d = make("q")
    bind(d, "amq.topic", "q", pattern)
    assert routed(d, "amq.topic", key) == ({"q"} if expected else set())


def test_topic_literal_wildcard_words_in_routing_key():
    d = make("q1", "q2")
    bind(d, "amq.topic", "q1", "a.*")
    bind(d, "amq.topic", "q2", "a.#")
    assert routed(d, "amq.topic", "a.*") == {"q1", "q2"}
    assert routed(d, "amq.topic", "a.#") == {"q1", "q2"}
    assert routed(d, "amq.topic", "a.#.c") == {"q2"}


def test_split_topic_like_rabbitmq():
    assert split_topic("") == []
    assert split_topic("a.") == ["a", ""]
    assert split_topic(".a") == ["", "a"]


def test_topic_cache_is_invalidated_on_binding_change():
    d = make("q1", "q2")
    bind(d, "amq.topic", "q1", "a.*")
    assert routed(d, "amq.topic", "a.b") == {"q1"}  # now cached
    bind(d, "amq.topic", "q2", "#.b")
    assert routed(d, "amq.topic", "a.b") == {"q1", "q2"}
    unbind(d, "amq.topic", "q1", "a.*")
    assert routed(d, "amq.topic", "a.b") == {"q2"}
    d.apply_all(d.plan_queue_delete(V, "q2", False, False, None, 0, 0))
    assert routed(d, "amq.topic", "a.b") == set()


def test_topic_cache_is_bounded():
    t = TopicTable(cache_size=8)
    t.add(("queue", "q"), "#", None)
    for i in range(100):
        assert t.match(f"k{i}")[0] == ("q",)
    assert len(t._cache) <= 8


def test_topic_prunes_empty_branches():
    t = TopicTable()
    t.add(("queue", "q"), "a.b.c", None)
    t.remove(("queue", "q"), "a.b.c", None)
    assert t._root.children == {}


def test_direct_returns_shared_result_without_allocating():
    t = DirectTable()
    t.add(("queue", "q"), "k", None)
    assert t.match("k") is t.match("k")
    d = make("q")
    bind(d, "amq.direct", "q", "k")
    assert d.route(V, "amq.direct", "k", EMPTY_PROPS) is d.route(V, "amq.direct", "k", EMPTY_PROPS)


def test_headers_all_and_any():
    d = make("all", "any", "nomatch")
    bind(d, "amq.headers", "all", **{"x-match": "all", "a": 1, "b": "two"})
    bind(d, "amq.headers", "any", **{"x-match": "any", "a": 1, "b": "two"})
    assert routed(d, "amq.headers", "", props({"a": 1, "b": "two", "c": 3})) == {"all", "any"}
    assert routed(d, "amq.headers", "", props({"a": 1})) == {"any"}
    assert routed(d, "amq.headers", "", props({"a": 2, "b": "three"})) == set()
    assert routed(d, "amq.headers", "", props(None)) == set()
    assert routed(d, "amq.headers", "", EMPTY_PROPS) == set()


def test_headers_default_is_all_and_empty_pattern_matches_everything():
    d = make("q", "anyq")
    bind(d, "amq.match", "q")  # no arguments: x-match all over nothing
    bind(d, "amq.match", "anyq", **{"x-match": "any"})  # any over nothing: never
    assert routed(d, "amq.match", "", props({"z": 1})) == {"q"}
    assert routed(d, "amq.match", "", EMPTY_PROPS) == {"q"}


def test_headers_x_keys_ignored_unless_with_x():
    d = make("plain", "withx")
    bind(d, "amq.headers", "plain", **{"x-match": "all", "x-tag": "t", "a": 1})
    bind(d, "amq.headers", "withx", **{"x-match": "all-with-x", "x-tag": "t", "a": 1})
    assert routed(d, "amq.headers", "", props({"a": 1})) == {"plain"}
    assert routed(d, "amq.headers", "", props({"a": 1, "x-tag": "t"})) == {"plain", "withx"}


def test_headers_any_with_x():
    d = make("q")
    bind(d, "amq.headers", "q", **{"x-match": "any-with-x", "x-tag": "t", "a": 1})
    assert routed(d, "amq.headers", "", props({"x-tag": "t"})) == {"q"}
    assert routed(d, "amq.headers", "", props({"x-tag": "u"})) == set()


def test_headers_value_comparison():
    d = make("num", "bool", "void")
    bind(d, "amq.headers", "num", **{"n": 1})
    bind(d, "amq.headers", "bool", **{"b": True})
    bind(d, "amq.headers", "void", **{"v": None})  # presence only
    assert routed(d, "amq.headers", "", props({"n": 1.0})) == {"num"}  # Erlang 1 == 1.0
    assert routed(d, "amq.headers", "", props({"n": True})) == set()  # booleans are not numbers
    assert routed(d, "amq.headers", "", props({"b": True})) == {"bool"}
    assert routed(d, "amq.headers", "", props({"b": 1})) == set()
    assert routed(d, "amq.headers", "", props({"v": "anything"})) == {"void"}


def test_headers_malformed_props_route_nowhere():
    d = make("q")
    bind(d, "amq.headers", "q", **{"a": 1})
    assert routed(d, "amq.headers", "", b"\x20\x00\x00\x00\xff") == set()


def test_exchange_to_exchange_and_dedup():
    d = make("q1", "q2")
    x(d, "up", "fanout")
    x(d, "down", "direct")
    bind(d, "up", "down", kind="exchange")
    bind(d, "up", "q1")
    bind(d, "down", "q1", "k")
    bind(d, "down", "q2", "k")
    assert routed(d, "up", "k") == {"q1", "q2"}
    assert routed(d, "up", "other") == {"q1"}


def test_exchange_cycles_terminate():
    d = make("q1", "q2")
    x(d, "a", "fanout")
    x(d, "b", "fanout")
    bind(d, "a", "b", kind="exchange")
    bind(d, "b", "a", kind="exchange")
    bind(d, "a", "a", kind="exchange")
    bind(d, "a", "q1")
    bind(d, "b", "q2")
    assert routed(d, "a", "") == {"q1", "q2"}
    assert routed(d, "b", "") == {"q1", "q2"}


def test_e2e_through_headers_exchange_decodes_headers():
    d = make("q")
    x(d, "front", "fanout")
    bind(d, "front", "amq.headers", kind="exchange")
    bind(d, "amq.headers", "q", **{"h": "v"})
    assert routed(d, "front", "", props({"h": "v"})) == {"q"}
    assert routed(d, "front", "", props({"h": "w"})) == set()


def test_alternate_exchange_used_only_when_unroutable():
    d = make("main", "alt")
    x(d, "ae", "fanout")
    x(d, "x", "direct", **{"alternate-exchange": "ae"})
    bind(d, "ae", "alt")
    bind(d, "x", "main", "k")
    assert routed(d, "x", "k") == {"main"}
    assert routed(d, "x", "nope") == {"alt"}


def test_route_follows_binding_removal_on_exchange_delete():
    d = make("q")
    x(d, "mid", "fanout")
    bind(d, "amq.fanout", "mid", kind="exchange")
    bind(d, "mid", "q")
    assert routed(d, "amq.fanout", "") == {"q"}
    d.apply_all(d.plan_exchange_delete(V, "mid", False))
    assert routed(d, "amq.fanout", "") == set()
    assert d.bindings(V) == []


def test_route_unknown_vhost_or_exchange_is_empty():
    d = make("q")
    assert d.route("nope", "", "q", EMPTY_PROPS) == ()
    assert d.route(V, "nope", "q", EMPTY_PROPS) == ()
