"""How MQTT messages and sessions sit in the broker: stored properties, queue names, store placement.

An MQTT publish is stored like an AMQP one: published to ``amq.topic``, properties in
AMQP encoding (the contract's ``props_raw``). QoS 0 is delivery-mode 1, QoS 1/2 are
delivery-mode 2 (persistent), and the header ``x-mqtt-publish-qos`` keeps the exact QoS
(as RabbitMQ's MQTT plugin). A message published over AMQP has QoS 1 when persistent,
else 0.
"""

from __future__ import annotations

from pamqp import commands

from broker.amqp.properties import decode_headers, delivery_mode

# The KV spaces and the shard of each key (the node places the logs at boot with the same functions).
from broker.mqtt.placement import (  # noqa: F401
    INBOUND2,
    OUTBOUND2,
    RETAINED,
    SESSIONS,
    retained_shard,
    session_queue,
    session_shard,
)

EXCHANGE = "amq.topic"
QOS_HEADER = "x-mqtt-publish-qos"
PROPS = tuple(
    commands.Basic.Properties(delivery_mode=2 if qos else 1, headers={QOS_HEADER: qos}).marshal()
    for qos in range(3)
)
_QOS_MARK = QOS_HEADER.encode()

def qos_of(props_raw: bytes) -> int:
    """The QoS a stored message was published with."""
    if props_raw == PROPS[0]:
        return 0
    if props_raw == PROPS[1]:
        return 1
    if props_raw == PROPS[2]:
        return 2
    try:
        if _QOS_MARK in props_raw:
            value = (decode_headers(props_raw) or {}).get(QOS_HEADER)
            if isinstance(value, int) and 0 <= value <= 2:
                return value
        return 1 if delivery_mode(props_raw) == 2 else 0
    except ValueError:
        return 0


def transient_queue(client_id: str, frontend: int, conn_id: int) -> str:
    """The exclusive queue of a clean session: unique per connection, so a takeover never waits for it."""
    return f"mqtt-subscription-{client_id}-{frontend}.{conn_id}"
