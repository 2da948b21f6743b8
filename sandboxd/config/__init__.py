"""The daemon's settings: one TOML file, every key documented with its default.

Where they come from, each later one winning over the earlier (``load``): the built-in defaults;
the file (``sandboxd serve --config FILE``, else ``$SANDBOXD_CONFIG``, else
``/etc/sandboxd/sandboxd.toml`` when it exists); the environment (``$SANDBOXD_<SECTION>_<KEY>``,
e.g. ``SANDBOXD_LISTEN_WORKERS=8``: a string key takes the value as it is, any other a TOML
value such as ``8``, ``true`` or ``["192.0.2.53"]``); the command-line flags. ``load`` checks
everything once, the values and what they name (groups, users, the TLS files), and returns a
frozen ``DaemonSettings``: the daemon reads nothing else. An unknown key, a bad value or a file
that is not TOML stops the daemon at start-up with where the value came from, the key and what
to fix; ``sandboxd config check FILE`` says the same without starting anything, and
``sandboxd config defaults`` prints a file with every key.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from typing import Callable, Self

from sandboxd import defaults
from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel.overlay import DEFAULT_CHECKPOINTS, MAX_CHECKPOINTS
from sandboxd.policy.limits import (DEFAULT_PTYS, DEFAULT_REVIEW_OWNER_BYTES, DEFAULT_REVIEW_SESSION_BYTES,
                                    MAX_PTYS)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.config.settings import DaemonSettings

DEFAULT_PATH = "/etc/sandboxd/sandboxd.toml"
CONFIG_ENV = "SANDBOXD_CONFIG"
BUILT_IN = "(built-in defaults)"


class ConfigError(InvalidPolicy):
    def __init__(self, path: str, key: str, problem: str) -> None:
        self.path, self.key, self.problem = path, key, problem
        super().__init__(f"{path}: {key}: {problem}" if key else f"{path}: {problem}")

    def _fields(self) -> dict[str, object]:
        return {"path": self.path, "key": self.key, "problem": self.problem}

    @classmethod
    def _from_fields(cls, data: Mapping[str, object]) -> Self:
        return cls(str(data.get("path", "")), str(data.get("key", "")), str(data.get("problem", "")))


class Key(Record):
    section: str
    name: str
    default: object
    doc: str
    check: "Callable[[object], str | None]"        # a problem, or None when the value is good

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def _text(value: object) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _absolute(value: object) -> str | None:
    return _text(value) or (None if str(value).startswith("/") else "must be an absolute path")


def _optional_absolute(value: object) -> str | None:
    return None if value == "" else _absolute(value)


def _supervisor_cgroup(value: object) -> str | None:
    import os
    if value == "":
        return None
    if not isinstance(value, str) or not value.startswith("/") or value == "/" or os.path.normpath(value) != value:
        return f"must be empty or an absolute normal path below the cgroup root, e.g. \"/sandboxd.supervisor\", not {value!r}"
    return None


def _whole(low: int, high: int) -> "Callable[[object], str | None]":
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"must be a whole number from {low} to {high}, not {value!r}"
        return None
    return check


def _positive_seconds(value: object) -> str | None:
    # TOML has nan and inf: refused with the rest (the comparison alone lets nan through).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return f"must be a positive number of seconds, not {value!r}"
    return None


def _seconds_up_to(maximum: float, *, zero: str = "") -> "Callable[[object], str | None]":
    """Seconds above 0 (or 0 too, meaning ``zero``) and at most ``maximum``."""
    def check(value: object) -> str | None:
        low = 0 if zero else 0 + 1e-9
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < low or value > maximum):
            return (f"must be a number of seconds from {'0 (' + zero + ')' if zero else 'above 0'} to {maximum:g}, "
                    f"not {value!r}")
        return None
    return check


def _days_or_zero(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"must be a number of days, 0 (kept until applied or discarded) or more, not {value!r}"
    return None


def _retain_days(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"must be a number of days, 0 (kept for good) or more, not {value!r}"
    return None


def _audit_max_bytes(value: object) -> str | None:
    if value in ("0", 0):
        return None
    from sandboxd.policy import parse_size
    from sandboxd.policy.audit_limits import MIN_MAX_BYTES

    wanted = f"must be \"0\" (no bound) or a size of at least {MIN_MAX_BYTES >> 20}M like 2G, not {value!r}"
    if value == "" or _size_or_empty(value) is not None:
        return wanted
    return None if parse_size(str(value)) >= MIN_MAX_BYTES else wanted


def _ipv4_list(value: object) -> str | None:
    if not isinstance(value, list):
        return "must be a list of IPv4 addresses, like [\"192.0.2.53\"]"
    from sandboxd.policy.ipv4 import ipv4_address

    for item in value:
        try:
            ipv4_address(item)
        except ValueError as exc:
            return f"{item!r} is not an IPv4 address ({exc})"
    return None


def _string_table(value: object) -> str | None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                               for k, v in value.items()):
        return "must be a table of strings, like { \"agent-a\" = \"alice\" }"
    return None


def _octal_mode(value: object) -> str | None:
    text = str(value)
    if not isinstance(value, str) or not text or any(c not in "01234567" for c in text) or int(text, 8) > 0o777:
        return f"must be an octal permission string like \"0660\", not {value!r}"
    return None


def _boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, not {value!r}"


def _seconds_or_zero(value: object) -> str | None:
    from sandboxd.policy.limits import MAX_TIMEOUT_SECONDS

    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or value > MAX_TIMEOUT_SECONDS):
        return f"must be a number of seconds from 0 (none) to {MAX_TIMEOUT_SECONDS} (7 days), not {value!r}"
    return None


def _size_or_empty(value: object) -> str | None:
    from sandboxd.policy import parse_size

    if value == "":
        return None
    from sandboxd.policy.limits import MAX_BYTES

    try:
        size = parse_size(str(value), "size")
    except InvalidPolicy:
        return f"must be a size like 512M or 2G (empty: none), not {value!r}"
    return None if size <= MAX_BYTES else f"must be at most 2^53 bytes (8192T), not {value!r}"


def _size(value: object) -> str | None:
    return "must be a size like 256M or 1G" if value == "" else _size_or_empty(value)


def _review_bytes(*, zero: bool) -> "Callable[[object], str | None]":
    """A review store's size (kernel.review_space): at least its MIN_SHARE, 1 MiB; "0" where
    ``zero``: no bound."""
    def check(value: object) -> str | None:
        if zero and value in ("0", 0):
            return None
        wanted = "a size of at least 1M, like 512M or 2G" + (" (\"0\": no bound)" if zero else "")
        if value == "" or _size_or_empty(value) is not None:
            return f"must be {wanted}, not {value!r}"
        from sandboxd.policy import parse_size

        return None if parse_size(str(value)) >= 1 << 20 else f"must be {wanted}, not {value!r}"
    return check


def _min_free(value: object) -> str | None:
    from sandboxd.policy.audit_limits import parse_min_free

    if not isinstance(value, str):
        return f"must be a size like \"512M\" or a share of the disk like \"5%\" (\"0\": no floor), not {value!r}"
    try:
        parse_min_free(value)
    except InvalidPolicy as exc:
        return str(exc)
    return None


def _cidr(value: object) -> str | None:
    import ipaddress

    try:
        network = ipaddress.ip_network(str(value))
    except ValueError:
        return f"must be an IPv4 network like 10.233.0.0/16, not {value!r}"
    if network.version != 4 or network.prefixlen > 29:
        return "must be an IPv4 network of /29 or larger (each sandbox takes a /30)"
    return None


def _upstream_proxy(value: object) -> str | None:
    """"" or ``http://HOST:PORT`` (no user, no path: proxy authentication is not taken yet)."""
    if value == "":
        return None
    wanted = f"must be http://HOST:PORT (no user or path; empty: none), not {value!r}"
    if not isinstance(value, str) or not value.startswith("http://"):
        return wanted
    return None if split_upstream_proxy(value) is not None else wanted


def split_upstream_proxy(url: str) -> tuple[str, int] | None:
    """``http://HOST:PORT`` as (host, port): HOST a host name or an IPv4 address; None otherwise."""
    authority = url.removeprefix("http://").removesuffix("/")
    if not url.startswith("http://") or "@" in authority or "/" in authority:
        return None
    return _host_and_port(authority, ipv6=False)


def _host_and_port(text: str, *, ipv6: bool) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host, port): HOST an IPv4 address or a host name (and with ``ipv6``, an
    IPv6 address in brackets), PORT from 1 to 65535; None when it is not that."""
    import ipaddress

    from sandboxd.policy.domains import host_name
    from sandboxd.policy.ipv4 import ipv4_address, port

    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        return None
    try:
        number = port(port_text)
    except ValueError:
        return None
    if ipv6 and host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), number
        except ValueError:
            return None
    try:
        return str(ipv4_address(host)), number
    except ValueError:
        name = host_name(host)
        return None if name is None else (name, number)


def _allowed_ranges(value: object) -> str | None:
    """IPv4 networks root lets the egress proxy reach although it refuses their range; never one
    holding a cloud metadata address or loopback."""
    import ipaddress

    from sandboxd.policy.network import METADATA_ADDRESSES

    if not isinstance(value, list):
        return "must be a list of IPv4 networks, like [\"10.1.0.0/16\"]"
    never = [ipaddress.ip_network("127.0.0.0/8")] + [ipaddress.ip_network(a) for a in METADATA_ADDRESSES]
    for item in value:
        try:
            network = ipaddress.ip_network(str(item))
        except ValueError:
            return f"{item!r} is not an IPv4 network like 10.1.0.0/16"
        if network.version != 4:
            return f"{item!r} is not an IPv4 network like 10.1.0.0/16"
        clash = next((other for other in never if network.version == other.version and network.overlaps(other)), None)
        if clash is not None:
            what = "loopback" if clash.is_loopback else f"the cloud metadata address {clash.network_address}"
            return f"{item!r} holds {what}, which the proxy never reaches: name a range without it"
    return None


def _secrets(value: object) -> str | None:
    """``NAME = { file = "/abs", upstreams = ["https://HOST[:PORT]", ...], users = [...], groups = [...],
    inject = "HEADER: TEMPLATE" | "basic[:USER]" }`` for each daemon-side secret."""
    from sandboxd.policy.network import check_secret_name, parse_credential

    example = ("like github = { file = \"/etc/sandboxd/secrets/github\", upstreams = [\"https://api.github.com\"], "
               "users = [\"alice\"], groups = [\"devs\"] }")
    if not isinstance(value, dict):
        return f"must be a table of secrets, {example}"
    for name, entry in value.items():
        try:
            check_secret_name(str(name))
        except InvalidPolicy as exc:
            return str(exc)
        if (not isinstance(entry, dict) or set(entry) - {"file", "users", "groups", "upstreams", "inject"}
                or "file" not in entry):
            return f"{name}: must be {{ file = ..., upstreams = [...], users = [...], groups = [...] }} ({example})"
        if not isinstance(entry["file"], str) or not entry["file"].startswith("/"):
            return f"{name}: file must be an absolute path"
        for field in ("users", "groups"):
            items = entry.get(field, [])
            if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
                return f"{name}: {field} must be a list of names or numbers"
        upstreams = entry.get("upstreams")
        if not isinstance(upstreams, list) or not upstreams or not all(isinstance(item, str) for item in upstreams):
            return (f"{name}: upstreams must list the only https://HOST[:PORT] its secret may be sent to "
                    f"({example}): a daemon secret is bound to its upstreams")
        inject = entry.get("inject", "")
        if not isinstance(inject, str):
            return f"{name}: inject must be \"HEADER: TEMPLATE\" or \"basic[:USER]\""
        try:
            for url in upstreams:
                parse_credential(f"X={url}")
            if inject:
                parse_credential(f"X=https://localhost;{inject}")
        except InvalidPolicy as exc:
            return f"{name}: {str(exc).replace('credential ', '', 1)}"
    return None


def split_listen_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` of a TCP listener as (host, port): HOST an IPv4 address, an IPv6 one in
    brackets or a host name, PORT from 1 to 65535; None when it is not that."""
    return _host_and_port(text, ipv6=True)


def _listen_address(value: object) -> str | None:
    """"" (none) or ``HOST:PORT`` (split_listen_address); whether HOST names this machine is
    looked up once, with the other names, by ``load`` (settings.resolve_listener)."""
    if value == "":
        return None
    if not isinstance(value, str) or split_listen_address(value) is None:
        return (f"{value!r} must be HOST:PORT (an address or a host name of this machine, [IPv6] in brackets, "
                "and a port from 1 to 65535, like 127.0.0.1:9464; empty: none)")
    return None


def _otlp_endpoint(value: object) -> str | None:
    if not isinstance(value, str) or (value and not value.startswith(("http://", "https://"))):
        return f"must be an http:// or https:// URL (the collector's OTLP/HTTP logs path), not {value!r}"
    return None


def _pod_uids(value: object) -> str | None:
    from sandboxd.kernel.pod_cgroups import POD_UID

    if not isinstance(value, list) or not all(isinstance(item, str) and POD_UID.fullmatch(item) for item in value):
        return ("must be a list of pod UIDs (metadata.uid, like \"0f3c2a1e-1b2c-4d5e-8f90-123456789abc\", lower-case; "
                "a static pod's: 32 hex digits)")
    return None


def _one_of(*choices: str) -> "Callable[[object], str | None]":
    def check(value: object) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}, not {value!r}"
    return check


KEYS: tuple[Key, ...] = (
    Key("listen", "socket", defaults.SOCKET, "the Unix socket clients connect to (under socket "
        "activation, the socket systemd hands over wins)", _absolute),
    Key("listen", "socket_mode", "0666", "the socket's permissions (octal); 0666 lets every local user connect "
        "(each sees only its own sessions)", _octal_mode),
    Key("listen", "admin_group", "", "members of this group (name or gid) see and use every session; empty: "
        "only root", _text),
    Key("listen", "workers", 128, "RPCs served at once", _whole(1, 1024)),
    Key("quotas", "connections_per_uid", 64, "connections one local user may hold open at once (more are closed "
        "as soon as they are accepted); root may hold four times as many", _whole(1, 65536)),
    Key("quotas", "proxy_connections_per_session", 256, "connections a session's sandbox may hold open at once "
        "through its egress proxy (allowed domains); more are refused at once", _whole(1, 65536)),
    Key("quotas", "network_questions_per_session", 16, "network questions (unlisted = ask) one session may have "
        "held at once; more are refused at once", _whole(1, 1024)),
    Key("quotas", "intercepted_connections_per_session", 64, "intercepted (TLS-ended) connections one session's "
        "sandbox may hold open at once, within quotas.proxy_connections_per_session", _whole(1, 65536)),
    Key("quotas", "published_connections_per_session", 256, "connections open at once to a session's published "
        "ports, from anyone; more are refused at once", _whole(1, 65536)),
    Key("quotas", "published_connections_per_peer", 32, "connections open at once to a session's published ports "
        "from one local user (by the uid of its socket; an address when none) other than the session's owner; "
        "as many (at most half the session's cap) stay reserved for the owner", _whole(1, 65536)),
    Key("quotas", "sessions_per_uid", 64, "open sessions one local user (a TLS caller: one certificate) may hold; "
        "root has its own quota (quotas.root_sessions)", _whole(1, 100000)),
    Key("quotas", "root_sessions", 256, "open sessions local root's own callers may hold (an agent pod running "
        "as root, a script): a separate, larger quota than quotas.sessions_per_uid; an administrator's sessions of "
        "other users count against their owners", _whole(1, 100000)),
    Key("quotas", "calls_per_uid", 16, "calls one user may have running at once: Exec, file tools, search, patches "
        "and Authorize, including those held for approval; root is exempt. 4 users at calls_per_uid + "
        "streams_per_uid must leave room in listen.workers for a fifth (checked at start)", _whole(1, 1024)),
    Key("quotas", "background_per_uid", 16, "background processes (StartBackground) one user's sessions keep, "
        "running or ended with their output (up to 4 MiB each) still readable; starting one more forgets that "
        "user's oldest ended one, and with all of them running it is refused; root is exempt", _whole(1, 1024)),
    Key("quotas", "streams_per_uid", 4, "open WatchEvents, following ReadBackgroundOutput and server reflection "
        "streams per user; root is exempt", _whole(1, 1024)),
    Key("quotas", "requests_per_uid", 8, "every other call (CreateSession, UpdateSessionPolicy, CloseSession, "
        "standing rules, GetStatus ...) one user may have in progress at once: one naming a path that does not "
        "answer waits up to fork_server.wait_seconds, holding a worker; root is exempt. 4 users at calls_per_uid + "
        "streams_per_uid + requests_per_uid must leave the first-slot share of listen.workers free (checked at "
        "start)", _whole(1, 1024)),
    Key("quotas", "terminals_per_uid", 8, "calls on a terminal (sandboxctl shell, Exec with a terminal) one user may "
        "have running at once, among its calls_per_uid; root is exempt", _whole(1, 1024)),
    Key("quotas", "git_watches_per_uid", 0, "inotify watches one user's git guards hold together (one per directory "
        "of its sessions' writable roots), out of root's host-wide fs.inotify.max_user_watches; past it that user's "
        "guards walk the roots after each call instead (one lstat per directory); 0: a sixteenth of "
        "fs.inotify.max_user_watches", _whole(0, 1 << 30)),
    Key("quotas", "git_inotify_instances", 0, "inotify instances the git guards hold, out of root's host-wide "
        "fs.inotify.max_user_instances: one per owner (a uid, a TLS principal) for the first owners, so that one "
        "owner's file churn overflowing its queue makes only its own guards walk their trees; past it, newer "
        "owners share the last one (an overflow there is theirs together); 1: all owners share one; 0: an eighth "
        "of fs.inotify.max_user_instances (16 of the default 128)", _whole(0, 1 << 20)),
    Key("quotas", "reserved_workers", 0, "workers that running calls and streams (everyone's, root's too) may never "
        "take: they stay free for requests (CreateSession, CloseSession, ResolveApproval ...); must be below "
        "listen.workers; 0: a quarter of listen.workers (at least 1)", _whole(0, 1023)),
    Key("tls", "address", "", "HOST:PORT of an optional TCP listener; it always needs TLS and client "
        "certificates (all four tls keys)", _listen_address),
    Key("tls", "cert", "", "the server's certificate chain (PEM)", _optional_absolute),
    Key("tls", "key", "", "the server's private key (PEM)", _optional_absolute),
    Key("tls", "client_ca", "", "the CA client certificates must be signed by", _optional_absolute),
    Key("tls", "user", "nobody", "the local USER[:GROUP] TCP callers act as, unless tls.users maps them: all "
        "callers acting as one local user share its file rights", _text),
    Key("tls", "identity", "common-name", "what names a TLS caller (its principal): the certificate's "
        "common-name, or its one uri (SPIFFE IDs) or dns subject alternative name; a certificate without it is "
        "refused", _one_of("common-name", "uri", "dns")),
    Key("tls", "users", {}, "principal -> local USER[:GROUP] it acts as, e.g. { \"agent-a\" = \"alice\" }; "
        "others act as tls.user", _string_table),
    Key("state", "dir", defaults.STATE_DIR, "the event store (audit log) and session metadata", _absolute),
    Key("fork_server", "ping_timeout_seconds", 10, "the watchdog: a fork server that does not answer a ping "
        "within this (pinged every third of it) is killed and replaced, and health says NOT_SERVING meanwhile; "
        "one that has answered nothing since it started gets 60 s (or this, if longer) first",
        _positive_seconds),
    Key("fork_server", "wait_seconds", 10, "how long a request may wait on the paths it names (opened as its "
        "caller), its session's build or its command's start; past it the request fails with DEADLINE_EXCEEDED "
        "naming the path (a FUSE, NFS or sshfs mount that does not answer), and nobody else waits",
        _positive_seconds),
    Key("fork_server", "stuck_openers_per_uid", 8, "path lookups one owner (a uid, a TLS principal) may have "
        "outstanding in the fork server: each request naming a path opens it as its caller in a child, which a "
        "file system that does not answer leaves stuck (D state: a pid, ~2 MB, a descriptor) until that mount goes. "
        "Past it, while some are stuck, that owner's requests naming paths are refused at once (RESOURCE_EXHAUSTED "
        "naming the stuck paths); a burst of lookups that answer waits its turn instead; local root's own are not "
        "counted", _whole(1, 4096)),
    Key("drain", "shutdown", "drain", "what SIGTERM does: drain (no new sessions or calls: UNAVAILABLE with a retry "
        "hint; the running calls finish, up to drain.timeout_seconds; then the daemon exits) or stop (every "
        "running call and sandbox is killed at once, as before); SIGINT always stops", _one_of("drain", "stop")),
    Key("drain", "timeout_seconds", 60, "how long a drain (SIGTERM, `sandboxd drain`) lets running calls finish; "
        "those still running then are killed, each with a CallStopped audit event (reason drain_timeout). Keep "
        "it below the service manager's stop timeout (systemd TimeoutStopSec, the pod's "
        "terminationGracePeriodSeconds)", _seconds_up_to(86400)),
    Key("sessions", "idle_expiry_seconds", 86400, "a session with no call (and no running call or background "
        "process) for this long is closed, with a SessionClosed event whose reason is idle_expiry, so a crashed "
        "agent's sessions do not live forever; 0: never", _seconds_up_to(365 * 86400, zero="never")),
    Key("supervisor", "survive_restart", True, "the fork server is a surviving supervisor: sessions and running "
        "calls outlive the daemon (a crash, SIGKILL, a restart or upgrade) and the next daemon on the same socket "
        "adopts them; false: they die with the daemon, as before", _boolean),
    Key("supervisor", "orphan_seconds", 600, "how long a surviving supervisor whose daemon is gone waits for the "
        "next one to attach; past it every sandbox is stopped (as a daemon's stop does) and it exits",
        _positive_seconds),
    Key("supervisor", "cgroup", "", "a cgroup (a path from the hierarchies' roots, e.g. /sandboxd.supervisor) "
        "the surviving supervisor moves itself into at start in every hierarchy it belongs to (v2 and each v1 "
        "one), with every sandbox below it, so that killing the daemon's own group (a container runtime "
        "replacing the daemon's pod) spares them; empty: it stays in the daemon's group (systemd: "
        "KillMode=process)", _supervisor_cgroup),
    Key("approvals", "timeout_seconds", 300, "a call nobody approves within this is denied", _positive_seconds),
    Key("audit", "event_bytes", 16384, "the most bytes one event keeps (its data as JSON): a longer value a caller "
        "chose (a command, a tool's arguments or result) is kept as its start (up to a quarter of this), its full "
        "length and SHA-256", _whole(1024, 1 << 20)),
    Key("audit", "owner_budget", "256M", "bytes one owner's (a uid, a TLS principal) sessions may add to the audit "
        "log per audit.budget_period_seconds (refilled evenly); past it that owner's new calls, sessions, policy "
        "changes and standing rules are refused (RESOURCE_EXHAUSTED) until it refills; local root is exempt",
        _size),
    Key("audit", "budget_period_seconds", 86400, "the period of audit.owner_budget", _positive_seconds),
    Key("audit", "min_free", "512M", "free space (counting root's reserve: the daemon writes it) the audit "
        "log's disk must keep, as a size or a share of the disk (\"5%\"); below it no new call, session or policy change starts "
        "(RESOURCE_EXHAUSTED) while reads keep working; \"0\": no floor", _min_free),
    Key("audit", "checkpoint_events", 1000, "events between signed checkpoints of the audit chain (one is also "
        "written at every shutdown and prune): the events after the last one are what someone without the key "
        "could rewrite unnoticed", _whole(1, 1_000_000)),
    Key("audit", "retain_days", 0, "events older than this many days are pruned, oldest first in whole chunks, "
        "under a signed checkpoint that spans the gap (sandboxd audit verify still says whole); 0: kept for good",
        _retain_days),
    Key("audit", "max_bytes", "0", "past this size of the audit database the oldest events are pruned the same "
        "way until it fits; an open session's last event and everything after it stay; \"0\": no bound",
        _audit_max_bytes),
    Key("audit.export", "sink", "none", "where the audit log is sent as OCSF JSON lines, at least once from a "
        "cursor kept in the state directory: \"none\", \"stdout\" (the daemon's standard output), \"file\" "
        "(audit.export.path, rotated) or \"otlp\" (OTLP logs over HTTP to audit.export.endpoint; needs the otlp "
        "extra)", _one_of("none", "stdout", "file", "otlp")),
    Key("audit.export", "path", "", "the file sink's file (absolute); empty: audit-export.ocsf.jsonl in "
        "state.dir", _optional_absolute),
    Key("audit.export", "max_bytes", "64M", "the file sink rotates before a record would take the file past "
        "this: FILE -> FILE.1 -> ... -> FILE.KEEP", _size),
    Key("audit.export", "keep", 5, "rotated files the file sink keeps (the oldest is removed)", _whole(1, 1000)),
    Key("audit.export", "endpoint", "", "the otlp sink's OTLP/HTTP logs URL, like "
        "http://127.0.0.1:4318/v1/logs", _otlp_endpoint),
    Key("audit.export", "batch", 500, "events read, sent and acknowledged at a time; a restart repeats at most "
        "one batch", _whole(1, 1000)),
    Key("policy", "allow_user_full_access", True, "a local non-root caller may create danger-full-access "
        "sessions, whose commands run on the host as that caller with its own rights and no more (a killable "
        "tree, the session's limits, the audit trail); false: only local root may (TLS callers never may)",
        _boolean),
    Key("tenancy", "mode", "uid", "who a tenant is: uid (a local user; root is the node's admin) or pod (on a "
        "Kubernetes node: a caller inside a pod is its pod, by the pod UID in its cgroup, whatever uid it runs as; "
        "uid 0 in a pod is not root: its own sessions, quotas and audit budget, no danger-full-access; a caller "
        "whose pod cannot be read from its cgroup is refused; callers in no pod stay uid tenants)",
        _one_of("uid", "pod")),
    Key("tenancy", "admin_pods", [], "under tenancy.mode = pod, the UIDs of pods whose callers are local callers "
        "of their uid (uid 0: the node's root, who sees every session and may use danger-full-access); the "
        "daemon's own pod always is one", _pod_uids),
    Key("tenancy", "cgroup_root", "/", "under tenancy.mode = pod, the cgroup kubelet's kubepods cgroup is in "
        "(kubelet --cgroup-root with the cgroupfs driver); a kubepods or kubepods.slice cgroup anywhere else names "
        "no pod", _absolute),
    Key("network", "dns", [], "resolvers for isolated networks; empty: the host's", _ipv4_list),
    Key("network", "pool", "10.233.0.0/16", "addresses of isolated networks, a /30 per sandbox", _cidr),
    Key("network", "upstream_proxy", "", "http://HOST:PORT of a proxy every connection the egress proxy lets out "
        "goes through (by CONNECT); the allowlists, endpoint rules and credentials still apply here; empty: none",
        _upstream_proxy),
    Key("network", "upstream_ca_file", "", "a PEM file of CA certificates trusted for upstream servers (a "
        "corporate proxy's) besides the host's store, and added to every proxied sandbox's bundle; root's and "
        "not group or other writable; empty: none", _optional_absolute),
    Key("network", "allowed_ranges", [], "IPv4 networks the egress proxy may reach although they are in a refused "
        "range (an intercepting mirror on 10.x); never loopback or a cloud metadata address", _allowed_ranges),
    Key("network", "secrets", {}, "secrets sessions may name instead of sending one (--daemon-credential VAR=NAME): "
        "NAME = { file = \"/etc/sandboxd/secrets/NAME\", upstreams = [\"https://api.github.com\"], users = [...], "
        "groups = [...] } (optional inject = \"HEADER: TEMPLATE\" or \"basic[:USER]\" fixes how it is sent); the "
        "file root's, mode 0600, read at each use; a credential naming it must target one of its upstreams", _secrets),
    Key("defaults", "sandbox_policy", "workspace-write", "the sandbox of a session that does not ask for one",
        _one_of("read-only", "workspace-write")),
    Key("defaults", "network_access", False, "network access of such a session (isolated)", _boolean),
    Key("defaults", "approval_policy", "on-request", "the approval policy of a session that does not ask for one",
        _one_of("never", "on-request", "always")),
    Key("defaults", "timeout_seconds", 0, "per-call timeout of sessions that set none; 0: none", _seconds_or_zero),
    Key("defaults", "memory", "", "memory limit of sessions that set none (512M, 2G); empty: min(8G, half of "
        "RAM)", _size_or_empty),
    Key("defaults", "pids", 0, "process (task) limit of sessions that set none; 0: 1024", _whole(0, 1 << 22)),
    Key("limits", "max_memory", "", "the most memory a session may ask for (more is refused); empty: "
        "limits.total_memory", _size_or_empty),
    Key("limits", "max_pids", 0, "the most processes (tasks) a session may ask for; 0: limits.total_pids",
        _whole(0, 1 << 22)),
    Key("limits", "total_memory", "", "memory of all sandboxes together (the cap of their parent cgroup); "
        "empty: three quarters of RAM", _size_or_empty),
    Key("limits", "total_pids", 0, "tasks of all sandboxes together (the cap of their parent cgroup); 0: half "
        "of the smaller of kernel.pid_max and kernel.threads-max", _whole(0, 1 << 22)),
    Key("limits", "owner_pids", 0, "tasks of all sandboxes of one owner (a uid, a TLS principal; root's own "
        "sessions have no share) together; 0: a fifth of limits.total_pids, so four owners at their share "
        "leave a fifth for the rest", _whole(0, 1 << 22)),
    Key("limits", "session_ptys", DEFAULT_PTYS, "terminals (ptys) one session's sandbox may hold at once: its own "
        "devpts is mounted with this max=, and past it the next one opened there fails with ENOSPC. Every sandbox "
        "draws on one kernel-wide pool (kernel.pty.max minus kernel.pty.reserve, 3072 by default): a user holds at "
        "most quotas.sessions_per_uid times this", _whole(1, MAX_PTYS)),
    Key("limits", "owner_memory", "", "memory of all sandboxes of one owner together; empty: no share (only "
        "limits.total_memory: the OOM killer acts there)", _size_or_empty),
    Key("limits", "charge_pods", False, "on Kubernetes: a session of a caller in a pod gets its cgroup under "
        "the pod's, beside its containers, so the pod's memory and pids limits cover it and the pod pays for it "
        "(removed when the session closes; the session is closed when the pod's containers are gone); callers "
        "outside a pod keep the daemon's own layout", _boolean),
    Key("review", "default", False, "review mode for a workspace-write session whose CreateSession does not say "
        "(its writes are kept in a change set under state.dir and reach the host only when applied: "
        "docs/review-mode.md); a session asks for it or not with `review`", _boolean),
    Key("review", "session_bytes", DEFAULT_REVIEW_SESSION_BYTES, "bytes one review session's change set may hold "
        "(its upper layers, in a tmpfs of this size: memory, counted in the session's memory limit); past it the "
        "sandbox's writes get ENOSPC. \"0\": no bound at all, the change sets are plain directories on the state "
        "directory's disk (for a host that bounds that disk otherwise)", _review_bytes(zero=True)),
    Key("review", "owner_bytes", DEFAULT_REVIEW_OWNER_BYTES, "bytes all review sessions of one owner (a uid, a TLS "
        "principal) may hold together, kept change sets included: a new session gets the smaller of "
        "review.session_bytes and what the owner's others leave, and is refused (RESOURCE_EXHAUSTED) under 1 MiB. "
        "A store takes its bytes and 1 KiB of kernel memory for each file it may hold (one per 4 KiB of its size; "
        "a closed session's: those it holds)", _review_bytes(zero=False)),
    Key("review", "owner_stores", 128, "review change sets one owner (a uid, a TLS principal) may keep at once, open "
        "and closed sessions' together: past it CreateSession of a review session is refused (RESOURCE_EXHAUSTED "
        "naming this key) until some are applied or discarded. Each costs the fork server a look when the "
        "owner's next one is made; 0: no cap (review.owner_bytes still bounds them)", _whole(0, 1 << 16)),
    Key("review", "keep_days", 14, "days a closed review session's change set with pending changes is kept (to "
        "list, apply or discard: docs/review-mode.md) before the daemon's sweep removes it, with an audit event; "
        "0: kept until applied or discarded. A fraction of a day is taken as it is", _days_or_zero),
    Key("review", "max_checkpoints", DEFAULT_CHECKPOINTS, "checkpoints one review session keeps (each a layer of "
        "its overlays, made in O(changes since the last one)); past it the oldest two are merged into one: "
        "the oldest point is forgotten (no rollback reaches it), its changes stay", _whole(1, MAX_CHECKPOINTS)),
    Key("metrics", "listen", "", "HOST:PORT of the Prometheus metrics listener (HTTP, /metrics); empty: none",
        _listen_address),
    Key("log", "level", "info", "info: the daemon's life and its problems; debug: also every decision and call "
        "end, each line with its session_id and call_id (the event store records them all anyway)",
        _one_of("debug", "info", "warning")),
    Key("log", "format", "json", "json: one JSON object per line on stderr; text: plain lines", _one_of("json", "text")),
)
_BY_NAME = {key.dotted: key for key in KEYS}


class Config(Record):
    """The values of every key (dotted name -> value, each passed its key's check), and the file read.

    Read them through the typed accessors: a key read as the wrong type is a bug here, not a bad file."""
    values: Mapping[str, object]        # read-only
    path: str | None

    def __getitem__(self, dotted: str) -> object:
        return self.values[dotted]

    def text(self, dotted: str) -> str:
        value = self.values[dotted]
        if not isinstance(value, str):
            raise TypeError(f"configuration key {dotted} is {value!r}, not a string")
        return value

    def whole(self, dotted: str) -> int:
        value = self.values[dotted]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"configuration key {dotted} is {value!r}, not a whole number")
        return value

    def number(self, dotted: str) -> float:
        value = self.values[dotted]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"configuration key {dotted} is {value!r}, not a number")
        return float(value)

    def flag(self, dotted: str) -> bool:
        value = self.values[dotted]
        if not isinstance(value, bool):
            raise TypeError(f"configuration key {dotted} is {value!r}, not true or false")
        return value

    def texts(self, dotted: str) -> tuple[str, ...]:
        value = self.values[dotted]
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise TypeError(f"configuration key {dotted} is {value!r}, not a list of strings")
        return tuple(value)

    def table(self, dotted: str) -> dict[str, str]:
        value = self.values[dotted]
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
            raise TypeError(f"configuration key {dotted} is {value!r}, not a table of strings")
        return dict(value)


def default_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """The file a daemon without --config reads, if any."""
    explicit = environ.get(CONFIG_ENV)
    if explicit:
        return explicit
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


# The flags of ``sandboxd serve`` that set a key (cli.serve builds its parser from this).
FLAGS: dict[str, str] = {
    "listen.socket": "--socket", "listen.admin_group": "--admin-group", "listen.workers": "--workers",
    "state.dir": "--state-dir", "network.dns": "--dns", "approvals.timeout_seconds": "--approval-timeout",
    "tls.address": "--tcp", "tls.cert": "--tls-cert", "tls.key": "--tls-key", "tls.client_ca": "--tls-client-ca",
    "tls.user": "--tcp-user", "log.format": "--log-format", "log.level": "--log-level",
    "metrics.listen": "--metrics", "network.upstream_proxy": "--upstream-proxy",
    "network.upstream_ca_file": "--upstream-ca-file"}
_TLS = ("tls.address", "tls.cert", "tls.key", "tls.client_ca")


def load(path: str | None = None, *, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, object] | None = None) -> "DaemonSettings":
    """The daemon's settings: the built-in defaults, then the file ``path`` (None: the one
    ``$SANDBOXD_CONFIG`` in ``environ`` names, else DEFAULT_PATH if it exists), then ``environ``'s
    ``SANDBOXD_<SECTION>_<KEY>`` variables, then ``flags`` (dotted key -> value: the command
    line's), each checked as it comes in and all of them together at the end, with what they
    name (groups, users, TLS files). ConfigError naming where the bad value came from, the key
    and what to fix. ``environ`` None: the process's own."""
    environ = os.environ if environ is None else environ
    path = path or default_path(environ)
    values = _defaults()
    _overlay_file(values, path)
    sources = {dotted: path or BUILT_IN for dotted in values}
    sources.update(_overlay_environment(values, environ))
    for dotted, value in (flags or {}).items():
        key = _BY_NAME[dotted]               # a KeyError is a bug in the caller: flags are ours
        _set(values, FLAGS.get(dotted, dotted), key, value)
        sources[dotted] = FLAGS.get(dotted, dotted)
    flagged = {FLAGS[k] for k in (flags or {}) if k.startswith("tls.") and k in FLAGS}
    if flagged and not all(values[k] for k in _TLS):
        raise ConfigError("command line", "tls", "a TCP listener needs all of --tcp, --tls-cert, --tls-key and "
                          "--tls-client-ca (tls.address, tls.cert, tls.key, tls.client_ca): there is no "
                          "plain-text or unauthenticated TCP")
    from sandboxd.config.settings import settings_from

    return settings_from(*_check_together(values, path), sources)


def env_name(key: Key) -> str:
    """The environment variable that sets ``key``: ``SANDBOXD_<SECTION>_<NAME>``."""
    return f"SANDBOXD_{key.section}_{key.name}".replace(".", "_").upper()


def read_file(path: str | None) -> Config:
    """The built-in defaults, overlaid with ``path`` (None: defaults only), every key and the
    keys together checked. ConfigError on any problem. (``load`` adds the environment and flags.)"""
    values = _defaults()
    _overlay_file(values, path)
    return _check_together(values, path)[0]


def _defaults() -> dict[str, object]:
    return {key.dotted: key.default for key in KEYS}


def _overlay_file(values: dict[str, object], path: str | None) -> None:
    if path is None:
        return
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from None
    _overlay_tables(values, path, data, "")


def _overlay_tables(values: dict[str, object], path: str, data: dict[str, object], outer: str) -> None:
    """The keys of each [section] (and [section.sub], such as [audit.export]) of ``data``."""
    sections = {k.section for k in KEYS}
    for part, table in data.items():
        section = f"{outer}.{part}" if outer else part
        if not isinstance(table, dict):
            raise ConfigError(path, section, "must be a [section] table; known sections: "
                              + ", ".join(sorted(sections)))
        for name, value in table.items():
            if isinstance(value, dict) and f"{section}.{name}" in sections:
                _overlay_tables(values, path, {name: value}, section)
                continue
            key = _BY_NAME.get(f"{section}.{name}")
            if key is None:
                known = [k.name for k in KEYS if k.section == section]
                hint = f"known keys of [{section}]: {', '.join(known)}" if known else \
                    f"known sections: {', '.join(sorted({k.section for k in KEYS}))}"
                raise ConfigError(path, f"{section}.{name}", f"unknown key ({hint})")
            _set(values, path, key, value)


def _set(values: dict[str, object], source: str, key: Key, value: object) -> None:
    problem = key.check(value)
    if problem:
        raise ConfigError(source, key.dotted, problem)
    values[key.dotted] = value


# SANDBOXD_* variables that are not configuration keys: read by sandboxd itself (the client's
# socket, the MCP token, the allocation tracer, set-up's bin directory) or by its tests, benchmarks
# and packaging scripts. Any other SANDBOXD_* variable that looks like a key (it starts with a
# section's prefix, or is close to a key's variable) is a typo, refused by ``load``.
OTHER_VARIABLES = frozenset({
    CONFIG_ENV, "SANDBOXD_SOCKET", "SANDBOXD_MCP_TOKEN", "SANDBOXD_TRACEMALLOC", "SANDBOXD_TRACEMALLOC_INTERVAL",
    "SANDBOXD_TRACEMALLOC_FRAMES", "SANDBOXD_BIN_DIR", "SANDBOXD_DEBIAN_MIRROR", "SANDBOXD_CONFORMANCE",
    "SANDBOXD_VNG_VENV", "SANDBOXD_CI_MATRIX", "SANDBOXD_CI_MATRIX_ARGS", "SANDBOXD_CI_MATRIX_TIMEOUT",
    "SANDBOXD_CALL_SOURCE", "SANDBOXD_CALL_H", "SANDBOXD_BENCH_SOURCE", "SANDBOXD_TEST_SLOW",
    "SANDBOXD_TEST_DAEMON_START", "SANDBOXD_TESTS_REVIEW", "SANDBOXD_FUZZ_EXAMPLES", "SANDBOXD_FUZZ_BATCHES",
    "SANDBOXD_CLASSIFY_EXAMPLES", "SANDBOXD_GIT_DIFF_EXAMPLES"})
CLOSE_ENOUGH = 0.8          # difflib's ratio above which a variable is taken for a key's, mistyped


def mistyped_variable(name: str) -> str | None:
    """The problem with ``$name`` when it looks like a key's variable but is none (the closest
    key named), else None (a key's own variable, one of OTHER_VARIABLES, or unrelated)."""
    import difflib

    by_variable = {env_name(key): key for key in KEYS}
    if not name.startswith("SANDBOXD_") or name in by_variable or name in OTHER_VARIABLES:
        return None
    # A section's variables share their prefix (env_name without the key's own name).
    prefixes = {variable[:-len(key.name)]: key.section for variable, key in by_variable.items()}
    section = next((section for prefix, section in prefixes.items() if name.startswith(prefix)), None)
    close = difflib.get_close_matches(name, by_variable, n=1, cutoff=CLOSE_ENOUGH)
    if not close and section is not None:     # a section's prefix: its nearest key, however far
        close = difflib.get_close_matches(name, [v for v, k in by_variable.items() if k.section == section],
                                          n=1, cutoff=0.0)
    if not close:
        return None
    key = by_variable[close[0]]
    return (f"no configuration key is set by this variable: did you mean ${close[0]} ({key.dotted})? "
            "(unset it, or rename it)")


def _overlay_environment(values: dict[str, object], environ: Mapping[str, str]) -> dict[str, str]:
    """Set the keys ``environ`` names; returns each one's variable (key -> "$NAME"). A variable
    that looks like a key's but is none (mistyped_variable) is refused, in name order."""
    for name in sorted(environ):
        problem = mistyped_variable(name)
        if problem:
            raise ConfigError(f"${name}", "", problem)
    given: dict[str, str] = {}
    for key in KEYS:
        name = env_name(key)
        text = environ.get(name)
        if text is None:
            continue
        value: object = text
        if not isinstance(key.default, str):
            try:
                value = tomllib.loads(f"value = {text}")["value"]
            except tomllib.TOMLDecodeError:
                raise ConfigError(f"${name}", key.dotted, f"{text!r} is not a TOML value (like 8, true or "
                                  "[\"192.0.2.53\"])") from None
        _set(values, f"${name}", key, value)
        given[key.dotted] = f"${name}"
    return given


def _check_together(values: dict[str, object], path: str | None) -> "tuple[Config, ResourceLimits]":
    """The checks of keys against each other, once every source is in; the checked values and
    the resource limits they resolve to."""
    from types import MappingProxyType

    checked = Config(MappingProxyType(dict(values)), path)
    where = path or BUILT_IN
    reserved, workers = checked.whole("quotas.reserved_workers"), checked.whole("listen.workers")
    if 0 < reserved >= workers:
        raise ConfigError(where, "quotas.reserved_workers", f"must be below listen.workers "
                          f"({workers}): the rest serve running calls and streams")
    limits = resource_limits(checked)            # the limits must nest: defaults <= max <= total
    tls = [values[dotted] for dotted in _TLS]
    if any(tls) and not all(tls):
        raise ConfigError(where, "tls", "a TCP listener needs all of address, cert, key and client_ca")
    _check_export(checked, where)
    return checked, limits


def _check_export(config: Config, where: str) -> None:
    """[audit.export]: what its sink needs (``serve`` and ``config check`` refuse the same)."""
    sink = config.text("audit.export.sink")
    if sink == "otlp" and not config.text("audit.export.endpoint"):
        raise ConfigError(where, "audit.export.endpoint", "the otlp sink needs the collector's OTLP/HTTP logs "
                          "URL, like \"http://127.0.0.1:4318/v1/logs\"")
    if sink == "otlp":
        import importlib.util

        try:
            found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
        except ModuleNotFoundError:
            # A parent package is missing: opentelemetry-api alone (the MCP SDK brings it) has no
            # opentelemetry.exporter, and find_spec imports the parents of the name it is asked for.
            found = False
        if not found:
            raise ConfigError(where, "audit.export.sink", "\"otlp\" needs the OpenTelemetry SDK, which is not "
                              "installed: install sandboxd's otlp extra (pip install 'sandboxd[otlp]') or choose "
                              "another sink")


class ResourceLimits(Record):
    """The daemon's limits with the host-derived defaults filled in (bytes and task counts)."""
    memory: int              # a session's when it sets none
    pids: int
    max_memory: int          # the most a session may ask for
    max_pids: int
    total_memory: int        # all sandboxes together: their parent cgroup's caps
    total_pids: int
    owner_pids: int          # all sandboxes of one owner together: the caps of its group
    owner_memory: int = 0    # 0: none


def resource_limits(config: Config) -> ResourceLimits:
    """The ``defaults``/``limits`` keys resolved against this host (kernel.host_limits); ConfigError
    when they do not nest (a default above its maximum, a maximum above the total)."""
    from sandboxd.kernel import host_limits
    from sandboxd.policy import parse_size

    def size(dotted: str) -> int | None:
        text = config.text(dotted)
        return parse_size(text, dotted) if text else None

    ceiling = host_limits.default_ceiling()
    total_memory = size("limits.total_memory") or ceiling.memory_bytes or 0
    total_pids = config.whole("limits.total_pids") or ceiling.pids or 0
    max_memory = size("limits.max_memory") or total_memory
    max_pids = config.whole("limits.max_pids") or total_pids
    owner_pids = config.whole("limits.owner_pids") or host_limits.owner_pids(total_pids)
    owner_memory = size("limits.owner_memory") or 0
    # The built-in defaults shrink to fit a smaller maximum or share; a default set in the file must fit as it is.
    resolved = ResourceLimits(
        memory=size("defaults.memory") or min(host_limits.default_memory(), max_memory, owner_memory or max_memory),
        pids=config.whole("defaults.pids") or min(host_limits.DEFAULT_PIDS, max_pids, owner_pids),
        max_memory=max_memory, max_pids=max_pids, total_memory=total_memory, total_pids=total_pids,
        owner_pids=owner_pids, owner_memory=owner_memory)
    path = config.path or BUILT_IN
    nested = [("defaults.memory", "limits.max_memory"), ("limits.max_memory", "limits.total_memory"),
              ("defaults.pids", "limits.max_pids"), ("limits.max_pids", "limits.total_pids"),
              ("defaults.pids", "limits.owner_pids"), ("limits.owner_pids", "limits.total_pids")]
    if owner_memory:
        nested += [("defaults.memory", "limits.owner_memory"), ("limits.owner_memory", "limits.total_memory")]
    within = {"limits.max": "its maximum", "limits.owner": "its owner's share", "limits.total": "the total of all sandboxes"}
    for low, high in nested:
        below, above = _resolved_value(resolved, low), _resolved_value(resolved, high)
        if below > above:
            what = "an owner's share" if low.startswith("limits.owner") else "a session's limit"
            raise ConfigError(path, low, f"{below} is above {high} ({above}): {what} must fit under "
                              f"{within[high.rsplit('_', 1)[0]]}; lower {low} or raise {high}")
    return resolved


def _resolved_value(resolved: ResourceLimits, dotted: str) -> int:
    return {"defaults.memory": resolved.memory, "defaults.pids": resolved.pids,
            "limits.max_memory": resolved.max_memory, "limits.max_pids": resolved.max_pids,
            "limits.total_memory": resolved.total_memory, "limits.total_pids": resolved.total_pids,
            "limits.owner_pids": resolved.owner_pids, "limits.owner_memory": resolved.owner_memory}[dotted]


def defaults_file() -> str:
    """A configuration file with every key at its default, each with its documentation."""
    lines = ["# sandboxd configuration (TOML). Every key is shown with its default.", ""]
    section = ""
    for key in KEYS:
        if key.section != section:
            section = key.section
            lines += ([""] if len(lines) > 2 else []) + [f"[{section}]"]
        value = key.default
        rendered = ("[]" if value == [] else "{}" if value == {} else f'"{value}"' if isinstance(value, str)
                    else str(value).lower() if isinstance(value, bool) else str(value))
        lines += [f"# {key.doc}", f"{key.name} = {rendered}"]
    return "\n".join(lines) + "\n"
