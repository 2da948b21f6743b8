"""ApplyPatch's file tool: `git apply`, all-or-nothing, inside the session's sandbox.

git checks every hunk before it writes, but then writes file by file: a write that fails part
way (a directory made immutable, a full disk, a quota) leaves the files before it changed. So
before git runs, each target's old state is kept here: a descriptor on each existing regular
file (git removes a file and writes a new one in its place, so the old inode, held open, keeps
the old bytes), a symlink's target, and which targets did not exist (and which of their parent
directories). If git fails, every target is put back as it was; a target that cannot be is named.

Run by the confined child like the other file tools (launcher.file_tools): nothing is imported
at run time; git is exec'd by a child of this one, with the call's stdin (the patch) as its own.

Exit codes: 0 applied; EXIT_RESTORED git failed and everything was put back (stderr: git's
message); EXIT_NOT_RESTORED git failed and the targets on stdout (hex, one a line) could not be
put back (stderr: git's message, then why).
"""

from __future__ import annotations

import errno
import os
import stat

EXIT_RESTORED = 4
EXIT_NOT_RESTORED = 5


class _Kept:
    """One target's state before git ran."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.link: str | None = None
        self.mode = 0
        self.identity: tuple[int, int, int] | None = None       # (dev, ino, mode); None: absent
        self.made_dirs: list[str] = []                          # parents git may create, deepest first
        self.problem = ""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._missing_parents()
            return
        except OSError as exc:
            self.problem = exc.strerror or str(exc)
            return
        self.identity, self.mode = (st.st_dev, st.st_ino, st.st_mode), st.st_mode
        try:
            if stat.S_ISLNK(st.st_mode):
                self.link = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            self.problem = f"not kept: {exc.strerror or exc}"

    def _missing_parents(self) -> None:
        parent = os.path.dirname(self.path)
        while parent and parent != "/" and not os.path.lexists(parent):
            self.made_dirs.append(parent)
            parent = os.path.dirname(parent)

    def _remove_made_dirs(self) -> None:
        for directory in self.made_dirs:                  # deepest first; one still in use stays
            try:
                os.rmdir(directory)
            except OSError:
                break

    def unchanged(self) -> bool:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return self.identity is None
        return self.identity == (st.st_dev, st.st_ino, st.st_mode)

    def restore(self) -> None:
        if self.unchanged():
            self._remove_made_dirs()                      # git may have made them before its write failed
            return
        if self.problem:
            raise OSError(errno.EIO, self.problem)
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            os.unlink(self.path)
        if self.identity is None:
            self._remove_made_dirs()
            return
        if self.link is not None:
            os.symlink(self.link, self.path)
            return
        out = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.lseek(self.fd, 0, os.SEEK_SET)
            while True:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            os.fchmod(out, stat.S_IMODE(self.mode))
        finally:
            os.close(out)


def run(targets: "list[str]", argv: "list[str]", env: "dict[str, str]") -> int:
    """Apply (git reads the patch from our stdin); on failure put every target back."""
    kept = [_Kept(path) for path in targets]
    try:
        status = _git(argv, env)
        if status == 0:
            return 0
        left = []
        for target in reversed(kept):                     # created files before the directories they made
            try:
                target.restore()
            except OSError as exc:
                left.append(target.path)
                os.write(2, f"\nnot put back: {target.path}: {exc.strerror or exc}".encode(errors="replace"))
        if left:
            os.write(1, "".join(os.fsencode(path).hex() + "\n" for path in left).encode())
            return EXIT_NOT_RESTORED
        return EXIT_RESTORED
    finally:
        for target in kept:
            if target.fd >= 0:
                os.close(target.fd)


def _git(argv: "list[str]", env: "dict[str, str]") -> int:
    """Run ``argv`` (searched on env's PATH) with our stdin; its stdout goes to our stderr, which
    the daemon shows on failure (our stdout is the list of targets not put back)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(2, 1)
            for directory in env.get("PATH", "/usr/bin:/bin").split(":"):
                try:
                    os.execve(os.path.join(directory, argv[0]), argv, env)
                except OSError:
                    continue
            os.write(2, f"{argv[0]} not found on {env.get('PATH')}".encode())
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128
