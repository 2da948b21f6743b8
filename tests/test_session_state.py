"""A session's state changes only under its lock (service/sessions.py): a plain user's client runs
UpdateSessionPolicy and Exec on one session from many threads at once. Every policy change makes
its own generation, consecutive, none twice, none skipped (the audit log says which); every Exec
runs in one complete generation's sandbox: each generation's policy has exactly one writable
root outside the workspace, and each command finds exactly one of them writable, a root some
generation really had."""

from __future__ import annotations

import json
import os

from daemon_fixtures import daemon  # noqa: F401 - pytest fixture
from daemon_helpers import Daemon, close_quietly, plain_users, run_client_as
from sandboxd.v1 import sandboxd_pb2 as pb

UPDATERS, UPDATES_EACH = 4, 10          # 40 policy changes
EXECUTORS, EXECS_EACH = 4, 40           # 160 commands
ROOTS = 1 + UPDATERS * UPDATES_EACH     # root 0: the session's first policy

STRESS = r'''
import itertools, threading
roots = ARGS["roots"]
def policy(index):
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[roots[index]])
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
                                                     sandbox_policy=policy(0)), timeout=60).id
probe = "for d in " + " ".join(roots) + '; do touch "$d/probe" 2>/dev/null && echo "$d"; done; true'
indexes = itertools.count(1)
updates, execs, errors = [], [], []
def updater():
    for _ in range(ARGS["updates_each"]):
        index = next(indexes)
        try:
            stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session, sandbox_policy=policy(index)),
                                     timeout=120)
            updates.append(index)
        except grpc.RpcError as error:
            errors.append(["update", error.code().name, error.details()])
def executor():
    for _ in range(ARGS["execs_each"]):
        try:
            out, code = run(session, ["sh", "-c", probe])
            execs.append([out.split(), code])
        except grpc.RpcError as error:
            errors.append(["exec", error.code().name, error.details()])
threads = [threading.Thread(target=updater) for _ in range(ARGS["updaters"])]
threads += [threading.Thread(target=executor) for _ in range(ARGS["executors"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
events = stub.QueryEvents(pb.QueryEventsRequest(session_id=session, types=["PolicyChanged"], page_size=1000),
                          timeout=60).events
changes = [[json.loads(e.data_json)["generation"], json.loads(e.data_json)["after"]["sandbox_policy"]["writable_roots"]]
           for e in events]
final = stub.GetSession(pb.GetSessionRequest(session_id=session), timeout=60)
stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=60)
print(json.dumps({"updates": updates, "execs": execs, "errors": errors, "changes": changes,
                  "generation": final.sandbox_generation, "running": final.running_calls,
                  "policy": list(final.sandbox_policy.writable_roots)}))
'''


def test_concurrent_policy_changes_and_execs_keep_generations_whole(daemon: Daemon) -> None:  # noqa: F811
    with plain_users(1) as (user,):
        base = daemon.base / f"stress-{user.uid}"
        ws, roots = base / "ws", [str(base / f"root-{i}") for i in range(ROOTS)]
        for path in (base, ws, *roots):
            os.mkdir(path)
            os.chown(path, user.uid, user.gid)
        try:
            seen = run_client_as(user.uid, user.gid, daemon.socket, STRESS, {
                "ws": str(ws), "roots": roots, "updaters": UPDATERS, "updates_each": UPDATES_EACH,
                "executors": EXECUTORS, "execs_each": EXECS_EACH}, timeout=600)
        finally:
            for session in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions:
                if session.owner_uid == user.uid:
                    close_quietly(daemon.stub, session.id)
    assert seen["errors"] == [], seen["errors"][:5]
    assert sorted(seen["updates"]) == list(range(1, ROOTS))
    # Generations: one per change, consecutive from 2, in the order they took effect.
    generations = [generation for generation, _ in seen["changes"]]
    assert generations == list(range(2, ROOTS + 1)), generations
    policy_of = {1: [roots[0]], **{generation: after for generation, after in seen["changes"]}}
    assert sorted(r for after in policy_of.values() for r in after) == sorted(roots)   # each change's own root
    assert seen["generation"] == ROOTS and seen["policy"] == policy_of[ROOTS] and seen["running"] == 0
    # Every command ran in one whole generation: exactly one root writable, one some generation had.
    assert len(seen["execs"]) == EXECUTORS * EXECS_EACH
    had = {after[0] for after in policy_of.values()}
    for writable, code in seen["execs"]:
        assert code == 0 and len(writable) == 1 and writable[0] in had, (writable, code)
    # Control: the commands really saw the changes (not all one generation).
    assert len({writable[0] for writable, _ in seen["execs"]}) > 1
    # The roots the commands named are the ones they wrote.
    written = {r for r in roots if os.path.exists(os.path.join(r, "probe"))}
    assert written == {writable[0] for writable, _ in seen["execs"]}
