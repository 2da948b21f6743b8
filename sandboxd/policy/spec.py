"""LaunchSpec: everything one sandboxed command launch needs, as plain data."""

from __future__ import annotations

from sandboxd import defaults
from sandboxd._record import Factory, Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.git_dirs import FoundGitDirs
from sandboxd.policy.limits import MAX_ARGV, MAX_ENV_BYTES, MAX_ENV_ENTRIES, Limits, check_count
from sandboxd.policy.sandbox import SandboxPolicy, default_policy, validate_policy

MAX_ARG_STRLEN = 128 << 10          # the kernel's limit on one argument or environment string, with its NUL
_POINTER = 8


_ARG_MAX: list[int] = []


def arg_max() -> int:
    """The kernel's ARG_MAX for this process (a quarter of the stack limit, at least 128 KiB);
    read once: the hot path only compares."""
    if not _ARG_MAX:
        import os

        try:
            value = os.sysconf("SC_ARG_MAX")
        except (ValueError, OSError):
            value = -1
        _ARG_MAX.append(value if value > 0 else 128 << 10)
    return _ARG_MAX[0]


def check_command(argv: "tuple[str, ...] | list[str]", env: "dict[str, str]") -> None:
    """What execve would refuse (E2BIG, or a NUL cutting a string short), refused here with what
    to fix: no NUL byte, each string below MAX_ARG_STRLEN, all of them within ARG_MAX; and no
    more arguments and variables than policy.limits allows."""
    check_count("argv", argv, MAX_ARGV)
    check_count("env", env, MAX_ENV_ENTRIES)
    total = env_bytes = 0
    for arg in argv:
        if "\0" in arg:
            raise InvalidPolicy("command arguments may not contain NUL bytes")
        size = len(arg.encode(errors="surrogateescape")) + 1
        if size > MAX_ARG_STRLEN:
            raise InvalidPolicy(f"a command argument is {size - 1} bytes long: the kernel takes at most "
                                f"{MAX_ARG_STRLEN - 1} per argument (pass large data on stdin or in a file)")
        total += size + _POINTER
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidPolicy(f"bad environment variable {key[:100]!r}: names need no '=' and no NUL bytes, "
                                "values no NUL bytes")
        size = len(key.encode(errors="surrogateescape")) + len(value.encode(errors="surrogateescape")) + 2
        if size > MAX_ARG_STRLEN:
            raise InvalidPolicy(f"environment variable {key[:100]!r} is {size - 2} bytes long: the kernel takes at "
                                f"most {MAX_ARG_STRLEN - 2} per variable (pass large data in a file)")
        total += size + _POINTER
        env_bytes += size
    if env_bytes > MAX_ENV_BYTES:
        raise InvalidPolicy(f"env takes {env_bytes} bytes (NAME=value, all variables); the limit is {MAX_ENV_BYTES}")
    if total > arg_max():
        raise InvalidPolicy(f"the command and its environment take {total} bytes: above the kernel's ARG_MAX "
                            f"({arg_max()} bytes); pass large data on stdin or in a file")


class LaunchSpec(Record):
    """One command to run in a sandbox.

    ``workspace`` is the directory that is writable under WorkspaceWrite; ``cwd``
    (default: the workspace) is where the command starts. ``user`` is
    ``(uid, gid)``; ``None`` means the owner of the workspace.
    """

    argv: tuple[str, ...]
    workspace: str
    env: dict[str, str] = Factory(dict)
    cwd: str | None = None
    policy: SandboxPolicy = Factory(default_policy)
    limits: Limits = Factory(Limits)
    user: tuple[int, int] | None = None
    dns: tuple[str, ...] = ()           # resolvers for an isolated network (default: the host's)
    network_pool: str = ""              # its addresses (default: kernel.netns.DEFAULT_POOL)
    # Whose rights the workspace, the writable roots and the allowed Unix sockets are checked
    # with, by the kernel, under those credentials: (uid, gid, supplementary groups). None: the
    # launching process's own (root running `sandboxd run`, or the daemon for a root caller).
    caller: tuple[int, int, tuple[int, ...]] | None = None
    # sandboxd's own places, invisible inside the sandbox (its sockets' directory, its state),
    # and its own sockets and listeners, which connect() is refused for (connect_broker).
    hidden_paths: tuple[str, ...] = ()
    # The owner's own places hidden likewise (defaults.owner_hidden_paths: their kept change sets),
    # each only if it is a directory of theirs reached through no symlink (launcher.plan checks).
    owner_hidden: tuple[str, ...] = ()
    denied_sockets: tuple[str, ...] = ()
    denied_listeners: tuple[str, ...] = ()   # "HOST:PORT" of the daemon's TCP listeners
    # The registries of approval channels (`sandboxd mcp --http`'s listeners), whose sockets
    # connect() is refused for too, also those registered after the launch (launcher.channel_registry).
    approval_channels: tuple[str, ...] = ()
    # `sandboxd run`'s homes (cli/run_env.py; rootfs step 7b): directories covered by an empty,
    # read-only directory, so that a command never reads the dotfiles (keys, tokens) of its user or
    # its caller (a workspace or writable root inside one is attached over it); and the command's
    # own HOME, a new directory of its user's in the sandbox's private /tmp ("": none).
    hidden_homes: tuple[str, ...] = ()
    private_home: str = ""
    # Whom the sandbox counts against (a daemon's caller: "uid-1000", "tls-<hash>"): its cgroups
    # go in that owner's group, under its share of the ceiling (limits.owner_*). Empty: no owner
    # level (`sandboxd run`, root's own sessions).
    owner: str = ""
    # A session of a caller in a Kubernetes pod (limits.charge_pods): the pod's cgroup in each hierarchy
    # ("unified", "memory", "pids" -> its path below the mount; kernel.pod_cgroups), where its groups
    # go as leaves beside the pod's containers instead of below the daemon's base group, with no
    # owner level and no ceiling: the pod's own limits are those. Empty: the daemon's base group.
    placement: dict[str, str] = Factory(dict)
    # With a proxied network (policy.proxied): the certificates the sandbox trusts besides the
    # host's bundle (the session's CA, network.upstream_ca_file), PEM. Public material only; its
    # keys never leave the daemon. Empty: none (rootfs binds no bundle).
    trust_pem: str = ""
    # The git directories of each writable root (by real path), found by the git guard's baseline
    # walk just before the launch (policy.git_dirs): the build protects them without walking the
    # root again. A root not named here is walked at build. Not on the fork server's wire: a
    # session's build walks (its guard's baseline is taken after the build: service.git_guard_hook).
    git_dirs: "dict[str, FoundGitDirs]" = Factory(dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))
        if not self.argv or not self.argv[0]:
            raise InvalidPolicy("no program given: put the command after '--'")
        check_command(self.argv, self.env)
        if not self.workspace.startswith("/") or "\0" in self.workspace:
            raise InvalidPolicy(f"workspace {self.workspace[:200]!r} must be an absolute path without NUL bytes")
        if self.cwd is not None and not self.cwd.startswith("/"):
            raise InvalidPolicy(f"cwd {self.cwd!r} must be an absolute path")
        if self.dns:
            from sandboxd.policy.ipv4 import ipv4_address    # (ipaddress: ~10 ms, only when asked)

            for server in self.dns:
                try:
                    ipv4_address(server)
                except ValueError as exc:
                    raise InvalidPolicy(f"DNS server {server!r} must be an IPv4 address such as 192.0.2.53: "
                                        f"{exc}") from None
        if self.user is not None and (self.user[0] < 0 or self.user[1] < 0):
            raise InvalidPolicy(f"bad user {self.user!r}: uid and gid must be >= 0")
        check_trust_pem(self.trust_pem)
        for path in (*self.hidden_paths, *self.owner_hidden, *self.denied_sockets, *self.approval_channels):
            if not path.startswith("/") or "\0" in path:
                raise InvalidPolicy(f"sandboxd's own path {path!r} must be absolute")
        for path in self.hidden_homes:
            if not path.startswith("/") or "\0" in path or not path.strip("/"):
                raise InvalidPolicy(f"hidden home {path!r} must be an absolute path other than /")
        if self.private_home and (not self.private_home.startswith("/tmp/") or "\0" in self.private_home
                                  or ".." in self.private_home.split("/")):
            raise InvalidPolicy(f"private home {self.private_home!r} must be a path in /tmp")
        if not is_owner_key(self.owner):
            raise InvalidPolicy(f"owner {self.owner[:100]!r} must be empty or up to {MAX_OWNER_KEY} lowercase "
                                "letters, digits and '-' (it names a cgroup)")
        validate_policy(self.policy)


MAX_OWNER_KEY = 64
MAX_TRUST_PEM = 64 << 10                 # the session CA and network.upstream_ca_file: a few KiB each
PEM_BEGIN = "-----BEGIN CERTIFICATE-----"
PEM_END = "-----END CERTIFICATE-----"


def check_trust_pem(text: str) -> str:
    """``text`` ("" or PEM certificates, nothing else: no key, no other block, at most
    MAX_TRUST_PEM bytes) or InvalidPolicy. Only the text's shape: whether each parses is the
    network layer's to check where it makes or reads them."""
    if not text:
        return text
    if len(text.encode(errors="surrogateescape")) > MAX_TRUST_PEM:
        raise InvalidPolicy(f"the sandbox's trusted certificates take more than {MAX_TRUST_PEM} bytes")
    inside = False
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line == PEM_BEGIN and not inside:
            inside = True
        elif line == PEM_END and inside:
            inside = False
        elif not inside or line.startswith("-----") or not line.isascii():
            raise InvalidPolicy("the sandbox's trusted certificates must be PEM certificates only "
                                f"({PEM_BEGIN} ... {PEM_END} blocks)")
    if inside:
        raise InvalidPolicy(f"the sandbox's trusted certificates end inside a certificate (no {PEM_END})")
    return text
_OWNER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def is_owner_key(key: str) -> bool:
    """A usable LaunchSpec.owner: empty, or a cgroup name part that cannot climb or nest (checked
    by hand to keep ``re`` off the launch path)."""
    return not key or (len(key) <= MAX_OWNER_KEY and key[0] != "-" and set(key) <= _OWNER_CHARS)


def policy_to_dict(policy: SandboxPolicy) -> dict[str, object]:
    """Plain JSON-able form of a sandbox policy (the event store; the fork server's wire has its own
    typed record, supervisor.fork_protocol.PolicyRecord)."""
    return {"name": str(policy.mode), "network_access": bool(policy.network_access),
            "writable_roots": list(policy.writable_roots), "protected_subpaths": list(policy.protected_subpaths),
            "network_mode": str(policy.network_mode), "allowed_unix_sockets": list(policy.allowed_unix_sockets),
            "allowed_hosts": list(policy.allowed_hosts), "published_ports": list(policy.published_ports),
            "allowed_domains": list(policy.allowed_domains), "allowed_endpoints": list(policy.allowed_endpoints),
            "unlisted": str(policy.unlisted), "credentials": list(policy.credentials),
            "hide_home": bool(policy.hide_home)}


def policy_from_dict(data: dict[str, object]) -> SandboxPolicy:
    """A policy as the store kept it (older rows leave fields out: they take their defaults)."""
    from sandboxd.policy.sandbox import policy_from_name

    return policy_from_name(str(data["name"]), network_access=bool(data.get("network_access")),
                            writable_roots=list(_strings(data, "writable_roots")),
                            protected_subpaths=list(_strings(data, "protected_subpaths")),
                            network_mode=str(data.get("network_mode") or defaults.NETWORK_MODE),
                            allowed_unix_sockets=list(_strings(data, "allowed_unix_sockets")),
                            allowed_hosts=list(_strings(data, "allowed_hosts")),
                            published_ports=list(_strings(data, "published_ports")),
                            allowed_domains=list(_strings(data, "allowed_domains")),
                            allowed_endpoints=list(_strings(data, "allowed_endpoints")),
                            unlisted=str(data.get("unlisted") or ""),
                            credentials=list(_strings(data, "credentials")),
                            hide_home=bool(data.get("hide_home")))


def _strings(data: dict[str, object], key: str) -> tuple[str, ...]:
    value = data.get(key) or ()
    if not isinstance(value, (list, tuple)):
        raise InvalidPolicy(f"malformed stored policy: {key} must be a list")
    return tuple(str(item) for item in value)
