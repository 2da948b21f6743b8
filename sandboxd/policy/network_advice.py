"""The policy advisor: the one rule that would let a refused or held request through.

Pure and deterministic. Its proposal is shown on a network question's card, in the body of the
proxy's 403 and in the PermissionDenied event, so that even under ``unlisted = refuse`` a person
learns the one-line fix. A proposal is as narrow as is useful: the exact host name for an unlisted
host (never a wildcard, never ``*``); for an endpoint miss the request's own method and path, with
each segment that looks like an identifier (a number, a hash, a UUID, a long token) made ``*`` so
the next issue or commit is covered too. Never ``**``, never any method: a method that is not
letters (``*`` above all, which a rule reads as any method) gets no proposal, nor a path holding a
character outside ``_SAFE``. An unlisted host on a port other than 80 or 443 gets no proposal
either: an allowed_domains entry allows its host on every port, far more than the one port asked
about (the person may still allow it once, or give a rule of their own).
"""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.network import MAX_GLOB, EndpointRule, NetworkRules, normalize_path, parse_endpoint

_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TOKEN = _DIGITS | _LETTERS | frozenset("_-")
# What a proposed path may hold: it is shown on cards, in 403 bodies and events, and pasted into
# command lines (no quote, no shell or markup character).
_SAFE = _DIGITS | _LETTERS | frozenset("-._~/*%:@+,=")
_MIN_HEX = 7                            # a short git hash
_MIN_TOKEN = 16
_UUID_GROUPS = (8, 4, 4, 4, 12)
# The ports a domain proposal may answer: an allowed domain allows every port, which is what a
# question about the web's own ports expects, not one about any other.
WEB_PORTS = frozenset((80, 443))


class Proposal(Record):
    """A rule to add: ``kind`` "domain" (``rule`` is an allowed_domains entry) or "endpoint"
    (``rule`` is an allowed_endpoints entry); ``why`` says what it answers, for a person."""

    kind: str
    rule: str
    why: str


def propose(host: str, port: int, method: str, path: str, rules: NetworkRules) -> Proposal | None:
    """The rule that lets ``method`` on ``path`` (a request target; "" for a tunnel) to ``host``:
    ``port`` through under ``rules``; None when there is none to offer (a path endpoint rules
    cannot match: refused as ambiguous, or longer than a rule may be)."""
    if not rules.allowed(host, port):
        if port not in WEB_PORTS:
            return None                 # a domain would allow every port, not only this one
        return Proposal("domain", host, f"{host} is not among the allowed domains")
    if not (method.isascii() and method.isalpha()):
        return None                     # "*" would read as any method; other tokens no rule names
    normal = normalize_path(path)
    if normal is None:
        return None
    glob = "/".join("*" if _identifier(segment) or "*" in segment else segment for segment in normal.split("/"))
    if len(glob) > MAX_GLOB or not _SAFE.issuperset(glob):
        return None
    text = EndpointRule(host, (method,), glob).text()
    try:
        # Its own parse is the judge: a method no rule can name (lower case, not a token) gives none.
        if parse_endpoint(text).text() != text:
            return None
    except InvalidPolicy:
        return None
    count = len(rules.ruled(host))
    return Proposal("endpoint", text,
                    f"{method} {normal} matches none of the {count} endpoint rule{'s' * (count != 1)} for {host}")


def _identifier(segment: str) -> bool:
    """Whether a path segment looks like an identifier rather than a name of the API."""
    if not segment:
        return False
    if _DIGITS.issuperset(segment):
        return True
    if len(segment) >= _MIN_HEX and _HEX.issuperset(segment):
        return True
    if _uuid(segment):
        return True
    return (len(segment) >= _MIN_TOKEN and _TOKEN.issuperset(segment)
            and bool(_DIGITS & set(segment)) and bool(_LETTERS & set(segment)))


def _uuid(segment: str) -> bool:
    groups = segment.split("-")
    return (tuple(map(len, groups)) == _UUID_GROUPS
            and all(_HEX.issuperset(group) for group in groups))


__all__ = ["WEB_PORTS", "Proposal", "propose"]
