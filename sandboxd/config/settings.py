"""The settings the daemon is built from (``config.load`` makes them): one frozen record, every
field typed and ready to use, and what the keys name already looked up and read, so a bad value
stops the start here, once, never half-way through it."""

from __future__ import annotations

from dataclasses import dataclass, field
import ipaddress
import os
from typing import Callable, Mapping

from sandboxd.config import (BUILT_IN, Config, ConfigError, ResourceLimits, split_listen_address,
                             split_upstream_proxy)
from sandboxd.errors import InvalidPolicy, SandboxdError
from sandboxd.kernel import host_limits
from sandboxd.policy.audit_export import AuditExport
from sandboxd.policy.audit_limits import AuditLimits, parse_min_free
from sandboxd.policy.decision import approval_policy
from sandboxd.policy.ipv4 import port as tcp_port
from sandboxd.policy.limits import parse_size
from sandboxd.policy.spec import MAX_TRUST_PEM, PEM_BEGIN, check_trust_pem
from sandboxd.policy.quota_limits import QuotaLimits
from sandboxd.policy.sandbox import sandbox_mode
from sandboxd.policy.session_defaults import SessionDefaults

TLS_FILES = ("tls.cert", "tls.key", "tls.client_ca")


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """The optional TCP listener: TLS, and a client certificate signed by ``client_ca`` required.
    Its callers are named by ``identity`` (service.callers: the common name, or a URI or DNS
    subject alternative name) and act as the local user ``users`` maps them to, else ``uid:gid``."""
    address: str
    port: int
    cert: bytes                   # PEM, read once at load: a file that cannot be read stops the start
    key: bytes
    client_ca: bytes
    uid: int
    gid: int
    identity: str
    users: Mapping[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class SecretSource:
    """A daemon-side secret (``[network.secrets] NAME``): its file, read at each use (service
    side: owner root, mode 0600), who may name it besides root, the only upstreams (host, port) a
    credential using it may target, and, when the entry fixes it, how it is sent
    ((header, template, basic user) of a CredentialSpec)."""
    file: str
    uids: tuple[int, ...]
    gids: tuple[int, ...]
    upstreams: tuple[tuple[str, int], ...] = ()
    inject: tuple[str, str, str | None] | None = None


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Everything the daemon is built from, checked once by ``load``: each field is ready to use."""
    source: Config                # every key's value as checked, and the file read (None: none)
    socket: str
    socket_mode: int
    admin_gid: int | None
    workers: int
    connections_per_uid: int
    quotas: QuotaLimits
    tls: TlsSettings | None
    state_dir: str
    ping_timeout: float
    wait_seconds: float
    stuck_openers: int
    approval_timeout: float
    survive_restart: bool               # supervisor.survive_restart: sandboxes outlive the daemon
    orphan_seconds: float               # supervisor.orphan_seconds
    supervisor_cgroup: str              # supervisor.cgroup: its own v2 group ("": the daemon's)
    audit: AuditLimits
    audit_export: AuditExport
    allow_user_full_access: bool
    dns: tuple[str, ...]
    network_pool: str
    proxy_connections: int
    published_connections: int
    published_per_peer: int
    session_defaults: SessionDefaults
    metrics_listen: str
    log_format: str
    log_level: str
    review_session_bytes: int     # review.session_bytes (0: no bound), for kernel.review_space.make_store
    review_owner_bytes: int       # review.owner_bytes
    review_owner_stores: int      # review.owner_stores (0: no cap)
    review_keep_days: float       # review.keep_days (0: kept for good), for service.review_expiry
    upstream_proxy: tuple[str, int] | None = None   # network.upstream_proxy as (host, port)
    upstream_ca_pem: bytes = b""  # network.upstream_ca_file's certificates, read once at load
    allowed_ranges: tuple[str, ...] = ()            # network.allowed_ranges, canonical
    secrets: Mapping[str, SecretSource] = field(default_factory=dict)   # network.secrets, users looked up
    network_questions: int = 16   # quotas.network_questions_per_session
    intercepted_connections: int = 64   # quotas.intercepted_connections_per_session
    tenancy_mode: str = "uid"     # tenancy.mode: "uid" or "pod" (service.principals)
    admin_pods: frozenset[str] = frozenset()        # tenancy.admin_pods
    cgroup_root: str = "/"        # tenancy.cgroup_root
    shutdown: str = "drain"       # drain.shutdown: what SIGTERM does (service.daemon)
    drain_timeout: float = 60.0   # drain.timeout_seconds
    idle_expiry: float = 86400.0  # sessions.idle_expiry_seconds (0: never), for service.idle_expiry

    @property
    def config_path(self) -> str | None:
        return self.source.path


def settings_from(config: Config, limits: ResourceLimits, sources: Mapping[str, str]) -> DaemonSettings:
    """``config`` (every key checked, and the keys together; ``limits``: its resource limits
    resolved) as the daemon's settings, with what the keys name looked up: the admin group, the
    TLS files and users; the quotas checked against the workers. ``sources``: where each key's
    value came from, for the messages."""
    def refuse(dotted: str, problem: str) -> ConfigError:
        return ConfigError(sources.get(dotted, config.path or BUILT_IN), dotted, problem)

    admin_gid = None
    group = config.text("listen.admin_group")
    if group:
        from sandboxd.kernel.users import group_id
        try:
            admin_gid = group_id(group)
        except KeyError:
            raise refuse("listen.admin_group", f"no group {group!r} on this machine: name an existing group "
                         "(or its number), or leave it empty (only root sees every session)") from None
    try:
        quotas = QuotaLimits(sessions_per_uid=config.whole("quotas.sessions_per_uid"),
                             root_sessions=config.whole("quotas.root_sessions"),
                             calls_per_uid=config.whole("quotas.calls_per_uid"),
                             streams_per_uid=config.whole("quotas.streams_per_uid"),
                             requests_per_uid=config.whole("quotas.requests_per_uid"),
                             terminals_per_uid=config.whole("quotas.terminals_per_uid"),
                             background_per_uid=config.whole("quotas.background_per_uid"),
                             git_watches_per_uid=(config.whole("quotas.git_watches_per_uid")
                                                  or host_limits.owner_watches()),
                             git_inotify_instances=(config.whole("quotas.git_inotify_instances")
                                                    or host_limits.git_instances()),
                             reserved_workers=config.whole("quotas.reserved_workers"),
                             workers=config.whole("listen.workers"))
    except SandboxdError as exc:
        raise refuse("quotas", str(exc)) from None
    min_free_bytes, min_free_percent = parse_min_free(config.text("audit.min_free"))
    try:
        audit = AuditLimits(event_bytes=config.whole("audit.event_bytes"),
                            owner_budget_bytes=parse_size(config.text("audit.owner_budget"), "audit.owner_budget"),
                            budget_period_seconds=config.number("audit.budget_period_seconds"),
                            min_free_bytes=min_free_bytes, min_free_percent=min_free_percent,
                            checkpoint_events=config.whole("audit.checkpoint_events"),
                            retain_days=config.number("audit.retain_days"),
                            max_bytes=_size_or_zero(config, "audit.max_bytes"))
    except SandboxdError as exc:
        raise refuse("audit", str(exc)) from None
    try:
        audit_export = AuditExport(
            sink=config.text("audit.export.sink"),
            path=config.text("audit.export.path") or os.path.join(config.text("state.dir"), "audit-export.ocsf.jsonl"),
            max_bytes=parse_size(config.text("audit.export.max_bytes"), "audit.export.max_bytes"),
            keep=config.whole("audit.export.keep"), endpoint=config.text("audit.export.endpoint"),
            batch=config.whole("audit.export.batch"))
    except SandboxdError as exc:                  # each problem starts with the key it is about
        named = str(exc).split(" ", 1)[0]
        raise refuse(named if named.startswith("audit.export.") else "audit.export", str(exc)) from None
    defaults = SessionDefaults(
        sandbox=sandbox_mode(config.text("defaults.sandbox_policy")),
        network_access=config.flag("defaults.network_access"),
        approval=approval_policy(config.text("defaults.approval_policy")),
        timeout_seconds=config.number("defaults.timeout_seconds") or None,
        memory_bytes=limits.memory, pids=limits.pids, max_memory_bytes=limits.max_memory, max_pids=limits.max_pids,
        total_memory_bytes=limits.total_memory, total_pids=limits.total_pids,
        owner_memory_bytes=limits.owner_memory or None, owner_pids=limits.owner_pids,
        ptys=config.whole("limits.session_ptys"), review=config.flag("review.default"),
        charge_pods=config.flag("limits.charge_pods"),
        max_checkpoints=config.whole("review.max_checkpoints"))
    return DaemonSettings(
        source=config, socket=config.text("listen.socket"), socket_mode=int(config.text("listen.socket_mode"), 8),
        admin_gid=admin_gid, workers=config.whole("listen.workers"),
        connections_per_uid=config.whole("quotas.connections_per_uid"), quotas=quotas,
        tls=_tls(config, refuse), state_dir=config.text("state.dir"),
        ping_timeout=config.number("fork_server.ping_timeout_seconds"),
        wait_seconds=config.number("fork_server.wait_seconds"),
        stuck_openers=config.whole("fork_server.stuck_openers_per_uid"),
        approval_timeout=config.number("approvals.timeout_seconds"), audit=audit, audit_export=audit_export,
        survive_restart=config.flag("supervisor.survive_restart"),
        orphan_seconds=config.number("supervisor.orphan_seconds"),
        supervisor_cgroup=config.text("supervisor.cgroup"),
        allow_user_full_access=config.flag("policy.allow_user_full_access"),
        tenancy_mode=config.text("tenancy.mode"), admin_pods=frozenset(config.texts("tenancy.admin_pods")),
        cgroup_root=config.text("tenancy.cgroup_root"),
        dns=config.texts("network.dns"), network_pool=config.text("network.pool"),
        proxy_connections=config.whole("quotas.proxy_connections_per_session"),
        published_connections=config.whole("quotas.published_connections_per_session"),
        published_per_peer=config.whole("quotas.published_connections_per_peer"),
        session_defaults=defaults, metrics_listen=_listener(config, "metrics.listen", refuse),
        log_format=config.text("log.format"), log_level=config.text("log.level"),
        review_session_bytes=_size_or_zero(config, "review.session_bytes"),
        review_owner_bytes=parse_size(config.text("review.owner_bytes"), "review.owner_bytes"),
        review_owner_stores=config.whole("review.owner_stores"),
        review_keep_days=config.number("review.keep_days"),
        upstream_proxy=split_upstream_proxy(config.text("network.upstream_proxy")),
        upstream_ca_pem=_upstream_ca(config, refuse),
        allowed_ranges=tuple(str(ipaddress.ip_network(item)) for item in config.texts("network.allowed_ranges")),
        secrets=_secrets(config, refuse),
        network_questions=config.whole("quotas.network_questions_per_session"),
        intercepted_connections=config.whole("quotas.intercepted_connections_per_session"),
        shutdown=config.text("drain.shutdown"), drain_timeout=config.number("drain.timeout_seconds"),
        idle_expiry=config.number("sessions.idle_expiry_seconds"))


def _listener(config: Config, dotted: str, refuse: "Callable[[str, str], ConfigError]") -> str:
    """A listener's HOST:PORT (its key's check passed), with HOST looked up: a name that does not
    resolve stops the start here, with the key and the value, not as a traceback when it binds."""
    import socket

    address = config.text(dotted)
    split = split_listen_address(address) if address else None
    if split is None:
        return address
    host, port = split
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        cause = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise refuse(dotted, f"{address!r}: unknown host {host!r} ({cause}): name an address or a host name "
                     "of this machine") from None
    return address


def _upstream_ca(config: Config, refuse: "Callable[[str, str], ConfigError]") -> bytes:
    """network.upstream_ca_file's contents: a regular file of root's that only root may change (it
    decides which servers are trusted, and sandboxes trust it too), holding PEM certificates."""
    import stat

    path = config.text("network.upstream_ca_file")
    if not path:
        return b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise refuse("network.upstream_ca_file", f"cannot open {path} ({exc.strerror}): give a PEM file of root's, "
                     "not a symlink") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise refuse("network.upstream_ca_file", f"{path} must be a regular file owned by root and not group "
                         "or other writable (it decides which servers every session trusts)")
        if info.st_size > MAX_TRUST_PEM:
            raise refuse("network.upstream_ca_file", f"{path} is above {MAX_TRUST_PEM} bytes")
        data = os.read(fd, MAX_TRUST_PEM + 1)
    finally:
        os.close(fd)
    try:
        check_trust_pem(data.decode("ascii"))
    except (UnicodeDecodeError, InvalidPolicy):
        raise refuse("network.upstream_ca_file", f"{path} must hold PEM certificates only") from None
    if PEM_BEGIN.encode() not in data:
        raise refuse("network.upstream_ca_file", f"{path} holds no certificate")
    return data


def _secrets(config: Config, refuse: "Callable[[str, str], ConfigError]") -> Mapping[str, SecretSource]:
    """network.secrets with their users and groups looked up once (a name that is no user or
    group stops the start, as listen.admin_group does). The files are read at each use."""
    from types import MappingProxyType

    from sandboxd.kernel.users import group_id, parse_user

    table = config["network.secrets"]
    assert isinstance(table, dict)          # its key's check
    secrets: dict[str, SecretSource] = {}
    for name, entry in table.items():
        try:
            uids = tuple(parse_user(user, f"network.secrets.{name}.users")[0] for user in entry.get("users", []))
        except InvalidPolicy as exc:
            raise refuse("network.secrets", f"{exc}: name an existing user, or give its number") from None
        try:
            gids = tuple(group_id(group) for group in entry.get("groups", []))
        except KeyError as exc:
            raise refuse("network.secrets", f"{name}: no group {exc.args[0]!r} on this machine") from None
        upstreams, inject = secret_binding(entry)
        secrets[name] = SecretSource(file=entry["file"], uids=uids, gids=gids, upstreams=upstreams, inject=inject)
    return MappingProxyType(secrets)


def secret_binding(entry: "Mapping[str, object]") -> tuple[tuple[tuple[str, int], ...], tuple[str, str, str | None] | None]:
    """A checked [network.secrets] entry's upstreams as (host, port) and its ``inject`` (None:
    any header a credential names), parsed as a credential's would be (policy.network)."""
    from sandboxd.policy.network import parse_credential

    urls = entry.get("upstreams", [])
    assert isinstance(urls, list)           # its key's check
    upstreams = tuple(dict.fromkeys((spec.host, spec.port) for spec in (parse_credential(f"X={url}") for url in urls)))
    inject = entry.get("inject")
    if not inject:
        return upstreams, None
    spec = parse_credential(f"X=https://localhost;{inject}")
    return upstreams, (spec.header, spec.template, spec.basic_user)


def _size_or_zero(config: Config, dotted: str) -> int:
    text = str(config[dotted])
    return 0 if text == "0" else parse_size(text, dotted)


def _tls(config: Config, refuse: "Callable[[str, str], ConfigError]") -> TlsSettings | None:
    """The TCP listener's settings with its files read and its users looked up; None without one."""
    from types import MappingProxyType

    from sandboxd.kernel.users import parse_user

    address = _listener(config, "tls.address", refuse)
    if not address:
        return None
    port = tcp_port(address.rpartition(":")[2])
    pem: dict[str, bytes] = {}
    for dotted in TLS_FILES:
        file = config.text(dotted)
        try:
            with open(file, "rb") as f:
                pem[dotted] = f.read()
        except OSError as exc:
            raise refuse(dotted, f"cannot read {file} ({exc.strerror}): give a PEM file the daemon can read") from None
    try:
        uid, gid = parse_user(config.text("tls.user"), "tls.user")
    except InvalidPolicy as exc:
        raise refuse("tls.user", f"{exc}: name an existing USER[:GROUP], or give numbers") from None
    users: dict[str, tuple[int, int]] = {}
    for principal, user in config.table("tls.users").items():
        try:
            users[principal] = parse_user(user, f"tls.users[{principal!r}]")
        except InvalidPolicy as exc:
            raise refuse("tls.users", f"{exc}: name an existing USER[:GROUP], or give numbers") from None
    return TlsSettings(address=address, port=port, cert=pem["tls.cert"], key=pem["tls.key"],
                       client_ca=pem["tls.client_ca"], uid=uid, gid=gid, identity=config.text("tls.identity"),
                       users=MappingProxyType(users))
