"""MQTT topic names and filters: validation (4.7), matching, and the mapping to AMQP topic routing keys.

Mapping as RabbitMQ's MQTT plugin: ``/`` and ``.`` swap places (topic ``a/b.c`` is
routing key ``a.b/c``), a ``+`` level is ``*``, ``#`` stays ``#``; MQTT publishes go
to ``amq.topic`` with that routing key.
"""

from __future__ import annotations

_SWAP = str.maketrans("/.", "./")
MAX_TOPIC_BYTES = 65535


def valid_topic_name(topic: str) -> bool:
    """A PUBLISH topic: at least one character, no wildcards [MQTT-4.7.3-1], [MQTT-3.3.2-2]."""
    return bool(topic) and "+" not in topic and "#" not in topic and len(topic.encode()) <= MAX_TOPIC_BYTES


def valid_topic_filter(topic_filter: str) -> bool:
    """``#`` only as the whole last level, ``+`` only as a whole level [MQTT-4.7.1-2], [MQTT-4.7.1-3]."""
    if not topic_filter:
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def topic_to_key(topic: str) -> str:
    return topic.translate(_SWAP)


def filter_to_key(topic_filter: str) -> str:
    return "/".join("*" if level == "+" else level for level in topic_filter.split("/")).translate(_SWAP)


def key_to_topic(routing_key: str) -> str:
    return routing_key.translate(_SWAP)


def matches(topic_filter: str, topic: str) -> bool:
    """Whether a filter matches a topic name, with the ``$`` rule [MQTT-4.7.2-1]."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f = topic_filter.split("/")
    t = topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True  # also matches the parent level ("a/#" matches "a")
        if i >= len(t):
            return False
        if level != "+" and level != t[i]:
            return False
    return len(f) == len(t)
