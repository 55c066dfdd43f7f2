"""The TLS context of the TLS listeners (AMQPS, MQTTS, WSS in the frontends; HTTPS in the node): TLS 1.2+.

Built once per process (each frontend, the node) from the settings (``--tls-cert``, ``--tls-key``,
``--tls-ca``, ``--tls-verify-peer``; checked at start-up by ``broker.config.tls_problem``).
"""

from __future__ import annotations

import ssl


def reload_certificate(ctx: ssl.SSLContext, settings: dict) -> None:
    """Re-read the certificate, key and CA into the same context (SIGHUP): new handshakes use them,
    established connections keep theirs. Raises ssl.SSLError/OSError and leaves the old ones on error."""
    ctx.load_cert_chain(settings["tls_cert"], settings["tls_key"])
    if settings.get("tls_ca"):
        ctx.load_verify_locations(settings["tls_ca"])


def server_context(settings: dict) -> ssl.SSLContext | None:
    """None when no certificate is configured (the TLS listeners stay off)."""
    cert, key = settings.get("tls_cert"), settings.get("tls_key")
    if not cert or not key:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # secure cipher defaults, no compression
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if settings.get("tls_ca"):
        ctx.load_verify_locations(settings["tls_ca"])
    if settings.get("tls_verify_peer"):
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_common_name(transport: object, settings: dict) -> str | None:
    """The CN of a client certificate the TLS listener verified (--tls-verify-peer), else None.

    It is the user of AMQP's EXTERNAL mechanism and of an MQTT CONNECT without a user name, as
    RabbitMQ's rabbitmq_auth_mechanism_ssl and ssl_cert_login do.
    """
    if not settings.get("tls_verify_peer") or transport is None:
        return None
    cert = transport.get_extra_info("peercert")  # type: ignore[attr-defined]
    for rdn in (cert or {}).get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None
