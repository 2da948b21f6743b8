"""IPv4 addresses, networks and ports given as text (policies, launch specs, the daemon's
configuration), read one way: the standard library's ``ipaddress``, and ports in ASCII digits.

Why not ``str.isdigit`` and ``int``: both accept digits of every script (``int("٤٤٣") == 443``),
``int`` also a sign, spaces and underscores, so a hand-made check lets through text that other
tools (nft, a resolver library, a log reader) read differently or not at all. ``ipaddress``
refuses non-ASCII digits, leading zeros (``010`` is octal to inet_aton), empty octets and
anything but four of them. Each function raises ``ValueError`` saying what is wrong; the callers
put it in their own words (InvalidPolicy: INVALID_ARGUMENT, or a configuration error).
"""

from __future__ import annotations

import ipaddress

__all__ = ["ipv4_address", "ipv4_network", "port", "port_range"]


def ipv4_address(text: object) -> ipaddress.IPv4Address:
    """``text`` as an IPv4 address in dotted-quad form, like 192.0.2.53."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not text")
    return ipaddress.IPv4Address(text)


def ipv4_network(text: object) -> ipaddress.IPv4Network:
    """``text`` as an IPv4 address (a /32) or network in CIDR form, like 198.51.100.0/24. Host bits
    may be set (198.51.100.7/24 is 198.51.100.0/24), as nft reads it."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not text")
    address, slash, prefix = text.partition("/")
    if slash and not (prefix.isascii() and prefix.isdigit()):
        raise ValueError(f"the prefix length {prefix!r} must be a number from 0 to 32 in ASCII digits")
    ipv4_address(address)                    # its own message: which octet is wrong, and why
    return ipaddress.IPv4Network(text, strict=False)


def port(text: str) -> int:
    """``text`` as a TCP port: 1 to 65535 in ASCII digits (no sign, space or underscore)."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"port {text!r} must be a number from 1 to 65535 in ASCII digits")
    number = int(text)
    if not 0 < number < 65536:
        raise ValueError(f"port {text!r} is out of range: ports go from 1 to 65535")
    return number


def port_range(text: str) -> tuple[int, int]:
    """"443" or "8000-8100" as (low, high), low <= high."""
    low, dash, high = text.partition("-")
    first = port(low)
    last = port(high) if dash else first
    if last < first:
        raise ValueError(f"port range {text!r} goes downward: give the lower port first")
    return first, last
