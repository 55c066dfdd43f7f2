"""Exchange and queue names as RabbitMQ takes them: any UTF-8 short string.

pamqp checks the exchange and queue names of every method it builds against a pattern
(``^[a-zA-Z0-9-_.:@#,/+ ]*$``). RabbitMQ takes any UTF-8 name up to 255 bytes, and so does the
node, which checks names itself (broker/definitions). Our parser never asks pamqp to check what
a client sends, but the replies we build with pamqp echo those names (queue.declare-ok,
basic.get-ok, basic.return), and a queue declared as ``é`` or ``q!`` got its declare-ok refused by
pamqp: a 541 that closed the client's connection (found by tests/test_fuzz.py). The wire format
bounds a name anyway (a shortstr), so the pattern becomes "any string" in this process.

Imported for its effect by broker/amqp/encoder.py.
"""

from __future__ import annotations

import re

from pamqp import constants

ANY_NAME = re.compile(r".*", re.DOTALL)

constants.DOMAIN_REGEX["exchange-name"] = ANY_NAME
constants.DOMAIN_REGEX["queue-name"] = ANY_NAME
