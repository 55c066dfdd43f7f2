"""The frontend's listeners: which protocol answers on which port (as uvicorn's table of protocol classes).

A row names the setting holding its port (0 = off) and the Session class that
terminates one connection, as ``module:Class``; the worker imports only the rows it
starts, so a protocol is added here without the worker knowing it. ``FORWARDED``
maps the kinds of node-forwarded payloads (contract FORWARDED) to the protocol
function that handles them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Listener:
    protocol: str
    port_setting: str  # key in the node's settings; 0 = this listener is off
    session: str  # "module:Class", called with the worker for each accepted connection
    tls: bool = False  # served with broker/tls.py's context; off when no certificate is configured


LISTENERS: tuple[Listener, ...] = (
    Listener("amqp", "port", "frontend.amqp.connection:AMQPConnection"),
    Listener("mqtt", "mqtt_port", "frontend.mqtt.connection:MQTTConnection"),
    Listener("amqps", "amqps_port", "frontend.amqp.connection:AMQPConnection", tls=True),
    Listener("mqtts", "mqtts_port", "frontend.mqtt.connection:MQTTConnection", tls=True),
)

FORWARDED: dict[str, str] = {
    "reply": "frontend.amqp.direct_reply:deliver_reply",  # direct reply-to answered on another frontend
    "mqtt.takeover": "frontend.mqtt.connection:forwarded_takeover",  # a client id connected elsewhere
    "mqtt.taken": "frontend.mqtt.connection:forwarded_taken",  # ... and that frontend flushed its session writes
}


def load(path: str) -> Any:
    """The object a ``module:name`` path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
