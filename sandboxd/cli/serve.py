"""`sandboxd serve`: the daemon, in the foreground, logging JSON lines to stderr."""

from __future__ import annotations

import argparse
import grp
import sys

from sandboxd.errors import SandboxdError
from sandboxd.service.server import DEFAULT_SOCKET, DEFAULT_STATE_DIR


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd serve", description=(
        "Run the sandboxd daemon: one persistent kernel sandbox per session, driven over gRPC "
        "(service sandboxd.v1.Sandbox, plus grpc.health.v1 and server reflection) on a Unix socket. "
        "Every local user may connect; each sees and uses only the sessions it created "
        "(the kernel tells the daemon who is calling), except root and the --admin-group."))
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the Unix socket to listen on (default {DEFAULT_SOCKET})")
    parser.add_argument("--admin-group", metavar="GROUP", help="members may see and use every session")
    parser.add_argument("--workers", type=int, default=64, help="concurrent RPCs (default 64)")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help=f"the event store (audit log) and session metadata (default {DEFAULT_STATE_DIR})")
    parser.add_argument("--dns", action="append", default=[], metavar="IP",
                        help="a resolver for isolated-network sessions (repeatable; default: the host's)")
    parser.add_argument("--approval-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a call nobody approves within this is denied (default 300)")
    tls = parser.add_argument_group("optional TCP listener (TLS with client certificates only)")
    tls.add_argument("--tcp", metavar="HOST:PORT", help="also listen here, with TLS")
    tls.add_argument("--tls-cert", metavar="FILE", help="the server's certificate chain (PEM)")
    tls.add_argument("--tls-key", metavar="FILE", help="the server's private key (PEM)")
    tls.add_argument("--tls-client-ca", metavar="FILE", help="CA that client certificates must be signed by")
    tls.add_argument("--tcp-user", metavar="USER[:GROUP]", default="nobody",
                     help="the local user TLS callers act as (default: nobody)")
    args = parser.parse_args(argv)
    listener = None
    tls_options = (args.tls_cert, args.tls_key, args.tls_client_ca)
    if args.tcp or any(tls_options):
        if not (args.tcp and all(tls_options)):
            sys.stderr.write("sandboxd serve: a TCP listener needs all of --tcp, --tls-cert, --tls-key and "
                             "--tls-client-ca (there is no plain-text or unauthenticated TCP)\n")
            return 2
        from sandboxd.cli.run import parse_user
        from sandboxd.errors import InvalidPolicy
        from sandboxd.service.server import TlsListener
        try:
            uid, gid = parse_user(args.tcp_user)
            listener = TlsListener(args.tcp, args.tls_cert, args.tls_key, args.tls_client_ca, uid, gid)
        except (InvalidPolicy, OSError) as exc:
            sys.stderr.write(f"sandboxd serve: {exc}\n")
            return 2
    admin_gid = None
    if args.admin_group:
        try:
            admin_gid = int(args.admin_group) if args.admin_group.isdigit() else grp.getgrnam(args.admin_group).gr_gid
        except KeyError:
            sys.stderr.write(f"sandboxd serve: unknown group {args.admin_group!r}\n")
            return 2
    from sandboxd.service.server import serve
    if args.approval_timeout <= 0:
        sys.stderr.write("sandboxd serve: --approval-timeout must be a positive number of seconds\n")
        return 2
    try:
        from sandboxd.policy import LaunchSpec
        LaunchSpec(argv=("true",), workspace="/", dns=tuple(args.dns))   # validates the addresses
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    return serve(args.socket, admin_gid=admin_gid, workers=args.workers, tls=listener, state_dir=args.state_dir,
                 approval_timeout=args.approval_timeout, dns=tuple(args.dns))
