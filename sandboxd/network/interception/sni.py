"""The server name of a TLS ClientHello (transparent capture: the name a client that ignores the
proxy variables connects to). A bounded parser: it never reads past the bytes it is given, takes at
most one record, and answers None for anything it does not understand."""

from __future__ import annotations

from sandboxd.policy.domains import host_name

MAX_HELLO = 16 * 1024                  # bytes of a ClientHello the proxy waits for
_HANDSHAKE, _CLIENT_HELLO, _SERVER_NAME, _HOST_NAME = 0x16, 0x01, 0x0000, 0x00


class _Short(Exception):
    """The bytes end before the structure does."""


def _take(data: bytes, at: int, size: int) -> tuple[bytes, int]:
    if at + size > len(data):
        raise _Short
    return data[at:at + size], at + size


def _number(data: bytes, at: int, size: int) -> tuple[int, int]:
    raw, at = _take(data, at, size)
    return int.from_bytes(raw, "big"), at


def server_name(client_hello: bytes) -> str | None:
    """The host name in the SNI extension of the ClientHello that starts ``client_hello``, lower
    case (policy.domains.host_name); None when there is none, it is not a host name, or the bytes
    are not (yet) a whole ClientHello."""
    try:
        return _server_name(client_hello[:MAX_HELLO])
    except _Short:
        return None


def needs_more(client_hello: bytes) -> bool:
    """Whether ``client_hello`` is the start of a TLS record not yet whole (wait for more bytes)."""
    if len(client_hello) < 5:
        return client_hello[:1] in (b"", bytes([_HANDSHAKE]))
    return client_hello[0] == _HANDSHAKE and len(client_hello) < min(5 + int.from_bytes(client_hello[3:5], "big"),
                                                                       MAX_HELLO)


def _server_name(data: bytes) -> str | None:
    kind, at = _number(data, 0, 1)
    _, at = _take(data, at, 2)                          # record version
    length, at = _number(data, at, 2)
    record, _ = _take(data, at, length)
    message, at = _number(record, 0, 1)
    if kind != _HANDSHAKE or message != _CLIENT_HELLO:
        return None
    body_length, at = _number(record, at, 3)
    body, _ = _take(record, at, body_length)
    at = 2 + 32                                         # client version, random
    session, at = _number(body, at, 1)
    at += session
    suites, at = _number(body, at, 2)
    at += suites
    compressions, at = _number(body, at, 1)
    at += compressions
    extensions_length, at = _number(body, at, 2)
    extensions, _ = _take(body, at, extensions_length)
    at = 0
    while at < len(extensions):
        kind, at = _number(extensions, at, 2)
        size, at = _number(extensions, at, 2)
        content, at = _take(extensions, at, size)
        if kind != _SERVER_NAME:
            continue
        list_length, inner = _number(content, 0, 2)
        names, _ = _take(content, inner, list_length)
        inner = 0
        while inner < len(names):
            name_type, inner = _number(names, inner, 1)
            name_length, inner = _number(names, inner, 2)
            name, inner = _take(names, inner, name_length)
            if name_type == _HOST_NAME:
                try:
                    return host_name(name.decode("ascii"))
                except UnicodeDecodeError:
                    return None
        return None
    return None


__all__ = ["MAX_HELLO", "needs_more", "server_name"]
