"""Authentication of AMQP connections against the users in the definitions.

Passwords are stored the way RabbitMQ's rabbit_password_hashing_sha256 does:
``base64(salt + sha256(salt + password))`` with a 4-byte random salt, so a
definitions export from RabbitMQ can be imported as is.

Mechanisms: PLAIN (``"\\0user\\0pass"``) and AMQPLAIN (an AMQP field table with
LOGIN and PASSWORD, sent without its 4-byte length prefix, as pika and
py-amqp do). Every failure is RabbitMQ's 403 ACCESS_REFUSED connection error;
a user listed in loopback_users may only log in from a loopback address.
"""

from __future__ import annotations

import ipaddress
import struct

from pamqp import decode

from broker.amqp.errors import AMQPConnectionError
from broker.definitions import Definitions, User
from broker.passwords import matches

MECHANISMS = "PLAIN AMQPLAIN"
ACCESS_REFUSED = 403
NOT_ALLOWED = 530

_CONNECTION_START_OK = (10, 11)
_CONNECTION_OPEN = (10, 40)
_LENGTH = struct.Struct(">I")


def check_password(user: User | str, password: str | bytes) -> bool:
    """Whether password matches a user (or a stored hash)."""
    return matches(user.password_hash if isinstance(user, User) else user, password)


def _refused(mechanism: str) -> AMQPConnectionError:
    return AMQPConnectionError(
        ACCESS_REFUSED,
        f"Login was refused using authentication mechanism {mechanism}. For details see the broker logfile.",
        *_CONNECTION_START_OK,
    )


def _parse_plain(response: bytes) -> tuple[str, bytes] | None:
    parts = response.split(b"\0")
    if len(parts) != 3:
        return None
    _authzid, user, password = parts
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


def _parse_amqplain(response: bytes) -> tuple[str, bytes] | None:
    table = None
    # Clients send the table without its length prefix; accept one that has it too.
    for data in (_LENGTH.pack(len(response)) + response, response):
        try:
            _, table = decode.field_table(data)
            break
        except (ValueError, UnicodeDecodeError):
            continue
    if not table:
        return None
    user, password = table.get("LOGIN"), table.get("PASSWORD")
    if isinstance(user, bytes):
        user = user.decode("utf-8", "replace")
    if isinstance(password, str):
        password = password.encode()
    if not isinstance(user, str) or not isinstance(password, bytes):
        return None
    return user, password


def is_loopback_peer(peer: object) -> bool:
    """Whether a client's peer address (a socket's (host, port, ...) tuple; None for a unix socket)
    is on loopback: the loopback_users rule of every protocol and of the HTTP API."""
    try:
        host = peer[0] if isinstance(peer, tuple) else None
        if host is None:
            return True  # unix socket
        addr = ipaddress.ip_address(host.split("%", 1)[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return addr.is_loopback
    except (ValueError, TypeError, IndexError):
        return False


def authenticate(defs: Definitions, mechanism: str, response: bytes, peer_is_loopback: bool,
                 loopback_users: tuple[str, ...] | list[str] | None = None) -> str:
    """The user name a connection.start-ok authenticates, or a 403 AMQPConnectionError.

    loopback_users defaults to ``defs.loopback_users``.
    """
    if mechanism == "PLAIN":
        creds = _parse_plain(bytes(response))
    elif mechanism == "AMQPLAIN":
        creds = _parse_amqplain(bytes(response))
    else:
        raise AMQPConnectionError(ACCESS_REFUSED, f"unknown authentication mechanism '{mechanism}'",
                                  *_CONNECTION_START_OK)
    if creds is None:
        raise _refused(mechanism)
    name, password = creds
    user = defs.users.get(name)
    if user is None or not check_password(user, password):
        raise _refused(mechanism)
    restricted = defs.loopback_users if loopback_users is None else loopback_users
    if name in restricted and not peer_is_loopback:
        raise _refused(mechanism)
    return name


def user_can_access_vhost(defs: Definitions, user: str, vhost: str) -> bool:
    return vhost in defs.vhosts and vhost in defs.permissions.get(user, {})


def check_vhost_access(defs: Definitions, user: str, vhost: str) -> None:
    """Raise RabbitMQ's connection.open refusal unless user may use vhost."""
    if vhost not in defs.vhosts:
        raise AMQPConnectionError(NOT_ALLOWED, f"vhost {vhost} not found", *_CONNECTION_OPEN)
    if not user_can_access_vhost(defs, user, vhost):
        raise AMQPConnectionError(NOT_ALLOWED, f"access to vhost '{vhost}' refused for user '{user}'",
                                  *_CONNECTION_OPEN)
