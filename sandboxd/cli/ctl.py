"""`sandboxctl`: drive the sandboxd daemon from a shell.

Every string it prints that came from the daemon (what callers chose: commands, paths, names,
reasons, and errors that quote them) goes through ``printable``: nothing a caller chose can move
the cursor, recolour or hide text, or start a line of its own. Only what a person asks for as
bytes (`read`, `logs`, a command's output) is written as it is, as `cat` would."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import grpc

from sandboxd import defaults
from sandboxd.cli import approval_prompt, audit_ctl, changes, terminal
from sandboxd.cli import network_args
from sandboxd.cli.env_args import add_env_options, env_from_args
from sandboxd.cli.exec_requests import ExecRequests
from sandboxd.client import (DEFAULT_SOCKET, MAX_READ_BYTES, MAX_WAIT_SECONDS, DrainWait, SandboxClient,
                             caller_environment, sandbox_policy, write_through)
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from google.protobuf.message import Message


def _message_dict(session: Message) -> dict[str, object]:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(session, preserving_proto_field_name=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxctl", description="Talk to the sandboxd daemon.")
    parser.add_argument("--socket", default="",
                        help=f"the daemon's socket (default: $SANDBOXD_SOCKET, else {DEFAULT_SOCKET})")
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
    create.add_argument("--review", action=argparse.BooleanOptionalAction, default=None,
                        help="review mode: writes are kept for `sandboxctl changes/apply/discard` and reach the "
                             "host only when applied (default: the daemon's review.default)")
    create.add_argument("--hide-home", action="store_true",
                        help="cover your home directory with an empty, read-only one in the sandbox (the workspace "
                             "and writable roots inside it stay): commands never read your keys and tokens")
    add_env_options(create, "every command of the session")
    network_args.add_network_options(create)
    listing = actions.add_parser("list", help="the sessions you may see")
    listing.add_argument("--json", action="store_true")
    show = actions.add_parser("show", help="one session: its policy and its credentials (never a secret)")
    show.add_argument("session_id")
    show.add_argument("--json", action="store_true")
    close = actions.add_parser("close", help="close a session: kills everything in it")
    close.add_argument("session_id")
    policy = actions.add_parser("policy", help="change a live session's policy (for its next calls)")
    policy.add_argument("session_id")
    policy.add_argument("--sandbox", choices=["read-only", "workspace-write", "danger-full-access"])
    policy.add_argument("--network", action="store_true")
    policy.add_argument("--writable-root", action="append", default=[])
    policy.add_argument("--approval", choices=["never", "on-request", "always"])
    policy.add_argument("--hide-home", action="store_true",
                        help="hide your home from now on (a session that hides it keeps hiding it)")
    network_args.add_network_options(policy)   # the lists given replace the session's; its secrets kept if unchanged
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
    audit_ctl.add_parser(commands)
    events.add_argument("--after", type=_event_id, default=0, metavar="ID",
                        help="only events after this id (the number after the time; resume a --follow with "
                        "the last id printed)")
    pending = commands.add_parser("pending", help="calls of a session waiting for approval")
    pending.add_argument("session_id")
    approvals = commands.add_parser("approvals", help="held calls of your sessions; --follow: as they come, "
                                                      "answered with y/s/n on a terminal")
    approvals.add_argument("--follow", "-f", action="store_true", help="keep watching (and answering on a terminal)")
    approvals.add_argument("--session", default="", help="one session (default: every session you own)")
    approvals.add_argument("--json", action="store_true", help="one JSON object per held call (never answers)")
    for verb, text in (("approve", "allow a held call (once, or for the session)"), ("deny", "deny a held call")):
        answer = commands.add_parser(verb, help=text)
        answer.add_argument("session_id")
        answer.add_argument("call_id")
        if verb == "approve":
            answer.add_argument("--session-wide", action="store_true",
                                help="also allow later calls of the same tool in this session; a network "
                                     "question: add its proposal (or --rule) to the session's policy")
            answer.add_argument("--rule", default="", metavar="RULE",
                                help="with --session-wide on a network question: the allowed domain or "
                                     "endpoint rule (HOST=METHODS:PATH-GLOB) to add instead of its proposal")
    rules = commands.add_parser("rules", help="workspace-scoped standing rules: always allow TOOL here")
    rules.add_argument("rule_action", choices=["list", "add", "remove"])
    rules.add_argument("workspace", nargs="?", default="")
    rules.add_argument("tool", nargs="?", default="")
    execute = commands.add_parser("exec", help="run a command in a session; exits with its status")
    execute.add_argument("session_id")
    execute.add_argument("--cwd", default="")
    execute.add_argument("--timeout", type=float, default=0)
    add_env_options(execute, "this command")
    execute.add_argument("argv", nargs="*", metavar="-- PROGRAM [ARGS...]")
    execute.add_argument("-t", "--tty", action="store_true", help="run it on a terminal (needs one here)")
    execute.add_argument("--checkpoint", action="store_true",
                         help="a review session: mark a checkpoint first, to roll this command back with "
                              "`sandboxctl rollback` (skipped when nothing changed or something else runs)")
    shell = commands.add_parser("shell", help="an interactive shell in a session's workspace (needs a terminal)")
    shell.add_argument("session_id")
    shell.add_argument("--cwd", default="")
    add_env_options(shell, "the shell")
    call = commands.add_parser("call", help="a call's outcome by its id, after its stream broke or the daemon "
                                             "restarted")
    call_actions = call.add_subparsers(dest="call_action", required=True)
    result = call_actions.add_parser("result", help="print the tail of a call's output (the last 64 KiB of each "
                                                    "stream) and exit with its status; 75 while it still runs")
    result.add_argument("session_id")
    result.add_argument("call_id")
    result.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                        help="wait up to this long for a running call to end (default: answer at once)")
    changes.add_commands(commands)
    return parser


SOCKET_ENV = defaults.SOCKET_ENV


def socket_choice(flag: str) -> tuple[str, bool]:
    """The socket to use (flag > $SANDBOXD_SOCKET > default) and whether the hints this tool prints
    must name it with --socket (only when it came from the flag and is not the default)."""
    if flag:
        return flag, flag != DEFAULT_SOCKET
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET, False


def _connection_error(error: grpc.RpcError, socket_path: str) -> str | None:
    """One line saying what to do when the daemon's socket cannot be used, else None."""
    details = error.details() or ""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    try:
        os.stat(socket_path)
        reachable = os.access(socket_path, os.R_OK | os.W_OK)
    except OSError as stat_error:
        reachable = stat_error.errno != errno.EACCES
    if not reachable or "Permission denied" in details or "EACCES" in details:
        return (f"you are not allowed on this socket ({socket_path}: its mode/group); ask the admin to add you "
                f"to the socket's group, or use a socket you may open")
    return (f"cannot reach sandboxd at {socket_path}: is `sandboxd serve` running? "
            f"(set {SOCKET_ENV} or --socket for another socket)")


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the command, options included: split it off before argparse sees it.
    command: list[str] = []
    if "--" in words:
        split = words.index("--")
        words, command = words[:split], words[split + 1:]
    parser = build_parser()
    args, extra = parser.parse_known_args(words)
    if extra:
        # `sandboxctl changes S --diff PATH...`: argparse gives a list of positionals only the words
        # before the first option; the paths after one come back here.
        if getattr(args, "command", "") not in changes.COMMANDS or any(word.startswith("-") for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.paths = [*args.paths, *extra]
    if command:
        args.argv = list(getattr(args, "argv", [])) + command
    if getattr(args, "rule", "") and not getattr(args, "session_wide", False):
        # Without it the call would be allowed once and the rule never added: not what was asked.
        parser.error("--rule adds a rule to the session's policy: add --session-wide")
    args.socket, args.name_socket = socket_choice(args.socket)
    try:
        with SandboxClient(args.socket) as client:
            status = _run(client, args)
        sys.stdout.flush()      # here, so a reader that left shows up as the BrokenPipeError below
        return status
    except grpc.RpcError as error:
        line = _connection_error(error, args.socket) or f"{error.code().name}: {error.details()}"
        sys.stderr.write(f"sandboxctl: {printable(line)}\n")
        return 1
    except ValueError as error:
        sys.stderr.write(f"sandboxctl: {printable(str(error))}\n")
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # `sandboxctl events | head`: the reader left. Point stdout at /dev/null so the interpreter's
        # final flush does not raise again, and exit as a tool killed by SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _event_id(text: str) -> int:
    """``--after``: an event id as `sandboxctl events` prints it."""
    if not text.isascii() or not text.isdigit() or int(text) >= 1 << 63:
        raise argparse.ArgumentTypeError(f"{text!r} is not an event id (a whole number, as events prints it)")
    return int(text)


def _event_line(event: pb.Event) -> str:
    """One event on one line. Each part is printable: a summary holding a newline cannot add a
    line of its own (a forged PermissionGranted for another session, say)."""
    data = json.loads(event.data_json or "{}")
    when = time.strftime("%H:%M:%S", time.localtime(event.time))
    detail = printable(str(data.get("summary") or data.get("message") or data.get("error") or ""))
    extra = " ".join(f"{key}={printable(str(data[key]))}" for key in ("reason", "by") if data.get(key))
    if "shell_status" in data:      # a command's end: how it ended, so a failure and a kill differ
        ended = [f"status={printable(str(data['shell_status']))}"]
        ended += [f"{key}={printable(str(data[key]))}" for key in ("signal",) if data.get(key)]
        ended += [key for key in ("timed_out", "oom_killed", "output_truncated") if data.get(key)]
        extra = " ".join([extra, *ended]).strip()
    clipped = data.get("clipped")
    if isinstance(clipped, list) and clipped:      # the store kept only the start of these (audit.event_bytes)
        cut = ", ".join(f"{'.'.join(map(str, c.get('path') or ['all']))} ({c.get('bytes')} bytes)" for c in clipped
                        if isinstance(c, dict))
        detail = f"{detail} [clipped: {printable(cut)}]".strip()
    # The id first after the time: what `sandboxctl events --follow --after ID` resumes from.
    return (f"{when} {event.id:>6} {printable(event.session_id)}#{event.sequence:<4} {printable(event.type):<24} "
            f"{printable(event.tool):<14} {printable(event.call_id):<18} {extra} {detail}").rstrip()


def _print_events(client: SandboxClient, args: argparse.Namespace) -> int:
    def show(event: pb.Event) -> None:
        if args.json:
            line = _message_dict(event)
            line["data"] = json.loads(str(line.pop("data_json", "") or "{}"))
            print(json.dumps(line), flush=True)
        else:
            print(_event_line(event), flush=True)
    if args.follow:
        for event in client.stub.WatchEvents(pb.WatchEventsRequest(session_id=args.session, types=args.type,
                                                                   after_id=args.after)):
            if not args.tool or event.tool == args.tool:
                show(event)
        return 0
    token = str(args.after) if args.after else ""
    while True:
        page = client.stub.QueryEvents(pb.QueryEventsRequest(session_id=args.session, types=args.type,
                                                             tool=args.tool, page_size=1000, page_token=token))
        for event in page.events:
            show(event)
        token = page.next_page_token
        if not token:
            return 0


def _run_policy_command(client: SandboxClient, args: argparse.Namespace) -> int:
    """events, pending, approve, deny, rules."""
    if args.command == "events":
        return _print_events(client, args)
    if args.command == "pending":
        for held in client.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=args.session_id)).approvals:
            print(approval_prompt.held_line(held))
        return 0
    if args.command in ("approve", "deny"):
        decision = "deny" if args.command == "deny" else ("allow_session" if args.session_wide else "allow_once")
        answer = client.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=args.session_id,
                                                                       call_id=args.call_id, decision=decision,
                                                                       rule=getattr(args, "rule", "")))
        print(f"{printable(args.call_id)} {printable(answer.decision)}")
        return 0
    if args.rule_action == "list":
        for rule in client.stub.ListStandingRules(pb.ListStandingRulesRequest(workspace=args.workspace)).rules:
            print(f"{printable(rule.workspace)}\t{printable(rule.tool)}")
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
          f"{max(0, int(time.time() - status.started_at))} s)")
    for name in sorted(status.features):
        print(f"{printable(name)}: {printable(status.features[name])}")
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
        if "audit_owner_budget" in limits:
            print(f"audit log: {usage['audit_bytes']} of your {limits['audit_owner_budget']} bytes "
                  "(audit.owner_budget, refilled evenly over its period) spent")
    return 0


def _session_line(session: pb.Session) -> str:
    policy = session.sandbox_policy
    mode = pb.SandboxPolicy.Mode.Name(policy.mode or pb.SandboxPolicy.WORKSPACE_WRITE).lower().replace("_", "-")
    network = "network" if policy.network_access or policy.mode == pb.SandboxPolicy.DANGER_FULL_ACCESS else "no-network"
    approval = pb.ApprovalPolicy.Name(session.approval_policy).lower().replace("_", "-")
    # The server reports the calls running now, not a running total: say exactly that.
    review = "  review" if session.review else ""
    review += "  hide-home" if policy.hide_home else ""
    credentials = network_args.credential_states_line(session)
    owner = f"uid={session.owner_uid}" + (f" {printable(session.owner_principal)}" if session.owner_principal else "")
    return (f"{printable(session.id)}  {owner}  {printable(session.workspace)}  {mode} {network}  "
            f"approval={approval}  running={session.running_calls}{review}" + (f"  {credentials}" if credentials else ""))


def _exec_or_shell(client: SandboxClient, args: argparse.Namespace, command: list[str], socket_option: str, *,
                   shell: bool = False) -> int:
    """`exec` (on a terminal with -t) and `shell`: one call, tagged so that its own approval is asked
    about in place (approval_prompt), with the caller's PATH/LANG/TERM and the --env options."""
    on_terminal = shell or args.tty
    if on_terminal:
        terminal.require_terminal("sandboxctl shell" if shell else "sandboxctl exec -t")
    context_id = approval_prompt.new_context_id()
    start = pb.ExecStart(session_id=args.session_id, argv=command, cwd=args.cwd,
                         timeout_seconds=getattr(args, "timeout", 0), env_overlay=env_from_args(args),
                         execution_context_id=context_id, checkpoint=getattr(args, "checkpoint", False),
                         caller_env=caller_environment(on_terminal=sys.stdout is not None and sys.stdout.isatty()))
    with approval_prompt.ExecApprovals(client, args.session_id, context_id, f"sandboxctl {socket_option}".rstrip(),
                                       interactive=approval_prompt.on_terminal()) as approvals:
        if not on_terminal:                                # its network questions are still asked here
            return _exec(client, start, write=approvals.output.write)
        status = terminal.run(client, start, on_started=approvals.stop)
    changes.end_of_session(client, args.session_id)        # a review session's pending changes: asked here
    return status


def _exec(client: SandboxClient, start: pb.ExecStart, on_started: Callable[[], None] = lambda: None,
          write: Callable[[int, bytes], None] = write_through) -> int:
    """Run one command, streaming stdin when it is not a terminal. Ctrl-C sends SIGINT to the
    remote command; a second Ctrl-C cancels the call (the daemon kills the command's tree).
    ``on_started``: the call was granted and runs (nothing is held for approval any more).
    ``write(1 or 2, bytes)``: where its output goes (held while a question is asked in place)."""
    # A closed stdin (`exec 0<&-`: sys.stdin is None) is forwarded as none, as a terminal is.
    forward_stdin = sys.stdin is not None and not sys.stdin.isatty()
    if not forward_stdin:
        start.close_stdin = True
    requests = ExecRequests(start, hold_until_started=True)
    if forward_stdin:
        requests.pump_stdin(sys.stdin.fileno(), close_at_eof=True)
    # Ctrl-C must not raise inside gRPC's iterator (that breaks the call): the first one only queues a
    # SIGINT for the remote command; the second raises KeyboardInterrupt, which ends this process and
    # with it the call, and the daemon kills the command's tree.
    def interrupt(_signum: int, _frame: object) -> None:
        requests.put(pb.ExecRequest(signal=signal.SIGINT))
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, interrupt)
    status, call_id, drain = 1, "", DrainWait()
    try:
        while True:
            try:
                for response in client.stub.Exec(iter(requests)):
                    kind = response.WhichOneof("kind")
                    if kind == "started_pid":
                        call_id = response.call_id or "?"
                        requests.started()
                        on_started()
                    elif kind in ("stdout", "stderr"):
                        write(1 if kind == "stdout" else 2, getattr(response, kind))
                    elif kind == "result":
                        status = response.result.shell_status
                break
            except grpc.RpcError as error:
                delay = None if call_id else drain.delay(error.code(), error.trailing_metadata())
                if delay is None:
                    if call_id and call_id != "?":        # it ran: its end can still be asked for
                        sys.stderr.write(f"sandboxctl: the call's stream broke; `sandboxctl call result "
                                         f"{printable(start.session_id)} {printable(call_id)}` tells how it ended\n")
                    raise
                requests.abandon()                        # refused before it ran: once more, whole
                time.sleep(delay)
    finally:
        signal.signal(signal.SIGINT, previous)
        requests.close()
    return status


# The commands whose one call can be held for approval: tagged, and asked about in place as exec's.
HELD_HERE = ("write", "read", "ls", "patch", "start", "ps", "stop")


def _held_here(client: SandboxClient, args: argparse.Namespace, data: bytes, tag: str) -> int:
    """One of HELD_HERE's calls, tagged ``tag``; ``data``: write's and patch's stdin, read already."""
    if args.command == "write":
        print(client.write_file(args.session_id, args.path, data, mode=args.mode, create_parents=args.parents,
                                context_id=tag))
    elif args.command == "read":
        sys.stdout.buffer.write(client.read_file(args.session_id, args.path, MAX_READ_BYTES, context_id=tag).data)
    elif args.command == "ls":
        for entry in client.list_dir(args.session_id, args.path, context_id=tag):
            print(f"{printable(entry.type):<7} {entry.mode:04o} {entry.size:>10}  {printable(entry.name)}")
    elif args.command == "patch":
        for patched in client.apply_patch(args.session_id, data.decode(), args.strip,   # UTF-8: _stdin_input
                                          context_id=tag):
            print(f"{printable(patched.action)}\t{printable(patched.path)}")
    elif args.command == "start":
        if not args.argv:
            raise ValueError("no command: sandboxctl start SESSION -- PROGRAM [ARGS...]")
        print(printable(client.start_background(args.session_id, args.argv, name=args.name, context_id=tag).id))
    elif args.command == "ps":
        for job in client.list_background(args.session_id, context_id=tag):
            state = "running" if job.running else f"exited {job.result.shell_status}"
            print(f"{printable(job.id)}  pid={job.pid}  {state:<10}  {printable(job.name)}")
    else:
        job = client.stop_background(args.session_id, args.job_id, context_id=tag)
        print(f"{printable(job.id)} stopped ({job.result.shell_status})")
    return 0


def _stdin_input(command: str) -> bytes:
    """write's data and patch's diff, from stdin (nothing for the other HELD_HERE commands): a
    closed stdin, or a patch that is not UTF-8, is a ValueError saying what to give instead."""
    if command not in ("write", "patch"):
        return b""
    what = "the file's bytes go" if command == "write" else "the unified diff goes"
    if sys.stdin is None:
        raise ValueError(f"{command}: {what} on stdin, which is closed: "
                         f"sandboxctl {command} SESSION {'PATH ' if command == 'write' else ''}< FILE")
    data = sys.stdin.buffer.read()
    if command == "patch":
        try:
            data.decode()
        except UnicodeDecodeError as error:
            raise ValueError(f"patch: the diff on stdin is not UTF-8 text (byte {error.start}): give a unified "
                             "diff in UTF-8 (a file that is not text: sandboxctl write SESSION PATH < FILE)") from None
    return data


STILL_RUNNING = 75          # EX_TEMPFAIL: `sandboxctl call result` of a call that still runs: ask again


def _call_result(client: SandboxClient, session_id: str, call_id: str, wait: float) -> int:
    """The call's output tails, raw as exec prints output (they are its command's own), and its
    status; STILL_RUNNING (saying so on stderr) when it runs past ``wait`` seconds."""
    if not 0 <= wait <= 86400 * 7:
        raise ValueError("--wait: give 0 to 604800 seconds")
    deadline = time.monotonic() + wait
    while True:                        # the daemon waits at most MAX_WAIT_SECONDS a request: asked again
        left = max(0.0, deadline - time.monotonic())
        answer = client.wait_call(session_id, call_id, min(left, MAX_WAIT_SECONDS))
        if answer.state == pb.CALL_STATE_FINISHED or left <= MAX_WAIT_SECONDS:
            break
    write_through(1, answer.stdout_tail)
    write_through(2, answer.stderr_tail)
    if answer.state != pb.CALL_STATE_FINISHED:
        sys.stderr.write(f"sandboxctl: call {printable(call_id)} is still running (ask again, or --wait SECONDS)\n")
        return STILL_RUNNING
    if answer.reason:
        sys.stderr.write(f"sandboxctl: call {printable(call_id)} was ended by the daemon: {printable(answer.reason)}\n")
    return answer.shell_status


def _run(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.command == "status":
        return _status(client)
    if args.command == "call":
        return _call_result(client, args.session_id, args.call_id, args.wait)
    if args.command in changes.COMMANDS or args.command in changes.CHECKPOINT_COMMANDS:
        return changes.run(client, args)
    if args.command in ("events", "pending", "approve", "deny", "rules"):
        return _run_policy_command(client, args)
    if args.command == "audit":
        return audit_ctl.run(client, args)
    if args.command == "approvals":
        return approval_prompt.follow(client, session_id=args.session, as_json=args.json, once=not args.follow,
                                      interactive=args.follow and not args.json and approval_prompt.on_terminal())
    if args.command == "exec":
        command = args.argv
        if not command:
            raise ValueError("no command: sandboxctl exec SESSION -- PROGRAM [ARGS...]")
        socket_option = f"--socket {args.socket}" if args.name_socket else ""
        return _exec_or_shell(client, args, command, socket_option)
    if args.command == "shell":
        socket_option = f"--socket {args.socket}" if args.name_socket else ""
        return _exec_or_shell(client, args, terminal.SHELL, socket_option, shell=True)
    if args.command in HELD_HERE:
        socket_option = f"--socket {args.socket}" if args.name_socket else ""
        data = _stdin_input(args.command)                  # before any question: its y/n reads the terminal
        with approval_prompt.asked_here(client, args.session_id, f"sandboxctl {socket_option}".rstrip()) as tag:
            return _held_here(client, args, data, tag)
    if args.command == "logs":
        for chunk in client.stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(
                session_id=args.session_id, id=args.job_id, follow=args.follow)):
            write_through(1, chunk.data)
        return 0
    if args.action == "create":
        labels = dict(item.split("=", 1) for item in args.label if "=" in item)
        # Relative paths are the caller's (`session create .`): the daemon takes absolute ones only.
        created = sandbox_policy(args.sandbox, network=args.network,
                                 writable_roots=[os.path.abspath(root) for root in args.writable_root])
        created.hide_home = args.hide_home
        credentials = network_args.credentials_from_args(args)
        network_args.apply_network(created, args, credentials)
        session = client.create_session(os.path.abspath(args.workspace), policy=created,
                                        approval=args.approval, labels=labels, env=env_from_args(args),
                                        review=args.review, credential_secrets=network_args.secrets_proto(credentials))
        print(printable(session.id))
    elif args.action == "show":
        shown = client.get_session(args.session_id)
        print(json.dumps(_message_dict(shown)) if args.json else _session_line(shown))
    elif args.action == "list":
        for session in client.list_sessions():
            if args.json:
                print(json.dumps(_message_dict(session)))
            else:
                print(_session_line(session))
    elif args.action == "close":
        changes.end_of_session(client, args.session_id)    # before it closes: apply, discard or keep
        client.close_session(args.session_id)
        print(f"{printable(args.session_id)} closed")              # a command a person types says what it did
    elif args.action == "policy":
        policy = (sandbox_policy(args.sandbox, network=args.network, writable_roots=args.writable_root)
                  if args.sandbox else None)
        credentials = network_args.credentials_from_args(args, secret_required=False)
        if policy is None and (network_args.given(args) or args.hide_home):
            policy = pb.SandboxPolicy()            # the network lists or hide_home alone: the rest as the session has it
            policy.CopyFrom(client.get_session(args.session_id).sandbox_policy)
        if policy is not None:
            if network_args.given(args):
                network_args.apply_network(policy, args, credentials)
            policy.hide_home = policy.hide_home or args.hide_home
        session = client.update_policy(args.session_id, policy=policy, approval=args.approval,
                                       credential_secrets=network_args.secrets_proto(credentials))
        print(f"{printable(session.id)} generation={session.sandbox_generation}")
    return 0


def entry() -> None:
    sys.exit(main())
