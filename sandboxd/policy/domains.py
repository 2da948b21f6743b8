"""Domain names of ``allowed_domains``: what a policy may name, and what the egress proxy matches.

One rule for both ends: a policy names ASCII host names (``pypi.org``, or ``*.pypi.org`` for its
subdomains, or ``*`` alone for any name), and the proxy (network.egress_proxy) lets a request through only when its name is
such a host name too, matched as text and asked of DNS (network.dns) as the same text. A name in
another script is given as its A-label (IDNA: ``xn--`` and punycode), which is what DNS holds;
anything else that is not ASCII is refused, saying so, with the A-label when the standard library
can compute it. Not Unicode names matched after some normalization: ``isalnum`` and ``lower``
take digits and letters of every script (``١٢.com``, ``pÿpi.org``, the Kelvin sign that lowers
to ``k``), and each resolver library encodes them its own way (IDNA 2003 or 2008, UTS 46).

A host name here: labels of ``a-z``, ``0-9`` and ``-`` (lower case; not starting or ending with
``-``), 1 to 63 characters each, at most 253 in all, the last not all digits (that is an IPv4
address, which goes in ``allowed_hosts``); a label starting ``xn--`` is an A-label, whose punycode
must decode to a name that is not ASCII and encode back to the same label.
"""

from __future__ import annotations

from sandboxd.errors import InvalidPolicy

MAX_NAME = 253                      # characters of a name without its final dot (255 on the wire)
MAX_LABEL = 63
WILDCARD = "*."
# An allowed_domains entry alone: any host name, through the proxy (refused ranges, metadata and
# bare IP addresses still refused). Without it, naming one credential would close the rest.
ANY_NAME = "*"
_LDH = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
ACE_PREFIX = "xn--"
# Characters IDNA 2003 (the standard library's codec) maps where IDNA 2008 keeps them, so the
# A-label it computes would be another name's (faß.de: fass.de, not xn--fa-hia.de): no suggestion.
_DEVIATIONS = frozenset("\u00df\u03c2\u200c\u200d")
_EXAMPLE = "give a name like pypi.org, or *.pypi.org for its subdomains"


def host_name(text: str) -> str | None:
    """``text`` (one final dot allowed, any case) as a host name of this module's rule, in lower
    case without the dot; None if it is not one."""
    name = text[:-1] if text.endswith(".") else text
    if not name.isascii() or not 0 < len(name) <= MAX_NAME:
        return None
    name = name.lower()
    labels = name.split(".")
    if labels[-1].isdigit():
        return None
    for label in labels:
        if not 0 < len(label) <= MAX_LABEL or not _LDH.issuperset(label) or label[0] == "-" or label[-1] == "-":
            return None
        if label.startswith(ACE_PREFIX) and not _is_a_label(label):
            return None
    return name


def _is_a_label(label: str) -> bool:
    try:
        decoded = label[len(ACE_PREFIX):].encode("ascii").decode("punycode")
    except UnicodeError:
        return False
    return not decoded.isascii() and decoded.encode("punycode").decode("ascii") == label[len(ACE_PREFIX):]


def allowed_domain(text: str) -> str:
    """One entry of ``allowed_domains`` as the policy keeps it (trimmed, lower case, without a
    final dot), or InvalidPolicy saying what to give instead."""
    entry = text.strip()
    if entry == ANY_NAME:
        return ANY_NAME
    wildcard = entry.startswith(WILDCARD)
    bare = entry[len(WILDCARD):] if wildcard else entry
    if not bare.isascii():
        raise InvalidPolicy(f"allowed domain {text!r} is not ASCII: give it as DNS holds it, in A-labels "
                            "(IDNA: xn--...)" + _suggestion(bare, wildcard))
    name = host_name(bare)
    if name is None:
        raise InvalidPolicy(f"allowed domain {text!r}: {_EXAMPLE} (letters, digits and hyphens, at most "
                            f"{MAX_LABEL} per label and {MAX_NAME} in all; an IP address goes in allowed_hosts; "
                            "an xn-- label must be an A-label)")
    if wildcard and len(name) > MAX_NAME - 2:
        raise InvalidPolicy(f"allowed domain {text!r}: no subdomain of a name of {len(name)} characters fits "
                            f"in {MAX_NAME}")
    return WILDCARD + name if wildcard else name


def domain_matches(host: str, pattern: str) -> bool:
    """Whether host name ``host`` (``host_name``'s form) is one ``pattern`` (an allowed_domains
    entry) allows: ``*`` any, ``*.example.com`` its subdomains (not itself), else exactly."""
    if pattern == ANY_NAME:
        return True
    if pattern.startswith(WILDCARD):
        return host.endswith(pattern[1:])
    return host == pattern


def _suggestion(bare: str, wildcard: bool) -> str:
    """", e.g. 'xn--...'" when the standard library's IDNA codec gives an A-label that is surely
    this name's and a valid entry; "" otherwise."""
    if _DEVIATIONS & set(bare):
        return ""
    try:
        encoded = bare.encode("idna").decode("ascii")
    except UnicodeError:
        return ""
    name = host_name(encoded)
    if name is None or (wildcard and len(name) > MAX_NAME - 2):
        return ""
    return f", e.g. {(WILDCARD if wildcard else '') + name!r}"
