"""Quotas under attack: one plain user (the attacker) takes sessions, streams, calls held for
approval and long commands up to and past its quotas; another (the victim) keeps being served,
and the workers kept for short calls stay free even when every long-lived slot is taken."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from conftest import BASE_ENV
from daemon_helpers import _CLIENT_PRELUDE, PYTHON, Daemon, close_quietly, make_base_dir, remove_tree, run_client_as
from plain_users import plain_user
from sandboxd import config
from sandboxd.errors import InvalidPolicy
from sandboxd.service.quotas import QuotaLimits
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

SESSIONS, CALLS, STREAMS, WORKERS, RESERVED = 6, 4, 4, 24, 8
LONG_LIVED = WORKERS - RESERVED
QUOTA_CONFIG = f"""
[listen]
workers = {WORKERS}
[quotas]
sessions_per_uid = {SESSIONS}
calls_per_uid = {CALLS}
streams_per_uid = {STREAMS}
reserved_workers = {RESERVED}
"""

ATTACKER = r'''
import sys, time
def settle(calls, live):
    """Wait until all but ``live`` calls have ended (the refused ones end at once)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(c.done() for c in calls) < len(calls) - live:
        time.sleep(0.05)
    time.sleep(0.5)
    return [(c.code().name, c.details()) for c in calls if c.done()]

ids, refusals = [], []
for index in range(ARGS["sessions"] + 3):
    try:
        ids.append(stub.CreateSession(pb.CreateSessionRequest(
            workspace=ARGS["ws"], approval_policy=pb.ALWAYS if index == 0 else pb.NEVER), timeout=60).id)
    except grpc.RpcError as error:
        refusals.append((error.code().name, error.details()))
streams = [stub.WatchEvents(pb.WatchEventsRequest(), timeout=600) for _ in range(80)]
ended_streams = settle(streams, ARGS["streams"])
held = [stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=ids[0], argv=["true"]))]), timeout=600)
        for _ in range(80)]
ended_held = settle(held, ARGS["calls"])
long_execs = []
for _ in range(10):
    try:
        for _ in stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=ids[1], argv=["sleep", "300"]))]),
                           timeout=60):
            pass
        long_execs.append(("OK", ""))
    except grpc.RpcError as error:
        long_execs.append((error.code().name, error.details()))
status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
control = code(lambda: stub.GetSession(pb.GetSessionRequest(session_id=ids[1]), timeout=30))
print(json.dumps({"sessions": len(ids), "session_refusals": refusals, "ended_streams": ended_streams,
                  "ended_held": ended_held, "long_execs": long_execs, "usage": dict(status.quota_usage),
                  "limits": dict(status.quota_limits), "control": control}), flush=True)
sys.stdin.readline()                                   # hold everything until the test is done
for c in streams + held:
    c.cancel()
print(json.dumps({"released": True}), flush=True)
'''

VICTIM = r'''
result = {}
try:
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60)
    result["create"] = "OK"
    try:
        result["exec"] = list(run(session.id, ["sh", "-c", "echo served"]))
    except grpc.RpcError as error:
        result["exec"] = [error.code().name, error.details()]
    result["get"] = code(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session.id), timeout=30))
    result["close"] = code(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=30))
except grpc.RpcError as error:
    result["create"] = [error.code().name, error.details()]
print(json.dumps(result))
'''


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    base = make_base_dir("sbxquota-")
    (base / "quotas.toml").write_text(QUOTA_CONFIG)
    d = Daemon(base, args=["--config", str(base / "quotas.toml")])
    try:
        d.start()
        yield d
    finally:
        d.close()
        remove_tree(base)


def owned_dir(path: Path, uid: int, gid: int) -> str:
    path.mkdir()
    os.chown(path, uid, gid)
    return str(path)


def victim_is_served(daemon: Daemon, uid: int, gid: int, ws: str) -> dict[str, Any]:
    return run_client_as(uid, gid, daemon.socket, VICTIM, {"ws": ws})


def test_one_user_past_its_quotas_cannot_stop_another(daemon: Daemon) -> None:
    with plain_user() as (attacker_uid, attacker_gid), plain_user() as (victim_uid, victim_gid):
        attacker_ws = owned_dir(daemon.base / "attacker", attacker_uid, attacker_gid)
        victim_ws = owned_dir(daemon.base / "victim", victim_uid, victim_gid)
        payload = json.dumps({"uid": attacker_uid, "gid": attacker_gid, "socket": daemon.socket, "ws": attacker_ws,
                              "sessions": SESSIONS, "calls": CALLS, "streams": STREAMS})
        attacker = subprocess.Popen([PYTHON, "-c", _CLIENT_PRELUDE + ATTACKER, payload], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd="/")
        try:
            assert attacker.stdout is not None and attacker.stdin is not None
            line = attacker.stdout.readline()
            assert line, f"the attacker failed: {attacker.stderr.read() if attacker.stderr else ''}"
            attack = json.loads(line)

            # Sessions: up to the quota, then RESOURCE_EXHAUSTED naming the limit and its key.
            assert attack["sessions"] == SESSIONS
            assert len(attack["session_refusals"]) == 3
            for code, details in attack["session_refusals"]:
                assert code == "RESOURCE_EXHAUSTED" and "quotas.sessions_per_uid" in details, details
            # 80 streams: STREAMS kept open, the rest refused at once.
            assert len(attack["ended_streams"]) == 80 - STREAMS
            assert all(c == "RESOURCE_EXHAUSTED" and "quotas.streams_per_uid" in d for c, d in attack["ended_streams"])
            # 80 Execs held for approval: CALLS held, the rest refused at once.
            assert len(attack["ended_held"]) == 80 - CALLS
            assert all(c == "RESOURCE_EXHAUSTED" and "quotas.calls_per_uid" in d for c, d in attack["ended_held"])
            # Long commands past the quota: refused, not queued.
            assert [c for c, _ in attack["long_execs"]] == ["RESOURCE_EXHAUSTED"] * 10
            # What GetStatus says of it, and a short call of its own still works.
            usage = dict(attack["usage"])
            assert usage.pop("connections") >= 1             # its own connections at the front door
            assert usage == {"sessions": SESSIONS, "calls": CALLS, "streams": STREAMS,
                             "long_lived": CALLS + STREAMS}
            assert attack["limits"]["calls_per_uid"] == CALLS and attack["limits"]["long_lived_total"] == LONG_LIVED
            assert attack["control"] == "OK"

            # Meanwhile the victim is served: a session, a command, the short calls.
            served = victim_is_served(daemon, victim_uid, victim_gid, victim_ws)
            assert served == {"create": "OK", "exec": ["served\n", 0], "get": "OK", "close": "OK"}, served

            # Every long-lived slot taken (root is held to the total only): the reserve stays free
            # for short calls; a further long-lived call is refused naming the reserve.
            channel = grpc.insecure_channel("unix:" + daemon.socket)
            stub = pb_grpc.SandboxStub(channel)
            root_streams = [stub.WatchEvents(pb.WatchEventsRequest(), timeout=600)
                            for _ in range(LONG_LIVED - CALLS - STREAMS)]
            try:
                deadline = time.monotonic() + 60           # wait until their handlers hold their slots
                while stub.GetStatus(pb.GetStatusRequest(), timeout=30).quota_usage["long_lived"] < LONG_LIVED:
                    assert time.monotonic() < deadline, "the streams never took their slots"
                    time.sleep(0.05)
                refused = stub.WatchEvents(pb.WatchEventsRequest(), timeout=60)
                with pytest.raises(grpc.RpcError) as caught:
                    next(iter(refused))
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "quotas.reserved_workers" in (caught.value.details() or "")
                assert not any(s.done() for s in root_streams)
                squeezed = victim_is_served(daemon, victim_uid, victim_gid, victim_ws)
                assert squeezed["create"] == "OK" and squeezed["get"] == "OK" and squeezed["close"] == "OK", squeezed
                assert squeezed["exec"][0] == "RESOURCE_EXHAUSTED" and "reserved_workers" in squeezed["exec"][1]
            finally:
                for s in root_streams:
                    s.cancel()
                channel.close()

            # The attacker lets go: its slots come back, and the victim runs commands again.
            attacker.stdin.write("done\n")
            attacker.stdin.flush()
            assert json.loads(attacker.stdout.readline()) == {"released": True}
            assert attacker.wait(60) == 0
            assert victim_is_served(daemon, victim_uid, victim_gid, victim_ws)["exec"] == ["served\n", 0]
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
            close_sessions_of(daemon, {attacker_uid, victim_uid})     # before userdel: their sandboxes go


def close_sessions_of(daemon: Daemon, uids: set[int]) -> None:
    for session in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions:
        if session.owner_uid in uids:
            close_quietly(daemon.stub, session.id)


def test_the_reserve_must_leave_workers_for_calls(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[listen]\nworkers = 8\n[quotas]\nreserved_workers = 8\n")
    with pytest.raises(config.ConfigError, match="quotas.reserved_workers: must be below listen.workers"):
        config.load(str(path))
    with pytest.raises(InvalidPolicy, match="reserved_workers"):
        QuotaLimits(workers=4, reserved_workers=5)
    # The default reserve is a quarter of the workers; a good file loads.
    assert QuotaLimits(workers=64).reserved_workers == 16 and QuotaLimits(workers=64).long_lived_total == 48
    path.write_text(QUOTA_CONFIG)
    assert config.load(str(path))["quotas.calls_per_uid"] == CALLS


@pytest.mark.parametrize("line, problem", [
    ("[approvals]\ntimeout_seconds = nan\n", "approvals.timeout_seconds: must be a positive number"),
    ("[defaults]\ntimeout_seconds = inf\n", "defaults.timeout_seconds: must be a number of seconds from 0"),
    ("[defaults]\nmemory = \"99999T\"\n", "defaults.memory: must be at most 2^53 bytes"),
    ("[quotas]\ncalls_per_uid = 0\n", "quotas.calls_per_uid: must be a whole number from 1"),
])
def test_config_values_out_of_range_stop_the_daemon(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(line)
    with pytest.raises(config.ConfigError, match=problem.replace("^", "\\^")):
        config.load(str(path))
    # control: the maxima load (a session's memory up to the total of all sandboxes, which must hold it)
    path.write_text("[defaults]\ntimeout_seconds = 604800\nmemory = \"8192T\"\n[limits]\ntotal_memory = \"8192T\"\n"
                    if "defaults" in line else "")
    config.load(str(path))


def test_each_owner_has_its_own_cgroup_key_and_root_none() -> None:
    """The group a caller's sandboxes share (LaunchSpec.owner, limits.owner_*): one per local uid, one
    per TLS principal whatever characters it holds (even one acting as root), a usable cgroup name
    each; root's own sessions have none (held only to the total, as by the quotas)."""
    from sandboxd.policy.spec import is_owner_key
    from sandboxd.service.peercred import PeerCredentials
    from sandboxd.service.quotas import cgroup_owner

    keys = [cgroup_owner(PeerCredentials(uid, uid, 0, principal, (uid,))) for uid, principal in (
        (1000, ""), (1001, ""), (65534, "tls:agent-a"), (65534, "tls:agent-b"), (65534, "tls-uri:spiffe://x/../y"),
        (0, "tls:admin"))]
    assert keys[:2] == ["uid-1000", "uid-1001"]
    assert len(set(keys)) == len(keys) and all(is_owner_key(key) and key for key in keys), keys
    assert cgroup_owner(PeerCredentials(0, 0, 0, "", (0,))) == ""
