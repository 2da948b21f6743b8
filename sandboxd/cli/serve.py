"""`sandboxd serve`: the daemon, in the foreground, logging to stderr (JSON lines by default).

Settings come from the configuration file, the environment and these flags, each winning over
the one before (sandboxd.config.load checks them all, once); service.daemon runs the daemon.
"""

from __future__ import annotations

import argparse
import errno
import sys

from sandboxd.config import FLAGS
from sandboxd.errors import SandboxdError
from sandboxd.printable import printable


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandboxd serve", description=(
        "Run the sandboxd daemon: one persistent kernel sandbox per session, driven over gRPC "
        "(service sandboxd.v1.Sandbox, plus grpc.health.v1 and server reflection) on a Unix socket. "
        "Every local user may connect; each sees and uses only the sessions it created "
        "(the kernel tells the daemon who is calling), except root and the admin group. "
        "Defaults come from the configuration file (see `sandboxd config defaults`); flags win over it."))
    p.add_argument("--config", metavar="FILE", help="the configuration file (default: $SANDBOXD_CONFIG, else "
                   "/etc/sandboxd/sandboxd.toml if it exists)")
    p.add_argument("--socket", help="the Unix socket to listen on [listen.socket]")
    p.add_argument("--admin-group", metavar="GROUP", help="members may see and use every session [listen.admin_group]")
    p.add_argument("--workers", type=int, help="concurrent RPCs [listen.workers]")
    p.add_argument("--state-dir", help="the event store (audit log) and session metadata [state.dir]")
    p.add_argument("--dns", action="append", metavar="IP",
                   help="a resolver for isolated-network sessions (repeatable) [network.dns]")
    p.add_argument("--approval-timeout", type=float, metavar="SECONDS",
                   help="a call nobody approves within this is denied [approvals.timeout_seconds]")
    p.add_argument("--log-format", choices=["json", "text"], help="[log.format]")
    p.add_argument("--log-level", choices=["debug", "info", "warning"], help="[log.level]")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics here [metrics.listen]")
    p.add_argument("--upstream-proxy", metavar="http://HOST:PORT",
                   help="send what the egress proxy lets out through this proxy [network.upstream_proxy]")
    p.add_argument("--upstream-ca-file", metavar="FILE",
                   help="CA certificates (PEM) trusted for upstream servers [network.upstream_ca_file]")
    tls = p.add_argument_group("optional TCP listener (TLS with client certificates only)")
    tls.add_argument("--tcp", metavar="HOST:PORT", help="also listen here, with TLS [tls.address]")
    tls.add_argument("--tls-cert", metavar="FILE", help="the server's certificate chain (PEM) [tls.cert]")
    tls.add_argument("--tls-key", metavar="FILE", help="the server's private key (PEM) [tls.key]")
    tls.add_argument("--tls-client-ca", metavar="FILE", help="CA that client certificates must be signed by [tls.client_ca]")
    tls.add_argument("--tcp-user", metavar="USER[:GROUP]", help="the local user TLS callers act as [tls.user]")
    return p


def flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The configuration keys the command line sets (dotted key -> value): the flags given."""
    given = {dotted: getattr(args, flag[2:].replace("-", "_")) for dotted, flag in FLAGS.items()}
    return {dotted: value for dotted, value in given.items() if value is not None}


NEEDS_ROOT = ("sandboxd serve: needs root (you are uid {uid}): the daemon builds every user's sandboxes "
              "(namespaces, mounts, cgroups, network links) and runs each command as the user who asked for it, "
              "which only root may do. Start it as root (`packaging/setup.sh serve`, or the systemd unit); as "
              "yourself, `sandboxd run` runs one command in a sandbox, rootless, with no daemon\n")


def main(argv: list[str]) -> int:
    import os

    from sandboxd import config

    args = parser().parse_args(argv)
    if os.geteuid() != 0:
        sys.stderr.write(NEEDS_ROOT.format(uid=os.geteuid()))
        return 1
    try:
        settings = config.load(args.config, flags=flag_values(args))
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {printable(str(exc))}\n")   # it may quote the file's text
        return 2
    from sandboxd.network.socket_files import PlaceTaken
    from sandboxd.network.tcp_listeners import ListenerUnavailable
    from sandboxd.service.daemon import Daemon
    try:
        return Daemon(settings).run()
    except ListenerUnavailable as exc:
        # A busy or unusable TLS or metrics port: one line naming the key, the address and the cause.
        sys.stderr.write(f"sandboxd serve: {printable(str(exc))}\n")
        return 1
    except PlaceTaken as exc:
        # A name beside the socket another user made first (a socket in /tmp): one line, not a traceback.
        sys.stderr.write(f"sandboxd serve: {printable(str(exc))}\n")
        return 1
    except SandboxdError as exc:
        # A surviving supervisor another daemon is attached to (WrongState), or one that does not
        # answer its attach (SetupError): one line, not a traceback.
        sys.stderr.write(f"sandboxd serve: {printable(str(exc))}\n")
        return 1
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # A second `sandboxd serve` on a busy socket: one line, not a traceback.
        sys.stderr.write(f"sandboxd serve: another daemon is serving {printable(settings.socket)}: stop it "
                         f"first, or serve on another socket (--socket)\n")
        return 1
