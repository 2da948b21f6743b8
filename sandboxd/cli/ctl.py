"""`sandboxctl`: drive the sandboxd daemon from a shell."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from sandboxd.client import DEFAULT_SOCKET, SandboxClient, sandbox_policy, write_through
from sandboxd.v1 import sandboxd_pb2 as pb


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
    write = commands.add_parser("write", help="write stdin to a file in a session (atomically)")
    write.add_argument("session_id")
    write.add_argument("path")
    write.add_argument("--mode", type=lambda text: int(text, 8), default=0, help="octal, e.g. 644")
    write.add_argument("--parents", action="store_true", help="create missing parent directories")
    read = commands.add_parser("read", help="print a file of a session")
    read.add_argument("session_id")
    read.add_argument("path")
    ls = commands.add_parser("ls", help="list a directory of a session (default: the workspace)")
    ls.add_argument("session_id")
    ls.add_argument("path", nargs="?", default="")
    patch = commands.add_parser("patch", help="apply a unified diff from stdin, all-or-nothing")
    patch.add_argument("session_id")
    patch.add_argument("-p", dest="strip", type=int, default=0, help="path components to strip (default: auto)")
    start = commands.add_parser("start", help="start a background process; prints its id")
    start.add_argument("session_id")
    start.add_argument("--name", default="")
    start.add_argument("argv", nargs="*", metavar="-- PROGRAM [ARGS...]")
    ps = commands.add_parser("ps", help="list a session's background processes")
    ps.add_argument("session_id")
    stop = commands.add_parser("stop", help="stop a background process (its whole tree)")
    stop.add_argument("session_id")
    stop.add_argument("job_id")
    logs = commands.add_parser("logs", help="print a background process's output")
    logs.add_argument("session_id")
    logs.add_argument("job_id")
    logs.add_argument("--follow", "-f", action="store_true")
    execute = commands.add_parser("exec", help="run a command in a session; exits with its status")
    execute.add_argument("session_id")
    execute.add_argument("--cwd", default="")
    execute.add_argument("--timeout", type=float, default=0)
    execute.add_argument("argv", nargs="*", metavar="-- PROGRAM [ARGS...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the command, options included: split it off before argparse sees it.
    command: list[str] = []
    if "--" in words:
        split = words.index("--")
        words, command = words[:split], words[split + 1:]
    args = build_parser().parse_args(words)
    if command:
        args.argv = list(getattr(args, "argv", [])) + command
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
        command = args.argv
        if not command:
            raise ValueError("no command: sandboxctl exec SESSION -- PROGRAM [ARGS...]")
        outcome = client.exec(args.session_id, command, cwd=args.cwd, timeout=args.timeout, on_output=write_through)
        return outcome.result.shell_status
    if args.command == "write":
        written = client.write_file(args.session_id, args.path, sys.stdin.buffer.read(), mode=args.mode,
                                    create_parents=args.parents)
        print(written)
        return 0
    if args.command == "read":
        sys.stdout.buffer.write(client.read_file(args.session_id, args.path).data)
        return 0
    if args.command == "ls":
        for entry in client.list_dir(args.session_id, args.path):
            print(f"{entry.type:<7} {entry.mode:04o} {entry.size:>10}  {entry.name}")
        return 0
    if args.command == "patch":
        for patched in client.apply_patch(args.session_id, sys.stdin.read(), args.strip):
            print(f"{patched.action}\t{patched.path}")
        return 0
    if args.command == "start":
        command = args.argv
        if not command:
            raise ValueError("no command: sandboxctl start SESSION -- PROGRAM [ARGS...]")
        print(client.start_background(args.session_id, command, name=args.name).id)
        return 0
    if args.command == "ps":
        for job in client.list_background(args.session_id):
            state = "running" if job.running else f"exited {job.result.shell_status}"
            print(f"{job.id}  pid={job.pid}  {state:<10}  {job.name}")
        return 0
    if args.command == "stop":
        job = client.stop_background(args.session_id, args.job_id)
        print(f"{job.id} stopped ({job.result.shell_status})")
        return 0
    if args.command == "logs":
        for chunk in client.stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(
                session_id=args.session_id, id=args.job_id, follow=args.follow)):
            write_through(1, chunk.data)
        return 0
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
