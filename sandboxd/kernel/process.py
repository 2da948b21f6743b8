"""Per-process attributes of a sandboxed child: death signal, session, descriptors."""

from __future__ import annotations

import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch

from sandboxd.kernel._libc import checked, from_oserror, libc, prctl, raw_syscall

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PTRACER = 0x59616D61          # "Yama"
CLOSE_RANGE_CLOEXEC = 4


def die_with_parent(expected_parent: int) -> None:
    """Get SIGKILL when the parent dies; cover the race where it already has.

    Must be called again after any credential change: the kernel clears the
    parent-death signal when the effective uid/gid or capabilities change.
    """
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, step="prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != expected_parent:
        os._exit(137)


def set_dumpable(flag: bool) -> None:
    prctl(PR_SET_DUMPABLE, 1 if flag else 0, step="prctl(PR_SET_DUMPABLE)")


def set_child_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1, step="prctl(PR_SET_CHILD_SUBREAPER)")


def declare_ptracer(tracer: int) -> None:
    """Let ``tracer`` (a pid of this process's PID namespace) and its descendants pass Yama's
    ptrace_scope 1 check on this process, as its ancestors do (the other ptrace checks, same uid
    and dumpable, still apply). For this process only: neither its children nor a process it
    forks inherits it; an exec keeps it. A kernel without Yama has nothing to declare (EINVAL)."""
    import ctypes

    result = libc.prctl(ctypes.c_int(PR_SET_PTRACER), ctypes.c_ulong(tracer), ctypes.c_ulong(0),
                        ctypes.c_ulong(0), ctypes.c_ulong(0))
    if result < 0 and ctypes.get_errno() != errno.EINVAL:
        checked(result, "prctl(PR_SET_PTRACER)")


def set_name(name: str) -> None:
    """This thread's name (``comm``: ps, top, /proc/PID/comm), its first 15 bytes."""
    import ctypes
    # A buffer held until the call returns: the kernel copies the name from it. (A pointer taken from
    # a temporary c_char_p pointed at freed memory by the time prctl read it: the name came out empty.)
    name_buffer = ctypes.create_string_buffer(name.encode()[:15])
    prctl(PR_SET_NAME, ctypes.addressof(name_buffer), step="prctl(PR_SET_NAME)")


def set_title(title: str) -> None:
    """Name this process and overwrite its command line in place, so a sandbox helper's
    /proc/PID/cmdline shows nothing of the command line it was forked from.

    Writes over the argv area (found in /proc/self/stat) through /proc/self/mem,
    as setproctitle(3) does. (psutil has no arg_start/arg_end to find it by.)
    """
    set_name(title)
    with open("/proc/self/stat", "rb") as stat_file:
        fields = stat_file.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])      # arg_start, arg_end (fields 48, 49)
    if end <= start:
        return
    data = title.encode()[: end - start - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(data.ljust(end - start, b"\0"))


def cloexec_from(first: int = 3, *, use_close_range: bool = True) -> bool:
    """Mark every descriptor >= ``first`` close-on-exec, so exec leaves only 0-2 open.

    close_range(2) with CLOSE_RANGE_CLOEXEC does it in one call (5.11); older
    kernels (and ``use_close_range=False``, for tests) get a walk over /proc/self/fd,
    and a descriptor that cannot be marked fails the launch (sandboxd_call.c does the same).
    Returns whether the walk was taken.
    """
    if use_close_range and raw_syscall("close_range", first, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC) == 0:
        return False
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd >= first:
            try:
                os.set_inheritable(fd, False)
            except OSError as exc:
                if exc.errno != errno.EBADF:              # the listing's own descriptor, closed by now
                    raise
    return True


def close_all_except(keep: set[int]) -> None:
    """Close every descriptor not in ``keep`` (used by long-lived helpers inside the sandbox)."""
    low = 0
    for fd in sorted(keep):
        if fd > low and raw_syscall("close_range", low, fd - 1, 0) != 0:
            os.closerange(low, fd)
        low = fd + 1
    if raw_syscall("close_range", low, 0xFFFFFFFF, 0) != 0:
        os.closerange(low, 65536)


def descendants() -> list[int]:
    """Every living (or zombie) descendant of the caller, from the parent links in /proc/*/stat.

    (/proc/PID/task/TID/children would be cheaper, but needs CONFIG_PROC_CHILDREN,
    which not every kernel has; this project's CI kernel does not.)
    """
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found: list[int] = []
    pending = [os.getpid()]
    while pending:
        kids = children.get(pending.pop(), [])
        found.extend(kids)
        pending.extend(kids)
    return found


def descriptor_targets(pid: int | str) -> list[str]:
    """What each open descriptor of ``pid`` names (``socket:[INODE]`` for a socket); OSError when
    its descriptors may not be listed (gone, another user's, not dumpable)."""
    directory = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        targets = []
        for name in os.listdir(directory):
            try:
                targets.append(os.readlink(name, dir_fd=directory))
            except OSError:
                continue                  # closed meanwhile
        return targets
    finally:
        os.close(directory)


def held_sockets(first: int = 0) -> "Iterator[tuple[int, int, int]]":
    """(pid, descriptor, socket inode) of each socket held open by the processes /proc lists, other
    than the caller: in a sandbox's init, whose /proc is its PID namespace's, the sandbox's
    processes. ``first``'s come first (a server keeps its process), and each socket once. Only the
    processes whose descriptors the caller may read count (its own user's dumpable ones): one that
    made itself non-dumpable is not seen, which refuses, never allows. The cost grows with the
    descriptors of the namespace's processes: the sandbox's own to inflate."""
    me, seen = os.getpid(), set()
    pids = [first] if first > 0 and first != me else []
    pids += (int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) not in (me, first))
    for pid in pids:
        try:
            directory = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue                      # gone, or not ours to read
        try:
            names = os.listdir(directory)
            for name in names:
                try:
                    target = os.readlink(name, dir_fd=directory)
                except OSError:
                    continue              # closed meanwhile
                if target.startswith("socket:[") and target not in seen:
                    seen.add(target)
                    yield pid, int(name), int(target[len("socket:["):-1])
        except OSError:
            continue
        finally:
            os.close(directory)


def kill_descendants(*, reap: bool = False) -> None:
    """SIGKILL the caller's whole subtree. With ``reap``, also collect the dead, repeating until
    no child is left (a child subreaper inherits every orphan of its tree, so nothing escapes)."""
    if not _has_children():
        return  # every descendant descends from a child: none, so no /proc walk
    for _ in range(1000):
        victims = descendants()
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not reap:
            return
        try:
            while os.waitpid(-1, 0)[0] > 0:
                pass
        except ChildProcessError:
            pass


def _has_children() -> bool:
    """Whether the caller has any child, living or zombie (WNOWAIT: nothing is reaped)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def new_session() -> None:
    """setsid(): no controlling terminal, so TIOCSTI cannot push keystrokes into the caller's shell."""
    try:
        os.setsid()
    except OSError as exc:
        checked(-(exc.errno or 1), "setsid")


# What a process standing between a caller and a command (a sandbox's init, a call's init, a
# rootless launch's outer process) passes down, like tini: termination and job control.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT)


# A session call's bias for the OOM killer (its supervisor's, which its command inherits), above the
# 0 of the session's init: a command that runs its group's memory out is what the kernel takes, also
# when a second kill comes before the first one's memory is freed (under load it took a session's
# init, and the session with it). Raising it needs no privilege, but the file must be writable to
# the process: set before the privilege drop (after it, a non-dumpable process's /proc entries are
# root's).
COMMAND_OOM_SCORE_ADJ = 500
OOM_SCORE_ADJ_PATH = "/proc/self/oom_score_adj"


def prefer_for_oom_kill() -> None:
    """This process (a call's supervisor) and what it forks go first when the group runs out of memory."""
    try:
        fd = os.open(OOM_SCORE_ADJ_PATH, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(COMMAND_OOM_SCORE_ADJ).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise from_oserror(exc, "oom_score_adj", OOM_SCORE_ADJ_PATH) from None


def hold_forwarded_signals() -> None:
    """Block FORWARDED_SIGNALS: held across a fork until the forwarding to the child exists
    (``forward_signals_to`` then ``release_forwarded_signals``); the child's ``default_signals``
    clears what it inherited."""
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)


def release_forwarded_signals() -> None:
    """Unblock FORWARDED_SIGNALS: one that came while they were held is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)


def default_signals() -> None:
    """A command's start: the forwarded signals' default actions, and nothing held (as the C
    helper's empty mask), so one that came while its parent held them reaches it."""
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def forward_signals_to(target: int) -> None:
    """Pass FORWARDED_SIGNALS that reach this process on to ``target`` (gone: ignored)."""
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
