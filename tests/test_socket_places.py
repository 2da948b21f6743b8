"""The daemon's own places beside a socket in a shared directory (round 4's second hostile pass,
finding 11).

The attack: the daemon kept its private directory and its approval channels' directory under two
fixed names beside its socket (`.sandboxd-private`, `.sandboxd-mcp`), also when the socket sat in
/tmp, /var/tmp or /dev/shm, where any user may make a name first. A plain user's
`mkdir /var/tmp/.sandboxd-mcp` stopped `sandboxd serve --socket /var/tmp/x.sock` with a
traceback, leaving `.sandboxd-private` behind (and `.sandboxd-private` itself was made with
`makedirs(exist_ok)` and chmod'ed through whatever stood there).

Now, in a shared directory, everything of the daemon's beside the socket is in one directory named
after the socket (defaults.own_dir), made root's with the discipline of the socket files
(network.socket_files.own_directory: made, or opened without following a link and checked to be
root's; another user's name is never used nor changed). Here, as a plain user the test makes:

- the finding's reproduction (the two fixed names planted in /dev/shm) no longer stops a daemon
  there: it serves, its sandboxes see nothing of its places (the control of what follows);
- the name it does use, planted first (a directory, a link to one, a file at the socket's own
  name), makes it refuse to start with one line naming the path, its owner and the fix, exit 1,
  no traceback, nothing left of what it made, and the planted thing untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, SLOW
from daemon_helpers import Daemon, DaemonFactory, PlainUser, create_session, plain_users, run_exec, workspace_write
from sandboxd import defaults

pytestmark = pytest.mark.timeout(int(600 * SLOW))


@pytest.fixture(scope="module")
def squatter() -> Iterator[PlainUser]:
    with plain_users(1) as (user,):
        yield user


def as_user(user: PlainUser, code: str, *args: str) -> None:
    """``code`` run by ``user`` (a plain user's Python, outside any sandbox)."""
    done = subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, timeout=60 * SLOW, env=BASE_ENV,
                          user=user.uid, group=user.gid, extra_groups=[], cwd="/")
    assert done.returncode == 0, done.stderr


def remove(*paths: str) -> None:
    for path in paths:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)


def socket_in(directory: str) -> str:
    return os.path.join(directory, f"sbxt-places-{uuid.uuid4().hex[:8]}.sock")


def refused(sandboxd_daemon: DaemonFactory, socket: str, user: PlainUser, taken: str, problem: str) -> None:
    """The daemon of ``socket`` refuses to start, in one line naming ``taken``, its owner and the fix."""
    failure = sandboxd_daemon.start_failure(socket=socket)
    lines = [line for line in failure.log.splitlines() if line.startswith("sandboxd serve:")]
    assert failure.returncode == 1 and "Traceback" not in failure.log, failure.log
    assert len(lines) == 1, failure.log
    assert lines[0].startswith(f"sandboxd serve: {taken} ("), lines
    assert f"{problem} uid {user.uid} ({user.name}), not to the daemon's uid 0" in lines[0], lines
    assert f"remove it (`rm -r {taken}`)" in lines[0] and "/run/sandboxd" in lines[0], lines


def test_the_findings_planted_names_no_longer_stop_a_daemon_in_a_shared_directory(
        sandboxd_daemon: DaemonFactory, squatter: PlainUser) -> None:
    """The finding's reproduction: the fixed names another user made first in /dev/shm are not the
    daemon's any more; it serves, its places are root's and where `sandboxd run` and the connect
    broker look for them (defaults.channel_registry), and a sandbox of it sees none of them."""
    planted = [os.path.join("/dev/shm", name) for name in (defaults.CHANNELS_DIR_NAME, defaults.PRIVATE_DIR_NAME)
               if not os.path.lexists(os.path.join("/dev/shm", name))]
    socket = socket_in("/dev/shm")
    own = defaults.own_dir(socket)
    assert own is not None and own.startswith("/dev/shm/.sandboxd-sbxt-places-")
    try:
        for path in planted:
            as_user(squatter, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", path)
        daemon: Daemon = sandboxd_daemon(socket=socket)
        for path, mode in ((own, 0o755), (defaults.private_dir(socket), 0o700), (defaults.channels_dir(socket), 0o755),
                           (defaults.channel_registry(socket), 0o755)):
            st = os.lstat(path)
            assert (st.st_uid, st.st_mode & 0o7777) == (0, mode), (path, st)
        assert daemon.private == Path(own) / "private" and (daemon.private / f"grpc-{daemon.pid}.sock").exists()
        for path in planted:                                  # the planted ones: untouched, still the user's
            assert (os.lstat(path).st_uid, os.listdir(path)) == (squatter.uid, []), path
        workspace = sandboxd_daemon.workspace()
        session = create_session(daemon.stub, workspace, workspace_write())
        seen = run_exec(daemon.stub, session.id, ["/bin/sh", "-c", f"ls -A {own}; test -S {socket} || echo no-socket"])
        assert seen.stdout == b"no-socket\n", seen.describe()
        daemon.stop()
    finally:
        remove(*planted, own)


@pytest.mark.parametrize("shared", ["/var/tmp", "/tmp", "/dev/shm"])
def test_a_name_another_user_took_first_is_refused_in_one_line(sandboxd_daemon: DaemonFactory, squatter: PlainUser,
                                                               shared: str) -> None:
    """The daemon's own directory beside a socket in ``shared``, made first by another user: one
    line, exit 1, the user's directory untouched, nothing else made. Control: with that name free,
    the same command serves."""
    socket = socket_in(shared)
    own = defaults.own_dir(socket)
    assert own is not None
    try:
        daemon = sandboxd_daemon(socket=socket)             # the control
        daemon.stop()
        assert os.lstat(own).st_uid == 0
        remove(own)
        as_user(squatter, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777); "
                          "open(sys.argv[1] + '/mine', 'w').close()", own)
        refused(sandboxd_daemon, socket, squatter, own, "belongs to")
        st = os.lstat(own)
        assert (st.st_uid, st.st_mode & 0o7777, os.listdir(own)) == (squatter.uid, 0o777, ["mine"])
        assert not os.path.lexists(socket)
    finally:
        remove(own, socket)


def test_a_link_or_a_file_at_a_name_is_refused_and_never_followed(sandboxd_daemon: DaemonFactory,
                                                                  squatter: PlainUser) -> None:
    """A link planted at the daemon's directory's name (to a directory of the user's, mode 0750)
    is refused, and nothing is changed through it; a file at the socket's own name is refused the
    same way, and what the daemon made before it found out is gone again."""
    socket = socket_in("/var/tmp")
    own = defaults.own_dir(socket)
    assert own is not None
    target = f"/var/tmp/sbxt-places-target-{uuid.uuid4().hex[:8]}"
    try:
        as_user(squatter, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o750); "
                          "os.symlink(sys.argv[1], sys.argv[2])", target, own)
        refused(sandboxd_daemon, socket, squatter, own, "is not a directory: a link or file that belongs to")
        st = os.lstat(target)
        assert (st.st_uid, st.st_mode & 0o7777, os.listdir(target)) == (squatter.uid, 0o750, [])
        assert os.readlink(own) == target
        remove(own)
        as_user(squatter, "import sys; open(sys.argv[1], 'w').close()", socket)
        refused(sandboxd_daemon, socket, squatter, socket, "is not a socket: it belongs to")
        assert os.lstat(socket).st_uid == squatter.uid
        assert not os.path.lexists(own)                  # made, then removed when the socket's name was taken
    finally:
        remove(own, socket, target)


def test_a_socket_directory_others_may_write_is_refused(sandboxd_daemon: DaemonFactory, squatter: PlainUser) -> None:
    """Outside the shared directories the socket's directory is the daemon's own (its private
    sockets are there, under fixed names): a directory of another user's, or one others may write
    (root's, mode 1777, not one sandboxd knows as shared), would let them move those sockets and put
    their own in place. Refused in one line; control: the same directory root's 0755 serves."""
    directory = f"/var/tmp/sbxt-places-dir-{uuid.uuid4().hex[:8]}"
    socket = os.path.join(directory, "sandboxd.sock")
    try:
        as_user(squatter, "import os, sys; os.mkdir(sys.argv[1])", directory)
        failure = sandboxd_daemon.start_failure(socket=socket)
        assert failure.returncode == 1 and "Traceback" not in failure.log, failure.log
        assert (f"sandboxd serve: {directory} (the socket's directory, where the daemon keeps its private sockets) "
                f"belongs to uid {squatter.uid} ({squatter.name}), not to the daemon's uid 0: serve on a socket in a "
                "directory only root may write") in failure.log, failure.log
        os.chown(directory, 0, 0)
        os.chmod(directory, 0o1777)
        failure = sandboxd_daemon.start_failure(socket=socket)
        assert failure.returncode == 1 and "Traceback" not in failure.log, failure.log
        assert f"sandboxd serve: {directory} (the socket's directory, where" in failure.log, failure.log
        assert "may be written by group or others (mode 1777)" in failure.log, failure.log
        assert os.listdir(directory) == [], os.listdir(directory)
        os.chmod(directory, 0o755)
        sandboxd_daemon(socket=socket).stop()            # the control
    finally:
        remove(directory)
