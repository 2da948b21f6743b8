"""One inotify instance for every git guard of a daemon (gitguard/watch.py), against the real
kernel: past fs.inotify.max_user_instances sessions (128 for root) a guard with an instance of
its own had none and walked its whole tree after every call. And a budget of watches per owner
(issue 24): a user with 20,000 directories took 20,021 of root's host-wide watches."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxd.gitguard.guard import GitGuard
from sandboxd.gitguard.watch import InotifyHub
from sandboxd.v1 import sandboxd_pb2 as pb

from conftest import eventually
from daemon_helpers import Daemon, DaemonFactory, PlainUser, run_client_as
from test_git_walk import git_init


def inotify_fds() -> int:
    return sum(1 for name in os.listdir("/proc/self/fd")
               if _link(f"/proc/self/fd/{name}") == "anon_inode:inotify")


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def test_guards_share_one_instance_and_each_sees_only_its_own_changes(base_dir: Path) -> None:
    """200 guards (more than root's 128 instances) on one hub hold one inotify descriptor and no
    thread. A repository made in one workspace after the baseline, with a config key that runs
    code, is found by that guard only through the event on its workspace's directory (with
    inotify a guard looks only where events fired) and neutralised; no other guard reports
    anything."""
    threads, before = threading.active_count(), inotify_fds()
    hub = InotifyHub()
    workspaces = [base_dir / f"ws{i}" for i in range(200)]
    for path in workspaces:
        git_init(path)
    guards = [GitGuard([str(path)], hub=hub) for path in workspaces]
    try:
        assert inotify_fds() == before + 1 and threading.active_count() == threads
        assert all(guard.inotify is not None for guard in guards)
        planted = workspaces[150] / "sub" / ".git"
        for name in ("objects", "refs"):
            (planted / name).mkdir(parents=True)
        (planted / "HEAD").write_text("ref: refs/heads/main\n")
        (planted / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
        found = [guard.inspect() for guard in guards]
        assert [(i, item.key) for i, items in enumerate(found) for item in items] == [(150, "core.fsmonitor")]
        assert "fsmonitor" not in (planted / "config").read_text()
    finally:
        for guard in guards:
            guard.close()
    assert hub.watches == 0                            # every watch went with the last guard using it
    assert inotify_fds() == before                     # and the instance with the last guard
    again = GitGuard([str(workspaces[0])], hub=hub)    # a later session gets a new one
    try:
        assert again.inotify is not None and inotify_fds() == before + 1
    finally:
        again.close()
    hub.close()
    assert inotify_fds() == before


def test_two_guards_on_one_directory_both_get_its_events(base_dir: Path) -> None:
    """Two sessions on one workspace get the kernel's one watch of that directory: an event is
    handed to both, whoever drains first; closing one keeps the other's watch."""
    hub = InotifyHub()
    first, second = hub.subscribe(), hub.subscribe()
    fd = open_dir(base_dir)
    try:
        wd = first.watch_fd(fd)
        assert second.watch_fd(fd) == wd
        (base_dir / "a").write_text("")
        assert first.drain() == ({wd}, False)
        assert second.drain() == ({wd}, False)
        assert first.drain() == (set(), False)         # taken once
        first.close()
        assert hub.watches == 1
        (base_dir / "b").write_text("")
        assert second.drain() == ({wd}, False)
        second.close()
        assert hub.watches == 0
        (base_dir / "c").write_text("")
        third = hub.subscribe()
        assert third.drain() == (set(), False)         # the watch is gone from the kernel too
        third.close()
    finally:
        os.close(fd)
        hub.close()


def overflow(directory: Path) -> None:
    """More events in ``directory`` than the kernel queues (fs.inotify.max_queued_events)."""
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())
    (directory / "a").write_text("")
    for i in range(limit // 2 + 10):                   # two events each (moved from, moved to)
        os.rename(directory / "ab"[i % 2], directory / "ba"[i % 2])


@pytest.mark.parametrize("instances", [3, 1], ids=["an-instance-per-owner", "control-one-shared"])
def test_an_overflow_is_only_its_owners(instances: int, base_dir: Path) -> None:
    """More events than the kernel queues in a directory of owner a: a's subscriptions are told they
    lost events (their guards then look at everything), owner b's are not (its instance is its own).
    The control: with one instance for all (quotas.git_inotify_instances = 1, as before round 4's
    second pass) the overflow is b's as well."""
    hub = InotifyHub(instances=instances)
    busy, busy_too, quiet = hub.subscribe("a"), hub.subscribe("a"), hub.subscribe("b")
    (base_dir / "busy").mkdir()
    (base_dir / "quiet").mkdir()
    fd, quiet_fd = open_dir(base_dir / "busy"), open_dir(base_dir / "quiet")
    try:
        busy.watch_fd(fd)
        quiet.watch_fd(quiet_fd)
        assert hub.instances_held() == (2 if instances > 1 else 1)
        overflow(base_dir / "busy")
        assert busy.drain()[1] is True
        assert busy_too.drain()[1] is True             # the owner's other guard too, whoever drained
        assert quiet.drain()[1] is (instances == 1)
        assert quiet.drain() == (set(), False)
    finally:
        os.close(fd)
        os.close(quiet_fd)
        for subscription in (busy, busy_too, quiet):
            subscription.close()
    assert hub.instances_held() == 0                   # each instance went with its last subscription
    hub.close()


def test_past_the_instance_budget_owners_share_one(base_dir: Path) -> None:
    """A budget of 3 instances: the first two owners get one each, the next two share the third; an
    overflow by one of those two is both of theirs and nobody else's. When the sharers are gone, a new
    owner gets an instance of its own again."""
    hub = InotifyHub(instances=3)
    subscriptions = {owner: hub.subscribe(owner) for owner in "abcd"}
    assert [hub.shares(owner) for owner in "abcd"] == [False, False, True, True]
    assert hub.instances_held() == 3
    fds = []
    try:
        for owner, subscription in subscriptions.items():
            (base_dir / owner).mkdir()
            fds.append(open_dir(base_dir / owner))
            subscription.watch_fd(fds[-1])
        overflow(base_dir / "c")
        assert {owner: subscription.drain()[1] for owner, subscription in subscriptions.items()} == \
            {"a": False, "b": False, "c": True, "d": True}
    finally:
        for fd in fds:
            os.close(fd)
    subscriptions.pop("a").close()
    assert hub.instances_held() == 2
    later = hub.subscribe("e")
    assert not hub.shares("e") and hub.instances_held() == 3
    for subscription in [*subscriptions.values(), later]:
        subscription.close()
    assert hub.instances_held() == 0
    hub.close()


# -- a per-owner budget of root's watches (issue 24, part 7) ---------------------------------------


def tree(root: Path, directories: int) -> Path:
    """``root`` holding a git repository and ``directories`` empty directories under ``many/``."""
    git_init(root)
    for index in range(directories):
        (root / "many" / f"d{index:04}").mkdir(parents=True)
    return root


def plant(directory: Path) -> None:
    """A git directory made after the baseline, whose config runs code (what a sandboxed call plants)."""
    planted = directory / "sub" / ".git"
    for name in ("objects", "refs"):
        (planted / name).mkdir(parents=True)
    (planted / "HEAD").write_text("ref: refs/heads/main\n")
    (planted / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")


def directory_inodes(root: Path) -> dict[int, Path]:
    found = {os.stat(root).st_ino: root}
    for parent, names, _ in os.walk(root):
        for name in names:
            found[os.stat(os.path.join(parent, name)).st_ino] = Path(parent, name)
    return found


def watched_inodes(pid: int) -> set[int]:
    """The inodes every inotify instance of process ``pid`` watches (its fdinfo lists them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if _link(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                inodes |= {int(field[4:], 16) for line in f if line.startswith("inotify ")
                           for field in line.split() if field.startswith("ino:")}
    return inodes


def test_an_owner_past_its_watch_budget_is_walked_and_others_are_watched(base_dir: Path) -> None:
    """Owner a's guard on 120 directories with a budget of 50 watches: a holds 50 (ENOSPC past
    them, as when root has none left), its root falls back to the walk by ctime, and a repository
    planted in a directory it does not watch is still neutralised. Owner b, on 20 directories, is
    watched whole and its plant found through its events. Closing a's guard gives its watches back.
    Control: without a budget a's guard watches every directory of its tree."""
    hub = InotifyHub(watches_per_owner=50)
    big, small = tree(base_dir / "big", 120), tree(base_dir / "small", 20)
    guards = {"a": GitGuard([str(big)], hub=hub, owner="a"), "b": GitGuard([str(small)], hub=hub, owner="b")}
    try:
        assert hub.watches_of("a") == 50
        assert hub.watches_of("b") == len(directory_inodes(small))        # all of b's, .git's own included
        watched = watched_inodes(os.getpid())
        unwatched = [path for inode, path in directory_inodes(big).items() if inode not in watched
                     and path.parent.name == "many"]
        assert unwatched and set(directory_inodes(small)) <= watched
        plant(unwatched[0])
        plant(small / "many" / "d0003")
        found = {owner: [item.key for item in guard.inspect()] for owner, guard in guards.items()}
        assert found == {"a": ["core.fsmonitor"], "b": ["core.fsmonitor"]}, found
        assert "fsmonitor" not in (unwatched[0] / "sub" / ".git" / "config").read_text()
        guards["a"].close()
        assert hub.watches_of("a") == 0 and hub.watches_of("b") > 0
    finally:
        for guard in guards.values():
            guard.close()
    unbounded = InotifyHub()
    control = GitGuard([str(big)], hub=unbounded, owner="a")
    try:
        assert unbounded.watches_of("a") == len(directory_inodes(big)) > 50
    finally:
        control.close()
        unbounded.close()
    hub.close()


def test_one_owners_guards_share_its_budget_and_a_watch_counts_once(base_dir: Path) -> None:
    """Two sessions of one owner on one workspace hold the same watches: counted once against it;
    a third session's guard on another tree has what is left."""
    hub = InotifyHub(watches_per_owner=30)
    ws, other = tree(base_dir / "ws", 10), tree(base_dir / "other", 40)
    first, second = GitGuard([str(ws)], hub=hub, owner="a"), GitGuard([str(ws)], hub=hub, owner="a")
    try:
        held = hub.watches_of("a")
        assert held == len(directory_inodes(ws)) < 30
        third = GitGuard([str(other)], hub=hub, owner="a")
        assert hub.watches_of("a") == 30
        third.close()
        first.close()
        assert hub.watches_of("a") == held                # the second still holds them
    finally:
        second.close()
        hub.close()
    assert hub.watches_of("a") == 0


OPEN_SESSION = r'''
print(json.dumps({"session": stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER),
                                                timeout=120).id}))
'''

PLANT = r'''
script = ("mkdir -p {0}/sub/.git/objects {0}/sub/.git/refs && echo 'ref: refs/heads/main' > {0}/sub/.git/HEAD && "
          "printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > {0}/sub/.git/config").format(ARGS["plant"])
exits = [r.result.exit_code for r in stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
    session_id=ARGS["session"], argv=["sh", "-c", script]))]), timeout=120) if r.WhichOneof("kind") == "result"]
events = stub.QueryEvents(pb.QueryEventsRequest(session_id=ARGS["session"], types=["GitConfigNeutralized"]),
                          timeout=60).events
stub.CloseSession(pb.CloseSessionRequest(session_id=ARGS["session"]), timeout=120)
print(json.dumps({"exit": exits, "neutralized": [json.loads(e.data_json)["key"] for e in events]}))
'''


def sessions_on_trees(daemon: Daemon, users: list[PlainUser], sizes: list[int]) -> list[tuple[str, Path]]:
    """Each user's workspace (a repository and ``size`` directories, theirs) and a session on it."""
    opened = []
    for user, size in zip(users, sizes, strict=True):
        ws = tree(daemon.base / f"ws-{user.name}-{os.urandom(3).hex()}", size)
        subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(ws)], check=True)
        opened.append((run_client_as(user.uid, user.gid, daemon.socket, OPEN_SESSION, {"ws": str(ws)})["session"], ws))
    return opened


def test_a_daemon_holds_each_owner_to_its_watch_budget(sandboxd_daemon: DaemonFactory,
                                                       plain_users: Callable[[int], list[PlainUser]]) -> None:
    """Through the daemon, as plain users (quotas.git_watches_per_uid = 100): a user whose
    workspace has 300 directories gets 100 of root's watches, and a repository its command plants
    in a directory the daemon does not watch is neutralised after the call (the walk); another
    user's 20-directory workspace is watched whole and its plant neutralised too. Control: with the
    default budget (a sixteenth of fs.inotify.max_user_watches) the first user's tree is watched whole."""
    big_user, small_user = plain_users(2)
    daemon = sandboxd_daemon(config="[quotas]\ngit_watches_per_uid = 100\n")
    (big_session, big), (small_session, small) = sessions_on_trees(daemon, [big_user, small_user], [300, 20])
    watched = watched_inodes(daemon.pid)
    big_dirs, small_dirs = directory_inodes(big), directory_inodes(small)
    assert len(watched & set(big_dirs)) == 100, len(watched & set(big_dirs))
    assert set(small_dirs) <= watched
    target = next(path for inode, path in big_dirs.items() if inode not in watched and path.parent.name == "many")
    for user, session, where in ((big_user, big_session, target), (small_user, small_session, small / "many" / "d0003")):
        seen = run_client_as(user.uid, user.gid, daemon.socket, PLANT, {"session": session, "plant": str(where)})
        assert seen == {"exit": [0], "neutralized": ["core.fsmonitor"]}, (user, seen)
        assert "fsmonitor" not in (where / "sub" / ".git" / "config").read_text()
    control = sandboxd_daemon(socket=sandboxd_daemon.base / "control" / "sandboxd.sock")
    [(session, big)] = sessions_on_trees(control, [big_user], [300])
    try:
        assert set(directory_inodes(big)) <= watched_inodes(control.pid)
    finally:
        control.stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=60)


# -- one owner's file churn costs only that owner (round 4's second hostile pass, finding 10) ------

# As the attacker: a command in its session that creates and removes a file in its workspace as fast
# as it can (two events each on the workspace's watch) until the test drops ``stop`` there; every
# 4096 cycles it writes how many it has done into ``progress`` (in place: no event the guard watches).
CHURN = r'''
script = ("import os\n"
          "progress = os.open('progress', os.O_CREAT | os.O_WRONLY, 0o600)\n"
          "n = 0\n"
          "while n % 4096 or not os.path.exists('stop'):\n"
          "    os.close(os.open('f', os.O_CREAT | os.O_WRONLY, 0o600)); os.unlink('f'); n += 1\n"
          "    if not n % 4096: os.pwrite(progress, str(n).encode().ljust(20), 0)\n"
          "print(n)\n")
out, status = run(ARGS["session"], ["python3", "-c", script])
print(json.dumps({"cycles": int(out.split()[-1]), "status": status}))
'''

# As the victim: one Exec of `true`; its seconds.
CALL = r'''
import time
began = time.monotonic()
out, status = run(ARGS["session"], ["true"])
print(json.dumps({"seconds": time.monotonic() - began, "status": status}))
'''
VICTIM_CALLS = 4


def lost_events(daemon: Daemon, session: str) -> int:
    """How many of ``session``'s inspections the daemon logged as having lost inotify events."""
    text = daemon.log_path.read_text(errors="replace")      # all of it (``log`` is its tail)
    return text.count(f"session {session}: git guard: inotify events were lost")


def churned(workspace: Path) -> int:
    """The attacker's cycles so far (each two events on its workspace's watch)."""
    try:
        return int((workspace / "progress").read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.parametrize("instances", [0, 1], ids=["an-instance-per-owner", "control-one-shared"])
def test_one_users_file_churn_makes_nobody_else_walk(instances: int, sandboxd_daemon: DaemonFactory,
                                                     plain_users: Callable[[int], list[PlainUser]]) -> None:
    """The pass's reproduction: the attacker's sandbox creates and removes a file in a loop while the
    victim, whose workspace has 2,000 directories, runs `true` now and then: before each of its calls
    the attacker has made more events than an inotify queue holds (fs.inotify.max_queued_events) since
    the victim's last call ended, whatever the machine's load. Each guard's inspection after a call
    reads its queue: with the default (an instance per owner) the victim's never lost an event, so its
    guard looked only where events fired; the attacker's own queue overflowed (its inspection after the
    churn looked at everything: the attack happened). The control (quotas.git_inotify_instances = 1,
    everyone on one queue, as before): every inspection of the victim's lost events and walked its
    whole tree. The victim's call times are printed, never asserted."""
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        enough = int(f.read()) // 2 + 4096                # cycles that overflow a queue nobody drains
    attacker, victim = plain_users(2)
    daemon = sandboxd_daemon(config=f"[quotas]\ngit_inotify_instances = {instances}\n[log]\nlevel = \"debug\"\n")
    (churner, churn_ws), (victims, _victim_ws) = sessions_on_trees(daemon, [attacker, victim], [0, 2000])
    churn: dict[str, object] = {}
    thread = threading.Thread(target=lambda: churn.update(run_client_as(
        attacker.uid, attacker.gid, daemon.socket, CHURN, {"session": churner}, timeout=900)), daemon=True)
    thread.start()
    seconds = []
    try:
        mark = 0
        for _ in range(VICTIM_CALLS):
            assert eventually(lambda: churned(churn_ws) >= mark + enough or not thread.is_alive(), 300), churn
            call = run_client_as(victim.uid, victim.gid, daemon.socket, CALL, {"session": victims})
            assert call["status"] == 0, call
            seconds.append(call["seconds"])
            mark = churned(churn_ws)
    finally:
        (churn_ws / "stop").touch()
        thread.join(120)
        for session in (churner, victims):             # before the users go
            daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=120)
    seconds.sort()
    print(f"\ninstances {instances}: the attacker's churn {churn}; the victim's Exec true: p50 "
          f"{seconds[len(seconds) // 2] * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms; inspections that lost "
          f"events: victim {lost_events(daemon, victims)}, attacker {lost_events(daemon, churner)}")
    assert churn.get("status") == 0, churn
    assert lost_events(daemon, churner) >= 1, "the churn never overflowed the attacker's queue"
    if instances == 1:
        # Each of the victim's calls (and, under load, an inspection more: its session's close) lost events.
        assert lost_events(daemon, victims) >= VICTIM_CALLS, "the control: on a shared queue the victim lost events"
    else:
        assert lost_events(daemon, victims) == 0, daemon.log()[-3000:]
