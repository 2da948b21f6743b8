"""SandboxPolicy: what is structurally possible for a session.

``ReadOnly`` | ``WorkspaceWrite(network_access, writable_roots)`` | ``DangerFullAccess``.
The default is ``WorkspaceWrite(network_access=False, writable_roots=[])``.

Pure: validation here only looks at the strings. Whether a root exists and
where its symlinks lead is answered at the kernel edge
(``sandboxd.kernel.paths``), which raises the same ``InvalidPolicy``.
"""

from __future__ import annotations

import posixpath

from sandboxd import defaults
from sandboxd._record import Choice, Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy import limits
from sandboxd.policy.domains import allowed_domain
from sandboxd.policy.network import (
    NetworkRules,
    Unlisted,
    covers,
    parse_credential,
    parse_endpoint,
    parse_unlisted,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar

# Paths inside every writable root that stay read-only: git runs hooks and
# reads config (core.fsmonitor, core.hooksPath, aliases) on the host later, so
# a sandboxed command that could write them could run code outside the sandbox.
# The rest of .git stays writable so `git add` and `git commit` work.
DEFAULT_PROTECTED_SUBPATHS: tuple[str, ...] = (".git/hooks", ".git/config")

# Where writable roots may never point: these are replaced inside the sandbox
# by fresh kernel filesystems, so a bind there would either be hidden or hand
# the sandbox a piece of the host's /proc, /sys or /dev.
_FORBIDDEN_ROOT_PREFIXES = ("/proc", "/sys", "/dev")


class SandboxMode(Choice):
    """Which of the three kinds a policy is (its wire and CLI name)."""

    READ_ONLY: ClassVar[SandboxMode]
    WORKSPACE_WRITE: ClassVar[SandboxMode]
    DANGER_FULL_ACCESS: ClassVar[SandboxMode]


SandboxMode.define(READ_ONLY="read-only", WORKSPACE_WRITE="workspace-write", DANGER_FULL_ACCESS="danger-full-access")


class NetworkMode(Choice):
    """The network a sandbox with network access gets: "isolated" (a network namespace of its own
    behind NAT and the host's egress filter) or "host" (the host's TCP and UDP as they are)."""

    ISOLATED: ClassVar[NetworkMode]
    HOST: ClassVar[NetworkMode]


NetworkMode.define(ISOLATED="isolated", HOST="host")
NETWORK_MODES = NetworkMode.all()


def parse_network_mode(text: object) -> NetworkMode:
    """The network mode ``text`` names, or InvalidPolicy saying which there are."""
    try:
        return NetworkMode.parse(text)
    except ValueError:
        raise InvalidPolicy(f"unknown network mode {text!r}: use isolated (the default) or host") from None


class SandboxPolicy(Record):
    """One of ReadOnly, WorkspaceWrite, DangerFullAccess: ``mode`` says which.

    Every kind has every field, so every reader takes them typed (no getattr with a default); only
    workspace-write may set the lists and the network mode (the others refuse them: an empty list
    and the host's network mode are what they stand for)."""

    mode: ClassVar[SandboxMode]
    network_access: bool = False
    writable_roots: tuple[str, ...] = ()
    protected_subpaths: tuple[str, ...] = ()
    # With network access: which network (NetworkMode). Only workspace-write has a choice: the
    # others have the host's (danger-full-access) or none at all (read-only: "host" never matters).
    network_mode: NetworkMode = NetworkMode.HOST
    # Host pathname Unix sockets the sandbox may connect to (an ssh-agent, a database socket);
    # every other host socket stays unreachable (without network, or with an isolated one).
    allowed_unix_sockets: tuple[str, ...] = ()
    # With an isolated network: the only destinations allowed, "CIDR" or "CIDR:PORTS" (PORTS
    # like 443 or 8000-8100, comma-separated). Empty: every destination the host filter allows.
    allowed_hosts: tuple[str, ...] = ()
    # Servers of the sandbox reachable on the host's 127.0.0.1: "[HOSTPORT:]PORT" (network.publish).
    published_ports: tuple[str, ...] = ()
    # With an isolated network: names reachable through the filtering proxy ("pypi.org",
    # "*.pythonhosted.org"), which is then the only way out (network.egress_proxy).
    allowed_domains: tuple[str, ...] = ()
    # With an isolated network: per host, the only requests let through, "HOST=METHODS:PATH-GLOB"
    # (policy.network.parse_endpoint; kept canonical). A host with rules is intercepted.
    allowed_endpoints: tuple[str, ...] = ()
    # A destination the lists do not allow: refused, or held and asked (policy.network.Unlisted).
    unlisted: Unlisted = Unlisted.REFUSE
    # With an isolated network: "VAR=https://HOST[:PORT][;...]" (policy.network.parse_credential;
    # kept canonical): VAR holds a phantom, the proxy puts the secret in for that upstream only.
    # Only the public half: the secret never is in a policy.
    credentials: tuple[str, ...] = ()
    # The owner's home directory covered by an empty, read-only one, as `sandboxd run` does
    # (launcher.rootfs step 7b): a command never reads their keys and tokens (~/.ssh, ~/.aws,
    # ~/.config) from the host's read-only view. The workspace and writable roots inside stay.
    # Confined kinds only (danger-full-access has no walls to hide it behind). Kept for the
    # session's life: an update that leaves it out keeps it (service.sessions.lifecycle).
    hide_home: bool = False

    @property
    def name(self) -> SandboxMode:
        """The kind's wire and CLI name (the same as ``mode``)."""
        return self.mode

    @property
    def confined(self) -> bool:
        """Whether the sandbox has walls at all (everything but danger-full-access)."""
        return self.mode is not SandboxMode.DANGER_FULL_ACCESS

    @property
    def workspace_writable(self) -> bool:
        """Whether the workspace and the writable roots are bound writable (workspace-write only)."""
        return self.mode is SandboxMode.WORKSPACE_WRITE

    @property
    def isolated_network(self) -> bool:
        """A network namespace of the sandbox's own (network access, workspace-write, isolated)."""
        return self.network_access and self.workspace_writable and self.network_mode is NetworkMode.ISOLATED

    @property
    def proxied(self) -> bool:
        """Whether the egress proxy is the sandbox's only way out: an isolated network with a
        domain, an endpoint rule, a credential or ``unlisted = ask`` (each needs the proxy)."""
        return self.isolated_network and bool(self.allowed_domains or self.allowed_endpoints or self.credentials
                                               or self.unlisted is Unlisted.ASK)

    @property
    def network_rules(self) -> NetworkRules:
        """What the egress proxy enforces, typed (the lists are canonical: they parse as kept)."""
        return NetworkRules(self.allowed_domains, tuple(parse_endpoint(rule) for rule in self.allowed_endpoints),
                            tuple(parse_credential(spec) for spec in self.credentials), self.unlisted)

    def without_network_rules(self) -> SandboxPolicy:
        """This policy with the proxy's lists emptied: two policies equal so differ only in what a
        running proxy can take live (the sandbox itself stays)."""
        return self.replace(allowed_domains=(), allowed_endpoints=(), unlisted=Unlisted.REFUSE, credentials=())

    def _typed(self) -> None:
        """Lists from callers become tuples (the policy stays hashable and immutable), the network
        mode's text its member."""
        for field in ("writable_roots", "protected_subpaths", "allowed_unix_sockets", "allowed_hosts",
                      "published_ports", "allowed_domains", "allowed_endpoints", "credentials"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        object.__setattr__(self, "network_mode", parse_network_mode(self.network_mode))
        object.__setattr__(self, "unlisted", parse_unlisted(self.unlisted))

    def _refuse_workspace_options(self) -> None:
        """The lists and the network mode are workspace-write's: the other kinds refuse them."""
        self._typed()
        if self.writable_roots:
            raise InvalidPolicy(f"{self.mode} has no writable roots: use workspace-write to list writable roots")
        if self.protected_subpaths:
            raise InvalidPolicy(f"{self.mode} has no protected subpaths: they are options of workspace-write")
        if (self.allowed_unix_sockets or self.allowed_hosts or self.published_ports or self.allowed_domains
                or self.network_mode is not NetworkMode.HOST):
            raise InvalidPolicy("allowed Unix sockets, allowed hosts, published ports, allowed domains and the "
                                "network mode are options of workspace-write")
        if self.allowed_endpoints or self.credentials or self.unlisted is not Unlisted.REFUSE:
            raise InvalidPolicy("endpoint rules, credentials and unlisted = ask are options of workspace-write "
                                "with an isolated network")


class ReadOnly(SandboxPolicy):
    """Read anything the host lets the sandbox uid read; write nothing but a private /tmp; no network."""

    mode = SandboxMode.READ_ONLY

    def __post_init__(self) -> None:
        if self.network_access:
            raise InvalidPolicy("read-only has no network access: use workspace-write with network_access")
        self._refuse_workspace_options()


class WorkspaceWrite(SandboxPolicy):
    """Write the workspace and the listed roots; everything else read-only. With network access,
    ``network_mode`` "isolated" (the default) gives the sandbox a network namespace of its own
    behind NAT and the host's egress filter; "host" gives it the host's TCP and UDP as they are (not
    its Unix sockets: a connect reaches the sandbox's own or allowed_unix_sockets, in every mode)."""

    protected_subpaths: tuple[str, ...] = DEFAULT_PROTECTED_SUBPATHS
    network_mode: NetworkMode = NetworkMode.parse(defaults.NETWORK_MODE)

    mode = SandboxMode.WORKSPACE_WRITE

    def __post_init__(self) -> None:
        self._typed()
        self._check_list_limits()
        if self.allowed_domains and not self.isolated_network:
            raise InvalidPolicy("allowed domains apply to the isolated network: turn network access on "
                                "(and keep network_mode isolated)")
        object.__setattr__(self, "allowed_domains", tuple(allowed_domain(d) for d in self.allowed_domains))
        self._check_proxy_rules()
        if self.published_ports and self.network_access and self.network_mode is NetworkMode.HOST:
            raise InvalidPolicy("published ports need a network of the sandbox's own: with the host's network "
                                "its servers are on the host already")
        for entry in self.published_ports:
            parse_publish(entry)
        for path in self.allowed_unix_sockets:
            if not path.startswith("/"):
                raise InvalidPolicy(f"allowed Unix socket {path!r} must be an absolute path")
        if self.allowed_hosts and not self.isolated_network:
            raise InvalidPolicy("allowed hosts apply to the isolated network: turn network access on "
                                "(and keep network_mode isolated)")
        for entry in self.allowed_hosts:
            parse_allowed_host(entry)

    def _check_proxy_rules(self) -> None:
        """Endpoint rules, credentials and ``ask`` are the isolated network's proxy's; rules only
        narrow what a domain or a credential allows; a variable holds one credential. Each kept
        canonical."""
        if (self.allowed_endpoints or self.credentials or self.unlisted is Unlisted.ASK) and not self.isolated_network:
            raise InvalidPolicy("endpoint rules, credentials and unlisted = ask apply to the isolated network: turn "
                                "network access on (and keep network_mode isolated)")
        specs = tuple(parse_credential(text) for text in self.credentials)
        names = [spec.name for spec in specs]
        for name in names:
            if names.count(name) > 1:
                raise InvalidPolicy(f"credential variable {name} is named twice: give each variable one upstream")
        rules = tuple(parse_endpoint(text) for text in self.allowed_endpoints)
        for rule in rules:
            if not (any(covers(pattern, rule.host) for pattern in self.allowed_domains)
                    or any(spec.host == rule.host for spec in specs)):
                raise InvalidPolicy(f"endpoint rule {rule.text()!r}: endpoint rules only narrow: allow the host "
                                    f"{rule.host} first (allowed domains or a credential's upstream)")
        object.__setattr__(self, "allowed_endpoints", tuple(dict.fromkeys(rule.text() for rule in rules)))
        object.__setattr__(self, "credentials", tuple(spec.text() for spec in specs))

    def _check_list_limits(self) -> None:
        """Every list within its limit (policy.limits says why each), before any entry is parsed."""
        for field, limit in (("writable_roots", limits.MAX_WRITABLE_ROOTS),
                             ("protected_subpaths", limits.MAX_PROTECTED_SUBPATHS),
                             ("allowed_unix_sockets", limits.MAX_ALLOWED_UNIX_SOCKETS),
                             ("allowed_hosts", limits.MAX_ALLOWED_HOSTS),
                             ("allowed_domains", limits.MAX_ALLOWED_DOMAINS),
                             ("allowed_endpoints", limits.MAX_ALLOWED_ENDPOINTS),
                             ("credentials", limits.MAX_CREDENTIALS),
                             ("published_ports", limits.MAX_PUBLISHED_PORTS)):
            limits.check_count(field, getattr(self, field), limit)
        limits.check_bytes("the writable roots, protected subpaths, sockets, hosts, domains, ports, endpoint rules "
                           "and credentials of a policy",
                           (*self.writable_roots, *self.protected_subpaths, *self.allowed_unix_sockets,
                            *self.allowed_hosts, *self.allowed_domains, *self.published_ports,
                            *self.allowed_endpoints, *self.credentials),
                           limits.MAX_POLICY_LIST_BYTES)


class DangerFullAccess(SandboxPolicy):
    """No filesystem or network restriction; still a killable process tree and no TIOCSTI."""

    mode = SandboxMode.DANGER_FULL_ACCESS
    network_access: bool = True

    def __post_init__(self) -> None:
        if not self.network_access:
            raise InvalidPolicy("danger-full-access always has the host network: use workspace-write "
                                "without network_access to cut it")
        if self.hide_home:
            raise InvalidPolicy("danger-full-access has no walls to hide the home behind: use read-only or "
                                "workspace-write with hide_home (a session that hides its home keeps hiding it: "
                                "create a new session for full access)")
        self._refuse_workspace_options()


_NAMES = {
    "read-only": SandboxMode.READ_ONLY, "read_only": SandboxMode.READ_ONLY, "readonly": SandboxMode.READ_ONLY,
    "workspace-write": SandboxMode.WORKSPACE_WRITE, "workspace_write": SandboxMode.WORKSPACE_WRITE,
    "auto": SandboxMode.WORKSPACE_WRITE,
    "danger-full-access": SandboxMode.DANGER_FULL_ACCESS, "danger_full_access": SandboxMode.DANGER_FULL_ACCESS,
    "full": SandboxMode.DANGER_FULL_ACCESS,
}


def sandbox_mode(name: str) -> SandboxMode:
    """The kind a wire or CLI name (or one of its spellings) names, or InvalidPolicy listing them."""
    canonical = _NAMES.get(name.strip().lower())
    if canonical is None:
        raise InvalidPolicy(
            f"unknown sandbox policy {name!r}: use one of read-only, workspace-write, danger-full-access")
    return canonical


def default_policy() -> SandboxPolicy:
    return WorkspaceWrite()


def parse_publish(entry: str) -> tuple[int, int]:
    """"[HOSTPORT:]PORT" into (host port, sandbox port)."""
    from sandboxd.policy.ipv4 import port

    host, _, inside = entry.rpartition(":")
    try:
        sandbox_port = port(inside)
        host_port = port(host) if host else sandbox_port
    except ValueError as exc:
        raise InvalidPolicy(f"publish {entry!r}: give [HOSTPORT:]PORT, like 8000 or 18000:8000 ({exc})") from None
    return host_port, sandbox_port


def parse_allowed_host(entry: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """"CIDR" or "CIDR:PORTS" into (CIDR, ((low, high), ...)); no ports means every port."""
    from sandboxd.policy.ipv4 import ipv4_network, port_range

    address, _, ports = entry.partition(":")
    try:
        network = ipv4_network(address)
    except ValueError as exc:
        raise InvalidPolicy(f"allowed host {entry!r}: give an IPv4 address or CIDR, optionally with ports, "
                            f"like 203.0.113.7, 198.51.100.0/24:443 or 192.0.2.1:8000-8100,9000 ({exc})") from None
    ranges = []
    for item in filter(None, ports.split(",")):
        try:
            ranges.append(port_range(item))
        except ValueError as exc:
            raise InvalidPolicy(f"allowed host {entry!r}: bad port range {item!r} (use 443 or 8000-8100): "
                                f"{exc}") from None
    return str(network), tuple(ranges)


def policy_from_name(name: str, *, network_access: bool = False,
                     writable_roots: tuple[str, ...] | list[str] = (),
                     protected_subpaths: tuple[str, ...] | list[str] | None = None,
                     network_mode: str = defaults.NETWORK_MODE, allowed_unix_sockets: tuple[str, ...] | list[str] = (),
                     allowed_hosts: tuple[str, ...] | list[str] = (),
                     published_ports: tuple[str, ...] | list[str] = (),
                     allowed_domains: tuple[str, ...] | list[str] = (),
                     allowed_endpoints: tuple[str, ...] | list[str] = (), unlisted: str = "",
                     credentials: tuple[str, ...] | list[str] = (), hide_home: bool = False) -> SandboxPolicy:
    """Build a policy from its wire/CLI name (``read-only``, ``workspace-write``, ``danger-full-access``)."""
    canonical = sandbox_mode(name)
    if canonical is SandboxMode.READ_ONLY:
        if network_access:
            raise InvalidPolicy("read-only has no network access: use workspace-write with network_access")
        if writable_roots:
            raise InvalidPolicy("read-only has no writable roots: use workspace-write to list writable roots")
    if canonical is not SandboxMode.WORKSPACE_WRITE and (allowed_unix_sockets or allowed_hosts or published_ports
                                           or allowed_domains or allowed_endpoints or credentials
                                           or parse_unlisted(unlisted) is not Unlisted.REFUSE):
        raise InvalidPolicy("allowed Unix sockets, allowed hosts, published ports, allowed domains, endpoint rules, "
                            "credentials and unlisted = ask are options of workspace-write")
    if canonical is SandboxMode.READ_ONLY:
        return ReadOnly(hide_home=hide_home)
    if canonical is SandboxMode.DANGER_FULL_ACCESS:
        return DangerFullAccess(hide_home=hide_home)
    policy = WorkspaceWrite(
        network_access=network_access, writable_roots=tuple(writable_roots),
        protected_subpaths=DEFAULT_PROTECTED_SUBPATHS if protected_subpaths is None else tuple(protected_subpaths),
        network_mode=parse_network_mode(network_mode or defaults.NETWORK_MODE),
        allowed_unix_sockets=tuple(allowed_unix_sockets),
        allowed_hosts=tuple(allowed_hosts), published_ports=tuple(published_ports),
        allowed_domains=tuple(allowed_domains), allowed_endpoints=tuple(allowed_endpoints),
        unlisted=parse_unlisted(unlisted), credentials=tuple(credentials), hide_home=hide_home)
    validate_policy(policy)
    return policy


def validate_policy(policy: SandboxPolicy) -> None:
    """Check the policy's own strings; raise InvalidPolicy saying what to fix."""
    if not isinstance(policy, (ReadOnly, WorkspaceWrite, DangerFullAccess)):
        raise InvalidPolicy(f"not a sandbox policy: {policy!r}")
    if not isinstance(policy, WorkspaceWrite):
        return
    for root in policy.writable_roots:
        validate_writable_root(root)
    for sub in policy.protected_subpaths:
        if not sub or sub.startswith("/") or ".." in sub.split("/"):
            raise InvalidPolicy(
                f"protected subpath {sub!r} must be a relative path inside a writable root, without '..'")


def validate_writable_root(root: str) -> None:
    if not isinstance(root, str) or not root:
        raise InvalidPolicy("a writable root must be a non-empty path")
    if "\0" in root:
        raise InvalidPolicy(f"writable root {root!r} contains a NUL byte")
    if not root.startswith("/"):
        raise InvalidPolicy(f"writable root {root!r} is relative: give an absolute path")
    normal = posixpath.normpath(root)
    if normal in ("/", "//"):
        raise InvalidPolicy("a writable root of / would make the whole host writable: "
                            "use danger-full-access if that is really meant")
    for prefix in _FORBIDDEN_ROOT_PREFIXES:
        if normal == prefix or normal.startswith(prefix + "/"):
            raise InvalidPolicy(f"writable root {root!r} is under {prefix}, which the sandbox replaces "
                                "with its own; pick a directory elsewhere")


def is_within(path: str, root: str) -> bool:
    """True when normalised absolute ``path`` is ``root`` or lies under it (string logic only)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


__all__ = ["DEFAULT_PROTECTED_SUBPATHS", "DangerFullAccess", "NetworkMode", "ReadOnly", "SandboxMode", "SandboxPolicy",
           "WorkspaceWrite", "parse_network_mode", "sandbox_mode",
           "default_policy", "is_within", "policy_from_name", "validate_policy", "validate_writable_root"]
