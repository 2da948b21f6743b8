"""`sandboxd mcp`: an MCP server (stdio, or opt-in streamable HTTP on localhost) whose tools run
in a sandboxd session, as a client of the daemon with the caller's own identity."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

import grpc

from sandboxd.cli import network_args
from sandboxd.cli.ctl import SOCKET_ENV, _connection_error, socket_choice
from sandboxd.client import DEFAULT_SOCKET
from sandboxd.printable import printable
from sandboxd.service.server import TextLogFormatter

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.mcp.daemon import SessionSpec
    from sandboxd.mcp.gateway.router import GatewaySetup

USAGE_EPILOG = """examples:
  sandboxd mcp --workspace ~/project                       stdio, a workspace-write session without network
  claude mcp add sandboxd -- sandboxd mcp --workspace ~/project --approval never
  sandboxd mcp --http 127.0.0.1:8765 --workspace ~/project  streamable HTTP at http://127.0.0.1:8765/mcp
                                                           (with the bearer token it names on stderr)
  sandboxd mcp --workspace ~/project --gateway ~/.config/sandboxd/gateway.toml
                                                           also the tools of the upstream MCP servers the file
                                                           names (UPSTREAM__tool), each in its own sandbox
  claude mcp add sandboxd -- sandboxd mcp --workspace ~/project --gateway ~/.config/sandboxd/gateway.toml

a gateway file (docs/mcp.md, "The gateway"):
  [upstreams.fs]
  command = ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/home/me/notes"]
  writable_roots = ["/home/me/notes"]
  [upstreams.fs.tools.read_text_file]
  effect = "read-only"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandboxd mcp", epilog=USAGE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="An MCP server whose tools (shell, files, patches, search, background processes) run in a "
                    "sandboxd session opened for each MCP connection and closed when it ends.")
    parser.add_argument("--socket", default="",
                        help=f"the daemon's socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})")
    parser.add_argument("--workspace", default="", help="the session's workspace (default: the current directory)")
    parser.add_argument("--sandbox", default="workspace-write",
                        choices=["read-only", "workspace-write", "danger-full-access"])
    parser.add_argument("--network", action="store_true", help="let commands reach the network")
    parser.add_argument("--writable-root", action="append", default=[], metavar="DIR",
                        help="another directory commands may write (repeatable)")
    parser.add_argument("--approval", default="on-request", choices=["never", "on-request", "always"])
    parser.add_argument("--permission-mode", default="", choices=["", "read_only", "auto", "full"],
                        help="one axis instead of --sandbox and --approval (see docs/mcp.md)")
    parser.add_argument("--review", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the session's writes for a person's review (sandboxctl changes, apply, discard); "
                             "the model may list and diff them, never apply (default: the daemon's review.default)")
    parser.add_argument("--checkpoint-calls", action="store_true",
                        help="in review mode, mark a checkpoint before each shell call, so that a person can roll "
                             "the session back to before any of them (sandboxctl checkpoints, rollback)")
    parser.add_argument("--session", default="", metavar="ID",
                        help="attach to this existing session of yours instead (it is not closed at exit)")
    parser.add_argument("--http", default="", metavar="unix:PATH|127.0.0.1:PORT",
                        help="serve streamable HTTP (at /mcp) on a Unix socket (mode 0600) or a loopback port "
                             "that only your own uid may use, outside any sandbox, with this server's bearer "
                             "token, instead of stdio")
    parser.add_argument("--token-file", default="", metavar="PATH",
                        help="--http: write the bearer token made at start here (mode 0600) instead of your "
                             "directory in the daemon's place, which no sandbox sees; or pass one in "
                             "$SANDBOXD_MCP_TOKEN")
    parser.add_argument("--idle-timeout", default=600.0, type=float, metavar="SECONDS",
                        help="--http: end an MCP session (and its sandboxd session) that no request reached "
                             "for this long (default 600)")
    parser.add_argument("--gateway", default="", metavar="FILE",
                        help="also serve the tools, resources and prompts of the upstream MCP servers this TOML "
                             "file names, each run in its own sandboxd session, every call through this "
                             "session's approvals and audit (docs/mcp.md, \"The gateway\")")
    network_args.add_network_options(parser)
    return parser


def parse_listen(text: str) -> tuple[str, int] | str:
    """unix:PATH -> PATH; HOST:PORT (loopback only) -> (HOST, PORT)."""
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not os.path.isabs(path):
            raise ValueError(f"--http {text}: the socket path must be absolute")
        return path
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http {text}: use unix:/absolute/path or 127.0.0.1:PORT (localhost only)")
    return host, int(port)


def log_printable() -> None:
    """What this process logs (sandboxd.mcp, the MCP SDK, uvicorn: warnings and worse) goes to
    stderr as the daemon's text lines, printable: a client's, an agent's or the daemon's strings in
    a message cannot forge a line or act on the terminal. Once per process."""
    root = logging.getLogger()
    if not any(isinstance(handler.formatter, TextLogFormatter) for handler in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TextLogFormatter())
        root.addHandler(handler)


def _gateway_setup(path: str) -> "GatewaySetup":
    """The gateway file read and checked (GatewayConfigError, a ValueError: exit 2 with its line),
    and its secrets' values for the audit's redaction."""
    from sandboxd.mcp.gateway.config import load
    from sandboxd.mcp.gateway.router import GatewaySetup

    try:
        config = load(os.path.abspath(path))
    except OSError as error:                 # unreadable: the one line says which file and why
        raise ValueError(f"--gateway {path}: {error.strerror or error}") from None
    return GatewaySetup.read(config)


def _credentials_unshared(flags: list[str], gateway: "GatewaySetup") -> None:
    """ValueError when a --credential variable of the gateway's own session is an upstream's too:
    one variable backs one holder (the person set it for one of them, not to hand it on)."""
    own = {text.partition("=")[0] for text in flags}
    for upstream in gateway.config.upstreams:
        for spec in upstream.credentials:
            variable = spec.partition("=")[0]
            if variable in own:
                raise ValueError(f"--credential {variable}: [upstreams.{upstream.name}] of the gateway file names it "
                                 "too: a variable backs one holder only; give one of them a variable of its own")


def _session_writes(spec: "SessionSpec") -> tuple[str, ...]:
    """Where the gateway's own session's commands may write (its workspace and writable roots);
    none under danger-full-access (no wall to name) or for an attached session (its roots are
    not known here)."""
    mode = spec.permission_mode
    writes = spec.sandbox == "workspace-write" if not mode else mode != "read_only"
    return () if spec.attach or not writes else (spec.workspace, *spec.writable_roots)


def _outside_the_session(path: str, spec: "SessionSpec") -> None:
    """ValueError when the gateway file is where the gateway's own session may write (its workspace
    or a writable root): the model's commands could then rewrite it, and the next start would give
    an upstream a wider sandbox, its trust, or another command. (Under danger-full-access there is
    no wall to keep it behind; an attached session's roots are not known here.)"""
    real = os.path.realpath(path)
    for root in _session_writes(spec):
        inside = os.path.realpath(root)
        if real == inside or real.startswith(inside.rstrip("/") + "/"):
            raise ValueError(f"--gateway {path}: the file is inside {root}, which this session's commands may "
                             "write: keep it where they cannot (e.g. ~/.config/sandboxd/gateway.toml)")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    log_printable()
    socket_path, name_socket = socket_choice(args.socket)
    from sandboxd.mcp.daemon import SessionSpec
    from sandboxd.v1 import sandboxd_pb2 as pb
    try:
        # Before this session's credentials are read: those taken out of the environment then
        # may be an upstream's too, and their values are redacted from the audit.
        gateway = _gateway_setup(args.gateway) if args.gateway else None
        if gateway is not None:
            _credentials_unshared(args.credential, gateway)
        credentials = network_args.credentials_from_args(args)
    except ValueError as error:
        sys.stderr.write(f"sandboxd mcp: {printable(str(error))}\n")
        return 2
    network = pb.SandboxPolicy()
    network_args.apply_network(network, args, credentials)
    spec = SessionSpec(network_policy=network if network_args.given(args) else None,
                       credential_secrets=network_args.secrets_proto(credentials),
                       workspace=os.path.abspath(args.workspace or os.getcwd()), sandbox=args.sandbox,
                       network=args.network, writable_roots=tuple(os.path.abspath(root) for root in args.writable_root),
                       approval=args.approval, permission_mode=args.permission_mode, attach=args.session,
                       labels={"client": "sandboxd-mcp"}, review=args.review,
                       checkpoint_calls=args.checkpoint_calls)
    ctl = f"sandboxctl --socket {socket_path}" if name_socket else "sandboxctl"
    try:
        if gateway is not None:
            _outside_the_session(args.gateway, spec)
            from sandboxd.mcp.gateway.cautions import cautions
            for line in cautions(gateway.config, _session_writes(spec)):
                sys.stderr.write(f"sandboxd mcp: warning: {line}\n")
        listen = parse_listen(args.http) if args.http else None
        if (args.token_file or args.idle_timeout != 600.0) and listen is None:
            raise ValueError("--token-file and --idle-timeout are for --http")
        if args.token_file and not os.path.isabs(args.token_file):
            raise ValueError(f"--token-file {args.token_file}: the path must be absolute")
        if not 0 < args.idle_timeout <= 7 * 86400:
            raise ValueError(f"--idle-timeout {args.idle_timeout:g}: give seconds above 0, at most a week")
        import anyio

        from sandboxd.cli import mcp_transports
        if listen is not None:
            options = mcp_transports.HttpOptions(listen, token_file=args.token_file, idle_timeout=args.idle_timeout)
            anyio.run(mcp_transports.serve_http, socket_path, spec, ctl, options, gateway)
        else:
            anyio.run(mcp_transports.serve_stdio, socket_path, spec, ctl, gateway)
    except grpc.RpcError as error:
        line = _connection_error(error, socket_path) or f"{error.code().name}: {error.details()}"
        sys.stderr.write(f"sandboxd mcp: {printable(line)}\n")
        return 1
    except ValueError as error:
        sys.stderr.write(f"sandboxd mcp: {printable(str(error))}\n")
        return 2
    except OSError as error:                 # --http: the address is taken, or not ours to use
        sys.stderr.write(f"sandboxd mcp: {printable(args.http)}: {printable(str(error.strerror or error))}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
