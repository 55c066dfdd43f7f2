"""Password hashes as RabbitMQ stores them (rabbit_password_hashing_sha256): base64(salt + sha256(salt + password)).

Kept apart from broker/auth.py so that definitions (which hash passwords when users are created)
and auth (which reads definitions to log clients in) import it without importing each other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os


def hash_password(password: str | bytes) -> str:
    pw = password.encode() if isinstance(password, str) else password
    salt = os.urandom(4)
    return base64.b64encode(salt + hashlib.sha256(salt + pw).digest()).decode("ascii")


def matches(stored: str, password: str | bytes) -> bool:
    """Whether password matches a stored hash (False for a malformed hash)."""
    pw = password.encode() if isinstance(password, str) else password
    try:
        raw = base64.b64decode(stored, validate=True)
    except (ValueError, TypeError):
        return False
    if len(raw) != 4 + 32:
        return False
    salt, digest = raw[:4], raw[4:]
    return hmac.compare_digest(hashlib.sha256(salt + pw).digest(), digest)
