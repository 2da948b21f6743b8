"""The names a gateway's client sees for its upstreams' tools, prompts and resources.

A tool or prompt is exposed as `UPSTREAM__name` (docs/mcp.md, "The gateway"): the Anthropic and
OpenAI APIs take tool names matching ``^[a-zA-Z0-9_-]{1,64}$`` only (no dot), and MCP clients
hand the names on to them. Upstream names match ``^[a-z0-9][a-z0-9-]{0,23}$`` (no ``_``), so the
first ``__`` splits an exposed name unambiguously, and no built-in tool has one.

An upstream's own name with other characters gets ``_`` for each; if the result collides with
another of the same upstream's names, or is longer than 64, it is cut and suffixed with ``-`` and
8 hex digits of sha256(original name). ``Names`` keeps the map both ways. A resource's URI is
rewritten to ``sandboxd-gateway://UPSTREAM/`` + the original URI percent-encoded, so reading one
routes by the prefix and hands the upstream its own URI back.
"""

from __future__ import annotations

import hashlib
import logging
import re
import urllib.parse
from collections.abc import Iterable

from sandboxd.printable import printable

log = logging.getLogger("sandboxd.mcp")
UPSTREAM_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")
EXPOSED_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
SEPARATOR = "__"
MAX_NAME = 64
_OUTSIDE = re.compile(r"[^A-Za-z0-9_-]")
_HASH_LENGTHS = (8, 16)          # 8 hex digits; 16 only if a listed name happens to end like a suffix
RESOURCE_SCHEME = "sandboxd-gateway"


def _digest(original: str, length: int) -> str:
    return hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()[:length]


class Names:
    """One upstream's listed names (of one kind: tools, or prompts) and their exposed names."""

    def __init__(self, upstream: str, originals: Iterable[str]) -> None:
        if not UPSTREAM_NAME.match(upstream):
            raise ValueError(f"upstream name {upstream!r} must match {UPSTREAM_NAME.pattern}")
        self.upstream = upstream
        self.prefix = upstream + SEPARATOR
        self._exposed: dict[str, str] = {}       # original -> exposed
        self._original: dict[str, str] = {}      # exposed -> original
        unique = list(dict.fromkeys(originals))  # an upstream listing a name twice: the first counts
        # Names that need no change are theirs first, so a sanitized name can never take a
        # clean one's place: the clean names never change with what else is listed.
        clean = [name for name in unique if self._plain(name) is not None]
        for name in clean:
            self._take(name, self.prefix + name)
        for name in unique:
            if name not in self._exposed:
                self._place(name)

    def _plain(self, original: str) -> str | None:
        exposed = self.prefix + original
        return exposed if original and EXPOSED_NAME.match(exposed) else None

    def _take(self, original: str, exposed: str) -> None:
        self._exposed[original], self._original[exposed] = exposed, original

    def _place(self, original: str) -> None:
        sanitized = self.prefix + _OUTSIDE.sub("_", original)
        if original and len(sanitized) <= MAX_NAME and sanitized not in self._original:
            self._take(original, sanitized)
            return
        for length in _HASH_LENGTHS:
            suffix = "-" + _digest(original, length)
            exposed = sanitized[:MAX_NAME - len(suffix)] + suffix
            if exposed not in self._original:
                self._take(original, exposed)
                return
        log.warning("sandboxd mcp gateway: %s: left out the name %s: no unique exposed name for it",
                    self.upstream, printable(original))

    def exposed(self, original: str) -> str | None:
        """The exposed name of an upstream's ``original`` name (None: not listed, or left out)."""
        return self._exposed.get(original)

    def original(self, exposed: str) -> str | None:
        """The upstream's own name behind ``exposed`` (None: not one of this upstream's)."""
        return self._original.get(exposed)

    def items(self) -> list[tuple[str, str]]:
        """(original, exposed) in the upstream's order."""
        return list(self._exposed.items())


def split(exposed: str) -> tuple[str, str] | None:
    """(upstream, rest) of an exposed name, or None for a name without ``__`` (a built-in tool)."""
    upstream, separator, rest = exposed.partition(SEPARATOR)
    if not separator or not UPSTREAM_NAME.match(upstream):
        return None
    return upstream, rest


def resource_uri(upstream: str, uri: str) -> str:
    """The URI a client sees for an upstream's resource ``uri``."""
    return f"{RESOURCE_SCHEME}://{upstream}/{urllib.parse.quote(uri, safe='', errors='surrogatepass')}"


def resource_origin(exposed: str) -> tuple[str, str] | None:
    """(upstream, its own URI) of an exposed resource URI, or None when it is not one."""
    prefix = f"{RESOURCE_SCHEME}://"
    if not exposed.startswith(prefix):
        return None
    upstream, slash, quoted = exposed[len(prefix):].partition("/")
    if not slash or not UPSTREAM_NAME.match(upstream):
        return None
    return upstream, urllib.parse.unquote(quoted, errors="surrogatepass")
