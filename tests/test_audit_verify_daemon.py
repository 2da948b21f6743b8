"""`sandboxctl audit verify` (the VerifyAudit RPC) against a real daemon: an administrator verifies
the node's whole chain; a plain user only a session of its own (the node's chain is refused, another
owner's session is not found); an edit made with sqlite3 to the live database while the daemon
serves is caught; and after a stop the shutdown checkpoint signs the head, so `sandboxd audit
verify` offline finds nothing unsigned. The control for each refusal is the same call allowed."""

from __future__ import annotations

import sqlite3
import subprocess
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import REPO
from daemon_helpers import SAFETY_DEADLINE, DaemonFactory, owned_dir, run_client_as
from sandboxd.audit.integrity import keys
from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import Exhausted, Forbidden
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.service.audit_verify import AuditVerification
from sandboxd.service.callers import identify
from sandboxd.v1 import sandboxd_pb2 as pb

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")

USER_CLIENT = r'''
step = ARGS["step"]
if step == "create":
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120)
    print(json.dumps({"id": s.id}))
else:
    answers = {}
    for name, session_id in (("node", ""), ("own", ARGS["own"]), ("other", ARGS["other"])):
        try:
            r = stub.VerifyAudit(pb.VerifyAuditRequest(session_id=session_id), timeout=120)
            answers[name] = {"whole": r.whole, "summary": r.summary}
        except grpc.RpcError as error:
            answers[name] = {"code": error.code().name, "details": error.details()}
    stub.CloseSession(pb.CloseSessionRequest(session_id=ARGS["own"]), timeout=120)
    print(json.dumps(answers))
'''


def _ctl(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXCTL, "--socket", socket, "audit", "verify", *args], capture_output=True, text=True,
                          timeout=SAFETY_DEADLINE)


def test_verify_through_the_daemon_by_administrator_and_owner(plain_users: Any, sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    ws = sandboxd_daemon.workspace()
    root_session = daemon.stub.CreateSession(pb.CreateSessionRequest(workspace=str(ws), approval_policy=pb.NEVER))
    for _ in range(3):
        list(daemon.stub.Run(pb.ExecStart(session_id=root_session.id, argv=["true"]), timeout=120))
    whole = _ctl(daemon.socket)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.startswith("whole: ") and " events, head " in whole.stdout
    public = keys.read_public_of_state(str(sandboxd_daemon.base / "state"))
    assert f"signed by {keys.key_id(public)}" in whole.stdout or "no signed checkpoint" in whole.stdout

    (user,) = plain_users(1)
    own_ws = owned_dir(sandboxd_daemon.base / "ws-user", user)
    own = run_client_as(user.uid, user.gid, daemon.socket, USER_CLIENT, {"step": "create", "ws": str(own_ws)})["id"]
    answers = run_client_as(user.uid, user.gid, daemon.socket, USER_CLIENT,
                            {"step": "verify", "own": own, "other": root_session.id})
    assert answers["node"]["code"] == "PERMISSION_DENIED" and "administrators" in answers["node"]["details"]
    assert answers["own"]["whole"] and answers["own"]["summary"].startswith(f"session {own}: whole: 1 events")
    assert answers["other"]["code"] == "NOT_FOUND"

    # An edit to the live database, made while the daemon serves, by someone without the key.
    database = sandboxd_daemon.base / "state" / "events.db"
    db = sqlite3.connect(database)
    edited = db.execute("SELECT MIN(id) FROM events WHERE session_id = ? AND type = ?",
                        (root_session.id, EventType.TOOL_STARTED)).fetchone()[0]
    db.execute("UPDATE events SET data = '{\"argv\":[\"false\"]}' WHERE id = ?", (edited,))
    db.commit()
    db.close()
    caught = _ctl(daemon.socket)
    assert caught.returncode == 1
    assert caught.stdout.startswith(f"NOT WHOLE: event {edited} edited")
    answer = daemon.stub.VerifyAudit(pb.VerifyAuditRequest(session_id=root_session.id))
    assert (answer.whole, answer.problem_kind, answer.problem_event_id) == (False, "edited", edited)

    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=root_session.id))
    daemon.stop()
    db = sqlite3.connect(database)
    last_kind, signed_through = db.execute("SELECT kind, last_event_id FROM audit_checkpoints ORDER BY id DESC "
                                           "LIMIT 1").fetchone()
    assert (last_kind, signed_through) == ("shutdown", db.execute("SELECT MAX(id) FROM events").fetchone()[0])
    db.close()
    offline = subprocess.run([SANDBOXD, "audit", "verify", "--db", str(database)], capture_output=True, text=True)
    assert offline.returncode == 1 and offline.stdout.startswith(f"NOT WHOLE: event {edited} edited")


def _verification(tmp_path: Path) -> tuple[EventStore, AuditVerification]:
    """A store of 30 events of session "s" and a verification over it in chunks of 10 (several
    chunks: a held caller check stops it inside its walk); every session visible to everyone."""
    from sandboxd.audit.store import open_in_state_dir

    store = open_in_state_dir(str(tmp_path / "state"))
    for index in range(30):
        store.append("s", EventType.TOOL_STARTED, data={"i": index})

    class Registry:
        def __init__(self, store: EventStore) -> None:
            self.store = store

        def visible_ids(self, _who: object, session_id: str = "") -> list[str]:
            return [session_id]

    return store, AuditVerification(Registry(store), chunk=10)  # type: ignore[arg-type]


def test_one_verification_per_owner_at_a_time(tmp_path: Path) -> None:
    """The per-owner bound, with the first verification held inside its walk: the owner's second
    is refused (RESOURCE_EXHAUSTED), another administrator's runs, and the node's chain is refused
    to a caller that is not one."""
    store, verification = _verification(tmp_path)
    root = identify(PeerCredentials(0, 0, 1, ""))
    admin = identify(PeerCredentials(4242, 4242, 1, "", (777,)), admin_gid=777)
    plain = identify(PeerCredentials(4243, 4243, 1, ""))
    inside, release = threading.Event(), threading.Event()

    def held() -> bool:
        inside.set()
        release.wait(SAFETY_DEADLINE)
        return True

    try:
        first: dict[str, pb.VerifyAuditResponse] = {}
        runner = threading.Thread(target=lambda: first.update(
            answer=verification.verify(root, pb.VerifyAuditRequest(), held)))
        runner.start()
        assert inside.wait(SAFETY_DEADLINE)
        with pytest.raises(Exhausted, match="under way"):
            verification.verify(root, pb.VerifyAuditRequest(), lambda: True)
        assert verification.verify(admin, pb.VerifyAuditRequest(), lambda: True).whole     # the control
        with pytest.raises(Forbidden, match="administrators"):
            verification.verify(plain, pb.VerifyAuditRequest(), lambda: True)
        assert verification.verify(plain, pb.VerifyAuditRequest(session_id="s"), lambda: True).whole
        release.set()
        runner.join()
        assert first["answer"].whole and first["answer"].events == 30
    finally:
        release.set()
        store.close()


def test_the_last_verification_slot_is_kept_for_administrators(tmp_path: Path) -> None:
    """Tenants looping on their own sessions fill what they may (MAX_RUNNING - 1): a third tenant
    is refused saying why, an administrator's whole-node verify still runs (the control)."""
    from sandboxd.service.audit_verify import ADMIN_RESERVED, MAX_RUNNING

    store, verification = _verification(tmp_path)
    tenants = [identify(PeerCredentials(5000 + index, 5000 + index, 1, "")) for index in range(MAX_RUNNING)]
    release = threading.Event()
    inside = [threading.Event() for _ in tenants]
    runners = []

    def holder(index: int) -> Any:
        def held() -> bool:
            inside[index].set()
            release.wait(SAFETY_DEADLINE)
            return True
        return held

    try:
        for index in range(MAX_RUNNING - ADMIN_RESERVED):
            runner = threading.Thread(target=verification.verify, args=(
                tenants[index], pb.VerifyAuditRequest(session_id="s"), holder(index)))
            runner.start()
            runners.append(runner)
            assert inside[index].wait(SAFETY_DEADLINE)
        with pytest.raises(Exhausted, match="kept for administrators"):
            verification.verify(tenants[-1], pb.VerifyAuditRequest(session_id="s"), lambda: True)
        root = identify(PeerCredentials(0, 0, 1, ""))
        assert verification.verify(root, pb.VerifyAuditRequest(), lambda: True).whole
    finally:
        release.set()
        for runner in runners:
            runner.join()
        store.close()
