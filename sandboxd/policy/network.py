"""The network rules of a policy as typed records: endpoint rules, credential specifications, what
happens to an unlisted destination, and the cloud metadata that is never reachable.

Pure text, no OS calls, no ``re`` (this module is on ``sandboxd run``'s import path through
policy.sandbox): a policy keeps its rules as canonical text (``allowed_endpoints``,
``credentials``), parsed here into ``EndpointRule`` and ``CredentialSpec``; ``NetworkRules`` is what
the egress proxy is given (built by ``SandboxPolicy.network_rules``), never a secret.

Endpoint rules (docs/networks.md): ``HOST=METHOD[,METHOD...]:PATH-GLOB``. A request's path is
matched only after ``normalize_path`` (anything an upstream could decode differently is refused
first), and the glob is matched segment by segment (``path_matches``), never through a regular
expression built from a caller's text.
"""

from __future__ import annotations

from sandboxd._record import Choice, Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.domains import WILDCARD, allowed_domain, domain_matches, host_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import ClassVar

MAX_GLOB = 1024                       # characters of an endpoint rule's path glob
# Segments of a glob and of a request's path: matching costs at most their product per rule, on
# the proxy's one loop (real API paths have a handful; a path with more gets 400).
MAX_GLOB_SEGMENTS = 64
MAX_PATH_SEGMENTS = 128
MAX_TEMPLATE = 256                    # characters of a credential's header template
MAX_BASIC_USER = 256
MAX_CREDENTIAL_NAME = 128             # characters of the variable that holds the phantom
DEFAULT_HEADER = "Authorization"
DEFAULT_TEMPLATE = "Bearer {}"
BASIC_TEMPLATE = "Basic {}"
HTTPS_PORT = 443
ANY_METHOD = "*"
GLOB_ANY_SEGMENTS = "**"

# RFC 9110 tchar without "*" (which stands for any method here, so no method may contain it).
_TOKEN = frozenset("!#$%&'+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_HEX = frozenset("0123456789abcdefABCDEF")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# Escapes an upstream may decode into a separator or a terminator: a path holding one is refused.
_AMBIGUOUS_ESCAPES = ("%2F", "%5C", "%00")
_NAME_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_REST = _NAME_FIRST | frozenset("0123456789")
# Headers a credential may not set: they frame the message or belong to one hop (a secret there
# would change how the proxy and the upstream read the stream, or never reach the upstream).
_FORBIDDEN_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "transfer-encoding", "upgrade", "content-length", "host", "expect"})
# Variables a credential's phantom may not take: the sandbox's way to its proxy and its trust
# bundle are set by sandboxd (a phantom there would break them or point them elsewhere).
RESERVED_CREDENTIAL_NAMES = frozenset({
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE", "NODE_USE_ENV_PROXY", "PATH", "HOME", "LD_PRELOAD", "LD_LIBRARY_PATH"})

# Cloud metadata services (docs/networks.md): refused in every policy but danger-full-access,
# whatever a name resolves to. AWS IMDS, ECS task, EKS pod identity, Tencent, Scaleway, Alibaba,
# Oracle legacy, AWS IPv6 (both).
METADATA_ADDRESSES: tuple[str, ...] = (
    "169.254.169.254", "169.254.170.2", "169.254.170.23", "169.254.0.23", "169.254.42.42", "100.100.100.200",
    "192.0.0.192", "fd00:ec2::254", "fd00:ec2::23")
METADATA_NAMES: frozenset[str] = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "instance-data", "instance-data.ec2.internal",
    "metadata.tencentyun.com", "metadata.azure.internal"})
_METADATA_SUFFIX = ".metadata.google.internal"
_NAT64_PREFIX = "64:ff9b::/96"


class Unlisted(Choice):
    """What happens to a connection or request the network lists do not allow: refused at once, or
    held and asked of the session's owner (reason network_request) under on-request or always."""

    REFUSE: ClassVar[Unlisted]
    ASK: ClassVar[Unlisted]


Unlisted.define(REFUSE="refuse", ASK="ask")


def parse_unlisted(text: object) -> Unlisted:
    """The choice ``text`` names ("" is the default, refuse), or InvalidPolicy naming both."""
    if text == "":
        return Unlisted.REFUSE
    try:
        return Unlisted.parse(text)
    except ValueError:
        raise InvalidPolicy(f"unlisted {str(text)[:100]!r}: use refuse (the default) or ask") from None


class EndpointRule(Record):
    """One endpoint rule: on ``host`` (an allowed_domains entry), requests with one of ``methods``
    (upper case; ``("*",)`` any) whose normalized path matches the glob ``path``."""

    host: str
    methods: tuple[str, ...]
    path: str

    def text(self) -> str:
        """The canonical text form, which ``parse_endpoint`` gives back as this rule."""
        return f"{self.host}={','.join(self.methods)}:{self.path}"

    def allows(self, method: str, path: str) -> bool:
        """Whether a request's method and normalized path (``normalize_path``) are this rule's."""
        return (self.methods == (ANY_METHOD,) or method in self.methods) and path_matches(self.path, path)


class CredentialSpec(Record):
    """A credential's public half: the variable ``name`` holds a phantom inside the sandbox, and the
    proxy puts the secret in ``header`` (``template`` with ``{}`` filled) of requests to ``host``:
    ``port`` over verified TLS. ``basic_user`` is set for Basic authentication: "" when the secret is
    "user:pass" itself, a user name otherwise (the secret is the password)."""

    name: str
    host: str
    port: int = HTTPS_PORT
    header: str = DEFAULT_HEADER
    template: str = DEFAULT_TEMPLATE
    basic_user: str | None = None

    @property
    def upstream(self) -> str:
        """``https://HOST:PORT``, as a person reads it (CredentialState.upstream)."""
        return f"https://{self.host}:{self.port}"

    def text(self) -> str:
        """The canonical text form, which ``parse_credential`` gives back as this spec."""
        base = f"{self.name}=https://{self.host}" + ("" if self.port == HTTPS_PORT else f":{self.port}")
        if self.basic_user is not None:
            return base + ";basic" + (f":{self.basic_user}" if self.basic_user else "")
        if (self.header, self.template) == (DEFAULT_HEADER, DEFAULT_TEMPLATE):
            return base
        return f"{base};{self.header}: {self.template}"


class NetworkRules(Record):
    """What the egress proxy enforces for one sandbox (built from its policy: no secret here)."""

    domains: tuple[str, ...] = ()
    endpoints: tuple[EndpointRule, ...] = ()
    credentials: tuple[CredentialSpec, ...] = ()
    unlisted: Unlisted = Unlisted.REFUSE

    def allowed(self, host: str, port: int) -> bool:
        """Whether ``host`` (a host name, lower case) on ``port`` may be reached: a domain pattern
        names it (any port), or a credential names exactly this host and port."""
        return (any(domain_matches(host, pattern) for pattern in self.domains)
                or any((c.host, c.port) == (host, port) for c in self.credentials))

    def ruled(self, host: str) -> tuple[EndpointRule, ...]:
        """The endpoint rules of ``host``: those of every pattern that matches it, together."""
        return tuple(rule for rule in self.endpoints if domain_matches(host, rule.host))

    def intercepts(self, host: str, port: int) -> bool:
        """Whether connections to ``host``:``port`` are intercepted (TLS ended by the session's CA):
        the host has endpoint rules, or a credential names this host and port."""
        return bool(self.ruled(host)) or any((c.host, c.port) == (host, port) for c in self.credentials)


def parse_endpoint(text: str) -> EndpointRule:
    """``HOST=METHOD[,METHOD...]:PATH-GLOB`` as a rule (host canonical, methods upper case and
    without repeats, the glob's escapes normalized), or InvalidPolicy saying what to give instead."""
    example = "like api.github.com=GET:/repos/*/issues/** or *.example.com=GET,HEAD:/v1/**"
    host_text, equals, rest = text.partition("=")
    method_text, colon, glob = rest.partition(":")
    if not equals or not colon:
        raise InvalidPolicy(f"endpoint rule {text[:200]!r}: give HOST=METHODS:PATH-GLOB, {example}")
    try:
        host = allowed_domain(host_text)
    except InvalidPolicy as exc:
        raise InvalidPolicy(f"endpoint rule {text[:200]!r}: its host: {exc}") from None
    methods = _methods(text, method_text)
    return EndpointRule(host, methods, _glob(text, glob))


def _methods(text: str, method_text: str) -> tuple[str, ...]:
    items = [item.strip() for item in method_text.split(",")]
    if items == [ANY_METHOD]:
        return (ANY_METHOD,)
    for item in items:
        if not item or not _TOKEN.issuperset(item):
            raise InvalidPolicy(f"endpoint rule {text[:200]!r}: method {item[:50]!r}: give methods like GET or "
                                "GET,HEAD (letters; '*' alone for any method)")
    return tuple(dict.fromkeys(item.upper() for item in items))


def _glob(text: str, glob: str) -> str:
    what = f"endpoint rule {text[:200]!r}: path {glob[:200]!r}"
    if not glob.startswith("/"):
        raise InvalidPolicy(f"{what} must start with '/' (like /repos/*/issues/**)")
    if len(glob) > MAX_GLOB:
        raise InvalidPolicy(f"{what} is longer than {MAX_GLOB} characters")
    if "?" in glob or "#" in glob:
        raise InvalidPolicy(f"{what}: rules match the path only: leave out the query ('?') and fragment ('#')")
    normal = _normalized(glob)
    if isinstance(normal, _Refusal):
        raise InvalidPolicy(f"{what}: {normal.why}")
    if normal.count("/") > MAX_GLOB_SEGMENTS:
        raise InvalidPolicy(f"{what} has more than {MAX_GLOB_SEGMENTS} segments")
    for segment in normal.split("/"):
        if GLOB_ANY_SEGMENTS in segment and segment != GLOB_ANY_SEGMENTS:
            raise InvalidPolicy(f"{what}: '**' stands alone between slashes (/a/**/b); '*' matches within "
                                "one segment")
    return normal


class _Refusal:
    """Why a path cannot be matched (what ``normalize_path`` returns None for)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def normalize_path(target: str) -> str | None:
    """A request target (origin-form) as endpoint rules match it: the query dropped, escapes of
    unreserved characters decoded and every other escape's hex in upper case. None when it cannot
    be matched safely (the proxy answers 400): not origin-form, a character outside visible ASCII, a
    bad escape, an escaped slash, backslash or NUL, a backslash, a "." or ".." segment (also
    with Tomcat-style ";parameters", "..;x"), more than MAX_PATH_SEGMENTS segments."""
    path = target.partition("?")[0]
    if not path.startswith("/") or "#" in path:
        return None
    normal = _normalized(path)
    return None if isinstance(normal, _Refusal) else normal


def why_not_normal(target: str) -> str:
    """Why ``normalize_path(target)`` is None, for the 400's body and the event ("" if it is not)."""
    path = target.partition("?")[0]
    if not path.startswith("/"):
        return "the request target is not a path starting with '/'"
    if "#" in path:
        return "the request target holds a fragment ('#')"
    normal = _normalized(path)
    return normal.why if isinstance(normal, _Refusal) else ""


def _normalized(path: str) -> str | _Refusal:
    out: list[str] = []
    index = 0
    while index < len(path):
        char = path[index]
        if not "!" <= char <= "~":
            return _Refusal("ambiguous path: a character outside visible ASCII")
        if char == "\\":
            return _Refusal("ambiguous path: a backslash")
        if char != "%":
            out.append(char)
            index += 1
            continue
        digits = path[index + 1:index + 3]
        if len(digits) != 2 or not _HEX.issuperset(digits):
            return _Refusal("a '%' not followed by two hex digits")
        decoded = chr(int(digits, 16))
        out.append(decoded if decoded in _UNRESERVED else "%" + digits.upper())
        index += 3
    normal = "".join(out)
    if normal.count("/") > MAX_PATH_SEGMENTS:
        return _Refusal(f"more than {MAX_PATH_SEGMENTS} segments")
    for escape in _AMBIGUOUS_ESCAPES:
        if escape in normal:
            return _Refusal(f"ambiguous path: an escaped {'slash' if escape == '%2F' else 'backslash' if escape == '%5C' else 'NUL'} ({escape})")
    for segment in normal.split("/"):
        if segment.partition(";")[0] in (".", ".."):
            return _Refusal("ambiguous path: a '.' or '..' segment")
    return normal


def path_matches(glob: str, path: str) -> bool:
    """Whether normalized ``path`` matches ``glob`` (both start with "/"): segment by segment, a
    literal segment matches itself (case-sensitively), "*" within a segment any run of characters
    other than "/", a "**" segment zero or more whole segments; empty segments count (``/a//b``,
    a trailing slash).

    The glob is cut at its "**" segments into blocks of one-segment patterns: the first block
    must match the path's first segments, the last its last ones, and each block between at its
    leftmost place after the one before (enough when every pattern takes exactly one segment, as
    for "*" in text). At most MAX_GLOB_SEGMENTS x MAX_PATH_SEGMENTS segment comparisons, with no
    table: the proxy matches on its one loop, for every sandbox."""
    blocks: list[list[str]] = [[]]
    for pattern in glob.split("/"):
        if pattern == GLOB_ANY_SEGMENTS:
            blocks.append([])
        else:
            blocks[-1].append(pattern)
    segments = path.split("/")
    if len(blocks) == 1:
        return len(blocks[0]) == len(segments) and _block_at(blocks[0], segments, 0)
    first, *middle, last = blocks
    end = len(segments) - len(last)
    if end < len(first) or not _block_at(first, segments, 0) or not _block_at(last, segments, end):
        return False
    position = len(first)
    for block in middle:
        while True:
            if position + len(block) > end:
                return False
            if _block_at(block, segments, position):
                break
            position += 1
        position += len(block)
    return True


def _block_at(block: list[str], segments: list[str], start: int) -> bool:
    """Whether each one-segment pattern of ``block`` matches the segment at ``start`` onwards."""
    return all(_segment_matches(pattern, segments[start + offset]) for offset, pattern in enumerate(block))


def _segment_matches(pattern: str, segment: str) -> bool:
    """One segment against a pattern whose only wildcard is "*": the first and last literal parts
    anchor it, each middle part is taken at its leftmost place (enough when "*" is the only
    wildcard)."""
    parts = pattern.split("*")
    if len(parts) == 1:
        return pattern == segment
    first, last = parts[0], parts[-1]
    if len(first) + len(last) > len(segment) or not segment.startswith(first) or not segment.endswith(last):
        return False
    position, end = len(first), len(segment) - len(last)
    for middle in parts[1:-1]:
        found = segment.find(middle, position, end)
        if found < 0:
            return False
        position = found + len(middle)
    return True


def match_cost(rules: Iterable[EndpointRule], path: str) -> int:
    """The most segment comparisons matching normalized ``path`` against ``rules`` may take: glob
    segments times path segments, summed over the rules (path_matches' bound, rule by rule)."""
    segments = path.count("/") + 1
    return sum((rule.path.count("/") + 1) * segments for rule in rules)


def endpoint_allowed(rules: Iterable[EndpointRule], method: str, path: str) -> bool:
    """Whether one of ``rules`` (a host's: ``NetworkRules.ruled``) lets ``method`` on the normalized
    ``path`` through."""
    return any(rule.allows(method, path) for rule in rules)


def parse_credential(text: str) -> CredentialSpec:
    """``VAR=https://HOST[:PORT]`` with an optional ``;HEADER: TEMPLATE`` or ``;basic[:USER]``, as a
    spec, or InvalidPolicy saying what to give instead (the text is public: never a secret)."""
    example = ("like GITHUB_TOKEN=https://api.github.com, KEY=https://api.example.com;x-api-key: {} or "
               "GIT_TOKEN=https://git.example.com;basic:git")
    name, equals, rest = text.partition("=")
    url, semicolon, option = rest.partition(";")
    what = f"credential {text[:200]!r}"
    if not equals:
        raise InvalidPolicy(f"{what}: give VAR=https://HOST[:PORT], {example}")
    _check_credential_name(what, name)
    host, port = _upstream(what, url)
    if not semicolon:
        return CredentialSpec(name, host, port)
    if option == "basic" or option.startswith("basic:"):
        user = option[len("basic:"):] if option != "basic" else ""
        if option != "basic" and not user:
            raise InvalidPolicy(f"{what}: ';basic:' needs a user name (or ';basic' when the secret is user:pass)")
        if len(user) > MAX_BASIC_USER or not all("!" <= char <= "~" for char in user) or ":" in user:
            raise InvalidPolicy(f"{what}: the basic user {user[:100]!r} must be visible ASCII without ':', at most "
                                f"{MAX_BASIC_USER} characters")
        return CredentialSpec(name, host, port, DEFAULT_HEADER, BASIC_TEMPLATE, user)
    header, colon, template = option.partition(":")
    template = template.strip(" ")
    if not colon or not header or not _TOKEN.issuperset(header):
        raise InvalidPolicy(f"{what}: the option {option[:100]!r}: give ';HEADER: TEMPLATE' with {{}} where the "
                            "secret goes (';x-api-key: {}') or ';basic[:USER]'")
    if header.lower() in _FORBIDDEN_HEADERS:
        raise InvalidPolicy(f"{what}: header {header!r} frames the message or belongs to one hop: name the "
                            "header the API reads its key from")
    if template.count("{}") != 1 or len(template) > MAX_TEMPLATE or not all(" " <= c <= "~" for c in template):
        raise InvalidPolicy(f"{what}: the template {template[:100]!r} must hold '{{}}' exactly once and only "
                            f"visible ASCII and spaces, at most {MAX_TEMPLATE} characters")
    return CredentialSpec(name, host, port, header, template)


def _check_credential_name(what: str, name: str) -> None:
    if (not 0 < len(name) <= MAX_CREDENTIAL_NAME or name[0] not in _NAME_FIRST
            or not _NAME_REST.issuperset(name)):
        raise InvalidPolicy(f"{what}: the variable {name[:100]!r} must be letters, digits and '_' (not first a "
                            f"digit), at most {MAX_CREDENTIAL_NAME} characters")
    if name in RESERVED_CREDENTIAL_NAMES:
        raise InvalidPolicy(f"{what}: sandboxd sets {name} itself inside the sandbox: pick another variable")


def _upstream(what: str, url: str) -> tuple[str, int]:
    scheme = "https://"
    if not url.startswith(scheme):
        raise InvalidPolicy(f"{what}: the upstream must be https://HOST[:PORT] (the secret only travels over "
                            "TLS to the upstream's verified certificate)")
    authority = url[len(scheme):].removesuffix("/")
    host_text, colon, port_text = authority.partition(":")
    host = host_name(host_text)
    if host is None or host_text.endswith("."):
        raise InvalidPolicy(f"{what}: the upstream {authority[:200]!r} must be a host name like api.github.com, "
                            "with an optional :PORT (no path, no IP address, no wildcard)")
    if not colon:
        return host, HTTPS_PORT
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidPolicy(f"{what}: port {port_text[:20]!r} must be 1 to 65535")
    return host, int(port_text)


MAX_SECRET = 8 << 10                  # bytes of one credential's secret
MAX_SECRET_NAME = 64                  # characters of a [network.secrets] name
_SECRET_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


class DaemonSecret(Record):
    """A credential's secret named in the daemon's configuration (``[network.secrets] NAME``),
    instead of one the caller sends: who may use it is the configuration's to say."""

    name: str


class CredentialState(Record):
    """A session's credential as a person may see it (Session.credential_states): never its secret.
    ``source`` is "caller" or "daemon:NAME"; ``usable`` False when a caller's secret was lost in a
    daemon restart."""

    name: str
    upstream: str
    source: str
    usable: bool


def check_secret(name: str, value: bytes) -> bytes:
    """A caller's secret for credential ``name``: 1 to MAX_SECRET bytes, each 0x21..0x7E (a header
    carries it: no space, CR, LF or NUL to inject another). InvalidPolicy naming ``name``, never
    the value."""
    if not value:
        raise InvalidPolicy(f"the secret of {name} is empty: set the variable (or the file) to the token")
    if len(value) > MAX_SECRET:
        raise InvalidPolicy(f"the secret of {name} is {len(value)} bytes: at most {MAX_SECRET} are taken")
    if not all(0x21 <= byte <= 0x7E for byte in value):
        raise InvalidPolicy(f"the secret of {name} has a character a header cannot carry (only visible ASCII: "
                            "no space, newline or control character; a trailing newline of a file is dropped "
                            "by the client)")
    return value


def check_secret_name(text: str) -> str:
    """A ``[network.secrets]`` name: 1 to 64 of a-z, 0-9, '_' and '-'; InvalidPolicy otherwise."""
    if not 0 < len(text) <= MAX_SECRET_NAME or not _SECRET_NAME_CHARS.issuperset(text):
        raise InvalidPolicy(f"daemon secret {text[:100]!r}: a name of [network.secrets] is 1 to {MAX_SECRET_NAME} "
                            "lower-case letters, digits, '_' and '-'")
    return text


def check_secrets_match(credentials: Iterable[CredentialSpec], given: Iterable[str],
                        known: Iterable[str] = ()) -> None:
    """Every credential has a secret (``given``, or one the session holds already: ``known``) and
    every given secret is a credential's: InvalidPolicy naming the variable otherwise."""
    names = [spec.name for spec in credentials]
    given, known = set(given), set(known)
    for name in names:
        if name not in given and name not in known:
            raise InvalidPolicy(f"credential {name} has no secret: send it in credential_secrets (sandboxctl: "
                                f"set ${name}, or --credential-file {name}=PATH)")
    for name in sorted(given - set(names)):
        raise InvalidPolicy(f"a secret is given for {name[:128]!r}, which no credential of the policy names")


def covers(pattern: str, entry: str) -> bool:
    """Whether allowed_domains ``pattern`` allows every name ``entry`` (a host name or a pattern)
    stands for: an endpoint rule only narrows what the domains allow."""
    if entry == "*":
        return pattern == "*"
    if entry.startswith(WILDCARD):
        return pattern == "*" or (pattern.startswith(WILDCARD) and entry[1:].endswith(pattern[1:]))
    return domain_matches(entry, pattern)


def metadata_name(host: str) -> bool:
    """Whether host name ``host`` (lower case, no final dot) names a cloud metadata service."""
    return host in METADATA_NAMES or host.endswith(_METADATA_SUFFIX)


def metadata_address(address: str) -> bool:
    """Whether ``address`` is a metadata service's, also written IPv4-mapped (``::ffff:a.b.c.d``) or
    NAT64 (``64:ff9b::a.b.c.d``). False for text that is no address."""
    import ipaddress                    # (~10 ms: only for a proxy's resolved answers, never a plain run)

    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        if ip in ipaddress.ip_network(_NAT64_PREFIX):
            candidates.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    known = {ipaddress.ip_address(item) for item in METADATA_ADDRESSES}
    return any(candidate in known for candidate in candidates)


__all__ = ["METADATA_ADDRESSES", "METADATA_NAMES", "CredentialSpec", "CredentialState", "DaemonSecret",
           "EndpointRule", "NetworkRules", "Unlisted", "check_secret", "check_secret_name", "check_secrets_match",
           "covers", "endpoint_allowed", "metadata_address", "metadata_name", "normalize_path", "parse_credential",
           "parse_endpoint", "parse_unlisted", "path_matches", "why_not_normal"]
