"""The daemon's start-up and watch helpers (service.daemon puts them together): its log lines,
what of it sandboxes must not see, the self-test, the sweep of sockets and self-test workspaces
left by killed daemons, and the watch on the fork server. (Its descriptor limit: kernel.rlimits.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING

from sandboxd import defaults
from sandboxd.printable import printable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import ExitStack

    from sandboxd.policy.session_defaults import SessionDefaults
    from sandboxd.service.sessions.lifecycle import OwnPlaces
    from sandboxd.supervisor.fork_client import ForkServer


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line. json.dumps escapes every control character and (ensure_ascii, its
    default) everything past ASCII: a caller's string in a message or a field stays in its quotes."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
                "logger": record.name}
        line.update(getattr(record, "fields", {}))
        return json.dumps(line)


class TextLogFormatter(logging.Formatter):
    """`sandboxd LEVEL: message (key=value ...)`, one line a record. The message and each field are
    printable: a caller's string in them (a path the git guard names, an error quoting a request)
    cannot start a line of its own, nor act on the terminal that reads the log."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{key}={printable(str(value))}" for key, value in getattr(record, "fields", {}).items())
        return (f"sandboxd {record.levelname.lower()}: {printable(record.getMessage())}"
                + (f" ({fields})" if fields else ""))


def make_own_directories(socket_path: str, undo: "ExitStack") -> str:
    """The daemon's directories beside its socket, made (or checked to be root's) before anything
    is served: in a shared directory its own one named after the socket (defaults.own_dir) first,
    then its private directory with the front door's relay directory, the approval channels'
    directory and their registry; else the socket's directory must be root's alone. A name another
    user took first stops the start with socket_files.PlaceTaken, nothing changed there; what this start made is removed again (while
    empty) by ``undo`` if a later step fails. Returns the private directory."""
    from sandboxd.network.socket_files import check_socket_directory, own_directory

    base = os.path.dirname(os.path.abspath(socket_path))
    os.makedirs(base, mode=0o755, exist_ok=True)
    private, channels = defaults.private_dir(socket_path), defaults.channels_dir(socket_path)
    shared = defaults.own_dir(socket_path)
    if shared is None:
        check_socket_directory(base)
    places = [] if shared is None else [(shared, 0o755, "this daemon's directory beside its socket")]
    places += [(private, 0o700, "this daemon's private directory"),
               (os.path.join(private, "relay"), 0o700, "the front door's relay directory"),
               (channels, 0o755, "the approval channels' directory"),
               (defaults.channel_registry(socket_path), 0o755, "the registry of approval channels")]
    for path, mode, role in places:
        if own_directory(path, mode, role=role):
            undo.callback(_remove_if_empty, path)
    return private


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def own_places(socket_path: str, backend: str, state_dir: str, tls_address: str,
               metrics_listen: str) -> "OwnPlaces":
    """What of this daemon every sandbox must not see or reach (sessions.OwnPlaces)."""
    from sandboxd.service.sessions.registry import OwnPlaces

    listeners = tuple(address for address in (tls_address, metrics_listen) if address)
    return OwnPlaces(hidden=(*defaults.daemon_hidden_paths(socket_path), os.path.abspath(state_dir)),
                     sockets=(os.path.abspath(socket_path), backend), listeners=listeners,
                     channels=(defaults.channel_registry(socket_path),))


SELF_TEST_DIR = "/var/tmp"
SELF_TEST_PREFIX = "sandboxd-selftest-"
# A self-test's workspace is locked (flock) an instant after it is made: one nobody holds is a dead
# daemon's only once it is older than this.
SELF_TEST_LOCK_GRACE = 60.0


@contextlib.contextmanager
def _self_test_workspace(directory: str = SELF_TEST_DIR) -> "Iterator[str]":
    """An empty directory in ``directory`` for the self-test, locked (flock) while it is used, removed afterwards.
    The lock, not the pid in its name, says its daemon lives: the kernel drops it when the daemon
    dies, and every daemon sharing /var/tmp sees it, whatever its PID namespace (a container's
    daemon saw a host daemon's pid as dead and removed its workspace mid-test)."""
    import fcntl
    import tempfile

    workspace = tempfile.mkdtemp(prefix=f"{SELF_TEST_PREFIX}{os.getpid()}-", dir=directory)
    held = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)    # 0700 and root's: only another daemon's sweep can hold it, an instant
        yield workspace
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(workspace)
        os.close(held)


def _sweep_self_test_workspaces(directory: str = SELF_TEST_DIR) -> None:
    """The empty workspaces of self-tests (in ``directory``) whose daemon was killed mid-test (SIGKILL
    skips the ``finally``): those nobody holds locked, made more than SELF_TEST_LOCK_GRACE seconds ago."""
    import fcntl

    now = time.time()
    for name in os.listdir(directory):
        if not name.startswith(SELF_TEST_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < SELF_TEST_LOCK_GRACE:
                continue                                   # may be between its making and its lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its daemon lives
            os.rmdir(path)                                 # only an empty directory
        except OSError:
            pass
        finally:
            os.close(fd)


def self_test(fork: "ForkServer", session_defaults: "SessionDefaults | None" = None,
              directory: str = SELF_TEST_DIR) -> str | None:
    """Launch `true` in a read-only sandbox with a memory and a pids limit through the fork server:
    the whole set-up sequence (cgroups, namespaces, mounts, pivot_root, privileges, Landlock,
    seccomp). A machine where limits cannot be applied fails here, at start-up, with the fix,
    not at a user's first limited call. The problem, or None. Its workspace is made in
    ``directory``, which the fork server must see at the same path: an attached supervisor a
    replaced pod left lives in that pod's mount namespace, where this container's /var/tmp is
    not (the daemon's private directory, on the socket's hostPath, is where both see it)."""
    from sandboxd.errors import SandboxdError
    from sandboxd.policy import LaunchSpec, Limits, ReadOnly

    _sweep_self_test_workspaces(directory)
    limits = Limits(memory_bytes=64 << 20, pids=16)
    if session_defaults is not None:          # the caps of all sandboxes together: in place from start-up
        limits = limits.replace(total_pids=session_defaults.total_pids,
                                total_memory_bytes=session_defaults.total_memory_bytes)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        with _self_test_workspace(directory) as workspace:
            call = fork.launch(LaunchSpec(argv=("true",), workspace=workspace, policy=ReadOnly(),
                                          limits=limits, env={"PATH": "/usr/bin:/bin"}), (null, null, null))
            info = fork.wait(call)
        return None if info.exit_code == 0 else f"`true` in a sandbox ended with status {info.shell_status}"
    except SandboxdError as exc:
        return str(exc)
    finally:
        os.close(null)


def sweep_private_dir(private: str) -> list[str]:
    """Remove the gRPC sockets (``grpc-<pid>.sock``) that daemons SIGKILLed earlier left in
    ``private``: those whose pid is dead. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(private)
    except OSError:
        return removed
    for name in names:
        pid = name[len("grpc-"):-len(".sock")] if name.startswith("grpc-") and name.endswith(".sock") else ""
        if not pid.isdigit() or (int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}")):
            continue
        try:
            os.unlink(os.path.join(private, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


# A fork server that keeps dying is not fixed by restarting it: past this many deaths in
# RESTART_WINDOW seconds the daemon exits non-zero and leaves it to the service manager.
MAX_FORK_RESTARTS = 5
RESTART_WINDOW = 60.0


class ForkWatch:
    """The daemon's watch on its fork server, by pidfd: ``died`` wakes the moment it exits."""

    def __init__(self, fork: "ForkServer", wake_fd: int = -1) -> None:
        self._fork = fork
        self._restarts: list[float] = []
        self._pidfd = -1
        self._wake_fd = wake_fd            # signal.set_wakeup_fd's pipe: a stop signal wakes died()
        self.rearm()

    def rearm(self) -> None:
        """Watch the fork server now running (after a start or restart)."""
        import select

        self.close()
        self._pidfd = os.pidfd_open(self._fork.pid)
        self._poller = select.poll()
        self._poller.register(self._pidfd, select.POLLIN)
        if self._wake_fd >= 0:
            self._poller.register(self._wake_fd, select.POLLIN)

    def died(self, timeout: float | None) -> str | None:
        """Wait up to ``timeout`` seconds (None: until the fork server dies or a signal comes);
        how the fork server ended if it did, else None."""
        events = self._poller.poll(None if timeout is None else int(timeout * 1000))
        if any(fd == self._wake_fd for fd, _ in events):
            try:
                while os.read(self._wake_fd, 64):
                    pass
            except BlockingIOError:
                pass
        if not any(fd == self._pidfd for fd, _ in events):
            return None
        try:                                              # WNOWAIT: the client's Popen reaps it
            result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return "ended"
        if result is None:
            return "ended"
        if result.si_code == os.CLD_EXITED:
            return f"exited with status {result.si_status}"
        return f"killed by signal {result.si_status}"

    def may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        return len(self._restarts) <= MAX_FORK_RESTARTS

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
