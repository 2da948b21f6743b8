"""The daemon's configuration file: one TOML file, every key documented with its default.

Where it is read from: ``sandboxd serve --config FILE``, else ``$SANDBOXD_CONFIG``, else
``/etc/sandboxd/sandboxd.toml`` when it exists (built-in defaults otherwise). Command-line flags
win over the file. An unknown key, a bad value or a file that is not TOML stops the daemon at
start-up with the file, the key and what is wrong; ``sandboxd config check FILE`` says the same
without starting anything, and ``sandboxd config defaults`` prints a file with every key.
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

DEFAULT_PATH = "/etc/sandboxd/sandboxd.toml"


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


def _cidr(value: object) -> str | None:
    import ipaddress

    try:
        network = ipaddress.ip_network(str(value))
    except ValueError:
        return f"must be an IPv4 network like 10.233.0.0/16, not {value!r}"
    if network.version != 4 or network.prefixlen > 29:
        return "must be an IPv4 network of /29 or larger (each sandbox takes a /30)"
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
    Key("quotas", "published_connections_per_session", 256, "connections open at once to a session's published "
        "ports, from anyone; more are refused at once", _whole(1, 65536)),
    Key("quotas", "published_connections_per_peer", 32, "connections open at once to a session's published ports "
        "from one local user (by the uid of its socket; an address when none) other than the session's owner; "
        "as many (at most half the session's cap) stay reserved for the owner", _whole(1, 65536)),
    Key("quotas", "sessions_per_uid", 64, "open sessions one local user (a TLS caller: one certificate) may hold; "
        "root is exempt", _whole(1, 100000)),
    Key("quotas", "calls_per_uid", 16, "calls one user may have running at once: Exec, file tools, search, patches "
        "and Authorize, including those held for approval; root is exempt. 4 users at calls_per_uid + "
        "streams_per_uid must leave room in listen.workers for a fifth (checked at start)", _whole(1, 1024)),
    Key("quotas", "background_per_uid", 16, "background processes (StartBackground) one user's sessions keep, "
        "running or ended with their output (up to 4 MiB each) still readable; starting one more forgets that "
        "user's oldest ended one, and with all of them running it is refused; root is exempt", _whole(1, 1024)),
    Key("quotas", "streams_per_uid", 4, "open WatchEvents and following ReadBackgroundOutput streams per user; "
        "root is exempt", _whole(1, 1024)),
    Key("quotas", "reserved_workers", 0, "workers that running calls and streams (everyone's, root's too) may never "
        "take: they stay free for short calls (CreateSession, CloseSession, ResolveApproval ...); must be below "
        "listen.workers; 0: a quarter of listen.workers (at least 1)", _whole(0, 1023)),
    Key("tls", "address", "", "HOST:PORT of an optional TCP listener; it always needs TLS and client "
        "certificates (all four tls keys)", _text),
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
        "within this (pinged every third of it) is killed and replaced, and health says NOT_SERVING meanwhile",
        _positive_seconds),
    Key("fork_server", "wait_seconds", 10, "how long a request may wait on the paths it names (opened as its "
        "caller), its session's build or its command's start; past it the request fails with DEADLINE_EXCEEDED "
        "naming the path (a FUSE, NFS or sshfs mount that does not answer), and nobody else waits",
        _positive_seconds),
    Key("approvals", "timeout_seconds", 300, "a call nobody approves within this is denied", _positive_seconds),
    Key("policy", "allow_user_full_access", True, "a local non-root caller may create danger-full-access "
        "sessions, whose commands run on the host as that caller with its own rights and no more (a killable "
        "tree, the session's limits, the audit trail); false: only local root may (TLS callers never may)",
        _boolean),
    Key("network", "dns", [], "resolvers for isolated networks; empty: the host's", _ipv4_list),
    Key("network", "pool", "10.233.0.0/16", "addresses of isolated networks, a /30 per sandbox", _cidr),
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
    Key("limits", "owner_memory", "", "memory of all sandboxes of one owner together; empty: no share (only "
        "limits.total_memory: the OOM killer acts there)", _size_or_empty),
    Key("metrics", "listen", "", "HOST:PORT of the Prometheus metrics listener (HTTP, /metrics); empty: none",
        _text),
    Key("log", "level", "info", "info: the daemon's life and its problems; debug: also every decision and call "
        "end, each line with its session_id and call_id (the event store records them all anyway)",
        _one_of("debug", "info", "warning")),
    Key("log", "format", "json", "json: one JSON object per line on stderr; text: plain lines", _one_of("json", "text")),
)
_BY_NAME = {key.dotted: key for key in KEYS}


class Config(Record):
    """The values of every key (dotted name -> value, each passed its key's check), and the file read.

    Read them through the typed accessors: a key read as the wrong type is a bug here, not a bad file."""
    values: dict[str, object]
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


def default_path() -> str | None:
    """The file a daemon without --config reads, if any."""
    explicit = os.environ.get("SANDBOXD_CONFIG")
    if explicit:
        return explicit
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def load(path: str | None) -> Config:
    """The built-in defaults, overlaid with ``path`` (None: defaults only). ConfigError on any problem."""
    values: dict[str, object] = {key.dotted: key.default for key in KEYS}
    if path is None:
        return Config(values, None)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(path, section, "must be a [section] table; known sections: "
                              + ", ".join(sorted({k.section for k in KEYS})))
        for name, value in table.items():
            key = _BY_NAME.get(f"{section}.{name}")
            if key is None:
                known = [k.name for k in KEYS if k.section == section]
                hint = f"known keys of [{section}]: {', '.join(known)}" if known else \
                    f"known sections: {', '.join(sorted({k.section for k in KEYS}))}"
                raise ConfigError(path, f"{section}.{name}", f"unknown key ({hint})")
            problem = key.check(value)
            if problem:
                raise ConfigError(path, key.dotted, problem)
            values[key.dotted] = value
    checked = Config(values, path)
    reserved, workers = checked.whole("quotas.reserved_workers"), checked.whole("listen.workers")
    if 0 < reserved >= workers:
        raise ConfigError(path, "quotas.reserved_workers", f"must be below listen.workers "
                          f"({workers}): the rest serve running calls and streams")
    resource_limits(checked)                     # the limits must nest: defaults <= max <= total
    tls = [values[f"tls.{name}"] for name in ("address", "cert", "key", "client_ca")]
    if any(tls) and not all(tls):
        raise ConfigError(path, "tls", "a TCP listener needs all of address, cert, key and client_ca")
    return Config(values, path)


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
    path = config.path or "(built-in defaults)"
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
