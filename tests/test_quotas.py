"""Quotas under attack: one plain user (the attacker) takes sessions, streams, calls held for
approval and long commands up to and past its quotas; another (the victim) keeps being served,
and the workers kept for short calls stay free even when every long-lived slot is taken. Four
users at their quotas together leave a fifth served, and an owner holding nothing gets a slot
as long as any is free (the first-slot share)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BASE_ENV
from daemon_helpers import (_CLIENT_PRELUDE, PYTHON, Daemon, DaemonFactory, close_quietly, make_base_dir, remove_tree,
                            run_client_as)
from plain_users import plain_user
from sandboxd import config
from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.service.callers import identify
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.service.quotas import CALLS as CALLS_KIND
from sandboxd.service.quotas import REQUESTS as REQUESTS_KIND
from sandboxd.service.quotas import STREAMS as STREAMS_KIND
from sandboxd.policy.quota_limits import QuotaLimits
from sandboxd.service.quotas import Quotas
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

# A pool of 24 long-lived slots (32 workers, 8 reserved), a first-slot share of 3 (an eighth);
# 4 owners at 3 calls + 2 streams hold 20, leaving one shared slot and the share for the others;
# with 2 requests each they hold 28 of the 32 workers, leaving the share and one more.
SESSIONS, CALLS, STREAMS, REQUESTS, WORKERS, RESERVED = 6, 3, 2, 2, 32, 8
LONG_LIVED = WORKERS - RESERVED
SHARE = LONG_LIVED // 8
SHARED = LONG_LIVED - SHARE
QUOTA_CONFIG = f"""
[listen]
workers = {WORKERS}
[quotas]
sessions_per_uid = {SESSIONS}
calls_per_uid = {CALLS}
streams_per_uid = {STREAMS}
requests_per_uid = {REQUESTS}
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
            assert usage.pop("audit_bytes") > 0              # what its sessions wrote to the audit log
            # Its GetStatus is one request in progress; the workers busy are its slots and that one.
            assert usage == {"sessions": SESSIONS, "calls": CALLS, "streams": STREAMS, "requests": 1, "terminals": 0,
                             "long_lived": CALLS + STREAMS, "workers_busy": CALLS + STREAMS + 1}
            assert attack["limits"]["calls_per_uid"] == CALLS and attack["limits"]["long_lived_total"] == LONG_LIVED
            assert attack["control"] == "OK"

            # Meanwhile the victim is served: a session, a command, the short calls.
            served = victim_is_served(daemon, victim_uid, victim_gid, victim_ws)
            assert served == {"create": "OK", "exec": ["served\n", 0], "get": "OK", "close": "OK"}, served

            # Root (held to the pool only) takes every slot it can: all but the first-slot share;
            # one more is refused naming that share, and the victim, holding nothing, still runs
            # a command in it, and its short calls are served from the reserve.
            with root_holding(daemon, SHARED - CALLS - STREAMS) as refusal:
                assert "first-slot share" in refusal, refusal
                squeezed = victim_is_served(daemon, victim_uid, victim_gid, victim_ws)
                assert squeezed == {"create": "OK", "exec": ["served\n", 0], "get": "OK", "close": "OK"}, squeezed

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


@contextmanager
def root_holding(daemon: Daemon, count: int) -> Iterator[str]:
    """Root holds ``count`` WatchEvents streams (all of them held, checked in GetStatus) while the
    block runs; yields the refusal of one more."""
    channel = grpc.insecure_channel("unix:" + daemon.socket)
    stub = pb_grpc.SandboxStub(channel)
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=30).quota_usage["long_lived"]
    streams = [stub.WatchEvents(pb.WatchEventsRequest(), timeout=600) for _ in range(count)]
    try:
        deadline = time.monotonic() + 60                  # wait until their handlers hold their slots
        while stub.GetStatus(pb.GetStatusRequest(), timeout=30).quota_usage["long_lived"] < before + count:
            assert time.monotonic() < deadline, "the streams never took their slots"
            assert not any(s.done() for s in streams), [s.details() for s in streams if s.done()]
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as caught:
            next(iter(stub.WatchEvents(pb.WatchEventsRequest(), timeout=60)))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        yield caught.value.details() or ""
        assert not any(s.done() for s in streams)
    finally:
        for s in streams:
            s.cancel()
        channel.close()


HOLDER = r'''
import sys, time
held = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.ALWAYS), timeout=60).id
free = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60).id
def start(session, argv):
    return stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=session, argv=argv))]), timeout=600)
streams = [stub.WatchEvents(pb.WatchEventsRequest(), timeout=600) for _ in range(ARGS["streams"])]
calls = [start(free, ["sleep", "300"])] + [start(held, ["true"]) for _ in range(ARGS["calls"] - 1)]
deadline = time.monotonic() + 120
while time.monotonic() < deadline:                     # until every one holds its slot
    usage = stub.GetStatus(pb.GetStatusRequest(), timeout=30).quota_usage
    if usage["calls"] == ARGS["calls"] and usage["streams"] == ARGS["streams"]:
        break
    time.sleep(0.05)
def refusal(call):
    try:
        for _ in call:
            pass
        return ["OK", ""]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
print(json.dumps({"usage": dict(usage), "running": [c.done() for c in streams + calls].count(False),
                  "more_calls": refusal(start(free, ["true"])),
                  "more_streams": refusal(stub.WatchEvents(pb.WatchEventsRequest(), timeout=60))}), flush=True)
sys.stdin.readline()                                   # hold everything until the test is done
for c in streams + calls:
    c.cancel()
print(json.dumps({"released": True}), flush=True)
'''

FIFTH = r'''
result = {}
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60)
def outcome(fn):
    try:
        return ["OK", fn()]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
result["exec"] = outcome(lambda: run(session.id, ["sh", "-c", "echo served > note; cat note"]))
result["read"] = outcome(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="note"),
                                               timeout=60).data.decode())
result["search"] = outcome(lambda: [m.path.rsplit("/", 1)[-1] for m in stub.Search(
    pb.SearchRequest(session_id=session.id, pattern="serv"), timeout=60).matches])
stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
print(json.dumps(result))
'''


def test_four_users_at_their_quotas_leave_a_fifth_served(daemon: Daemon) -> None:
    with contextlib.ExitStack() as stack:
        users = [stack.enter_context(plain_user()) for _ in range(5)]
        holders: list[subprocess.Popen[str]] = []
        try:
            for index, (uid, gid) in enumerate(users[:4]):
                payload = json.dumps({"uid": uid, "gid": gid, "socket": daemon.socket, "calls": CALLS,
                                      "streams": STREAMS, "ws": owned_dir(daemon.base / f"holder-{index}", uid, gid)})
                holders.append(subprocess.Popen([PYTHON, "-c", _CLIENT_PRELUDE + HOLDER, payload], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                env=BASE_ENV, cwd="/"))
            for holder in holders:
                assert holder.stdout is not None
                line = holder.stdout.readline()
                assert line, f"a holder failed: {holder.stderr.read() if holder.stderr else ''}"
                held = json.loads(line)
                # Control: each holds its whole quota (a long command, calls held for approval,
                # streams), all still running, and is refused one more of each.
                assert held["usage"]["calls"] == CALLS and held["usage"]["streams"] == STREAMS, held
                assert held["running"] == CALLS + STREAMS, held
                assert held["more_calls"][0] == "RESOURCE_EXHAUSTED" and "quotas.calls_per_uid" in held["more_calls"][1]
                assert held["more_streams"][0] == "RESOURCE_EXHAUSTED" and "streams_per_uid" in held["more_streams"][1]
            status = daemon.stub.GetStatus(pb.GetStatusRequest(), timeout=30)
            assert status.quota_usage["long_lived"] == 4 * (CALLS + STREAMS)          # the pool really is held
            assert status.quota_limits["first_slot_share"] == SHARE

            fifth_uid, fifth_gid = users[4]
            fifth_ws = owned_dir(daemon.base / "fifth", fifth_uid, fifth_gid)
            expected = {"exec": ["OK", ["served\n", 0]], "read": ["OK", "served\n"], "search": ["OK", ["note"]]}
            served = run_client_as(fifth_uid, fifth_gid, daemon.socket, FIFTH, {"ws": fifth_ws})
            assert served == expected, served
            # Root takes what is left outside the first-slot share; the fifth, holding nothing, is
            # still served from the share.
            with root_holding(daemon, SHARED - 4 * (CALLS + STREAMS)) as refusal:
                assert "first-slot share" in refusal, refusal
                served = run_client_as(fifth_uid, fifth_gid, daemon.socket, FIFTH, {"ws": fifth_ws})
                assert served == expected, served
        finally:
            for holder in holders:
                if holder.poll() is None and holder.stdin is not None:
                    holder.stdin.write("done\n")
                    holder.stdin.flush()
            for holder in holders:
                try:
                    holder.wait(60)
                except subprocess.TimeoutExpired:
                    holder.kill()
                    holder.wait()
            close_sessions_of(daemon, {uid for uid, _ in users})     # before userdel: their sandboxes go


def test_the_pool_and_its_shares(tmp_path: Path) -> None:
    """The rules of Quotas itself, with the counts a daemon test cannot reach cheaply: the pool
    full (the reserve named), and the start-up check that 4 owners at quota leave room."""
    limits = QuotaLimits(workers=WORKERS, reserved_workers=RESERVED, calls_per_uid=CALLS, streams_per_uid=STREAMS,
                         requests_per_uid=REQUESTS)
    quotas = Quotas(limits)
    who = [identify(PeerCredentials(2000 + i, 2000, 1)) for i in range(LONG_LIVED + 1)]
    with contextlib.ExitStack() as stack:
        for owner in who[:4]:                         # 4 owners at quota
            for _ in range(CALLS):
                stack.enter_context(quotas.hold(owner, CALLS_KIND))
            for _ in range(STREAMS):
                stack.enter_context(quotas.hold(owner, STREAMS_KIND))
        stack.enter_context(quotas.hold(who[4], CALLS_KIND))          # the fifth: the last shared slot
        with pytest.raises(Exhausted, match="first-slot share"):
            stack.enter_context(quotas.hold(who[4], CALLS_KIND))      # its second: not from the share
        for owner in who[5:5 + SHARE]:                # owners holding nothing: the share
            stack.enter_context(quotas.hold(owner, STREAMS_KIND))
        with pytest.raises(Exhausted, match="quotas.reserved_workers"):
            stack.enter_context(quotas.hold(who[5 + SHARE], CALLS_KIND))
        assert quotas.usage(who[0])["long_lived_total"] == LONG_LIVED
    assert quotas.usage(who[0]) == {CALLS_KIND: 0, STREAMS_KIND: 0, REQUESTS_KIND: 0, "terminals": 0,
                                    "long_lived_total": 0, "workers_busy": 0}
    # TLS principals are owners of their own, even when mapped to one uid (or to root).
    tls = [identify(PeerCredentials(0, 0, 0, f"tls:agent-{i}")) for i in range(2)]
    with quotas.hold(tls[0], STREAMS_KIND), quotas.hold(tls[0], STREAMS_KIND):
        with pytest.raises(Exhausted, match="tls:agent-0 already has 2 open streams"):
            with quotas.hold(tls[0], STREAMS_KIND):
                pass
        with quotas.hold(tls[1], STREAMS_KIND):
            assert quotas.usage(tls[1])[STREAMS_KIND] == 1
    # Start-up: the old defaults (16 calls + 8 streams of a 48-slot pool) are refused, saying why.
    with pytest.raises(InvalidPolicy, match="4 users at their quotas .* would hold 96 long-lived slots"):
        QuotaLimits(calls_per_uid=16, streams_per_uid=8)
    assert QuotaLimits().per_owner * 4 <= QuotaLimits().shared                 # control: the new defaults


def test_requests_and_terminals(tmp_path: Path) -> None:
    """Every RPC that is neither a call nor a stream is a request (CreateSession, UpdateSessionPolicy,
    AddStandingRule ... any of which may wait on a path that does not answer): at most REQUESTS in
    progress per owner, naming quotas.requests_per_uid; from any worker the calls and streams leave,
    and the last first-slot share of all the workers only for owners with none in progress, local
    root included. Terminal calls are counted apart, per owner (root exempt)."""
    limits = QuotaLimits(workers=WORKERS, reserved_workers=RESERVED, calls_per_uid=CALLS, streams_per_uid=STREAMS,
                         requests_per_uid=REQUESTS, terminals_per_uid=2)
    quotas = Quotas(limits)
    who = [identify(PeerCredentials(4000 + i, 4000, 1)) for i in range(9)]
    root = identify(PeerCredentials(0, 0, 1))
    with contextlib.ExitStack() as stack:
        for owner in who[:4]:                         # 4 owners at every quota: 28 of the 32 workers
            for kind, count in ((CALLS_KIND, CALLS), (STREAMS_KIND, STREAMS), (REQUESTS_KIND, REQUESTS)):
                for _ in range(count):
                    stack.enter_context(quotas.hold(owner, kind))
        with pytest.raises(Exhausted, match="uid 4000 already has 2 requests in progress.*quotas.requests_per_uid"):
            stack.enter_context(quotas.hold(who[0], REQUESTS_KIND))
        assert quotas.usage(who[0])["workers_busy"] == 4 * (CALLS + STREAMS + REQUESTS)
        stack.enter_context(quotas.hold(root, REQUESTS_KIND))         # root: the last worker outside the share
        with pytest.raises(Exhausted, match="first-slot share"):
            stack.enter_context(quotas.hold(root, REQUESTS_KIND))     # its second: not from the share
        for owner in who[4:4 + SHARE]:                # owners with none in progress: the share
            stack.enter_context(quotas.hold(owner, REQUESTS_KIND))
        with pytest.raises(Exhausted, match="maximum of 32 calls at once .listen.workers."):
            stack.enter_context(quotas.hold(who[4 + SHARE], REQUESTS_KIND))
    assert quotas.usage(who[0])["workers_busy"] == 0
    with quotas.terminal(who[0]), quotas.terminal(who[0]):
        with pytest.raises(Exhausted, match="2 calls on a terminal .*quotas.terminals_per_uid"):
            with quotas.terminal(who[0]):
                pass
        with quotas.terminal(who[1]), quotas.terminal(root), quotas.terminal(root), quotas.terminal(root):
            assert quotas.usage(who[0])["terminals"] == 2 and quotas.usage(root)["terminals"] == 3
    assert quotas.usage(who[0])["terminals"] == 0
    # Start-up: 4 owners whose calls, streams and requests reach into the share are refused, saying why.
    with pytest.raises(InvalidPolicy, match="4 users at all their quotas .* would hold 120 of the 128 workers"):
        QuotaLimits(requests_per_uid=10)
    defaults = QuotaLimits()                           # control: the defaults leave the share and more
    assert 4 * (defaults.per_owner + defaults.requests_per_uid) <= defaults.workers - defaults.first_slot_share


KINDS = (CALLS_KIND, STREAMS_KIND, REQUESTS_KIND)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from([True] * 5 + [False]), st.sampled_from(KINDS)),
                min_size=20, max_size=150))
def test_an_owner_holding_nothing_is_served_while_any_slot_is_free(steps: list[tuple[int, bool, str]]) -> None:
    """Any sequence of holds and releases of every kind by 10 owners (owner 0 is local root): the
    pool, the workers and the per-owner limits are never passed, and a hold is refused only for a
    reason that holds: the owner's quota, the pool or the workers full, or (for an owner already
    holding one of that pool) a first-slot share."""
    limits = QuotaLimits(workers=WORKERS, reserved_workers=RESERVED, calls_per_uid=CALLS, streams_per_uid=STREAMS,
                         requests_per_uid=REQUESTS)
    quota = {CALLS_KIND: CALLS, STREAMS_KIND: STREAMS, REQUESTS_KIND: REQUESTS}
    quotas = Quotas(limits)
    owners = [identify(PeerCredentials(0 if i == 0 else 3000 + i, 3000, 1)) for i in range(10)]
    held: list[list[tuple[str, contextlib.ExitStack]]] = [[] for _ in owners]
    for index, acquire, kind in steps:
        owner = owners[index]
        if not acquire:
            if held[index]:
                held[index].pop()[1].close()
            continue
        mine = quotas.usage(owner)
        long_lived = mine["long_lived_total"]
        busy = mine["workers_busy"]
        holds_long = any(k != REQUESTS_KIND for k, _ in held[index])
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(quotas.hold(owner, kind))
        except Exhausted:
            at_quota = not owner.is_root and mine[kind] >= quota[kind]
            if kind == REQUESTS_KIND:
                assert at_quota or busy >= WORKERS or (mine[kind] and busy >= WORKERS - SHARE), (index, kind, busy)
            else:
                assert at_quota or long_lived >= LONG_LIVED or busy >= WORKERS or (
                    holds_long and long_lived >= SHARED), (index, kind)
            continue
        if kind == REQUESTS_KIND:
            assert not (mine[kind] and busy >= WORKERS - SHARE), "the share went to an owner with a request"
        else:
            assert not (holds_long and long_lived >= SHARED), "the first-slot share went to an owner holding one"
        held[index].append((kind, stack))
        now = quotas.usage(owner)
        assert now["long_lived_total"] <= LONG_LIVED and now["workers_busy"] <= WORKERS
        assert now["workers_busy"] == sum(len(h) for h in held)
        assert owner.is_root or now[kind] <= quota[kind]
    for stacks in held:
        for _, stack in stacks:
            stack.close()
    assert quotas.usage(owners[0])["workers_busy"] == 0


def test_a_config_where_four_users_fill_the_pool_stops_the_daemon(sandboxd_daemon: DaemonFactory) -> None:
    failure = sandboxd_daemon.start_failure(config="[quotas]\ncalls_per_uid = 16\nstreams_per_uid = 8\n")
    assert failure.returncode == 2 and "4 users at their quotas" in failure.log, failure.log


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
    assert QuotaLimits(workers=128).reserved_workers == 32 and QuotaLimits(workers=128).long_lived_total == 96
    path.write_text(QUOTA_CONFIG)
    assert config.read_file(str(path))["quotas.calls_per_uid"] == CALLS


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
    from sandboxd.service.callers import identify
    from sandboxd.network.peer_credentials import PeerCredentials
    from sandboxd.service.quotas import cgroup_owner

    keys = [cgroup_owner(identify(PeerCredentials(uid, uid, 0, principal, (uid,)))) for uid, principal in (
        (1000, ""), (1001, ""), (65534, "tls:agent-a"), (65534, "tls:agent-b"), (65534, "tls-uri:spiffe://x/../y"),
        (0, "tls:admin"))]
    assert keys[:2] == ["uid-1000", "uid-1001"]
    assert len(set(keys)) == len(keys) and all(is_owner_key(key) and key for key in keys), keys
    assert cgroup_owner(identify(PeerCredentials(0, 0, 0, "", (0,)))) == ""


BACKGROUND_HOG = r'''
def start(sid, name):
    try:
        job = stub.StartBackground(pb.StartBackgroundRequest(session_id=sid, argv=["sh", "-c", "echo " + name + "; sleep 600"],
                                                             name=name), timeout=60)
        return ["OK", job.id]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]

def read(sid, job_id):
    try:
        return ["OK", b"".join(o.data for o in stub.ReadBackgroundOutput(
            pb.ReadBackgroundOutputRequest(session_id=sid, id=job_id), timeout=60)).decode()]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]

a = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60).id
b = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60).id
res = {"first": [start(a, "a1"), start(b, "b1"), start(a, "a2")]}
res["past_the_limit"] = start(b, "b2")
first_id = res["first"][0][1]
stub.StopBackground(pb.StopBackgroundRequest(session_id=a, id=first_id), timeout=60)
res["stopped_output"] = read(a, first_id)
res["after_one_ended"] = start(b, "b3")
res["forgotten"] = read(a, first_id)
res["listed"] = sorted(p.name for s in (a, b) for p in stub.ListBackground(
    pb.ListBackgroundRequest(session_id=s), timeout=60).processes)
for s in (a, b):
    stub.CloseSession(pb.CloseSessionRequest(session_id=s), timeout=60)
print(json.dumps(res))
'''


def test_a_users_background_processes_are_bounded_and_others_are_served(sandboxd_daemon: DaemonFactory) -> None:
    """quotas.background_per_uid (3 here): a plain user's sessions keep at most 3 background
    processes together; a fourth is refused while all run, naming the key; once one ended, a new
    one forgets it (its output is gone). Each kept one holds a thread and up to 4 MiB in the
    daemon: without the bound one user filled its memory. Another user is served meanwhile, and
    root (control) is not held to it."""
    daemon = sandboxd_daemon(config="[quotas]\nbackground_per_uid = 3\n")
    with plain_user() as (uid, gid), plain_user() as (other_uid, other_gid):
        ws = owned_dir(daemon.base / f"bg-{uid}", uid, gid)
        seen = run_client_as(uid, gid, daemon.socket, BACKGROUND_HOG, {"ws": ws})
        assert [code for code, _ in seen["first"]] == ["OK", "OK", "OK"], seen
        code, details = seen["past_the_limit"]
        assert code == "RESOURCE_EXHAUSTED" and "quotas.background_per_uid" in details, seen
        assert seen["stopped_output"] == ["OK", "a1\n"], seen          # ended, still readable
        assert seen["after_one_ended"][0] == "OK", seen
        assert seen["forgotten"][0] == "NOT_FOUND", seen                # made room for b3
        assert seen["listed"] == ["a2", "b1", "b3"], seen
        # Another user, and root, are not held by the first user's count.
        other_ws = owned_dir(daemon.base / f"bg-{other_uid}", other_uid, other_gid)
        assert run_client_as(other_uid, other_gid, daemon.socket, BACKGROUND_HOG,
                             {"ws": other_ws})["first"][2][0] == "OK"
        root_session = daemon.stub.CreateSession(pb.CreateSessionRequest(
            workspace=str(daemon.base), approval_policy=pb.NEVER), timeout=60).id
        try:
            jobs = [daemon.stub.StartBackground(pb.StartBackgroundRequest(
                session_id=root_session, argv=["sleep", "600"]), timeout=60) for _ in range(5)]
            assert len({job.id for job in jobs}) == 5
        finally:
            close_quietly(daemon.stub, root_session)
