"""Credentials held by the proxy: the phantom a sandbox holds, swapped for the real secret only in
requests to the credential's own upstream.

Inside the sandbox a credential's variable holds a phantom (``new_phantom``: worthless anywhere).
The intercepting proxy (network.interception) gives each request on a TLS connection whose
upstream certificate verified for ``host`` to ``CredentialSet.swap(host, port, headers)``: a
header of the credential's name that carries the phantom is replaced by the credential's own
header with the secret (docs/networks.md; design §2.4). Nothing else ever sees the secret: the
phantom elsewhere (another host or port, another header, the body, plain HTTP) is passed as is,
and what an upstream echoes back is scrubbed (``Scrubber``) before the sandbox reads it.

The secret lives in a ``Secret`` (a bytearray that prints as ``<secret>``, refuses pickling and
can be wiped): never in a Record, an exception, a log line or an event.
"""

from __future__ import annotations

import base64
import hmac
import os

from sandboxd.policy.network import CredentialSpec

PHANTOM_PREFIX = "sbxp_"
PHANTOM_BYTES = 25                     # 200 bits: 40 characters of base32
# Headers that belong to one hop (the sandbox's connection to the proxy), never passed upstream.
PROXY_HEADERS = frozenset({b"proxy-authorization", b"proxy-connection"})
_BASIC = b"basic "


def new_phantom() -> str:
    """A fresh phantom: ``sbxp_`` and 40 lower-case base32 characters (token68-safe, so it fits any
    header a client puts a token in)."""
    return PHANTOM_PREFIX + base64.b32encode(os.urandom(PHANTOM_BYTES)).decode("ascii").lower()


class Secret:
    """A credential's secret bytes. Prints as ``<secret>``; cannot be pickled or copied into a
    record; ``wipe`` zeroes it (best effort: Python may have made copies on the way in)."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes | bytearray) -> None:
        self._value = bytearray(value)

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Secret is never pickled or copied")

    def __len__(self) -> int:
        return len(self._value)

    def render(self, spec: CredentialSpec) -> bytes:
        """The header value that carries this secret for ``spec``: its template with ``{}`` filled,
        or, for Basic authentication, ``Basic base64(USER:secret)`` (``base64(secret)`` when the
        secret is ``user:pass`` itself)."""
        if spec.basic_user is not None:
            return b"Basic " + self._basic_token(spec)
        before, _, after = spec.template.partition("{}")
        return before.encode("ascii") + bytes(self._value) + after.encode("ascii")

    def forms(self, spec: CredentialSpec) -> tuple[bytes, ...]:
        """Every form of the secret a response must not carry back (``echo_forms``: as is, JSON-,
        percent-, HTML-escaped, inside base64 at any offset), and for Basic authentication the
        token the upstream got too."""
        forms = echo_forms(bytes(self._value))
        if spec.basic_user is not None:
            return forms + echo_forms(self._basic_token(spec))
        return forms

    def _basic_token(self, spec: CredentialSpec) -> bytes:
        user = spec.basic_user or ""
        plain = (user.encode("ascii") + b":" if user else b"") + bytes(self._value)
        return base64.b64encode(plain)

    def equals(self, other: "Secret") -> bool:
        """The same bytes (compared in constant time)."""
        return hmac.compare_digest(bytes(self._value), bytes(other._value))

    def wipe(self) -> None:
        for index in range(len(self._value)):
            self._value[index] = 0


def echo_forms(secret: bytes) -> tuple[bytes, ...]:
    """The forms an upstream may echo ``secret`` back in: as is; JSON-escaped (``\\/`` too, and
    ``\\uXXXX`` for every byte outside ASCII); percent-encoded (upper and lower case hex, ``+``
    for space); HTML-escaped (named, decimal and hex references for the quote); and the part of its
    base64 (standard and URL-safe) that stands for it whatever bytes surround it, at each of the
    three offsets the secret may start at within an encoded whole."""
    import html
    import json
    import urllib.parse

    text = secret.decode("latin-1")
    forms = {secret}
    escaped = json.dumps(text)[1:-1]
    forms |= {escaped.encode("ascii"), escaped.replace("/", "\\/").encode("ascii")}
    for quoted in (urllib.parse.quote_from_bytes(secret, safe=""), urllib.parse.quote_plus(text, safe="", encoding="latin-1")):
        forms |= {quoted.encode("ascii"), _lower_escapes(quoted).encode("ascii")}
    for quote in ("&#x27;", "&#39;", "&apos;"):
        forms.add(html.escape(text).replace("&#x27;", quote).encode("latin-1"))
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + secret)
        start, end = -(-8 * offset // 6), 8 * (offset + len(secret)) // 6
        core = encoded[start:end]
        forms |= {core, core.translate(_URLSAFE)}
    return tuple(sorted(form for form in forms if form))


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def _lower_escapes(quoted: str) -> str:
    """``quoted`` with each %XX escape's hex in lower case."""
    parts = quoted.split("%")
    return parts[0] + "".join("%" + part[:2].lower() + part[2:] for part in parts[1:])


class Credential:
    """One credential of a session: its public spec, its secret and the phantom that stands for it."""

    __slots__ = ("spec", "secret", "phantom")

    def __init__(self, spec: CredentialSpec, secret: Secret, phantom: str) -> None:
        self.spec, self.secret, self.phantom = spec, secret, phantom

    def __repr__(self) -> str:
        return f"Credential({self.spec.text()!r}, <secret>, {self.phantom!r})"

    def same(self, other: "Credential") -> bool:
        """Whether ``other`` is this credential: the same spec, phantom and secret."""
        return (self.spec == other.spec and self.phantom == other.phantom
                and self.secret.equals(other.secret))

    def replaces(self, value: bytes) -> bool:
        """Whether header ``value`` (of this credential's header) is the sandbox's use of the
        phantom: holds it (template form), or is Basic authentication whose password (or whole
        ``user:pass``, for ``;basic``) is the phantom."""
        phantom = self.phantom.encode("ascii")
        if self.spec.basic_user is None:
            return phantom in value
        if value[:len(_BASIC)].lower() != _BASIC:
            return False
        try:
            decoded = base64.b64decode(value[len(_BASIC):].strip(), validate=True)
        except ValueError:
            return False
        return decoded == phantom or decoded.partition(b":")[2] == phantom


class CredentialSet:
    """The credentials one proxy holds (one session's): an immutable snapshot, replaced whole on a
    change. Shared by the proxy's connections on its loop; holds no per-connection state."""

    __slots__ = ("_credentials",)

    def __init__(self, credentials: "tuple[Credential, ...] | list[Credential]" = ()) -> None:
        self._credentials = tuple(credentials)

    def __repr__(self) -> str:
        return f"CredentialSet({len(self._credentials)} credentials)"

    def __bool__(self) -> bool:
        return bool(self._credentials)

    def for_upstream(self, host: str, port: int) -> tuple[Credential, ...]:
        """The credentials of exactly ``host``:``port`` (a host name as matched: lower case)."""
        return tuple(c for c in self._credentials if (c.spec.host, c.spec.port) == (host, port))

    def swap(self, host: str, port: int,
             headers: "list[tuple[bytes, bytes]]") -> tuple[list[tuple[bytes, bytes]], int]:
        """``headers`` of a request to ``host``:``port`` over TLS whose certificate verified, as the
        upstream gets them: each field of a credential's header that uses its phantom replaced by
        exactly one field with the secret; the proxy's own headers (Proxy-Authorization) dropped;
        everything else as sent. Returns the headers and how many credentials were put in."""
        mine = self.for_upstream(host, port)
        out: list[tuple[bytes, bytes]] = []
        done: set[str] = set()
        for name, value in headers:
            lower = name.lower()
            if lower in PROXY_HEADERS:
                continue
            credential = next((c for c in mine if lower == c.spec.header.lower().encode("ascii")
                               and c.replaces(value)), None)
            if credential is None:
                out.append((name, value))
            elif credential.spec.name not in done:
                done.add(credential.spec.name)
                out.append((credential.spec.header.encode("ascii"), credential.secret.render(credential.spec)))
        return out, len(done)

    def scrubber(self, host: str, port: int) -> "Scrubber | None":
        """A scrubber for responses from ``host``:``port``, when a credential of it may be echoed."""
        needles = [form for c in self.for_upstream(host, port) for form in c.secret.forms(c.spec)]
        return Scrubber(needles) if needles else None

    def wipe(self) -> None:
        for credential in self._credentials:
            credential.secret.wipe()


class Scrubber:
    """Replaces every occurrence of a secret's forms in a response with ``*`` of the same length, so
    framing (Content-Length) stays right. For a body that arrives in pieces, ``feed`` holds back only
    a tail that could be the start of a secret (never a whole event: an SSE event ending in a
    newline passes at once, a secret has no whitespace) and ``finish`` gives it at the end."""

    __slots__ = ("_needles", "_carry")

    def __init__(self, needles: "list[bytes]") -> None:
        self._needles = sorted({n for n in needles if n}, key=len, reverse=True)
        self._carry = b""

    def head_value(self, value: bytes) -> bytes:
        """A response header's value, scrubbed (heads arrive whole)."""
        return self._replace(value)

    def feed(self, data: bytes) -> bytes:
        """The next piece of a body, scrubbed; a tail that may continue into the next piece waits."""
        text = self._replace(self._carry + data)
        keep = self._partial_tail(text)
        self._carry = text[len(text) - keep:] if keep else b""
        return text[:len(text) - keep] if keep else text

    def finish(self) -> bytes:
        """What was held back, at the end of the body."""
        rest, self._carry = self._carry, b""
        return rest

    def _replace(self, text: bytes) -> bytes:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, b"*" * len(needle))
        return text

    def _partial_tail(self, text: bytes) -> int:
        """The length of the longest tail of ``text`` that is a proper prefix of a needle: tried
        only where the needle's first byte is, longest first."""
        best = 0
        for needle in self._needles:
            start = max(len(text) - len(needle) + 1, 0)
            at = text.find(needle[:1], start)
            while at >= 0 and len(text) - at > best:
                if needle.startswith(text[at:]):
                    best = len(text) - at
                    break
                at = text.find(needle[:1], at + 1)
        return best


__all__ = ["Credential", "CredentialSet", "Scrubber", "Secret", "new_phantom"]
