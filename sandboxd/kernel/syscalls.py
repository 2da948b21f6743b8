"""The seam between a sandbox's setup steps and the kernel.

The setup sequences (launcher/sequence.py: a session's init, a call; launcher/rootfs.py: the
mount tree) make their system calls through ``current``, a ``Syscalls``: by default the real
ones, the kernel modules' functions themselves (no wrapper, no extra call). A test replaces it
with a fake that records each call instead of making it (tests/syscall_recorder.py), which
checks the ORDER of the steps without root: read-only root before the writable roots, /proc
after the mount namespace, seccomp last before exec. Order only: that a step blocks anything is
tested against the real kernel, never here.

The file-system calls the mount steps make in the new tree (mkdir, a mount point's file, a
symlink) and the lookups they decide by go through it too, so that a fake never touches the
host's /tmp and answers from a tree of its own.
"""

from __future__ import annotations

import errno
import os

from sandboxd.kernel import caps, cgroups, landlock, mounts, namespaces, netns, overlay, process, rlimits, seccomp
from sandboxd.kernel._libc import from_oserror


def _create_file(path: str, mode: int) -> None:
    """An empty file to mount over (a device node's or a file root's mount point)."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, mode))


def _write_file(path: str, text: str, mode: int) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _write_concatenated(path: str, source: str, extra: str, mode: int, *, limit: int, step: str) -> None:
    """A new file ``path`` (mode ``mode``) holding the file ``source`` followed by ``extra``
    (rootfs step 8e: the host's CA bundle and a sandbox's own certificates); a ``source`` of more
    than ``limit`` bytes is refused (EFBIG). An OSError becomes a SetupError naming ``step``, its
    errno and the path it was about."""
    at = source
    try:
        with open(source, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", source)
        at = path
        view = memoryview(b"".join((data, b"" if data.endswith(b"\n") or not data else b"\n",
                                    extra.encode("ascii"))))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, mode)
        try:
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        raise from_oserror(exc, step, at) from None


def _scandir(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as entries:
        return list(entries)


def _open_dir_path(path: str, *, step: str) -> int:
    """An O_PATH descriptor of the directory ``path`` (a symlink at its end is refused): what an
    overlay names its layers by (kernel.overlay.mount_over)."""
    try:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise from_oserror(exc, step, path) from None


def _is_dir_fd(fd: int) -> bool:
    import stat

    return stat.S_ISDIR(os.fstat(fd).st_mode)


class Syscalls:
    """Every kernel call of the setup sequences, by what it does; the real ones."""

    # Process and privileges (kernel/process.py, caps.py, rlimits.py, cgroups.py).
    die_with_parent = staticmethod(process.die_with_parent)
    hold_signals = staticmethod(process.hold_forwarded_signals)
    default_signals = staticmethod(process.default_signals)
    join_cgroups = staticmethod(cgroups.join)
    set_child_subreaper = staticmethod(process.set_child_subreaper)
    declare_ptracer = staticmethod(process.declare_ptracer)
    set_title = staticmethod(process.set_title)
    drop_privileges = staticmethod(caps.drop_privileges)
    set_dumpable = staticmethod(process.set_dumpable)
    new_session = staticmethod(process.new_session)
    apply_rlimits = staticmethod(rlimits.apply)
    prefer_for_oom_kill = staticmethod(process.prefer_for_oom_kill)
    verify_dropped = staticmethod(caps.verify_dropped)
    cloexec_from = staticmethod(process.cloexec_from)
    chdir = staticmethod(os.chdir)
    fork = staticmethod(os.fork)
    execve = staticmethod(os.execve)
    # Namespaces (kernel/namespaces.py, netns.py).
    unshare = staticmethod(namespaces.unshare)
    setns = staticmethod(namespaces.setns)
    set_hostname = staticmethod(namespaces.set_hostname)
    bring_up_loopback = staticmethod(netns.bring_up_loopback)
    # The last walls (kernel/landlock.py, seccomp.py).
    restrict_writes = staticmethod(landlock.restrict_writes)
    load_seccomp = staticmethod(seccomp.load)
    # The mount tree (kernel/mounts.py).
    make_private = staticmethod(mounts.make_private)
    mount = staticmethod(mounts.mount)
    bind = staticmethod(mounts.bind)
    tmpfs = staticmethod(mounts.tmpfs)
    set_attrs_recursive = staticmethod(mounts.set_attrs_recursive)
    clone_tree = staticmethod(mounts.clone_tree)
    attach_tree = staticmethod(mounts.attach_tree)
    pivot_root_here = staticmethod(mounts.pivot_root_here)
    mount_overlay = staticmethod(overlay.mount_over)
    open_dir_path = staticmethod(_open_dir_path)
    close = staticmethod(os.close)
    # Files made in the new tree, and the lookups the mount steps decide by.
    mkdir = staticmethod(os.mkdir)
    makedirs = staticmethod(os.makedirs)
    create_file = staticmethod(_create_file)
    write_file = staticmethod(_write_file)
    write_concatenated = staticmethod(_write_concatenated)
    symlink = staticmethod(os.symlink)
    chown = staticmethod(os.chown)
    lexists = staticmethod(os.path.lexists)
    isdir = staticmethod(os.path.isdir)
    isfile = staticmethod(os.path.isfile)
    islink = staticmethod(os.path.islink)
    ismount = staticmethod(os.path.ismount)
    readlink = staticmethod(os.readlink)
    scandir = staticmethod(_scandir)
    is_dir_fd = staticmethod(_is_dir_fd)


# What the setup sequences call. Looked up at each call (``syscalls.current.mount(...)``), so a
# test that replaces it reaches every step.
current: Syscalls = Syscalls()
