"""`sandboxd serve`: the daemon, in the foreground, logging JSON lines to stderr."""

from __future__ import annotations

import argparse
import grp
import sys

from sandboxd.service.server import DEFAULT_SOCKET


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd serve", description=(
        "Run the sandboxd daemon: one persistent kernel sandbox per session, driven over gRPC "
        "(service sandboxd.v1.Sandbox, plus grpc.health.v1 and server reflection) on a Unix socket. "
        "Every local user may connect; each sees and uses only the sessions it created "
        "(the kernel tells the daemon who is calling), except root and the --admin-group."))
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the Unix socket to listen on (default {DEFAULT_SOCKET})")
    parser.add_argument("--admin-group", metavar="GROUP", help="members may see and use every session")
    parser.add_argument("--workers", type=int, default=64, help="concurrent RPCs (default 64)")
    args = parser.parse_args(argv)
    admin_gid = None
    if args.admin_group:
        try:
            admin_gid = int(args.admin_group) if args.admin_group.isdigit() else grp.getgrnam(args.admin_group).gr_gid
        except KeyError:
            sys.stderr.write(f"sandboxd serve: unknown group {args.admin_group!r}\n")
            return 2
    from sandboxd.service.server import serve
    return serve(args.socket, admin_gid=admin_gid, workers=args.workers)
