"""`sandboxd run`: one command in a sandbox, no daemon. The CI-runner path."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from sandboxd.errors import InvalidPolicy, SandboxdError
from sandboxd.policy import DEFAULT_PROTECTED_SUBPATHS, LaunchSpec, Limits, parse_size, policy_from_name
from sandboxd.policy.limits import DEFAULT_TMP_SIZE

EXIT_TIMEOUT = 124
EXIT_SETUP_FAILED = 125

DESCRIPTION = """Run PROGRAM in a kernel-enforced sandbox and exit with its status.

policies:
  workspace-write     (default) the workspace and --writable-root dirs are writable,
                      everything else read-only; .git/hooks and .git/config stay
                      read-only; no network unless --network
  read-only           nothing writable but a private /tmp; no network
  danger-full-access  no filesystem or network restriction; still a killable tree,
                      and no TIOCSTI into your terminal

every policy but danger-full-access gets new mount, PID, IPC, UTS, cgroup and
(without --network) network namespaces, a read-only host root, fresh /proc, a
minimal /dev, a private /tmp, no capabilities, no_new_privs and seccomp.
"""

EPILOG = """exit status:
  the command's own; 128+N if it was killed by signal N; 124 on timeout;
  125 if the sandbox could not be set up (one line on stderr says why).

SIZE takes plain bytes or a K/M/G suffix (binary multiples): 512M, 2G.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"sandboxd run: {message}\n")
        sys.exit(EXIT_SETUP_FAILED)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sandboxd run", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                usage="sandboxd run [options] -- PROGRAM [ARGS...]")
    p.add_argument("--sandbox", default="workspace-write", metavar="POLICY",
                   help="read-only | workspace-write | danger-full-access (default: workspace-write)")
    p.add_argument("--workspace", metavar="DIR", help="the workspace (default: the current directory)")
    p.add_argument("--cwd", metavar="DIR", help="where the command starts (default: the workspace)")
    p.add_argument("--writable-root", action="append", default=[], metavar="DIR",
                   help="another writable directory (repeatable; workspace-write only)")
    p.add_argument("--protect", action="append", default=[], metavar="SUBPATH",
                   help="keep SUBPATH of every writable root read-only, in addition to "
                        f"{', '.join(DEFAULT_PROTECTED_SUBPATHS)} (repeatable)")
    p.add_argument("--no-default-protect", action="store_true",
                   help=f"do not protect {', '.join(DEFAULT_PROTECTED_SUBPATHS)} by default")
    net = p.add_mutually_exclusive_group()
    net.add_argument("--network", dest="network", action="store_true", default=False,
                     help="give the command the host's network (workspace-write only)")
    net.add_argument("--no-network", dest="network", action="store_false",
                     help="no network: a private namespace with only loopback (default)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="kill the whole tree after SECONDS")
    p.add_argument("--memory", metavar="SIZE", help="memory limit of the whole tree (cgroup)")
    p.add_argument("--pids", type=int, metavar="N", help="process/thread limit of the whole tree (cgroup)")
    p.add_argument("--cpu-seconds", type=int, metavar="N", help="CPU time limit per process (rlimit)")
    p.add_argument("--open-files", type=int, metavar="N", help="open files limit per process (rlimit)")
    p.add_argument("--tmp-size", metavar="SIZE", help=f"size of the private /tmp and /dev/shm "
                                                      f"(default {DEFAULT_TMP_SIZE >> 20}M)")
    p.add_argument("--user", metavar="UID[:GID]",
                   help="run as this user (numbers or names; default: the owner of the workspace)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="set a variable (repeatable)")
    p.add_argument("--clear-env", action="store_true", help="start from an empty environment")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS...]")
    return p


def parse_user(text: str) -> tuple[int, int]:
    import pwd
    import grp
    name, _, group = text.partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                default_gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                default_gid = uid
        else:
            entry = pwd.getpwnam(name)
            uid, default_gid = entry.pw_uid, entry.pw_gid
        if not group:
            return uid, default_gid
        return uid, int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidPolicy(f"unknown user or group in --user {text!r}") from None


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InvalidPolicy("no program given: sandboxd run [options] -- PROGRAM [ARGS...]")
    protected = () if args.no_default_protect else DEFAULT_PROTECTED_SUBPATHS
    protected = tuple(dict.fromkeys(protected + tuple(args.protect)))
    policy = policy_from_name(args.sandbox, network_access=args.network, writable_roots=args.writable_root,
                              protected_subpaths=protected)
    if args.network and policy.name != "workspace-write":
        if policy.name == "read-only":
            raise InvalidPolicy("--network needs --sandbox workspace-write (read-only has no network)")
    env = {} if args.clear_env else dict(os.environ)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidPolicy(f"--env {item!r} must look like NAME=VALUE")
        env[key] = value
    limits = Limits(
        timeout_seconds=args.timeout,
        memory_bytes=parse_size(args.memory, "--memory") if args.memory else None,
        pids=args.pids, cpu_seconds=args.cpu_seconds, open_files=args.open_files,
        tmp_size_bytes=parse_size(args.tmp_size, "--tmp-size") if args.tmp_size else DEFAULT_TMP_SIZE,
    )
    workspace = os.path.abspath(args.workspace or os.getcwd())
    return LaunchSpec(argv=tuple(command), workspace=workspace, env=env,
                      cwd=os.path.abspath(args.cwd) if args.cwd else None, policy=policy, limits=limits,
                      user=parse_user(args.user) if args.user else None)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        from sandboxd.supervisor.spawner import Spawner
        sandbox = Spawner().launch(spec)
        _forward_signals(sandbox)
        sandbox.wait_started()
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd run: {exc}\n")
        return EXIT_SETUP_FAILED
    info = sandbox.wait(spec.limits.timeout_seconds)
    if info.timed_out:
        sys.stderr.write(f"sandboxd run: timed out after {spec.limits.timeout_seconds:g}s; killed the whole tree\n")
    return info.shell_status


def _forward_signals(sandbox: "object") -> None:
    def forward(signum: int, _frame: object) -> None:
        sandbox.send_signal(signum)  # type: ignore[attr-defined]

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
