"""The daemon end to end with limits: serve, a session with a memory and a pids limit and an isolated
network, exec (limits enforced, usage numbers right), close (nothing left). The matrix runner
(packaging/vm/run-matrix) runs this on every kernel: it is what the first limited call of a user
goes through, whichever cgroup layout the machine has.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cgroup_helpers import HOLDING_FORKS, ParentGroup, forked, own_parent, read, wait_for
from conftest import PY
from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import (Daemon, DaemonFactory, ExecOutcome, PlainUser, close_quietly, create_session, rpc_error, run_client_as,
                            run_exec, workspace_write)
from sandboxd.kernel import host_limits
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

MEMORY = 128 << 20
PIDS = 32

# Touches argv[1] MiB page by page, then burns argv[2] seconds of CPU; prints ALIVE.
WORK = ("import sys, time\n"
        "b = bytearray(int(sys.argv[1]) << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < float(sys.argv[2]): pass\n"
        "print('ALIVE', flush=True)\n")

FORKS = ("import os, time\n"
         "n = 0\n"
         "try:\n"
         "    for _ in range(100):\n"
         "        if os.fork() == 0:\n"
         "            time.sleep(5); os._exit(0)\n"
         "        n += 1\n"
         "    print('FORKED', n)\n"
         "except OSError as e:\n"
         "    print('FORK-FAILED', e.errno, n)\n")


@pytest.fixture
def limited(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path) -> Iterator[pb.Session]:  # noqa: F811 - fixture
    before = daemon.own_cgroups()       # this daemon's: other daemons on the machine make and remove theirs
    s = create_session(stub, ws, workspace_write(network_access=True),
                       limits=pb.Limits(memory_bytes=MEMORY, pids=PIDS))
    try:
        yield s
    finally:
        close_quietly(stub, s.id)
    assert daemon.own_cgroups() <= before                # the session's groups went with it


def test_a_limited_networked_session_enforces_and_reports(daemon: Daemon, stub: pb_grpc.SandboxStub,  # noqa: F811
                                                         limited: pb.Session) -> None:
    # usage numbers: 48 MiB touched and 0.3 s of CPU are what ExecResult says
    out = run_exec(stub, limited.id, [PY, "-c", WORK, "48", "0.3"])
    assert out.stdout == b"ALIVE\n" and out.result.exit_code == 0, out.describe()
    assert (48 << 20) <= out.result.peak_memory_bytes <= MEMORY, out.result
    assert not out.result.oom_killed, out.result
    # at least what it burned; at most what the CPUs could give it (seconds, not another unit)
    assert 0.25 <= out.result.cpu_seconds <= out.result.wall_seconds * (os.cpu_count() or 1), out.result

    # memory: above the limit the allocation is killed, and the session lives on
    out = run_exec(stub, limited.id, [PY, "-c", WORK, "512", "0"])
    assert b"ALIVE" not in out.stdout and out.result.shell_status != 0, out.describe()
    assert out.result.oom_killed, out.describe()                  # and the caller is told why
    after = run_exec(stub, limited.id, ["true"]).result
    assert after.exit_code == 0 and not after.oom_killed, after  # the next call is not blamed

    # pids: the tree cannot grow past the limit (EAGAIN), counting the session's own processes
    out = run_exec(stub, limited.id, [PY, "-c", FORKS])
    words = out.stdout.split()
    assert words[:2] == [b"FORK-FAILED", b"11"] and int(words[2]) < PIDS, out.describe()

    # network: the session has a namespace of its own, with its own link, not the host's
    out = run_exec(stub, limited.id, ["sh", "-c", "ls /sys/class/net"])
    inside = set(out.stdout.decode().split())
    assert out.result.exit_code == 0 and "lo" in inside, out.describe()
    assert not inside & (set(os.listdir("/sys/class/net")) - {"lo", "eth0"}), inside
    assert daemon.own_links(), "an isolated network has a host-side link while the session lives"


def test_closing_the_session_removes_its_groups_and_link(daemon: Daemon, stub: pb_grpc.SandboxStub,  # noqa: F811
                                                         ws: Path) -> None:
    # this daemon's groups: every session has some now, and other daemons on the machine make theirs
    cgroups_before, links_before = daemon.own_cgroups(), daemon.own_links()
    s = create_session(stub, ws, workspace_write(network_access=True), limits=pb.Limits(memory_bytes=MEMORY, pids=PIDS))
    try:
        assert run_exec(stub, s.id, ["true"]).result.exit_code == 0
        assert daemon.own_cgroups() - cgroups_before, "a limited session has cgroups of its own"
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
    assert daemon.own_cgroups() <= cgroups_before
    assert daemon.own_links() <= links_before


def test_the_daemon_refuses_to_start_where_limits_cannot_be_applied(tmp_path: Path) -> None:
    """The start-up self-test builds a limited sandbox: with every cgroup hierarchy read-only the daemon
    stops at start-up with the fix, instead of failing a user's first limited call. (Control: every
    other daemon of these tests starts.)"""
    import subprocess

    from conftest import BASE_ENV, SANDBOXD

    script = ("awk '$9 ~ /^cgroup/ {print $5}' /proc/self/mountinfo | while read m; do "
              "mount -o remount,bind,ro \"$m\" || exit 9; done; exec \"$0\" serve --socket \"$1\" --state-dir \"$2\"")
    env = dict(BASE_ENV, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, SANDBOXD,
                             str(tmp_path / "sock"), str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot build a sandbox" in result.stderr and "cgroup" in result.stderr, result.stderr
    assert not (tmp_path / "sock").exists()


def user_workspace(factory: DaemonFactory, owner: PlainUser) -> Path:
    path = factory.workspace()
    os.chown(path, owner.uid, owner.gid)
    return path


# As a plain user: a session with no limits, a fork bomb (HOLDING_FORKS) in it, then one more call.
ATTACKER = """
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120)
bomb, _ = run(s.id, [ARGS["py"], "-c", ARGS["bomb"], "1500", ARGS["count"], ARGS["release"]])
after, status = run(s.id, ["echo", "alive"])
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
print(json.dumps({"bomb": bomb, "after": after, "status": status}))
"""

# As another plain user meanwhile: a session, ARGS["forks"] processes of its own (held until they are all
# made), a call; what failed on the way is reported by its gRPC status (a starved victim's calls fail).
VICTIM = """
found = {}
found["create"] = code(lambda: found.update(session=stub.CreateSession(pb.CreateSessionRequest(
    workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120).id))
if "session" in found:
    found["exec"] = code(lambda: found.update(forks=run(found["session"], [
        ARGS["py"], "-c", ARGS["bomb"], ARGS["forks"], ARGS["count"], ARGS["count"]])[0]))
    code(lambda: found.update(zip(("echo", "status"), run(found["session"], ["echo", "served"]))))
    stub.CloseSession(pb.CloseSessionRequest(session_id=found["session"]), timeout=60)
print(json.dumps(found))
"""


def limits_of_group_holding(daemon: Daemon, at_least: int) -> dict[str, str]:
    """The limit files (pids.max, memory.max or memory.limit_in_bytes) of the sandbox group of ``daemon``
    that holds at least ``at_least`` tasks now, across hierarchies."""
    groups = daemon.own_cgroups()
    busy = [g for g in groups if os.path.exists(f"{g}/pids.current")
            and int(Path(g, "pids.current").read_text()) >= at_least]
    assert len(busy) == 1, (busy, groups)
    found = {}
    for group in groups:
        if os.path.basename(group) == os.path.basename(busy[0]):
            for name in ("pids.max", "memory.max", "memory.limit_in_bytes"):
                if os.path.exists(f"{group}/{name}"):
                    found[name] = Path(group, name).read_text().strip()
    return found


def test_a_fork_bomb_stops_at_the_default_pids_limit_while_another_user_is_served(
        daemon: Daemon, sandboxd_daemon_module: DaemonFactory,  # noqa: F811 - the fixture
        plain_users: Callable[[int], list[PlainUser]]) -> None:
    """A plain user's session that set no limit gets the defaults (pids 1024, memory min(8G, half of RAM)):
    its fork bomb gets EAGAIN at 1024 tasks, and while it holds them another plain user's session is
    created, forks 100 processes of its own and answers; the attacker's session answers afterwards too."""
    attacker, victim = plain_users(2)
    ws_a, ws_v = user_workspace(sandboxd_daemon_module, attacker), user_workspace(sandboxd_daemon_module, victim)
    count, release = ws_a / "count", ws_a / "release"
    outcome: dict[str, object] = {}

    def attack() -> None:
        try:
            outcome["attacker"] = run_client_as(attacker.uid, attacker.gid, daemon.socket, ATTACKER, {
                "ws": str(ws_a), "py": PY, "bomb": HOLDING_FORKS, "count": str(count), "release": str(release)})
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["attacker"] = exc

    thread = threading.Thread(target=attack)
    thread.start()
    try:
        wait_for(count)                                   # the bomb hit its wall and holds its processes
        limits = limits_of_group_holding(daemon, 1000)
        assert limits["pids.max"] == str(host_limits.DEFAULT_PIDS), limits
        assert limits.get("memory.max", limits.get("memory.limit_in_bytes")) == str(host_limits.default_memory())
        served = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM, {
            "ws": str(ws_v), "py": PY, "bomb": HOLDING_FORKS, "forks": "100", "count": str(ws_v / "count")})
    finally:
        release.touch()
        thread.join(180)
    assert served["echo"] == "served\n" and served["status"] == 0, served
    assert forked(served["forks"]) == (100, 0), served    # the victim's own processes were all made
    result = outcome["attacker"]
    assert isinstance(result, dict), result
    made, errno = forked(result["bomb"])
    assert errno == 11 and 1000 <= made < host_limits.DEFAULT_PIDS, result     # EAGAIN at the default
    assert result["after"] == "alive\n" and result["status"] == 0, result       # and the session lives on


# As a plain user: ARGS["sessions"] sessions one after the other, each running a fork bomb (HOLDING_FORKS)
# that holds what it made; the next session starts once the bomb before it hit its wall. The file
# ARGS["ready"] says all are holding; they end when ARGS["release"] exists. Reports each session's
# CreateSession status and bomb output.
OWNER_BOMBS = """
import threading, time
sessions, threads = [], []
for i in range(int(ARGS["sessions"])):
    entry = {}
    sessions.append(entry)
    entry["create"] = code(lambda: entry.update(id=stub.CreateSession(pb.CreateSessionRequest(
        workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120).id))
    if "id" not in entry:
        continue
    count = f"{ARGS['ws']}/count-{i}"
    def bomb(entry=entry, count=count):
        try:
            entry["bomb"] = run(entry["id"], [ARGS["py"], "-c", ARGS["bomb"], "1500", count, ARGS["release"]])[0]
        except grpc.RpcError as error:
            entry["exec"] = [error.code().name, error.details()]
    threads.append(threading.Thread(target=bomb))
    threads[-1].start()
    deadline = time.monotonic() + 120
    while not os.path.exists(count) and threads[-1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
open(ARGS["ready"], "w").close()
for thread in threads:
    thread.join(600)
for entry in sessions:
    if "id" in entry:
        stub.CloseSession(pb.CloseSessionRequest(session_id=entry["id"]), timeout=60)
print(json.dumps({"sessions": sessions}))
"""

OWNER_SHARE = """
[defaults]
pids = 100
[limits]
total_pids = 300
owner_pids = {owner_pids}
"""


@pytest.mark.parametrize("owner_pids", [150, 300], ids=["owner-share-150", "control-share-is-the-total"])
def test_one_user_with_many_sessions_cannot_fill_the_ceiling_for_another(
        sandboxd_daemon: DaemonFactory, plain_users: Callable[[int], list[PlainUser]], owner_pids: int) -> None:
    """A daemon in a parent group of its own with total_pids 300 and 100 per session. Plain user A opens
    three sessions and runs a fork bomb in each, all held: with an owner share of 150 A's bombs get EAGAIN
    once its sessions hold 150 tasks together (its group's pids.max reads 150), and plain user B still
    creates a session and forks 50 processes; the control, a share as large as the total, lets A's three
    sessions fill all 300 and B is not served. After A's sessions close its owner group is gone."""
    attacker, victim = plain_users(2)
    with own_parent() as parent:
        daemon = sandboxd_daemon(config=OWNER_SHARE.format(owner_pids=owner_pids), wrapper=parent.wrapper)
        try:
            attack, served = bombs_of_one_owner_beside_another(sandboxd_daemon, daemon, parent, attacker, victim,
                                                               owner_pids)
        finally:
            daemon.close()                        # before its parent group goes
        assert parent.owner_groups() == [], parent.owner_groups()   # both owners' groups went with their sessions
    # Each of A's sessions stopped at a wall: its bomb got EAGAIN, or (the share already full) its Exec
    # could not start the command and says so.
    bombs = [forked(entry["bomb"]) for entry in attack["sessions"] if "bomb" in entry]
    refused = [entry["exec"] for entry in attack["sessions"] if "exec" in entry]
    assert len(bombs) + len(refused) == 3 and all(errno == 11 for _, errno in bombs), attack
    assert all(code == "RESOURCE_EXHAUSTED" and "limits.owner_pids" in details for code, details in refused), attack
    if owner_pids == 150:
        assert 140 <= sum(made for made, _ in bombs) < 150, attack                 # A's share, not more
        assert served.get("forks") and forked(served["forks"]) == (50, 0), served  # B made all of its own
        assert served.get("echo") == "served\n" and served.get("status") == 0, served
    else:
        assert sum(made for made, _ in bombs) >= 285, attack                       # A took the whole ceiling
        assert not served.get("forks") or forked(served["forks"]) != (50, 0), served   # and B is starved


def bombs_of_one_owner_beside_another(factory: DaemonFactory, daemon: Daemon, parent: ParentGroup,
                                      attacker: PlainUser, victim: PlainUser,
                                      owner_pids: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A's bombs (OWNER_BOMBS) held while B runs VICTIM with 50 forks: both clients' reports. Checks the
    cap A's owner group carries while A holds its tasks."""
    ws_a, ws_v = user_workspace(factory, attacker), user_workspace(factory, victim)
    ready, release = ws_a / "ready", ws_a / "release"
    outcome: dict[str, Any] = {}

    def attack() -> None:
        try:
            outcome["attack"] = run_client_as(attacker.uid, attacker.gid, daemon.socket, OWNER_BOMBS, {
                "ws": str(ws_a), "py": PY, "bomb": HOLDING_FORKS, "sessions": "3", "ready": str(ready),
                "release": str(release)}, timeout=600)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["attack"] = exc

    thread = threading.Thread(target=attack)
    thread.start()
    try:
        wait_for(ready)                                   # A's bombs all hit their walls and hold
        group = parent.owner_group("pids", f"uid-{attacker.uid}")
        assert read(group / "pids.max") == str(owner_pids)
        assert int(read(group / "pids.current")) >= min(owner_pids, 300) - 10, read(group / "pids.current")
        served = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM, {
            "ws": str(ws_v), "py": PY, "bomb": HOLDING_FORKS, "forks": "50", "count": str(ws_v / "count")})
    finally:
        release.touch()
        thread.join(300)
    assert isinstance(outcome["attack"], dict), outcome["attack"]
    return outcome["attack"], served


LOW_CEILING = """
[defaults]
memory = "96M"
pids = 40
[limits]
max_pids = 100
total_pids = 128
owner_pids = 128
total_memory = "256M"
"""
ALLOCATE = ("import sys, time\n"
            "b = bytearray(int(sys.argv[1]) << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ALIVE', flush=True)\n"
            "while len(sys.argv) > 2 and not __import__('os').path.exists(sys.argv[2]): time.sleep(0.05)\n")


def test_configured_defaults_maxima_and_the_parent_caps_hold(
        sandboxd_daemon: DaemonFactory, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """A daemon in a parent group of its own, configured low: the sandboxes' parent group carries
    limits.total_* (read back), a session that sets nothing gets defaults.* and is OOM-killed above its
    memory default; a session may ask for more up to limits.max_pids but not past it; and two sessions
    within their own limits together cannot pass the parent's caps (pids, memory), while each alone can."""
    (user,) = plain_users(1)
    with own_parent() as parent:
        daemon = sandboxd_daemon(config=LOW_CEILING, wrapper=parent.wrapper)
        try:
            check_low_ceiling(sandboxd_daemon, daemon, parent, user)
        finally:
            daemon.close()                        # before its parent group goes


def check_low_ceiling(factory: DaemonFactory, daemon: Daemon, parent: ParentGroup, user: PlainUser) -> None:
    stub = daemon.stub

    def session(**limits: int) -> tuple[pb.Session, Path]:
        ws = user_workspace(factory, user)
        return create_session(stub, ws, workspace_write(), limits=pb.Limits(**limits)), ws

    assert parent.cap("pids") == "128" and parent.cap("memory") == str(256 << 20)    # from start-up on
    plain, ws = session()
    assert parent.sandbox_limits("pids") == ["40"] and parent.sandbox_limits("memory") == [str(96 << 20)]
    hog = run_exec(stub, plain.id, [PY, "-c", ALLOCATE, "160"])
    assert hog.result.oom_killed and b"ALIVE" not in hog.stdout, hog.describe()
    fits = run_exec(stub, plain.id, [PY, "-c", ALLOCATE, "16"])             # control: under the default
    assert fits.stdout == b"ALIVE\n" and not fits.result.oom_killed, fits.describe()
    close_quietly(stub, plain.id)

    # more than the default: up to the configured maximum, not past it
    error = rpc_error(lambda: session(pids=101))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_pids" in error.details(), error
    first, ws_first = session(pids=100, memory_bytes=200 << 20)
    second, _ = session(pids=100, memory_bytes=200 << 20)
    assert sorted(parent.sandbox_limits("pids")) == ["100", "100"]

    # pids: the first holds what its own limit allows; the second then gets only what is left of 128
    release = ws_first / "release"
    outcome: dict[str, object] = {}
    held = threading.Thread(target=lambda: outcome.update(first=run_exec(
        stub, first.id, [PY, "-c", HOLDING_FORKS, "1500", str(ws_first / "count"), str(release)])))
    held.start()
    try:
        wait_for(ws_first / "count")
        squeezed = run_exec(stub, second.id, [PY, "-c", HOLDING_FORKS, "1500", "/tmp/n", "/tmp/n"])
    finally:
        release.touch()
        held.join(120)
    first_made, _ = forked(outcome["first"].stdout)   # type: ignore[attr-defined]
    second_made, errno = forked(squeezed.stdout)
    assert 90 <= first_made < 100, outcome["first"]
    assert errno == 11 and first_made + second_made < 128 and second_made < 40, squeezed.describe()
    alone = run_exec(stub, second.id, [PY, "-c", HOLDING_FORKS, "1500", "/tmp/n", "/tmp/n"])
    assert 90 <= forked(alone.stdout)[0] < 100, alone.describe()          # control: alone, its own limit

    # memory: 150M each fits its own 200M, but not both under the parent's 256M
    release.unlink()
    held = threading.Thread(target=lambda: outcome.update(first=run_exec(
        stub, first.id, [PY, "-c", ALLOCATE, "150", str(release)])))
    held.start()
    try:
        deadline_ok = wait_until_rss(parent, 140 << 20)
        second_alloc = run_exec(stub, second.id, [PY, "-c", ALLOCATE, "150"])
    finally:
        release.touch()
        held.join(120)
    first_alloc = outcome["first"]
    assert deadline_ok and isinstance(first_alloc, ExecOutcome), first_alloc
    # the parent's OOM killer took one of them (it picks the larger: either may be it)
    assert first_alloc.result.shell_status != 0 or second_alloc.result.shell_status != 0, \
        (first_alloc.describe(), second_alloc.describe())
    alone = run_exec(stub, second.id, [PY, "-c", ALLOCATE, "150"])
    assert alone.stdout == b"ALIVE\n" and not alone.result.oom_killed, alone.describe()   # control
    for s in (first, second):
        close_quietly(stub, s.id)


def wait_until_rss(parent, at_least: int, within: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Until the sandboxes below ``parent`` use at least ``at_least`` bytes together."""
    import time

    base, version = parent.bases["memory"]
    usage = base / ("memory.current" if version == "v2" else "memory.usage_in_bytes")
    deadline = time.monotonic() + within
    while int(usage.read_text()) < at_least:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(("config", "key", "above"), [
    ("[defaults]\npids = 200\n[limits]\ntotal_pids = 128\n", "defaults.pids", "limits.max_pids"),
    ("[limits]\nmax_pids = 200\ntotal_pids = 128\n", "limits.max_pids", "limits.total_pids"),
    ("[limits]\nmax_memory = \"1G\"\ntotal_memory = \"512M\"\n", "limits.max_memory", "limits.total_memory"),
    ("[limits]\ntotal_pids = 300\nowner_pids = 400\n", "limits.owner_pids", "limits.total_pids"),
])
def test_a_per_session_limit_past_the_parent_caps_is_refused_at_start(
        sandboxd_daemon: DaemonFactory, config: str, key: str, above: str) -> None:
    """A default or a maximum above what all sandboxes together may use stops the daemon at start-up,
    naming both keys. (Control: the daemon of the test above starts with them nested.)"""
    failure = sandboxd_daemon.start_failure(config=config)
    assert failure.returncode == 2 and key in failure.log and above in failure.log, failure
