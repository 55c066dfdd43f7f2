"""Where MQTT state sits on the shards: the KV spaces (shard/kvstore.py) and the shard of each key.

Used by the frontends (frontend/mqtt/) to address a shard, and by the node at boot to put every
key in the log of the shard that owns it for this shard count (broker/kv_layout.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

# KV spaces (shard/kvstore.py)
RETAINED = "mqtt.retained"
SESSIONS = "mqtt.session"
# Marks of the QoS 2 publishes of persistent sessions (key: client id; marks: packet ids received and
# not yet released), kept by every shard that stored such a message (contract MARKED_PUBLISH).
INBOUND2 = "mqtt.in2"
# Marks of the QoS 2 deliveries a persistent session's client has PUBREC'd and not yet PUBCOMP'd (key: client
# id; marks: packet ids), on the shard of the session queue, written with the message's ack (MARKED_ACK).
OUTBOUND2 = "mqtt.out2"
SPACES = (RETAINED, SESSIONS, INBOUND2, OUTBOUND2)


def retained_shard(vhost: str, shard_count: int) -> int:
    """The shard keeping a vhost's retained messages (all in one store: a SUBSCRIBE scans it)."""
    return zlib.crc32(f"{vhost}\0{RETAINED}".encode()) % max(1, shard_count)


def session_shard(vhost: str, client_id: str, shard_count: int) -> int:
    return zlib.crc32(f"{vhost}\0{SESSIONS}\0{client_id}".encode()) % max(1, shard_count)


SESSION_QUEUE_PREFIX = "mqtt-subscription-"


def session_queue(client_id: str) -> str:
    """The durable queue of a persistent session (clean session 0), RabbitMQ's name for it."""
    return f"{SESSION_QUEUE_PREFIX}{client_id}qos1"


def kv_owner(vhost: str, space: str, key: str, shard_count: int,
             queue_shard: Callable[[str, str], int | None]) -> int | None:
    """The shard whose log keeps ``key`` of ``space`` (broker/kv_layout.py): None where the key
    says nothing of it (an inbound QoS 2 mark stays with the shard that stored the message), -1
    for none (the QoS 2 marks of a session queue that no longer exists)."""
    if space == SESSIONS:
        return session_shard(vhost, key, shard_count)
    if space == RETAINED:
        return retained_shard(vhost, shard_count)
    if space == OUTBOUND2:
        shard = queue_shard(vhost, session_queue(key))
        return -1 if shard is None else shard
    return None
