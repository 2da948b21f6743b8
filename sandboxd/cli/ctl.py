"""`sandboxctl`: drive the sandboxd daemon from a shell."""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from sandboxd.client import DEFAULT_SOCKET, MAX_READ_BYTES, SandboxClient, sandbox_policy, write_through
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from google.protobuf.message import Message


def _message_dict(session: Message) -> dict[str, object]:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(session, preserving_proto_field_name=True)


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
    commands.add_parser("status", help="the daemon: health, version, kernel features, counts")
    events = commands.add_parser("events", help="the audit log: past events, then live ones with --follow")
    events.add_argument("--session", default="", help="one session (default: every session you may see)")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events as they happen")
    events.add_argument("--type", action="append", default=[], help="only this event type (repeatable)")
    events.add_argument("--tool", default="", help="only this tool's events")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    pending = commands.add_parser("pending", help="calls of a session waiting for approval")
    pending.add_argument("session_id")
    for verb, text in (("approve", "allow a held call (once, or for the session)"), ("deny", "deny a held call")):
        answer = commands.add_parser(verb, help=text)
        answer.add_argument("session_id")
        answer.add_argument("call_id")
        if verb == "approve":
            answer.add_argument("--session-wide", action="store_true",
                                help="also allow later calls of the same tool in this session")
    rules = commands.add_parser("rules", help="workspace-scoped standing rules: always allow TOOL here")
    rules.add_argument("rule_action", choices=["list", "add", "remove"])
    rules.add_argument("workspace", nargs="?", default="")
    rules.add_argument("tool", nargs="?", default="")
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
        sys.stderr.write(f"sandboxctl: {error.code().name}: {error.details()}\n")
        return 1
    except ValueError as error:
        sys.stderr.write(f"sandboxctl: {error}\n")
        return 2


def _event_line(event: pb.Event) -> str:
    data = json.loads(event.data_json or "{}")
    when = time.strftime("%H:%M:%S", time.localtime(event.time))
    detail = data.get("summary") or data.get("message") or data.get("error") or ""
    extra = " ".join(f"{key}={data[key]}" for key in ("reason", "by") if data.get(key))
    return (f"{when} {event.session_id}#{event.sequence:<4} {event.type:<24} {event.tool:<14} "
            f"{event.call_id:<18} {extra} {detail}").rstrip()


def _print_events(client: SandboxClient, args: argparse.Namespace) -> int:
    def show(event: pb.Event) -> None:
        if args.json:
            line = _message_dict(event)
            line["data"] = json.loads(str(line.pop("data_json", "") or "{}"))
            print(json.dumps(line), flush=True)
        else:
            print(_event_line(event), flush=True)
    if args.follow:
        for event in client.stub.WatchEvents(pb.WatchEventsRequest(session_id=args.session, types=args.type)):
            if not args.tool or event.tool == args.tool:
                show(event)
        return 0
    token = ""
    while True:
        page = client.stub.QueryEvents(pb.QueryEventsRequest(session_id=args.session, types=args.type,
                                                             tool=args.tool, page_size=1000, page_token=token))
        for event in page.events:
            show(event)
        token = page.next_page_token
        if not token:
            return 0


class _ApprovalNotices:
    """While a command runs, say on stderr when one of the session's calls is held for approval
    (the Exec stream itself stays silent until the call is answered)."""

    def __init__(self, client: SandboxClient, session_id: str) -> None:
        import threading

        self._client, self._session_id = client, session_id
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "_ApprovalNotices":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        told: set[str] = set()
        while not self._done.wait(0.5):
            try:
                held = self._client.stub.ListPendingApprovals(
                    pb.ListPendingApprovalsRequest(session_id=self._session_id)).approvals
            except grpc.RpcError:
                return
            for call in held:
                if call.call_id not in told:
                    told.add(call.call_id)
                    sys.stderr.write(f"sandboxctl: waiting for approval ({call.reason}): {call.summary}\n"
                                     f"  sandboxctl approve {self._session_id} {call.call_id} [--session-wide]"
                                     f"  |  sandboxctl deny {self._session_id} {call.call_id}\n")
                    sys.stderr.flush()


def _run_policy_command(client: SandboxClient, args: argparse.Namespace) -> int:
    """events, pending, approve, deny, rules."""
    if args.command == "events":
        return _print_events(client, args)
    if args.command == "pending":
        for held in client.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=args.session_id)).approvals:
            print(f"{held.call_id}  {held.tool:<14} risk={held.risk:<6} reason={held.reason:<20} {held.summary}")
        return 0
    if args.command in ("approve", "deny"):
        decision = "deny" if args.command == "deny" else ("allow_session" if args.session_wide else "allow_once")
        answer = client.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=args.session_id,
                                                                       call_id=args.call_id, decision=decision))
        print(f"{args.call_id} {answer.decision}")
        return 0
    if args.rule_action == "list":
        for rule in client.stub.ListStandingRules(pb.ListStandingRulesRequest(workspace=args.workspace)).rules:
            print(f"{rule.workspace}\t{rule.tool}")
        return 0
    if not args.workspace or not args.tool:
        raise ValueError(f"sandboxctl rules {args.rule_action} WORKSPACE TOOL")
    rule = pb.StandingRule(workspace=args.workspace, tool=args.tool)
    if args.rule_action == "add":
        client.stub.AddStandingRule(rule)
    elif not client.stub.RemoveStandingRule(rule).removed:
        raise ValueError(f"no rule for {args.tool} in {args.workspace}")
    return 0


def _status(client: SandboxClient) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # types-grpcio-health-checking declares HealthStub without its methods (grpc adds them in __init__).
    stub = health_pb2_grpc.HealthStub(client.channel)
    health = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)  # type: ignore[attr-defined]
    status = client.stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    print(f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}")
    print(f"version: sandboxd {status.version} (pid {status.pid}, up "
          f"{int(time.time() - status.started_at)} s)")
    for name in sorted(status.features):
        print(f"{name}: {status.features[name]}")
    print(f"sessions: {status.sessions}  running calls: {status.running_calls}  "
          f"pending approvals: {status.pending_approvals}  events: {status.events}")
    if status.quota_limits:
        limits, usage = status.quota_limits, status.quota_usage
        print(f"quotas (yours/limit): sessions {usage['sessions']}/{limits['sessions_per_uid']}  "
              f"running calls {usage['calls']}/{limits['calls_per_uid']}  "
              f"streams {usage['streams']}/{limits['streams_per_uid']}"
              + (f"  connections {usage['connections']}/{limits['connections_per_uid']}"
                 if "connections_per_uid" in limits else ""))
        print(f"workers: {limits['workers']} ({limits['reserved_workers']} kept for short calls; "
              f"long-lived calls and streams now {usage['long_lived']}/{limits['long_lived_total']})")
    return 0


def _run(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.command == "status":
        return _status(client)
    if args.command in ("events", "pending", "approve", "deny", "rules"):
        return _run_policy_command(client, args)
    if args.command == "exec":
        command = args.argv
        if not command:
            raise ValueError("no command: sandboxctl exec SESSION -- PROGRAM [ARGS...]")
        with _ApprovalNotices(client, args.session_id):
            outcome = client.exec(args.session_id, command, cwd=args.cwd, timeout=args.timeout,
                                  on_output=write_through)
        return outcome.result.shell_status
    if args.command == "write":
        written = client.write_file(args.session_id, args.path, sys.stdin.buffer.read(), mode=args.mode,
                                    create_parents=args.parents)
        print(written)
        return 0
    if args.command == "read":
        sys.stdout.buffer.write(client.read_file(args.session_id, args.path, MAX_READ_BYTES).data)
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
                print(json.dumps(_message_dict(session)))
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
