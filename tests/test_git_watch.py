"""One inotify instance for every git guard of a daemon (gitguard/watch.py), against the real
kernel: past fs.inotify.max_user_instances sessions (128 for root) a guard with an instance of
its own had none and walked its whole tree after every call."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sandboxd.gitguard.guard import GitGuard
from sandboxd.gitguard.watch import InotifyHub

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


def test_an_overflow_of_the_shared_queue_is_every_guards(base_dir: Path) -> None:
    """More events than the kernel queues (fs.inotify.max_queued_events): every subscription is
    told it lost events (its guard then looks at everything), not only the one that drained."""
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())
    hub = InotifyHub()
    busy, quiet = hub.subscribe(), hub.subscribe()
    (base_dir / "quiet").mkdir()
    fd, quiet_fd = open_dir(base_dir), open_dir(base_dir / "quiet")
    try:
        busy.watch_fd(fd)
        quiet.watch_fd(quiet_fd)
        (base_dir / "a").write_text("")
        for i in range(limit // 2 + 10):               # two events each (moved from, moved to)
            os.rename(base_dir / "ab"[i % 2], base_dir / "ba"[i % 2])
        assert busy.drain()[1] is True
        assert quiet.drain()[1] is True
        assert quiet.drain() == (set(), False)
    finally:
        os.close(fd)
        os.close(quiet_fd)
        busy.close()
        quiet.close()
        hub.close()
