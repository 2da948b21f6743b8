"""Issue 24, item 7: one user filled the root file system through the audit log (each event kept
the whole command, 192 MB in 10 s; no per-user bound; with the disk full, no call ran anywhere).

Each attack runs against a real daemon from a plain user made here, with a control:

* a command longer than an event keeps is recorded in its bounded form (its start, its length,
  its SHA-256), the person asked is told it is longer than shown, and the approval runs the whole
  command, never the recorded start;
* the flood (Execs with an argv as large as the kernel takes) adds a bounded number of bytes per
  call, where each call used to add its whole argv;
* past its audit budget the flooder's calls and sessions get RESOURCE_EXHAUSTED naming
  audit.owner_budget, no admitted call lost an event, and a bystander is served;
* a sandbox that floods denied connections writes until its owner's budget is spent, and the
  rest are counted into one event at the session's close;
* on a nearly full disk (a small tmpfs as the state directory) calls are refused saying where and
  how much is free, calls under way finish and are recorded, other owners' reads keep working,
  and calls are served again once space is freed.

tests/bench_audit_flood.py measures the growth rate of the flood (docs/approvals-and-audit.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from conftest import BASE_ENV, PY, REPO
from daemon_helpers import SAFETY_DEADLINE, Daemon, DaemonFactory, PlainUser, daemon_factory, run_client_as
from sandboxd.v1 import sandboxd_pb2 as pb

# A plain user's steps, each a fresh client (daemon_helpers.run_client_as). Long arguments are
# made in the client: a test's arguments travel as one command-line argument (128 KiB at most).
CLIENT = r'''
def long_argv(spec):
    return spec["head"] + [chr(65 + i % 26) * spec["bytes"] for i in range(spec["count"])]

def step(what):
    kind = what["kind"]
    if kind == "create":
        return {"id": stub.CreateSession(pb.CreateSessionRequest(
            workspace=what["ws"], approval_policy=what.get("approval", pb.NEVER),
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=bool(
                what.get("domains")), allowed_domains=what.get("domains", []))), timeout=120).id}
    if kind == "exec":
        out, code = run(what["session"], long_argv(what["argv"]))
        return {"out": out, "code": code}
    if kind == "flood":                   # Exec until refused or `calls` ran: the codes, in order
        codes, refusal = [], ""
        argv = long_argv(what["argv"])
        for _ in range(what["calls"]):
            try:
                for _r in stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=what["session"],
                                                                             argv=argv))]), timeout=120):
                    pass
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refusal = error.details()
                    break
        return {"codes": codes, "refusal": refusal}
    if kind == "try":                     # one call of each kind: its code and message
        out = {}
        def attempt(name, fn):
            try:
                result = fn()
                if hasattr(result, "__next__"):
                    for _r in result:
                        pass
                out[name] = ["OK", ""]
            except grpc.RpcError as error:
                out[name] = [error.code().name, error.details()]
        session = what.get("session", "")
        attempt("create", lambda: stub.CreateSession(pb.CreateSessionRequest(
            workspace=what["ws"], approval_policy=pb.NEVER), timeout=120))
        if session:
            attempt("exec", lambda: stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
                session_id=session, argv=["true"]))]), timeout=120))
            attempt("query", lambda: stub.QueryEvents(pb.QueryEventsRequest(session_id=session), timeout=60))
            attempt("get", lambda: stub.GetSession(pb.GetSessionRequest(session_id=session), timeout=60))
            attempt("rule", lambda: stub.AddStandingRule(pb.StandingRule(workspace=what["ws"], tool="fs.read"),
                                                         timeout=60))
        attempt("list", lambda: stub.ListSessions(pb.ListSessionsRequest(), timeout=60))
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=60)
        out["audit"] = [status.quota_usage["audit_bytes"], status.quota_limits["audit_owner_budget"]]
        return out
    if kind == "close":
        stub.CloseSession(pb.CloseSessionRequest(session_id=what["session"]), timeout=120)
        return {}

print(json.dumps(step(ARGS["step"])))
'''

# Inside the sandbox: what the command was given, so the test can tell whether it ran whole.
ECHO_ARGS = ("import hashlib, json, sys; a = sys.argv[1:]; "
             "print(json.dumps({'count': len(a), 'bytes': sum(map(len, a)), "
             "'sha256': hashlib.sha256(json.dumps(a).encode()).hexdigest()}))")


def as_user(user: PlainUser, daemon: Daemon, **step: Any) -> dict[str, Any]:
    return run_client_as(user.uid, user.gid, daemon.socket, CLIENT, {"step": step}, timeout=SAFETY_DEADLINE)


def long_argv(spec: dict[str, Any]) -> list[str]:
    """What the client's long_argv makes of ``spec``."""
    return spec["head"] + [chr(65 + i % 26) * spec["bytes"] for i in range(spec["count"])]


def owned_workspace(factory: DaemonFactory, user: PlainUser) -> Path:
    ws = factory.workspace()
    os.chown(ws, user.uid, user.gid)
    return ws


def events_of(daemon: Daemon, session_id: str, *types: str) -> list[pb.Event]:
    found, token = [], ""
    while True:
        page = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, types=list(types),
                                                             page_size=1000, page_token=token), timeout=60)
        found += list(page.events)
        token = page.next_page_token
        if not token:
            return found


def digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- the bounded form


def test_a_long_command_is_recorded_bounded_and_approved_whole(
        plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    (user,) = plain_users(1)
    daemon = sandboxd_daemon()
    ws = owned_workspace(sandboxd_daemon, user)
    session = as_user(user, daemon, kind="create", ws=str(ws), approval=pb.ALWAYS)["id"]
    spec = {"head": [PY, "-c", ECHO_ARGS], "count": 3, "bytes": 100_000}
    argv = long_argv(spec)
    ran: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: ran.update(as_user(user, daemon, kind="exec", session=session,
                                                                argv=spec)))
    caller.start()
    try:
        held: list[pb.PendingApproval] = []
        deadline = time.monotonic() + SAFETY_DEADLINE
        while not held and time.monotonic() < deadline:
            held = list(daemon.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session)).approvals)
            time.sleep(0.05)
        assert len(held) == 1, "the call was expected to be held for approval"
        line = "Execute: " + shlex.join(argv)
        # What a person is asked about (sandboxctl's prompt, approvals --follow): says it is longer.
        assert held[0].summary.endswith(f" of {len(line)} characters shown]"), held[0].summary
        assert held[0].summary.startswith(line[:100]) and len(held[0].summary) <= 200
        assert json.loads(held[0].arguments_json)["argv"] == argv           # the whole call, from the gate

        (requested,) = events_of(daemon, session, "PermissionRequested")
        data = json.loads(requested.data_json)
        assert len(requested.data_json) <= 16384
        assert data["summary"] == held[0].summary                           # the MCP elicitation's text
        assert data["clipped"] == [{"path": ["arguments", "argv"], "bytes": len(json.dumps(argv, separators=(
            ",", ":"))), "sha256": digest(argv)}]
        assert data["arguments"]["argv"].startswith(json.dumps(argv[:3], separators=(",", ":"))[:-1])
        shown = subprocess.run([str(REPO / ".venv" / "bin" / "sandboxctl"), "--socket", daemon.socket, "events",
                                "--session", session, "--type", "PermissionRequested"],
                               capture_output=True, text=True, timeout=60, env=BASE_ENV)
        assert shown.returncode == 0, shown.stderr
        assert f"[clipped: arguments.argv ({data['clipped'][0]['bytes']} bytes)]" in shown.stdout, shown.stdout

        assert daemon.stub.ResolveApproval(pb.ResolveApprovalRequest(
            session_id=session, call_id=held[0].call_id, decision="allow_once")).decision == "allow_once"
    finally:
        caller.join(SAFETY_DEADLINE)
    # The approval was of the call: the command that ran got every byte, not the recorded start.
    assert ran["code"] == 0, ran
    assert json.loads(ran["out"]) == {"count": 3, "bytes": 300_000,
                                      "sha256": hashlib.sha256(json.dumps(argv[3:]).encode()).hexdigest()}
    (started,) = events_of(daemon, session, "ToolInvocationStarted")
    assert json.loads(started.data_json)["clipped"][0]["sha256"] == digest(argv)

    # Control: a short command is recorded whole, with nothing clipped and no cut in its summary.
    short = {"head": ["/bin/echo", "hello"], "count": 0, "bytes": 0}
    caller = threading.Thread(target=lambda: ran.update(as_user(user, daemon, kind="exec", session=session,
                                                                argv=short)))
    caller.start()
    try:
        held = []
        while not held and caller.is_alive():
            held = list(daemon.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session)).approvals)
            time.sleep(0.05)
        assert held and held[0].summary == "Execute: /bin/echo hello"
        daemon.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session, call_id=held[0].call_id,
                                                              decision="allow_once"))
    finally:
        caller.join(SAFETY_DEADLINE)
    assert ran == {"out": "hello\n", "code": 0}
    last = json.loads(events_of(daemon, session, "ToolInvocationStarted")[-1].data_json)
    assert last == {"arguments": {"argv": ["/bin/echo", "hello"], "cwd": str(ws)}}


def test_the_flood_adds_a_bounded_amount_per_call(plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    """The issue's flood: argvs as large as the kernel takes (14 arguments of 131,071 bytes). Each
    call used to add its whole argv (1.8 MB) to the log; now each event keeps at most
    audit.event_bytes (16 KiB) and the argv's digest."""
    (user,) = plain_users(1)
    daemon = sandboxd_daemon()
    session = as_user(user, daemon, kind="create", ws=str(owned_workspace(sandboxd_daemon, user)))["id"]
    spec = {"head": ["true"], "count": 14, "bytes": 131_071}
    flood = as_user(user, daemon, kind="flood", session=session, argv=spec, calls=12)
    assert len(flood["codes"]) == 12 and "RESOURCE_EXHAUSTED" not in flood["codes"], flood
    events = events_of(daemon, session)
    calls = [e for e in events if e.type == "PermissionGranted"]
    assert len(calls) == 12
    sent = len(json.dumps(long_argv(spec), separators=(",", ":")))
    assert sent > 1_800_000                          # the control: what each call used to keep
    for event in events:
        assert len(event.data_json) <= 16384, (event.type, len(event.data_json))
    started = [json.loads(e.data_json) for e in events if e.type == "ToolInvocationStarted"]
    assert all(s["clipped"][0]["bytes"] == sent and s["clipped"][0]["sha256"] == digest(long_argv(spec))
               for s in started)
    per_call = sum(len(e.data_json) for e in events if e.call_id) / len(calls)
    assert per_call < 3 * 16384 and per_call * 100 < sent, per_call


# --------------------------------------------------------------------------- the budget

BUDGET = '[audit]\nevent_bytes = 4096\nowner_budget = "256K"\n'


def test_past_its_budget_the_flooder_is_refused_and_a_bystander_is_served(
        plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    attacker, bystander = plain_users(2)
    daemon = sandboxd_daemon(config=BUDGET)
    ws = owned_workspace(sandboxd_daemon, attacker)
    session = as_user(attacker, daemon, kind="create", ws=str(ws))["id"]
    spec = {"head": ["true"], "count": 1, "bytes": 100_000}
    flood = as_user(attacker, daemon, kind="flood", session=session, argv=spec, calls=1000)
    codes = flood["codes"]
    ran = codes.count("OK")
    assert codes[-1] == "RESOURCE_EXHAUSTED" and codes[:-1] == ["OK"] * ran and ran >= 20, codes
    assert "audit.owner_budget" in flood["refusal"] and f"uid {attacker.uid}" in flood["refusal"], flood

    # Every call that ran was recorded whole, and the refused one not at all (nothing dropped).
    events = events_of(daemon, session)
    by_type = {kind: [e.call_id for e in events if e.type == kind]
               for kind in ("PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted")}
    assert len(by_type["PermissionGranted"]) == ran
    assert by_type["PermissionGranted"] == by_type["ToolInvocationStarted"] == by_type["ToolInvocationCompleted"]
    written = sum(len(e.data_json) + 250 for e in events)          # with a generous row overhead
    assert written < (256 << 10) + (64 << 10), written             # the budget and an overdraft of a few calls

    # The attacker can start nothing more that writes, and can still read.
    tried = as_user(attacker, daemon, kind="try", session=session, ws=str(ws))
    for name in ("create", "exec", "rule"):
        assert tried[name][0] == "RESOURCE_EXHAUSTED" and "audit.owner_budget" in tried[name][1], tried
    assert tried["query"] == tried["get"] == tried["list"] == ["OK", ""], tried
    assert tried["audit"][1] == 256 << 10 and tried["audit"][0] >= tried["audit"][1], tried    # GetStatus says so

    # A bystander is not affected.
    other_ws = owned_workspace(sandboxd_daemon, bystander)
    other = as_user(bystander, daemon, kind="create", ws=str(other_ws))["id"]
    assert as_user(bystander, daemon, kind="flood", session=other, argv=spec, calls=5)["codes"] == ["OK"] * 5

    # Control: under the default budget the same flood runs on, unrefused.
    with daemon_factory("sbxd-nobudget-") as others:
        free = others()
        unbounded = as_user(attacker, free, kind="create", ws=str(owned_workspace(others, attacker)))["id"]
        assert as_user(attacker, free, kind="flood", session=unbounded, argv=spec,
                       calls=ran + 10)["codes"] == ["OK"] * (ran + 10)
        as_user(attacker, free, kind="close", session=unbounded)


def test_denials_a_sandbox_floods_are_counted_past_its_budget(plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    """The sandbox chooses how many connections the egress proxy denies; each is an event until
    the owner's budget is spent, and the rest are counted into one event when the session closes.
    Control: local root's session (never refused by a budget) records every one."""
    (user,) = plain_users(1)
    daemon = sandboxd_daemon(config='[audit]\nevent_bytes = 1024\nowner_budget = "16K"\n')
    attempts = 300
    probe = ("import os, socket\nhost, port = os.environ['HTTP_PROXY'].rsplit('/', 1)[-1].split(':')\n"
             f"for i in range({attempts}):\n"
             "    with socket.create_connection((host, int(port)), timeout=10) as s:\n"
             "        s.sendall(f'CONNECT denied{i}.invalid:443 HTTP/1.1\\r\\n\\r\\n'.encode())\n"
             "        assert b' 403 ' in s.recv(4096).split(b'\\r\\n')[0]\n"
             "print('denied', i + 1)\n")
    spec = {"head": [PY, "-c", probe], "count": 0, "bytes": 0}
    ws = owned_workspace(sandboxd_daemon, user)
    session = as_user(user, daemon, kind="create", ws=str(ws), domains=["allowed.invalid"])["id"]
    assert as_user(user, daemon, kind="exec", session=session, argv=spec) == {"out": f"denied {attempts}\n",
                                                                              "code": 0}
    as_user(user, daemon, kind="close", session=session)
    denials = [json.loads(e.data_json) for e in events_of(daemon, session, "PermissionDenied")]
    recorded = [d for d in denials if "destination" in d]
    summary = [d for d in denials if "destination" not in d]
    assert 0 < len(recorded) < 50, len(recorded)
    assert len(summary) == 1 and summary[0]["unrecorded"] == attempts - len(recorded), summary
    assert "audit.owner_budget" in summary[0]["message"]

    root_ws = sandboxd_daemon.workspace()
    control = daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(root_ws), approval_policy=pb.NEVER, sandbox_policy=pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=["allowed.invalid"])))
    out = b"".join(r.stdout for r in daemon.stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
        session_id=control.id, argv=long_argv(spec)))]), timeout=SAFETY_DEADLINE))
    assert out == f"denied {attempts}\n".encode()
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=control.id))
    every = [json.loads(e.data_json) for e in events_of(daemon, control.id, "PermissionDenied")]
    assert len(every) == attempts and all("destination" in d for d in every)


# --------------------------------------------------------------------------- the disk floor


def test_a_nearly_full_disk_refuses_calls_clearly_and_recovers(
        plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    caller, reader = plain_users(2)
    state = sandboxd_daemon.base / "state"
    state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "sbxd-audit-test", str(state)], check=True)
    daemon: Daemon | None = None
    filler = state / "filler"
    try:
        daemon = sandboxd_daemon(config='[audit]\nmin_free = "16M"\n')
        ws, reader_ws = owned_workspace(sandboxd_daemon, caller), owned_workspace(sandboxd_daemon, reader)
        session = as_user(caller, daemon, kind="create", ws=str(ws))["id"]
        readers = as_user(reader, daemon, kind="create", ws=str(reader_ws))["id"]
        true = {"head": ["true"], "count": 0, "bytes": 0}
        assert as_user(caller, daemon, kind="exec", session=session, argv=true)["code"] == 0      # control

        # A call under way when the disk fills finishes, and its end is recorded.
        slow: dict[str, Any] = {}
        sleeper = threading.Thread(target=lambda: slow.update(as_user(reader, daemon, kind="exec", session=readers,
                                                                      argv={"head": ["sleep", "3"], "count": 0,
                                                                            "bytes": 0})))
        sleeper.start()
        deadline = time.monotonic() + SAFETY_DEADLINE
        while not events_of(daemon, readers, "ToolInvocationStarted") and time.monotonic() < deadline:
            time.sleep(0.05)
        stat = os.statvfs(state)
        with open(filler, "wb") as f:                 # leave 8 MiB: below the floor of 16
            os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize - (8 << 20))
        tried = as_user(caller, daemon, kind="try", session=session, ws=str(ws))
        for name in ("create", "exec", "rule"):
            code, message = tried[name]
            assert code == "RESOURCE_EXHAUSTED", tried
            assert "below audit.min_free (16M" in message and str(state) in message and "MiB free" in message, message
        read = as_user(reader, daemon, kind="try", session=readers, ws=str(reader_ws))
        assert read["query"] == read["get"] == read["list"] == ["OK", ""], read
        assert read["exec"][0] == "RESOURCE_EXHAUSTED"   # nobody's call starts: none could be recorded
        sleeper.join(SAFETY_DEADLINE)
        assert slow == {"out": "", "code": 0}
        assert len(events_of(daemon, readers, "ToolInvocationCompleted")) == 1

        filler.unlink()                               # space returns: served again at once
        assert as_user(caller, daemon, kind="exec", session=session, argv=true)["code"] == 0
        assert as_user(caller, daemon, kind="try", session=session, ws=str(ws))["create"] == ["OK", ""]
        log = daemon.log_path.read_text(errors="replace")
        assert "refusing new calls" in log and "has room again" in log
    finally:
        if daemon is not None:
            daemon.stop()
        subprocess.run(["umount", str(state)], check=False)


def test_a_user_filling_the_disk_does_not_stop_the_daemon(plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    """The floor counts root's reserve (f_bfree): a plain user who fills the state directory's disk
    with their own file runs out of space at the reserve, above the floor, and every user is still
    served. The control: the space left to users (f_bavail) is then below the floor, which is where
    the daemon stopped everyone while it counted only that."""
    attacker, victim = plain_users(2)
    disk = sandboxd_daemon.base / "ext4.img"
    mount = Path(tempfile.mkdtemp(prefix="sbxd-fill-", dir="/var/tmp"))    # a place plain users can reach
    os.chmod(mount, 0o755)
    with open(disk, "wb") as image:
        image.truncate(64 << 20)
    # 25% reserved for root: 16 MiB, above the 8 MiB floor below.
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "25", str(disk)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(disk), str(mount)], check=True)
    daemon: Daemon | None = None
    try:
        state, public = mount / "state", mount / "public"
        state.mkdir(mode=0o700)
        public.mkdir()
        os.chown(public, attacker.uid, attacker.gid)
        daemon = sandboxd_daemon(config='[audit]\nmin_free = "8M"\n', args=["--state-dir", str(state)])
        ws = owned_workspace(sandboxd_daemon, victim)
        session = as_user(victim, daemon, kind="create", ws=str(ws))["id"]
        true = {"head": ["true"], "count": 0, "bytes": 0}
        assert as_user(victim, daemon, kind="exec", session=session, argv=true)["code"] == 0

        filled = subprocess.run(["dd", "if=/dev/zero", f"of={public / 'filler'}", "bs=1M"], capture_output=True,
                                text=True, user=attacker.uid, group=attacker.gid, extra_groups=[], timeout=120)
        assert "No space left on device" in filled.stderr, filled.stderr
        stat = os.statvfs(state)
        assert stat.f_bavail * stat.f_frsize < 8 << 20        # the control: users' share is below the floor
        assert stat.f_bfree * stat.f_frsize >= 8 << 20        # the reserve is not
        assert as_user(victim, daemon, kind="exec", session=session, argv=true)["code"] == 0
        assert as_user(victim, daemon, kind="try", session=session, ws=str(ws))["create"] == ["OK", ""]
    finally:
        if daemon is not None:
            daemon.stop()
        subprocess.run(["umount", str(mount)], check=False)
        mount.rmdir()
