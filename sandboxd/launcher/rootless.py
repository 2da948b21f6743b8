"""Rootless launches: what differs when `sandboxd run` is started by a plain user.

A plain user cannot unshare a PID namespace or mount anything in the host's namespaces, so the
spawner's child (the *outer* process) first enters a user namespace of its own that maps the
caller's uid and gid to themselves (kernel.userns), unshares the PID namespace there and forks
init, which then builds the sandbox exactly as for root (launcher.sequence): every namespace and
mount it makes is owned by that user namespace. The outer process stays outside the new PID
namespace (nothing inside can see it), drops every capability it had in the user namespace, and
only forwards signals to init and mirrors init's end, so the spawner sees one child as before.

The workspace and writable roots were opened and checked in the host's mount namespace, whose
descriptors open_tree cannot clone from ours; ``clone_roots`` re-opens each by its real path in
the sandbox's fresh mount namespace, refuses it unless it is the very file that was checked, and
clones that.
"""

from __future__ import annotations

import _socket
import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch

from sandboxd.errors import SetupError
from sandboxd.kernel import caps, mounts, namespaces, process, userns
from sandboxd.launcher.init_loop import send_fd
from sandboxd.launcher.plan import LaunchPlan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, NoReturn



def run_outer(plan: LaunchPlan, spawner: int, init: "Callable[[], object]") -> "NoReturn":
    """The outer process of a rootless launch (see the module's text). ``init`` runs in the forked
    child, PID 1 of the new PID namespace, and never returns. Failures before the fork raise (the
    caller reports them); afterwards this process ends the way init ended."""
    # Writing our own uid_map needs our /proc files to be ours: a `sandboxd run --credential` made
    # itself non-dumpable (cli.run_credentials), and this fork inherited that; it holds no secret
    # (they are read after it, or kept where no fork gets them).
    process.set_dumpable(True)
    userns.enter_own(plan.uid, plan.gid)
    process.die_with_parent(spawner)                  # entering a user namespace cleared the death signal
    namespaces.unshare(namespaces.CLONE_NEWPID)       # applies to the next child: init
    # A signal sent to `sandboxd run` from now on is forwarded to init, even one that comes before
    # the handlers below exist (under load, the command can be up and printing by then): held
    # blocked across the fork, delivered to the handlers once they are in place. Init keeps them
    # held until its own forwarding to the command exists (sequence._run_init).
    process.hold_forwarded_signals()
    try:
        init_pid = os.fork()
    except OSError as exc:
        process.release_forwarded_signals()
        raise SetupError("fork", exc.errno or 0, hint="the system is out of processes or memory") from None
    if init_pid == 0:
        init()
        os._exit(125)                                 # init never returns; this is belt and braces
    # Nothing of the launch's pipes may stay open here: EOF on the report pipe means "started".
    process.close_all_except(set())
    caps.drop_privileges(plan.uid, plan.gid, keep_groups=True)
    process.die_with_parent(spawner)
    # Not readable by the user's other processes (/proc/PID/mem, ptrace): it runs as that user,
    # and its memory is a copy of `sandboxd run`'s (its CA's key, for one).
    process.set_dumpable(False)

    process.forward_signals_to(init_pid)
    process.release_forwarded_signals()               # held by `sandboxd run` too
    _, status = os.waitpid(init_pid, 0)               # PEP 475: retried after each forwarded signal
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status))


def clone_roots(trees: dict[str, int]) -> None:
    """Replace the host-namespace descriptors in ``trees`` (a plan's root_trees, by real path) by
    clones made here (see the module's text). Call in the sandbox's new mount namespace before
    anything is mounted over the roots' paths (a root under /tmp is hidden once the private /tmp
    is there)."""
    for real, source in list(trees.items()):
        checked = os.fstat(source)
        try:
            here = os.open(real, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SetupError("reopen workspace or writable root", exc.errno or errno.EIO, real) from None
        try:
            found = os.fstat(here)
            if (found.st_dev, found.st_ino) != (checked.st_dev, checked.st_ino):
                raise SetupError("reopen workspace or writable root", errno.ESTALE, real,
                                 detail="the path was replaced while the sandbox was being set up")
            tree = mounts.clone_tree(here, step="clone workspace or writable root", path=real)
        finally:
            os.close(here)
        os.close(source)
        trees[real] = tree


def hand_over_proxy_listener(plan: LaunchPlan) -> None:
    """Rootless --allow-domain: listen on the sandbox's 127.0.0.1:proxy_port and send that socket
    to `sandboxd run`, which serves the egress proxy on it (network.loopback_proxy). Called by
    init in the new network namespace, before the command exists: its first request finds the
    proxy there, and no command can take the port first."""
    if plan.proxy_sink_fd < 0:
        return
    sink = _socket.socket(fileno=plan.proxy_sink_fd)
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        listener.bind(("127.0.0.1", plan.proxy_port))
        listener.listen(1024)
        send_fd(sink, listener.fileno())
    except OSError as exc:
        raise SetupError("egress proxy", exc.errno or errno.EIO, f"127.0.0.1:{plan.proxy_port}") from None
    finally:
        listener.close()
        sink.close()
