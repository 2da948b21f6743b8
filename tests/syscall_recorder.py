"""A recording fake of the kernel (the youki technique): a ``Syscalls`` (sandboxd/kernel/syscalls.py)
that writes one line per call instead of making it, so the ORDER of a setup sequence is tested
without root. It never claims that anything is blocked: the walls are tested against the real
kernel elsewhere. Its lookups answer from ``tree``, a model of the host ({path: "dir" | "file" |
"link:TARGET"}): under rootfs.NEW_ROOT, the bound copy of it.

Calls that hand back a descriptor (clone_tree, a seccomp listener) get a fresh one of /dev/null,
which the code under test closes as it would the real one. ``fork`` returns 0: the recording
follows the child, whose steps come next. ``execve`` records, then calls ``on_exec`` (a forked test
child writes its record there and ends).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from sandboxd.kernel import mounts, namespaces
from sandboxd.kernel.syscalls import Syscalls
from sandboxd.launcher import rootfs

_MS_FLAGS = ((mounts.MS_RDONLY, "ro"), (mounts.MS_NOSUID, "nosuid"), (mounts.MS_NODEV, "nodev"),
             (mounts.MS_NOEXEC, "noexec"))
_ATTRS = ((mounts.MOUNT_ATTR_RDONLY, "ro"), (mounts.MOUNT_ATTR_NOSUID, "nosuid"),
          (mounts.MOUNT_ATTR_NODEV, "nodev"), (mounts.MOUNT_ATTR_NOEXEC, "noexec"))


def _names(flags: int, table: tuple[tuple[int, str], ...]) -> str:
    return ",".join(name for bit, name in table if flags & bit)


class _Entry:
    """What os.scandir yields, for a path of the model."""

    def __init__(self, parent: str, name: str, kind: str) -> None:
        self.name, self.path, self._kind = name, f"{parent}/{name}", kind

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._kind == "dir"

    def is_symlink(self) -> bool:
        return self._kind.startswith("link:")


class SyscallRecorder(Syscalls):
    def __init__(self, tree: dict[str, str], on_exec: Callable[[], None] | None = None) -> None:
        self.calls: list[str] = []
        self.tree = tree
        self.on_exec = on_exec

    def numbered(self) -> str:
        return "\n".join(f"{index:3}. {call}" for index, call in enumerate(self.calls, 1))

    def _record(self, line: str) -> None:
        self.calls.append(line)

    @staticmethod
    def _descriptor() -> int:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    # -- the model's answers ------------------------------------------------------------------

    def _kind(self, path: str, follow: bool = True) -> str | None:
        host = path[len(rootfs.NEW_ROOT):] or "/" if path.startswith(rootfs.NEW_ROOT + "/") else path
        kind = self.tree.get(host.rstrip("/") or "/")
        for _ in range(8):
            if not follow or kind is None or not kind.startswith("link:"):
                break
            kind = self.tree.get(kind[5:])
        return kind

    def lexists(self, path: str) -> bool:
        return self._kind(path, follow=False) is not None

    def isdir(self, path: str) -> bool:
        return self._kind(path) == "dir"

    def isfile(self, path: str) -> bool:
        return self._kind(path) == "file"

    def islink(self, path: str) -> bool:
        return (self._kind(path, follow=False) or "").startswith("link:")

    def ismount(self, path: str) -> bool:
        return False

    def readlink(self, path: str) -> str:
        return (self._kind(path, follow=False) or "link:")[5:]

    def scandir(self, path: str) -> list[_Entry]:
        host = path[len(rootfs.NEW_ROOT):] if path.startswith(rootfs.NEW_ROOT + "/") else path
        return [_Entry(path, child[len(host) + 1:], kind) for child, kind in sorted(self.tree.items())
                if child.startswith(host + "/") and "/" not in child[len(host) + 1:]]

    def is_dir_fd(self, fd: int) -> bool:
        return True

    # -- the recorded calls -------------------------------------------------------------------

    def make_private(self, path: str = "/") -> None:
        self._record(f"make-rprivate {path}")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int,
              data: str | None = None, *, step: str | None = None) -> None:
        what = "remount" if flags & mounts.MS_REMOUNT else f"mount {fstype}"
        self._record(f"{what} {target} {_names(flags, _MS_FLAGS)}".rstrip())

    def bind(self, source: str, target: str, *, recursive: bool = True,
             step: str | None = None) -> None:
        self._record(f"bind {source} -> {target}" + ("" if recursive else " (one mount)"))

    def tmpfs(self, target: str, *, size: int, mode: int = 0o755,
              flags: int = mounts.MS_NOSUID | mounts.MS_NODEV, step: str | None = None) -> None:
        self._record(f"mount tmpfs {target} {_names(flags, _MS_FLAGS)}")

    def set_attrs_recursive(self, target: str, attr_set: int, attr_clr: int = 0,
                            *, step: str) -> None:
        cleared = f" -{_names(attr_clr, _ATTRS)}" if attr_clr else ""
        self._record(f"setattr -R {target} +{_names(attr_set, _ATTRS)}{cleared}")

    def clone_tree(self, fd: int, *, step: str, path: str | None = None) -> int:
        self._record(f"open_tree {path}")
        return self._descriptor()

    def attach_tree(self, tree: int, target: str, *, step: str) -> None:
        self._record(f"move_mount {target}")

    def open_dir_path(self, path: str, *, step: str) -> int:
        self._record(f"open {path}")
        return self._descriptor()

    def mount_overlay(self, target: str, *, lower_fd: int, upper_fd: int, work_fd: int, userxattr: bool,
                      shown: str, checkpoint_fds: tuple[int, ...] = ()) -> None:
        self._record(f"mount overlay {target} nosuid,nodev" + (" userxattr" if userxattr else "")
                     + (f" checkpoints={len(checkpoint_fds)}" if checkpoint_fds else ""))

    def pivot_root_here(self, new_root: str) -> None:
        self._record(f"pivot_root {new_root}")

    def unshare(self, flags: int) -> None:
        self._record(f"unshare {namespaces.describe(flags)}")

    def setns(self, fd: int, flags: int) -> None:
        self._record(f"setns {namespaces.describe(flags)}")

    def set_hostname(self, name: str) -> None:
        self._record(f"sethostname {name}")

    def bring_up_loopback(self) -> None:
        self._record("loopback up")

    def chdir(self, path: str) -> None:
        self._record(f"chdir {path}")

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._record(f"mkdir {path}")

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        self._record(f"mkdir -p {path}")

    def create_file(self, path: str, mode: int) -> None:
        self._record(f"create {path}")

    def write_file(self, path: str, text: str, mode: int) -> None:
        self._record(f"write {path}")

    def write_concatenated(self, path: str, source: str, extra: str, mode: int, *, limit: int, step: str) -> None:
        self._record(f"write {path} <- {source} + {len(extra)} bytes")

    def symlink(self, source: str, link: str) -> None:
        self._record(f"symlink {link} -> {source}")

    def chown(self, path: str, uid: int, gid: int) -> None:
        self._record(f"chown {path} {uid}:{gid}")

    def die_with_parent(self, expected_parent: int) -> None:
        self._record(f"pdeathsig, parent {expected_parent}")

    def join_cgroups(self, dirs: list[str], pid: int = 0) -> None:
        self._record(f"join cgroups {' '.join(dirs)}")

    def set_child_subreaper(self) -> None:
        self._record("child subreaper")

    def declare_ptracer(self, tracer: int) -> None:
        self._record(f"ptracer {tracer}")

    def set_title(self, title: str) -> None:
        self._record(f"title {title}")

    def drop_privileges(self, uid: int, gid: int, groups: tuple[int, ...] = (),
                        *, keep_groups: bool = False) -> None:
        self._record(f"drop privileges to {uid}:{gid}" + (" (groups kept)" if keep_groups else ""))

    def set_dumpable(self, flag: bool) -> None:
        self._record(f"dumpable {int(flag)}")

    def new_session(self) -> None:
        self._record("setsid")

    def apply_rlimits(self, *, cpu_seconds: int | None, open_files: int | None) -> None:
        self._record(f"rlimits cpu={cpu_seconds} files={open_files}")

    def verify_dropped(self) -> None:
        self._record("verify dropped")

    def restrict_writes(self, writable: list[str], file_writes_only: list[str],
                        *, forced_abi: int = 0) -> int:
        self._record(f"landlock writes {' '.join(writable)}; files {' '.join(file_writes_only)}")
        return 6

    def cloexec_from(self, first: int = 3, *, use_close_range: bool = True) -> bool:
        self._record(f"close-on-exec from {first}")
        return False

    def load_seccomp(self, program: bytes, *, new_listener: bool = False) -> int:
        self._record("seccomp" + (" with listener" if new_listener else ""))
        return self._descriptor() if new_listener else -1

    def prefer_for_oom_kill(self) -> None:
        self._record("oom score adj")

    def hold_signals(self) -> None:
        self._record("hold forwarded signals")

    def default_signals(self) -> None:
        self._record("default signals")

    def fork(self) -> int:
        self._record("fork")
        return 0

    def execve(self, path: str, argv: list[str], env: dict[str, str]) -> None:
        self._record(f"execve {path}")
        if self.on_exec is not None:
            self.on_exec()
