"""LaunchPlan: a LaunchSpec with every host fact resolved, ready for the child.

Built in the parent (the spawner) before fork, so bad input is reported
before any process or namespace exists.
"""

from __future__ import annotations

import os
import stat

from sandboxd._record import Factory, Record
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import access, mounts, overlay, paths, seccomp
from sandboxd.kernel.unix_diag import file_identity
from sandboxd.launcher import trust_bundle
from sandboxd.policy import LaunchSpec, Limits
from sandboxd.policy.git_dirs import FoundGitDirs
from sandboxd.policy.sandbox import is_within

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


class BrokerRules(Record):
    """What init's connect broker decides (launcher.connect_broker), fixed before the fork."""

    # Host socket files the policy names and the caller may connect to, as (major, minor, inode).
    allowed: frozenset[tuple[int, int, int]] = frozenset()
    # sandboxd's own sockets: refused in every mode, whatever else is allowed.
    denied: frozenset[tuple[int, int, int]] = frozenset()
    # sandboxd's own TCP listeners, (host, port): refused with the host's network.
    denied_listeners: tuple[tuple[str, int], ...] = ()
    # The host's network: its TCP and UDP as they are; a Unix socket (pathname or abstract) only the
    # sandbox's own or one the policy names, judged by who holds its listener (connect_broker).
    host_network: bool = False
    # The registries of approval channels (launcher.channel_registry): their listeners are refused
    # in every mode; and the descriptors init opened them on, before building the sandbox, with a
    # sock_diag socket of the host's network namespace (kernel.sock_diag.open_shared), where the
    # channels' sockets are, whatever the sandbox's network (-1: none could be opened).
    channel_dirs: tuple[str, ...] = ()
    channel_fds: tuple[int, ...] = ()
    host_diag_fd: int = -1
    host_network_namespace: int = 0         # where host_diag_fd was opened (its inode in /proc/self/ns)
    # Cloud metadata addresses (policy.network.metadata_packed) are refused in every mode; those of
    # them that are the sandbox's DNS resolvers (packed, policy.network.metadata_resolvers) on port 53 only.
    metadata_resolvers: frozenset[bytes] = frozenset()


class DebugHooks(Record):
    """Test-only knobs for a session call, the same on both call paths (the native helper gets
    them as flags). Never set in production: no request field reaches them."""

    trace_path: str = ""       # a host file each setup step's name is appended to, in order
    landlock_abi: int = 0      # use this Landlock ABI's rights when lower than the kernel's
    no_close_range: bool = False  # take the /proc/self/fd walk, as on a kernel before 5.11


class LaunchPlan(Record):
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    workspace: str
    confined: bool                      # every policy but DangerFullAccess
    network: bool
    network_isolated: bool              # a namespace of its own behind NAT (kernel.netns.IsolatedNetwork)
    writable_roots: tuple[str, ...]     # real paths, workspace first when writable
    readonly_roots: tuple[str, ...]     # the workspace under read-only: bound so it is seen even under /tmp
    protected_subpaths: tuple[str, ...]
    uid: int
    gid: int
    limits: Limits
    seccomp_program: bytes
    brokers_connect: bool               # the filter hands connect() to init (see connect_broker)
    tool: dict[str, object] | None = None  # a file tool to run in the sandbox instead of exec'ing argv
    # Launched by a plain user (launcher.rootless): built in a user namespace that maps the caller
    # to themselves; root_trees then holds the roots' checked descriptors, cloned in the child.
    rootless: bool = False
    dns: tuple[str, ...] = ()
    network_pool: str = ""
    allowed_unix_sockets: tuple[str, ...] = ()     # host socket files connect() may reach (connect_broker)
    # What the connect broker lets through or refuses, decided here (see launcher.connect_broker).
    broker: BrokerRules = Factory(lambda: BrokerRules())
    allowed_hosts: tuple[str, ...] = ()            # the isolated network's egress allowlist
    allowed_domains: tuple[str, ...] = ()          # ... and its names, through the egress proxy
    proxied: bool = False                          # the egress proxy is its only way out (policy.proxied)
    # Set by the spawner just before fork, for an isolated network: the namespace to join, and the
    # sandbox's resolv.conf.
    netns_fd: int = -1
    resolv_conf: str | None = None
    # Rootless --allow-domain (network.loopback_proxy): init listens on 127.0.0.1:proxy_port in the
    # sandbox's loopback-only namespace and sends that socket on proxy_sink_fd, set by the spawner.
    proxy_sink_fd: int = -1
    proxy_port: int = 0
    # Detached mount trees (mounts.clone_tree) of the workspace and writable roots, by real path,
    # made from the descriptors the caller's rights were checked on; closed in the parent after
    # the fork, and empty in a session's stored plan.
    root_trees: dict[str, int] = Factory(dict)
    # sandboxd's own directories and files, covered inside the sandbox (rootfs step 8c).
    hidden_paths: tuple[str, ...] = ()
    # Homes covered by an empty read-only directory, and the HOME made in /tmp (rootfs step 7b;
    # LaunchSpec.hidden_homes, private_home).
    hidden_homes: tuple[str, ...] = ()
    private_home: str = ""
    owner: str = ""                                # whose share of the ceiling its cgroups count against
    placement: dict[str, str] = Factory(dict)      # a pod's cgroups its groups go in (LaunchSpec.placement)
    # A non-root caller's danger-full-access: its supplementary groups, which its commands run with
    # (sequence._exec_as_caller: its own uid, gid and groups, no privilege, each call in a group of
    # its own below the session's). None for every other plan (root's full access included).
    caller_groups: tuple[int, ...] | None = None
    debug: DebugHooks | None = None                # tests only (DebugHooks)
    # A session call on a terminal: (rows, columns). Its stdin is then a socket the terminal's
    # master goes back on (launcher.sequence.open_terminal); its peer becomes the command's stdio.
    terminal: tuple[int, int] | None = None
    # LaunchSpec.git_dirs: the git directories of the writable roots, found already (rootfs step 8).
    git_dirs: "dict[str, FoundGitDirs]" = Factory(dict)
    # Review mode (kernel.overlay): each writable root, by real path, is covered by an overlay whose
    # upper layer collects its changes (rootfs step 8); empty: the roots are written directly.
    review_layers: "dict[str, overlay.Layers]" = Factory(dict)
    # LaunchSpec.trust_pem of a confined launch, and the host's CA bundle it is appended to
    # (launcher.trust_bundle.host_bundle_path, found here so that a host without one is refused
    # before the fork): rootfs step 8e binds both, read-only, over the bundles of the sandbox's root.
    trust_pem: str = ""
    trust_source: str = ""

    def close_trees(self) -> None:
        for fd in self.root_trees.values():
            os.close(fd)
        self.root_trees.clear()


def path_requests(spec: LaunchSpec) -> "list[access.PathRequest]":
    """The paths ``prepare`` opens as the caller, in the order it wants their descriptors."""
    policy = spec.policy
    return paths.requests_for(spec.workspace, policy.writable_roots,
                              policy.allowed_unix_sockets if policy.confined else ())


def path_check(spec: LaunchSpec) -> "Callable[[list[int]], None]":
    """The check ``prepare`` makes on the descriptors of ``path_requests(spec)`` with lookups of
    its own (paths.planted_symlink_check): made where they were opened, as the caller."""
    policy = spec.policy
    return paths.planted_symlink_check(spec.workspace, policy.writable_roots,
                                       workspace_writable=policy.workspace_writable)


def prepare(spec: LaunchSpec, opened: "list[int] | None" = None, *, review_dir: str | None = None) -> LaunchPlan:
    """Resolve ``spec``: its paths opened and checked as its caller, the mount trees of its roots
    cloned (the returned plan owns them: ``close_trees`` once the child has them). ``opened``: the
    descriptors of ``path_requests(spec)``, opened and checked (``path_check``) already (prepare
    owns them then). ``review_dir``: review mode, an empty directory of this process's (made by
    kernel.overlay.make_review_dir) that receives the layers of every writable root (the plan's
    review_layers, which the caller saves there); the writable roots are then overlays whose upper
    layers it holds."""
    policy = spec.policy
    confined, writable = policy.confined, policy.workspace_writable
    resolved = paths.resolve(spec.workspace, spec.cwd, policy.writable_roots,
                             workspace_writable=writable, confined=confined, caller=spec.caller,
                             allowed_sockets=policy.allowed_unix_sockets if confined else (),
                             opened=opened)
    trees: dict[str, int] = {}
    plain_user = os.geteuid() != 0                       # sandboxd run by a plain user: rootless
    rootless = confined and plain_user
    try:
        hidden = _hidden_paths((*spec.hidden_paths, *_owner_places(spec)), resolved.workspace,
                               resolved.writable_roots) if confined else ()
        if plain_user:
            check_rootless(spec)
        trust_source = _trust_source(spec) if confined else ""
        review_layers = (_review_layers(review_dir, resolved.writable_roots, resolved.descriptors, confined=confined,
                                        rootless=plain_user)
                         if review_dir is not None else {})
        if review_dir is not None:
            hidden = (*hidden, os.path.realpath(review_dir))      # the sandbox never sees its own change set
        if confined:
            for real, fd in resolved.descriptors.items():
                # A plain user may not clone mounts here: the child does, in its own namespace.
                trees[real] = os.dup(fd) if rootless else mounts.clone_tree(
                    fd, step="clone workspace or writable root", path=real)
    except BaseException:
        for tree in trees.values():
            os.close(tree)
        raise
    finally:
        resolved.close()
    if plain_user:
        uid, gid = os.geteuid(), os.getegid()             # the only ids it can run as (and its userns maps)
    elif spec.user is not None:
        uid, gid = spec.user
    else:
        st = os.stat(resolved.workspace)
        uid, gid = st.st_uid, st.st_gid
    network = bool(policy.network_access)
    isolated = policy.isolated_network
    filter_spec = seccomp.FilterSpec(confined=confined)
    broker = BrokerRules(allowed=resolved.socket_ids, denied=_socket_ids(spec.denied_sockets),
                         denied_listeners=tuple(_listener(entry) for entry in spec.denied_listeners),
                         host_network=network and not isolated, channel_dirs=spec.approval_channels,
                         metadata_resolvers=_metadata_resolvers(spec.dns) if confined and network else frozenset())
    if broker.denied_listeners:
        # The connect broker judges addresses with it, in init, which may not be able to import
        # it (connect_broker's imports): load it here, in the process that forks init.
        from sandboxd.kernel import addresses  # noqa: F401
    return LaunchPlan(
        argv=spec.argv, env=dict(spec.env), cwd=resolved.cwd, workspace=resolved.workspace,
        confined=confined, rootless=rootless, network=network, network_isolated=isolated, dns=tuple(spec.dns),
        network_pool=spec.network_pool,
        allowed_unix_sockets=policy.allowed_unix_sockets, allowed_hosts=policy.allowed_hosts,
        allowed_domains=policy.allowed_domains, proxied=policy.proxied,
        writable_roots=resolved.writable_roots,
        readonly_roots=() if writable or not confined else (resolved.workspace,),
        protected_subpaths=policy.protected_subpaths,
        uid=uid, gid=gid, limits=spec.limits,
        seccomp_program=seccomp.program_for(filter_spec), brokers_connect=filter_spec.brokers_connect,
        broker=broker, root_trees=trees, hidden_paths=hidden, owner=spec.owner,
        placement=dict(spec.placement),
        caller_groups=None if confined or spec.caller is None else tuple(spec.caller[2]),
        hidden_homes=spec.hidden_homes if confined else (), private_home=spec.private_home if confined else "",
        git_dirs={root: found for root, found in spec.git_dirs.items() if root in resolved.writable_roots},
        review_layers=review_layers,
        trust_pem=spec.trust_pem if trust_source else "", trust_source=trust_source,
    )


def _trust_source(spec: LaunchSpec) -> str:
    """The host bundle a sandbox trusting ``spec.trust_pem`` gets with it ("": it trusts nothing
    extra), or InvalidPolicy when the host has none: the sandbox would trust only its session's CA,
    and every connection the proxy does not intercept would fail to verify."""
    if not spec.trust_pem:
        return ""
    source = trust_bundle.host_bundle_path()
    if source is None:
        raise InvalidPolicy("this host has no CA bundle (none of " + ", ".join(trust_bundle.TRUST_BUNDLE_PATHS)
                            + "), which a sandbox that trusts its proxy's certificates gets them added to: "
                            "install the system's CA certificates (the ca-certificates package)")
    return source


def _metadata_resolvers(dns: "tuple[str, ...] | list[str]") -> frozenset[bytes]:
    """The sandbox's resolvers that are metadata addresses (BrokerRules.metadata_resolvers): its
    --dns, else the host's, which an isolated sandbox is given and the host's network uses."""
    from sandboxd.kernel.netns import host_resolvers
    from sandboxd.policy.network import metadata_resolvers

    return metadata_resolvers(dns or host_resolvers())


def _review_layers(review_dir: str, roots: tuple[str, ...], descriptors: dict[str, int], *, confined: bool,
                   rootless: bool) -> "dict[str, overlay.Layers]":
    """The layers of each writable root under ``review_dir`` (the caller saves their record:
    kernel.overlay.save, off the launch's path: it imports json); refused with the reason
    where review mode cannot be (no writable root, an old kernel rootless, a refused file system, the
    directory inside a root or a root inside it)."""
    if not confined or not roots:
        raise InvalidPolicy("review mode needs the workspace-write policy: there is nothing to review otherwise")
    if rootless and not overlay.rootless_supported():
        raise InvalidPolicy(f"review mode as a plain user needs unprivileged overlayfs (Linux 5.11 or later); "
                            f"this kernel is {os.uname().release}: run it as root")
    real = os.path.realpath(review_dir)
    if os.path.lexists(f"{real}/{overlay.LAYERS_FILE}"):      # a session's rebuild: the same change set
        return overlay.reuse_layers(real, roots, descriptors)
    for root in roots:
        if is_within(real, root) or is_within(root, real):
            raise InvalidPolicy(f"review directory {real!r} and writable root {root!r} overlap: the change set "
                                "must live outside every root")
    return {root: overlay.make_layers(real, index, root, descriptors[root], userxattr=rootless)
            for index, root in enumerate(roots)}


ROOT_NEEDED = "needs root"


def check_rootless(spec: LaunchSpec) -> None:
    """Refuse, with what to do, what a plain user's sandbox cannot build (launcher.rootless): another
    uid, and the isolated network's parts that live in the host's network namespace."""
    policy = spec.policy
    if spec.user is not None and spec.user != (os.geteuid(), os.getegid()):
        raise InvalidPolicy(f"--user {spec.user[0]}:{spec.user[1]} {ROOT_NEEDED}: a plain user's sandbox runs "
                            "the command as that user; drop --user, or run sandboxd run as root")
    if not policy.workspace_writable:
        return
    if policy.published_ports:
        raise InvalidPolicy(f"--publish {ROOT_NEEDED} (it listens in the sandbox's network namespace from the "
                            "host's): run sandboxd run as root, or use --network=host and no --publish")
    if not policy.isolated_network:
        return
    if policy.allowed_hosts:
        raise InvalidPolicy(f"--allow-host {ROOT_NEEDED} (an nftables filter in the host's namespace): run "
                            "sandboxd run as root, or name the hosts with --allow-domain")
    if not policy.proxied:
        raise InvalidPolicy(f"the isolated network (--network) {ROOT_NEEDED} (a veth pair, NAT and a filter in "
                            "the host's namespace): run sandboxd run as root, or use --network=host (the host's "
                            "network as it is) or --network --allow-domain NAME (only those names, through "
                            "a filtering proxy)")


def _owner_places(spec: LaunchSpec) -> tuple[str, ...]:
    """Those of ``spec.owner_hidden`` that are the owner's own directories, reached through no
    symlink: a name the owner controls must not make root hide (or refuse a workspace under) any
    other place; one that is not such a directory holds no change set of theirs to protect."""
    uid = spec.caller[0] if spec.caller is not None else os.geteuid()
    places = []
    for path in spec.owner_hidden:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and os.path.realpath(path) == os.path.normpath(path):
            places.append(os.path.normpath(path))
    return tuple(places)


def _hidden_paths(hidden: tuple[str, ...], workspace: str, writable_roots: tuple[str, ...]) -> tuple[str, ...]:
    """The existing ones of sandboxd's own paths, to cover inside the sandbox. A workspace or
    root inside one of them is refused: covering it would hide the workspace, and leaving it
    would show sandboxd's sockets or audit log to the sandbox."""
    present = []
    for path in hidden:
        real = os.path.realpath(path)
        if not os.path.lexists(real):
            continue
        for root in (workspace, *writable_roots):
            if is_within(root, real):
                raise InvalidPolicy(f"{root!r} is inside {real!r}, which is sandboxd's own and hidden from every "
                                    "sandbox: choose a workspace and writable roots elsewhere")
        present.append(real)
    return tuple(dict.fromkeys(present))


def _socket_ids(paths: tuple[str, ...]) -> frozenset[tuple[int, int, int]]:
    found = set()
    for path in paths:
        try:
            found.add(file_identity(os.stat(path)))
        except OSError:
            continue                                      # not there (yet): nothing to refuse
    return frozenset(found)


def _listener(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)
