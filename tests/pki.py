"""Certificates made in the tests with the `cryptography` package (EC P-256, SHA-256)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NOW = datetime.datetime.now(datetime.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue_cert(subject: str, issuer_key, issuer_name, *, ca: bool = False, expired: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = (NOW - datetime.timedelta(days=10), NOW - datetime.timedelta(days=1)) if expired else (
        NOW - datetime.timedelta(minutes=5), NOW + datetime.timedelta(days=1))
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = b.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def write_pem(path, key, cert) -> tuple[str, str]:
    kp, cp = path.with_suffix(".key"), path.with_suffix(".pem")
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cp), str(kp)


def make_pki(d: Path) -> dict:
    """A CA, another CA, and certificates: server (localhost, 127.0.0.1), client (CN guest), expired client,
    a client of the other CA. Paths of PEM files (cert, key) by role."""
    ca_key, ca = issue_cert("ShardMQ test CA", None, None, ca=True)
    other_key, other_ca = issue_cert("Some other CA", None, None, ca=True)
    files = {"ca": write_pem(d / "ca", ca_key, ca)[0], "other_ca": write_pem(d / "other", other_key, other_ca)[0]}
    files["server"] = write_pem(d / "server", *issue_cert("localhost", ca_key, ca.subject, server=True))
    files["client"] = write_pem(d / "client", *issue_cert("guest", ca_key, ca.subject))
    files["expired_client"] = write_pem(d / "expired", *issue_cert("guest", ca_key, ca.subject, expired=True))
    files["stranger"] = write_pem(d / "stranger", *issue_cert("guest", other_key, other_ca.subject))
    return files


