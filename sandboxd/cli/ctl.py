"""`sandboxctl`: drive the sandboxd daemon from a shell."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from sandboxd.client import DEFAULT_SOCKET, SandboxClient, sandbox_policy, write_through


def _session_line(session: object) -> dict[str, object]:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(session, preserving_proto_field_name=True)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxctl", description="Talk to the sandboxd daemon.")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the daemon's socket (default {DEFAULT_SOCKET})")
    commands = parser.add_subparsers(dest="command", required=True)
    session = commands.add_parser("session", help="create, list, close sessions, change their policy")
    actions = session.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a session; prints its id")
    create.add_argument("workspace")
    create.add_argument("--sandbox", default="workspace-write",
                        choices=["read-only", "workspace-write", "danger-full-access"])
    create.add_argument("--network", action="store_true")
    create.add_argument("--writable-root", action="append", default=[])
    create.add_argument("--approval", default="on-request", choices=["never", "on-request", "always"])
    create.add_argument("--label", action="append", default=[], metavar="K=V")
    listing = actions.add_parser("list", help="the sessions you may see")
    listing.add_argument("--json", action="store_true")
    close = actions.add_parser("close", help="close a session: kills everything in it")
    close.add_argument("session_id")
    policy = actions.add_parser("policy", help="change a live session's policy (for its next calls)")
    policy.add_argument("session_id")
    policy.add_argument("--sandbox", choices=["read-only", "workspace-write", "danger-full-access"])
    policy.add_argument("--network", action="store_true")
    policy.add_argument("--writable-root", action="append", default=[])
    policy.add_argument("--approval", choices=["never", "on-request", "always"])
    execute = commands.add_parser("exec", help="run a command in a session; exits with its status")
    execute.add_argument("session_id")
    execute.add_argument("--cwd", default="")
    execute.add_argument("--timeout", type=float, default=0)
    execute.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with SandboxClient(args.socket) as client:
            return _run(client, args)
    except grpc.RpcError as error:
        sys.stderr.write(f"sandboxctl: {error.code().name}: {error.details()}\n")  # type: ignore[attr-defined]
        return 1
    except ValueError as error:
        sys.stderr.write(f"sandboxctl: {error}\n")
        return 2


def _run(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.command == "exec":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            raise ValueError("no command: sandboxctl exec SESSION -- PROGRAM [ARGS...]")
        outcome = client.exec(args.session_id, command, cwd=args.cwd, timeout=args.timeout, on_output=write_through)
        return outcome.result.shell_status
    if args.action == "create":
        labels = dict(item.split("=", 1) for item in args.label if "=" in item)
        session = client.create_session(args.workspace, policy=sandbox_policy(
            args.sandbox, network=args.network, writable_roots=args.writable_root), approval=args.approval,
            labels=labels)
        print(session.id)
    elif args.action == "list":
        for session in client.list_sessions():
            if args.json:
                print(json.dumps(_session_line(session)))
            else:
                print(f"{session.id}  uid={session.owner_uid}  {session.workspace}  "
                      f"policy={session.sandbox_policy.mode}  calls={session.running_calls}")
    elif args.action == "close":
        client.close_session(args.session_id)
    elif args.action == "policy":
        policy = (sandbox_policy(args.sandbox, network=args.network, writable_roots=args.writable_root)
                  if args.sandbox else None)
        session = client.update_policy(args.session_id, policy=policy, approval=args.approval)
        print(f"{session.id} generation={session.sandbox_generation}")
    return 0


def entry() -> None:
    sys.exit(main())
