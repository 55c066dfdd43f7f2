"""Sans-IO PROXY protocol v1 and v2 (haproxy's ``send-proxy`` / ``send-proxy-v2``): parse and encode the header.

A load balancer in front of the broker prepends one header to a connection saying who the
client really is. ``ProxyHeaderParser.feed`` takes bytes until the header is complete and
returns it with the bytes that followed it (the client's protocol). Also used by a cluster
follower that proxies client connections to the leader (``encode_v2``), so it lives in broker/.
Spec: https://www.haproxy.org/download/2.8/doc/proxy-protocol.txt
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_PREFIX = b"PROXY "
V1_MAX = 107  # the longest v1 line, CRLF included
_V2_HEAD = struct.Struct(">BBH")
_V4 = struct.Struct(">4s4sHH")
_V6 = struct.Struct(">16s16sHH")


class ProxyProtocolError(Exception):
    """Not a PROXY protocol header: the connection is refused."""


@dataclass(frozen=True)
class ProxyHeader:
    """source/dest are (host, port), or None for LOCAL / UNKNOWN (the connection's own addresses count)."""
    version: int
    source: tuple[str, int] | None
    dest: tuple[str, int] | None


class ProxyHeaderParser:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> tuple[ProxyHeader, bytes] | None:
        """(header, bytes after it) once complete, None while more is needed; ProxyProtocolError if invalid."""
        buf = self._buf = self._buf + data
        n = len(buf)
        if buf[:min(n, 12)] == V2_SIGNATURE[:min(n, 12)]:
            if n < 16:
                return None
            return self._v2(buf)
        if buf[:min(n, 6)] != V1_PREFIX[:min(n, 6)]:
            raise ProxyProtocolError("no PROXY protocol header")
        end = buf.find(b"\r\n")
        if end < 0:
            if n >= V1_MAX:
                raise ProxyProtocolError("PROXY v1 line too long")
            return None
        return _v1(buf[:end]), buf[end + 2:]

    def _v2(self, buf: bytes) -> tuple[ProxyHeader, bytes] | None:
        ver_cmd, family, length = _V2_HEAD.unpack_from(buf, 12)
        if ver_cmd >> 4 != 2 or ver_cmd & 0x0F > 1:
            raise ProxyProtocolError(f"PROXY v2: bad version/command {ver_cmd:#x}")
        if len(buf) < 16 + length:
            return None
        body, rest = buf[16:16 + length], buf[16 + length:]
        if ver_cmd & 0x0F == 0:  # LOCAL: a health check of the balancer itself
            return ProxyHeader(2, None, None), rest
        proto = family & 0x0F
        if family >> 4 == 1 and proto in (1, 2):  # TCP/UDP over IPv4
            if length < _V4.size:
                raise ProxyProtocolError("PROXY v2: address block too short")
            src, dst, sport, dport = _V4.unpack_from(body)
        elif family >> 4 == 2 and proto in (1, 2):  # over IPv6
            if length < _V6.size:
                raise ProxyProtocolError("PROXY v2: address block too short")
            src, dst, sport, dport = _V6.unpack_from(body)
        else:  # UNSPEC or unix sockets: keep the connection's own addresses
            return ProxyHeader(2, None, None), rest
        return ProxyHeader(2, (str(ipaddress.ip_address(src)), sport), (str(ipaddress.ip_address(dst)), dport)), rest


def _v1(line: bytes) -> ProxyHeader:
    try:
        parts = line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise ProxyProtocolError("PROXY v1: not ASCII") from None
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return ProxyHeader(1, None, None)
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyProtocolError(f"PROXY v1: malformed line {line[:V1_MAX]!r}")
    try:
        src, dst = ipaddress.ip_address(parts[2]), ipaddress.ip_address(parts[3])
        sport, dport = int(parts[4]), int(parts[5])
    except ValueError:
        raise ProxyProtocolError(f"PROXY v1: malformed line {line[:V1_MAX]!r}") from None
    if (src.version == 4) != (parts[1] == "TCP4") or not (0 <= sport <= 65535 and 0 <= dport <= 65535):
        raise ProxyProtocolError(f"PROXY v1: malformed line {line[:V1_MAX]!r}")
    return ProxyHeader(1, (str(src), sport), (str(dst), dport))


def encode_v1(source: tuple[str, int], dest: tuple[str, int]) -> bytes:
    fam = "TCP4" if ipaddress.ip_address(source[0]).version == 4 else "TCP6"
    return f"PROXY {fam} {source[0]} {dest[0]} {source[1]} {dest[1]}\r\n".encode("ascii")


def encode_v2(source: tuple[str, int], dest: tuple[str, int]) -> bytes:
    src, dst = ipaddress.ip_address(source[0]), ipaddress.ip_address(dest[0])
    if src.version == 4:
        body = _V4.pack(src.packed, dst.packed, source[1], dest[1])
        family = 0x11
    else:
        body = _V6.pack(src.packed, dst.packed, source[1], dest[1])
        family = 0x21
    return V2_SIGNATURE + _V2_HEAD.pack(0x21, family, len(body)) + body
