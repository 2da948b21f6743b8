"""`sandboxd run`: one command in a sandbox, no daemon. The CI-runner path."""

from __future__ import annotations

import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch
import sys

from sandboxd import defaults
from sandboxd.errors import ExecFailed, InvalidPolicy, LimitsUnavailable, SandboxdError
from sandboxd.kernel.users import parse_user
from sandboxd.policy import DEFAULT_PROTECTED_SUBPATHS, LaunchSpec, Limits, parse_size, policy_from_name
from sandboxd.policy.git_config import GIT_GUARD_SUBPATH
from sandboxd.policy.limits import DEFAULT_TMP_SIZE
from sandboxd.policy.sandbox import DangerFullAccess, WorkspaceWrite
from sandboxd.printable import printable

TYPE_CHECKING = False
if TYPE_CHECKING:   # typing stays off the `sandboxd run` path: these are for the type checker only
    from typing import Callable, TypeVar

    from sandboxd.kernel.netns import IsolatedNetwork
    from sandboxd.kernel.overlay import Layers
    from sandboxd.network.loopback_proxy import LoopbackProxy
    from sandboxd.network.egress_proxy import EgressProxy
    from sandboxd.gitguard.guard import GitGuard
    from sandboxd.network.publish import PublishedPort
    from sandboxd.supervisor.spawner import SandboxProcess
    from sandboxd.cli.run_credentials import RunCredentials
    from sandboxd.network.upstream import UpstreamRoute

    N = TypeVar("N", int, float)

EXIT_TIMEOUT = 124
EXIT_SETUP_FAILED = 125

DESCRIPTION = """Run PROGRAM in a kernel-enforced sandbox and exit with its status.

policies:
  workspace-write     (default) the workspace and --writable-root dirs are writable,
                      everything else read-only; git control files (hooks,
                      config) stay read-only, and git hooks and config the
                      command plants are removed after it; no network unless
                      --network
  read-only           nothing writable but a private /tmp; no network
  danger-full-access  no filesystem or network restriction; still a killable tree,
                      and no TIOCSTI into your terminal

every policy but danger-full-access gets new mount, PID, IPC, UTS, cgroup and
(without --network) network namespaces, a read-only host root, fresh /proc, a
minimal /dev, a private /tmp, no capabilities, no_new_privs and seccomp.

as a plain user it runs rootless: the same sandbox, built in a user namespace that maps
you to yourself (the command runs as you); the isolated network (use --network=host, or
--network --allow-domain), --allow-host, --publish, --memory, --pids and --user need root.

environment: PATH, LANG, LC_*, TERM, COLORTERM, NO_COLOR and TZ from yours; USER
and LOGNAME of the command's user; HOME=/tmp/home, new and private; nothing else
unless named (--pass-env NAME, --env NAME=VALUE). The command user's and your
home directories are hidden (empty, read-only; a workspace or --cwd inside stays
visible), so keys and tokens in them (~/.ssh, ~/.aws, ~/.npmrc) are out of reach.
"""

EPILOG = """exit status:
  the command's own; 128+N if it was killed by signal N; 124 on timeout;
  125 if the sandbox could not be set up (one line on stderr says why).

SIZE takes plain bytes or a K/M/G suffix (binary multiples): 512M, 2G.
"""


# (flag, metavar, kind, help). Parsed by hand rather than with argparse, which
# imports `re` and `gettext`: on the CI machine that alone costs more than the
# sandbox launch it would parse the arguments for.
OPTIONS: tuple[tuple[str, str | None, str, str], ...] = (
    ("--sandbox", "POLICY", "value", "read-only | workspace-write | danger-full-access (default: workspace-write)"),
    ("--workspace", "DIR", "value", "the workspace (default: the current directory)"),
    ("--cwd", "DIR", "value", "where the command starts (default: the workspace)"),
    ("--writable-root", "DIR", "append", "another writable directory (repeatable; workspace-write only)"),
    ("--protect", "SUBPATH", "append", "keep SUBPATH of every writable root read-only, in addition to "
                                       f"{', '.join(DEFAULT_PROTECTED_SUBPATHS)} (repeatable)"),
    ("--no-default-protect", None, "flag", f"do not protect {', '.join(DEFAULT_PROTECTED_SUBPATHS)} by default"),
    ("--network", "[=isolated|host]", "optional", "network access (workspace-write only): isolated (the default) is a "
                                                  "namespace of its own behind NAT that reaches the internet but not "
                                                  "the host, its loopback, link-local or private ranges; "
                                                  "--network=host is the host's TCP and UDP as they are (its Unix "
                                                  "sockets stay unreachable, as without network)"),
    ("--dns", "IP", "append", "a resolver for the isolated network (repeatable; default: the host's)"),
    ("--allow-host", "CIDR[:PORTS]", "append", "with the isolated network, allow only these destinations "
                                               "(repeatable; PORTS like 443 or 8000-8100,9000)"),
    ("--publish", "[HOSTPORT:]PORT", "append", "make the sandbox's server on PORT reachable on the host's "
                                               "127.0.0.1:HOSTPORT (repeatable; not with --network=host)"),
    ("--allow-domain", "NAME", "append", "with the isolated network, reach only these names (repeatable; "
                                         "*.example.org for subdomains), through a filtering proxy that is "
                                         "then the only way out"),
    ("--credential", "VAR=https://HOST[:PORT][;...]", "append",
     "with the isolated network, give the command a phantom in VAR and let the proxy put your $VAR in for "
     "that upstream only (repeatable; ';HEADER: {}' or ';basic[:USER]' for other headers); the upstream "
     "is allowed; its certificate must verify against the host's store (and your SSL_CERT_FILE)"),
    ("--credential-file", "VAR=PATH", "append", "take --credential VAR's secret from the file PATH instead of $VAR"),
    ("--allow-endpoint", "HOST=METHOD[,...]:GLOB", "append",
     "with the isolated network, let only these requests to HOST through (repeatable; HOST allowed by "
     "--allow-domain or a --credential; e.g. api.github.com=GET:/repos/**); others get 403"),
    ("--upstream-proxy", "HOST:PORT", "value", "send every connection the filtering proxy lets out through this "
                                               "HTTP proxy (CONNECT), after its own checks (a corporate proxy)"),
    ("--allow-unix-socket", "PATH", "append", "a host Unix socket the command may connect to (repeatable; "
                                              "every other host socket stays unreachable)"),
    ("--no-network", None, "flag", "no network: a private namespace with only loopback (default)"),
    ("--timeout", "SECONDS", "value", "kill the whole tree after SECONDS"),
    ("--memory", "SIZE", "value", "memory limit of the whole tree (cgroup; default: min(8G, half of RAM))"),
    ("--pids", "N", "value", "process/thread limit of the whole tree (cgroup; default: 1024)"),
    ("--no-default-limits", None, "flag", "no memory or pids limit but those given (and no caps on the parent "
                                          "cgroup): for a machine whose cgroups sandboxd cannot manage"),
    ("--cpu-seconds", "N", "value", "CPU time limit per process (rlimit)"),
    ("--open-files", "N", "value", "open files limit per process (rlimit)"),
    ("--tmp-size", "SIZE", "value", f"size of the private /tmp and /dev/shm (default {DEFAULT_TMP_SIZE >> 20}M)"),
    ("--user", "UID[:GID]", "value", "run as this user (numbers or names; default: the owner of the workspace)"),
    ("--env", "K=V", "append", "set a variable (repeatable)"),
    ("--pass-env", "NAME", "append", "pass the caller's NAME (repeatable; the way to hand a secret to the command)"),
    ("--clear-env", None, "flag", "start from an empty environment"),
    ("--host-home", None, "flag", "keep the host's home directories visible (read-only) and HOME as it is"),
    ("--strict-homes", None, "flag", "refuse to run (125) when a home to hide (the command user's, yours, "
                                     "$HOME) cannot be (someone else's directory, a system one); without it, "
                                     "one line says so and the run goes on"),
    ("--review", "[=apply|discard|keep[:DIR]]", "optional",
     "review mode: writes go to an overlay, not the host; at the end the change summary, then "
     "[a]pply [d]iscard [k]eep [r]eview on a terminal (keep, saying where, without one); =apply, "
     "=discard or =keep:DIR decide beforehand (a kept DIR: sandboxd changes|apply|discard DIR)"),
    ("--review-bytes", "SIZE", "value", "as root, the change set's bound: a tmpfs of SIZE, past which the command's "
                                        "writes get ENOSPC (default 1G, review.session_bytes's; 0: none)"),
    ("--help", None, "flag", "show this help and exit"),
)
_BY_FLAG = {flag: (metavar, kind) for flag, metavar, kind, _ in OPTIONS}
USAGE = "usage: sandboxd run [options] -- PROGRAM [ARGS...]"


class UsageError(Exception):
    pass


def help_text() -> str:
    lines = [USAGE, "", DESCRIPTION.rstrip(), "", "options:"]
    for flag, metavar, kind, text in OPTIONS:
        left = f"  {flag}" + (f" {metavar}" if metavar else "") + ("..." if kind == "append" else "")
        lines.append(f"{left:<28}{text}" if len(left) < 28 else f"{left}\n{'':<28}{text}")
    return "\n".join(lines) + "\n\n" + EPILOG


def parse_args(argv: list[str]) -> dict[str, object]:
    """Options as a dict keyed like the flags (``writable_root``...), plus ``command``."""
    options: dict[str, object] = {flag[2:].replace("-", "_"): [] if kind == "append" else None
                                  for flag, _, kind, _ in OPTIONS}
    options["command"] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if arg == "--" or not arg.startswith("-") or arg == "-":
            options["command"] = argv[index:] if arg == "--" else argv[index - 1:]
            break
        flag, has_value, inline = arg.partition("=")
        flag = "--help" if flag == "-h" else flag
        if flag not in _BY_FLAG:
            raise UsageError(f"unknown option {flag!r} (see sandboxd run --help)")
        metavar, kind = _BY_FLAG[flag]
        key = flag[2:].replace("-", "_")
        if kind == "flag":
            if has_value:
                raise UsageError(f"{flag} takes no value")
            options[key] = True
            continue
        if kind == "optional":                     # --network or --network=VALUE, never a separate word
            options[key] = inline if has_value else True
            continue
        if has_value:
            value = inline
        elif index < len(argv):
            value, index = argv[index], index + 1
        else:
            raise UsageError(f"{flag} needs a value: {flag} {metavar}")
        if kind == "append":
            _strings(options, key).append(value)
        else:
            options[key] = value
    if options["network"] and options["no_network"]:
        raise UsageError("--network and --no-network exclude each other")
    if options["network"] not in (None, True, "isolated", "host"):
        raise UsageError(f"--network={options['network']}: use --network (isolated) or --network=host")
    for flag in ("dns", "allow_host", "allow_domain", "credential", "allow_endpoint"):
        if options[flag] and options["network"] not in (True, "isolated"):
            raise UsageError(f"--{flag.replace('_', '-')} only applies to the isolated network: add --network")
    if options["upstream_proxy"] is not None and not (options["allow_domain"] or options["credential"]
                                                      or options["allow_endpoint"]):
        raise UsageError("--upstream-proxy is where the filtering proxy sends what it lets out: add --network with "
                         "--allow-domain or --credential")
    if options["review"] is not None:
        from sandboxd.cli import run_review
        try:
            options["review"] = run_review.parse(options["review"])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if options["review_bytes"] is not None and options["review"] is None:
        raise UsageError("--review-bytes bounds a review's change set: add --review")
    return options


def _strings(options: dict[str, object], key: str) -> list[str]:
    """The values of an option given once per value (parse_args starts each as a list)."""
    values = options[key]
    assert isinstance(values, list), key
    return values


def _number(options: dict[str, object], key: str, kind: "Callable[[str], N]") -> "N | None":
    value = options[key]
    if value is None:
        return None
    try:
        return kind(str(value))
    except ValueError:
        raise UsageError(f"--{key.replace('_', '-')} {value!r} is not a {'whole ' if kind is int else ''}number") from None


def spec_from_args(args: dict[str, object], credentials: "RunCredentials | None" = None) -> LaunchSpec:
    """The launch ``args`` ask for; with ``credentials`` (run_credentials.prepare), its phantoms and
    trust variables over the environment and its CA's certificate to trust."""
    command = _strings(args, "command")
    if not command:
        raise InvalidPolicy("no program given: sandboxd run [options] -- PROGRAM [ARGS...]")
    protected = () if args["no_default_protect"] else DEFAULT_PROTECTED_SUBPATHS
    protected = tuple(dict.fromkeys(protected + tuple(_strings(args, "protect"))))
    network = bool(args["network"])
    mode = "host" if args["network"] == "host" else defaults.NETWORK_MODE
    policy = policy_from_name(str(args["sandbox"] or "workspace-write"), network_access=network,
                              writable_roots=list(_strings(args, "writable_root")),
                              protected_subpaths=protected, network_mode=mode,
                              allowed_unix_sockets=list(_strings(args, "allow_unix_socket")),
                              allowed_hosts=list(_strings(args, "allow_host")),
                              published_ports=list(_strings(args, "publish")),
                              allowed_domains=list(_strings(args, "allow_domain")),
                              allowed_endpoints=list(_strings(args, "allow_endpoint")),
                              credentials=credentials.policy_entries if credentials else [])
    workspace = os.path.abspath(str(args["workspace"] or os.getcwd()))
    cwd, user = args["cwd"], args["user"]
    command_user = parse_user(str(user)) if user else None
    from sandboxd.cli import run_env
    env, hidden_homes, private_home, home_notes = run_env.plan(
        dict(os.environ), workspace=workspace, user=command_user, confined=policy.confined,
        host_home=bool(args["host_home"]), clear=bool(args["clear_env"]), passes=_strings(args, "pass_env"),
        sets=_strings(args, "env"), strict_homes=bool(args["strict_homes"]))
    for note in home_notes:                         # asked to hide the homes, and one stays visible
        _say(note)
    if credentials is not None:
        env.update(credentials.environment())       # last: VAR is the phantom whatever else was asked
    memory, tmp_size = args["memory"], args["tmp_size"]
    # Like every session of the daemon: default limits, under the host-wide caps of the parent group.
    from sandboxd.kernel import host_limits
    ceiling, pids = host_limits.default_ceiling(), _number(args, "pids", int)
    if args["no_default_limits"]:
        ceiling = host_limits.Ceiling()
    elif pids is None:
        pids = host_limits.DEFAULT_PIDS
    limits = Limits(
        timeout_seconds=_number(args, "timeout", float),
        memory_bytes=(parse_size(str(memory), "--memory") if memory else
                      None if args["no_default_limits"] else host_limits.default_memory()),
        pids=pids, cpu_seconds=_number(args, "cpu_seconds", int),
        open_files=_number(args, "open_files", int),
        tmp_size_bytes=parse_size(str(tmp_size), "--tmp-size") if tmp_size else DEFAULT_TMP_SIZE,
        total_pids=ceiling.pids, total_memory_bytes=ceiling.memory_bytes,
    )
    from sandboxd.cli import run_user
    if run_user.plain_user():
        limits = run_user.limits_for_plain_user(limits, args)
    hidden, sockets, channels = _daemon_places()
    return LaunchSpec(argv=tuple(command), workspace=workspace, env=env,
                      cwd=os.path.abspath(str(cwd)) if cwd else None, policy=policy, limits=limits,
                      user=command_user, dns=tuple(_strings(args, "dns")),
                      hidden_homes=hidden_homes, private_home=private_home, hidden_paths=hidden,
                      owner_hidden=defaults.owner_hidden_paths(os.geteuid(), os.path.expanduser("~"),
                                                               os.environ.get("XDG_STATE_HOME", "")),
                      denied_sockets=sockets, approval_channels=channels,
                      trust_pem=credentials.trust_pem if credentials else "")


def _daemon_places() -> "tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]":
    """What of a daemon on this machine a run keeps out of reach: its sockets, its audit log, and
    its approval channels (`sandboxd mcp --http`, launcher.channel_registry); the default daemon's,
    and the one $SANDBOXD_SOCKET names for this user's clients."""
    sockets = tuple(dict.fromkeys((defaults.SOCKET, os.path.abspath(os.environ.get(defaults.SOCKET_ENV)
                                                                     or defaults.SOCKET))))
    hidden = (defaults.SOCKET_DIR, defaults.STATE_DIR, *(path for socket in sockets[1:]
                                                         for path in defaults.daemon_hidden_paths(socket)))
    return hidden, sockets, tuple(defaults.channel_registry(socket) for socket in sockets)


def _say(text: str) -> None:
    """One line of `sandboxd run`'s own on stderr. Printable: it may quote what the command chose
    (a path the git guard names, a destination the proxy refused)."""
    sys.stderr.write(f"sandboxd run: {printable(text)}\n")


def _waits_to_join(spec: LaunchSpec) -> bool:
    """Whether the child's cgroup join will write ``cgroup.procs`` (kernel/cgroups.join), the move
    that waits for an RCU grace period: into a v2 group that holds a limit, or into every group of
    a danger-full-access run (no PID namespace bounds it). A confined run whose limits are v1's
    moves through ``tasks`` alone, and the warm-up would only wait for nothing. A plain user's
    (rootless) run moves nothing itself."""
    if os.geteuid() != 0:
        return False
    if isinstance(spec.policy, DangerFullAccess):
        return True
    from sandboxd.kernel import cgroups
    return "v2" in (cgroups.where("memory"), cgroups.where("pids"))


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        if args["help"]:
            sys.stdout.write(help_text())
            return 0
        upstream = upstream_route(args["upstream_proxy"])
        credentials = None
        if args["credential"] or args["credential_file"] or args["allow_endpoint"]:
            from sandboxd.cli import run_credentials
            # First: before anything copies this process's environment (see run_credentials).
            credentials = run_credentials.prepare(_strings(args, "credential"), _strings(args, "credential_file"),
                                                  intercepts=bool(args["allow_endpoint"]))
        spec = spec_from_args(args, credentials)
    except UsageError as exc:
        sys.stderr.write(USAGE + "\n")
        _say(str(exc))
        return EXIT_SETUP_FAILED
    except SandboxdError as exc:
        _say(str(exc))
        return EXIT_SETUP_FAILED
    review, review_dir = args["review"], None
    if review is not None:
        from sandboxd.cli import run_review
        from sandboxd.kernel import overlay
        assert isinstance(review, run_review.Review)
        try:
            review_dir = run_review.new_directory(review, [spec.workspace, *_roots(spec)])
            overlay.make_review_dir(review_dir)
            from sandboxd.kernel import review_space             # the store's disk bound (issue 25)
            review_space.bound_run(review_dir, args["review_bytes"])
        except SandboxdError as exc:
            _say(str(exc))
            return EXIT_SETUP_FAILED
        review = review.replace(directory=review_dir)
    # In review mode nothing reaches the host: what would be planted is flagged in the change set.
    guard = _git_guard(spec) if review_dir is None else None
    if guard is not None:
        # One walk: the build protects the git directories the guard's baseline just found.
        spec = spec.replace(git_dirs=guard.found_git_dirs())
    warmup = None
    if (not args["no_default_limits"] or args["memory"] or args["pids"]) and _waits_to_join(spec):
        # Started here, not earlier: the wait is saved only if the child's move comes within about
        # one grace period of the warm-up's end, and the git guard's walk above can take longer.
        from sandboxd.kernel import cgroup_warmup
        warmup = cgroup_warmup.start()
    try:
        from sandboxd.kernel import process
        from sandboxd.supervisor.spawner import Spawner
        if warmup is not None:
            warmup.wait()                            # before the fork: no thread may run across it
        # Held from the fork until the forwarding exists (then delivered to it): a Ctrl-C in that
        # window reaches the command, not Python's KeyboardInterrupt. The command clears what it
        # inherits at its 'default signals' step (process.default_signals).
        process.hold_forwarded_signals()
        try:
            sandbox = Spawner().launch(spec, review_dir=review_dir)
            _forward_signals(sandbox)
        finally:
            process.release_forwarded_signals()
        sandbox.wait_started()
        if review_dir is not None:
            _save_layers(review_dir, list(sandbox.plan.review_layers.values()))
    except SandboxdError as exc:
        _say(str(exc))
        if review_dir is not None:
            _remove_review_dir(review_dir)           # made above for this run: nothing reached it
        if isinstance(exc, ExecFailed) and exc.errno == errno.EACCES:
            _note_uid(spec)
        if isinstance(exc, LimitsUnavailable) and not args["no_default_limits"]:
            sys.stderr.write("sandboxd run: (every run has default memory and pids limits: "
                             "--no-default-limits runs without them)\n")
        return EXIT_SETUP_FAILED
    published: "list[EgressProxy | PublishedPort]" = []
    network, policy = sandbox.network, spec.policy
    if network is not None and network.proxy_listener is not None and isinstance(policy, WorkspaceWrite):
        try:
            published.append(_serve_proxy(network, policy, credentials, upstream))
        except SandboxdError as exc:                 # a --credential-file read after the fork
            sandbox.kill()
            sandbox.wait()
            _say(str(exc))
            return EXIT_SETUP_FAILED
    if isinstance(policy, WorkspaceWrite) and policy.published_ports:
        try:
            published += _publish(sandbox.pid, policy.published_ports)
        except SandboxdError as exc:
            sandbox.kill()
            sandbox.wait()
            _say(str(exc))
            return EXIT_SETUP_FAILED
    info = sandbox.wait(spec.limits.timeout_seconds)
    for port in published:
        port.close()
    if guard is not None:
        for item in guard.inspect():
            _say(item.describe())
    if review is not None:
        from sandboxd.cli import run_review
        assert isinstance(review, run_review.Review)
        killed = ("the command timed out" if info.timed_out else
                  f"the command was killed by signal {info.signal}" if info.signal is not None else "")
        run_review.finish(review, list(sandbox.plan.review_layers.values()), killed=killed)
    if info.timed_out:
        sys.stderr.write(f"sandboxd run: timed out after {spec.limits.timeout_seconds:g}s; killed the whole tree\n")
    if info.oom_killed:
        sys.stderr.write(f"sandboxd run: the memory limit ({spec.limits.memory_bytes} bytes) was reached; "
                         "the kernel killed a process of the sandbox (OOM)\n")
    if info.exit_code:                               # its own failure, not a timeout or a signal
        _note_uid(spec, sandbox.plan.uid, sandbox.plan.gid)
    return info.shell_status


def _remove_review_dir(review_dir: str) -> None:
    from sandboxd.kernel import overlay
    try:
        overlay.remove_layers(review_dir)
    except OSError:
        pass                                         # what is left is the user's to see: it is theirs


def _save_layers(review_dir: str, layers: "list[Layers]") -> None:
    """The layers' record, what a later listing or apply from ``review_dir`` starts from: written
    while the command runs (json's import is not the launch's to pay)."""
    from sandboxd.kernel import overlay
    try:
        overlay.save(review_dir, layers)
    except OSError as exc:
        _say(f"review: could not record the layers in {review_dir}: {os.strerror(exc.errno or errno.EIO)}")


def _note_uid(spec: LaunchSpec, uid: "int | None" = None, gid: "int | None" = None) -> None:
    """Root's run of a command that failed as the workspace's owner: say so (cli.run_user)."""
    from sandboxd.cli.run_user import uid_note
    if uid is None or gid is None:
        owner = os.stat(spec.workspace)
        uid, gid = owner.st_uid, owner.st_gid
    note = uid_note(uid, gid, spec.workspace, asked=spec.user is not None)
    if note is not None:
        _say(note)


def _roots(spec: LaunchSpec) -> "list[str]":
    policy = spec.policy
    return list(policy.writable_roots) if isinstance(policy, WorkspaceWrite) else []


def _git_guard(spec: LaunchSpec) -> "GitGuard | None":
    """The git guard of the writable roots while .git/config is protected (the default): it takes
    them as they are now, and after the command removes the git configuration it planted. None
    when the roots are refused: the launch reports why."""
    policy = spec.policy
    if not isinstance(policy, WorkspaceWrite) or GIT_GUARD_SUBPATH not in policy.protected_subpaths:
        return None
    from sandboxd.kernel import paths
    from sandboxd.gitguard.guard import GitGuard
    try:
        resolved = paths.resolve(spec.workspace, spec.cwd, policy.writable_roots, workspace_writable=True,
                                 confined=True)
    except SandboxdError:
        return None
    resolved.close()                                 # only the real paths are needed here
    return GitGuard(resolved.writable_roots)


def _serve_proxy(network: "IsolatedNetwork | LoopbackProxy", policy: WorkspaceWrite,
                 credentials: "RunCredentials | None", upstream: "UpstreamRoute | None") -> "EgressProxy":
    """The egress proxy of --allow-domain, --allow-endpoint and --credential, on this process's relay
    loop (a thread: after the one fork, the parent forks no more); it connects from inside the
    sandbox's network namespace (rootless: from this process's). The credentials' secrets are
    taken here, after the fork (run_credentials)."""
    from sandboxd.network.egress_proxy import EgressProxy

    def denied(destination: str, why: str) -> None:
        _say(f"blocked a connection to {destination}: {why}")
        sys.stderr.flush()
    secrets = credentials.credential_set() if credentials is not None else None
    listener, network.proxy_listener = network.proxy_listener, None
    assert listener is not None                      # main serves a proxy only when there is one
    proxy = EgressProxy(listener, policy.network_rules, netns_fd=network.netns_fd, resolvers=network.resolvers,
                        on_denied=denied, credentials=secrets, upstream=upstream,
                        interceptor=credentials.interceptor() if credentials is not None else None).start()
    # Root's isolated network also captures the sandbox's ports 80 and 443 (network.transparent);
    # a rootless one has no namespace of its own to redirect in (docs/rootless.md).
    from sandboxd.kernel.netns import IsolatedNetwork
    captured = network.transparent_listener if isinstance(network, IsolatedNetwork) else None
    if isinstance(network, IsolatedNetwork) and captured is not None:
        network.transparent_listener = None
        proxy.serve_captured(captured)
    return proxy


def upstream_route(text: "object") -> "UpstreamRoute | None":
    """--upstream-proxy HOST:PORT (or http://HOST:PORT) as the route, or UsageError; None when not given."""
    if text is None:
        return None
    from sandboxd.config import split_upstream_proxy
    from sandboxd.network.upstream import UpstreamRoute
    value = str(text)
    split = split_upstream_proxy(value if value.startswith("http://") else "http://" + value)
    if split is None:
        raise UsageError(f"--upstream-proxy {value[:200]!r}: give HOST:PORT, a host name or IPv4 address and a port "
                         "(like proxy.corp.example:3128)")
    return UpstreamRoute(*split)


def _publish(init_pid: int, entries: "tuple[str, ...]") -> "list[PublishedPort]":
    """Listen for the published ports, on this process's relay loop (a thread: after the one fork,
    the parent forks no more)."""
    from sandboxd.network.publish import publish_all

    netns = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return publish_all(netns, entries, owners=frozenset({os.getuid()}))   # who ran it: its reserve
    finally:
        os.close(netns)


def _forward_signals(sandbox: "SandboxProcess") -> None:
    def forward(signum: int, _frame: object) -> None:
        sandbox.send_signal(signum)

    from sandboxd.kernel.process import FORWARDED_SIGNALS
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
