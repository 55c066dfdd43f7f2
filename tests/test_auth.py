"""PLAIN and AMQPLAIN authentication, password hashes, loopback-only users."""

from __future__ import annotations

import base64
import hashlib
from io import BytesIO

import pytest
from amqp.serialization import _write_table

from broker.amqp.errors import AMQPConnectionError
from broker.auth import authenticate, check_password, check_vhost_access, user_can_access_vhost
from broker.definitions import Definitions
from broker.passwords import hash_password

REFUSED_PLAIN = "Login was refused using authentication mechanism PLAIN. For details see the broker logfile."


@pytest.fixture
def defs() -> Definitions:
    d = Definitions()
    d.apply_all(d.default_user_ops("guest", "guest"))
    d.apply_all(d.default_user_ops("alice", "s3cret"))
    return d


def amqplain(login: str, password: str) -> bytes:
    """What py-amqp (kombu) sends: the field table without its length prefix."""
    buf = BytesIO()
    _write_table({b"LOGIN": login, b"PASSWORD": password}, buf.write, [])
    return buf.getvalue()[4:]


def test_hash_is_rabbitmq_sha256_format():
    h = hash_password("pw")
    raw = base64.b64decode(h)
    assert len(raw) == 36
    assert raw[4:] == hashlib.sha256(raw[:4] + b"pw").digest()
    assert check_password(h, "pw") and check_password(h, b"pw")
    assert not check_password(h, "PW")
    assert hash_password("pw") != hash_password("pw")  # salted


def test_check_password_accepts_a_rabbitmq_export_hash():
    salt = b"\x90\x8d\xc6\x0a"
    stored = base64.b64encode(salt + hashlib.sha256(salt + b"test12").digest()).decode()
    assert check_password(stored, "test12")
    assert not check_password("not base64!", "x")
    assert not check_password(base64.b64encode(b"short").decode(), "x")


def test_plain(defs):
    assert authenticate(defs, "PLAIN", b"\0alice\0s3cret", peer_is_loopback=False) == "alice"
    assert authenticate(defs, "PLAIN", b"authz\0alice\0s3cret", peer_is_loopback=False) == "alice"
    assert authenticate(defs, "PLAIN", b"\0guest\0guest", peer_is_loopback=True) == "guest"


@pytest.mark.parametrize("response", [b"\0alice\0wrong", b"\0bob\0s3cret", b"garbage", b"\0alice", b"",
                                      b"\0\xff\xfe\0x"])
def test_plain_refused(defs, response):
    with pytest.raises(AMQPConnectionError) as info:
        authenticate(defs, "PLAIN", response, peer_is_loopback=True)
    assert (info.value.code, info.value.text) == (403, REFUSED_PLAIN)
    assert info.value.reply_text.startswith("ACCESS_REFUSED - Login was refused")


def test_amqplain(defs):
    assert authenticate(defs, "AMQPLAIN", amqplain("alice", "s3cret"), peer_is_loopback=False) == "alice"
    with pytest.raises(AMQPConnectionError) as info:
        authenticate(defs, "AMQPLAIN", amqplain("alice", "nope"), peer_is_loopback=False)
    assert info.value.code == 403
    assert "mechanism AMQPLAIN" in info.value.text
    with pytest.raises(AMQPConnectionError):
        authenticate(defs, "AMQPLAIN", b"\x05LOGIN", peer_is_loopback=False)


def test_guest_only_from_loopback(defs):
    with pytest.raises(AMQPConnectionError) as info:
        authenticate(defs, "PLAIN", b"\0guest\0guest", peer_is_loopback=False)
    assert (info.value.code, info.value.text) == (403, REFUSED_PLAIN)
    assert authenticate(defs, "PLAIN", b"\0guest\0guest", peer_is_loopback=False, loopback_users=()) == "guest"
    with pytest.raises(AMQPConnectionError):
        authenticate(defs, "PLAIN", b"\0alice\0s3cret", peer_is_loopback=False, loopback_users=["alice"])


def test_unknown_mechanism(defs):
    with pytest.raises(AMQPConnectionError) as info:
        authenticate(defs, "EXTERNAL", b"", peer_is_loopback=True)
    assert info.value.code == 403
    assert info.value.text == "unknown authentication mechanism 'EXTERNAL'"


def test_vhost_access(defs):
    defs.apply(["vhost.put", "other"])
    assert user_can_access_vhost(defs, "alice", "/")
    assert not user_can_access_vhost(defs, "alice", "other")
    assert not user_can_access_vhost(defs, "nobody", "/")
    check_vhost_access(defs, "alice", "/")
    with pytest.raises(AMQPConnectionError) as info:
        check_vhost_access(defs, "alice", "other")
    assert (info.value.code, info.value.text) == (530, "access to vhost 'other' refused for user 'alice'")
    with pytest.raises(AMQPConnectionError) as info:
        check_vhost_access(defs, "alice", "missing")
    assert info.value.code == 530
    defs.apply(["permission.put", "alice", "other", {}])
    assert user_can_access_vhost(defs, "alice", "other")
    defs.apply(["vhost.delete", "other"])
    assert not user_can_access_vhost(defs, "alice", "other")
    defs.apply(["user.delete", "alice"])
    with pytest.raises(AMQPConnectionError):
        authenticate(defs, "PLAIN", b"\0alice\0s3cret", peer_is_loopback=True)
