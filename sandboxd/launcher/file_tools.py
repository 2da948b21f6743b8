"""File tools, run *inside* a session's sandbox by a forked child that is already fully
confined (its uid, no capabilities, Landlock, seccomp): the kernel decides what it may
touch, exactly as for a command. Nothing is exec'd and nothing is imported here at run
time (after the privilege drop the interpreter's own files may be unreadable).

Protocol with the daemon, over the call's pipes: the request's data comes on stdin
(WriteFile), the result goes to stdout (ListDir: one "type size mode mtime hex(name)"
line per entry, tab-separated); a failure writes "ERRNO<TAB>message" to stderr and
exits 1. Exit 3 means ReadFile stopped at max_bytes.
"""

from __future__ import annotations

import errno
import os
import stat

from sandboxd.launcher import patch_tool

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

EXIT_FAILED = 1
EXIT_TRUNCATED = 3


def run(tool: "dict[str, Any]") -> "NoReturn":   # the request, as JSON decoded it
    try:
        op = tool.get("op")
        path = str(tool["path"])
        if op == "read":
            code = _read(path, int(tool.get("max_bytes") or 0))
        elif op == "write":
            _write(path, int(tool.get("mode") or 0), bool(tool.get("create_parents")))
            code = 0
        elif op == "list":
            _list(path)
            code = 0
        elif op == "environment":
            _environment(path, [str(d) for d in tool.get("dirs") or ()])
            code = 0
        elif op == "patch":
            code = patch_tool.run([str(t) for t in tool["targets"]], [str(a) for a in tool["argv"]],
                                  {str(k): str(v) for k, v in dict(tool["env"]).items()})
        elif op == "search":
            _search(path, str(tool["pattern"]), bool(tool.get("case_insensitive")), int(tool.get("max_results") or 1000))
            code = 0
        else:
            raise OSError(errno.EINVAL, f"unknown file tool {op!r}")
    except OSError as exc:
        _fail(exc.errno or errno.EIO, exc.strerror or str(exc))
    except Exception as exc:  # noqa: BLE001 - reported, never a traceback
        _fail(errno.EIO, f"{type(exc).__name__}: {exc}")
    os._exit(code)


def _fail(code: int, message: str) -> "NoReturn":
    try:
        os.write(2, f"{code}\t{message}".encode(errors="replace"))
    finally:
        os._exit(EXIT_FAILED)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _open_regular(path: str) -> int:
    """Open ``path`` for reading only if it is a regular file. O_NONBLOCK: opening a FIFO must not
    wait for a writer; fstat then refuses it (and devices, sockets) before any read, which could
    block for ever or never end (/dev/zero)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise OSError(errno.EISDIR, "is a directory: use ListDir")
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    raise OSError(errno.EINVAL, f"{path} is {kind}: only regular files are read")


def _read(path: str, max_bytes: int) -> int:
    fd = _open_regular(path)
    try:
        left = max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return 0
            _write_all(1, chunk)
            left -= len(chunk)
        return EXIT_TRUNCATED if os.read(fd, 1) else 0
    finally:
        os.close(fd)


def _write(path: str, mode: int, create_parents: bool) -> None:
    """Atomic: a temporary file beside the target, fsync'd, then renamed over it."""
    directory, name = os.path.split(path)
    if create_parents:
        os.makedirs(directory, exist_ok=True)
    try:
        keep = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        keep = 0o644
    temporary = os.path.join(directory, f".{name}.sandboxd-{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode or keep)
    try:
        written = 0
        while True:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                break
            _write_all(fd, chunk)
            written += len(chunk)
        os.fchmod(fd, mode or keep)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(temporary, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    _write_all(1, str(written).encode())


def _list(path: str) -> None:
    lines = []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                    else "file" if stat.S_ISREG(st.st_mode) else "other")
            # Tab-separated, the name hex-encoded (any byte may be in a name): no `json`
            # import on the launch path that shares this module.
            lines.append(f"{kind}\t{st.st_size}\t{stat.S_IMODE(st.st_mode)}\t{st.st_mtime}\t"
                         f"{os.fsencode(entry.name).hex()}")
    _write_all(1, ("\n".join(sorted(lines)) + "\n").encode() if lines else b"")


def _environment(home: str, dirs: "list[str]") -> None:
    """A command's HOME and PATH, checked as the command will see them (service.environment):
    create ``home`` (0700) unless it exists; say whether it is a directory of ours we may write
    ("1" or "0" on the first line); then hex(entry) per line for each of ``dirs`` that is a
    directory here (following symlinks, as execvp's lookup does), in the order given."""
    try:
        os.mkdir(home, 0o700)
    except OSError:
        pass                                          # there already, or not makable: lstat says which
    try:
        st = os.lstat(home)                           # a symlink planted in its place is not ours
        usable = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and os.access(home, os.W_OK | os.X_OK)
    except OSError:
        usable = False
    lines = ["1" if usable else "0"]
    for entry in dirs:
        try:
            if stat.S_ISDIR(os.stat(entry).st_mode):
                lines.append(os.fsencode(entry).hex())
        except (OSError, ValueError):
            continue
    _write_all(1, ("\n".join(lines) + "\n").encode())


def _search(root: str, pattern: str, case_insensitive: bool, max_results: int) -> None:
    """The built-in search (no ripgrep): "hex(path) TAB line TAB hex(text)" per match."""
    import re  # already loaded in the fork server (json needs it), so nothing is read from disk here

    try:
        regex = re.compile(pattern.encode(), re.IGNORECASE if case_insensitive else 0)
    except re.error as exc:
        raise OSError(errno.EINVAL, f"bad regular expression: {exc}") from None
    found = 0
    out = []
    single: list[tuple[str, list[str], list[str]]] = [(os.path.dirname(root), [], [os.path.basename(root)])]
    for directory, dirs, files in os.walk(root) if os.path.isdir(root) else single:
        dirs[:] = sorted(d for d in dirs if d != ".git")
        for name in sorted(files):
            path = os.path.join(directory, name)
            try:
                fd = _open_regular(path)                  # never a FIFO or a device: they would block or never end
            except OSError:
                continue
            try:
                with open(fd, "rb") as f:
                    for number, line in enumerate(f, 1):
                        if b"\0" in line:
                            break                         # binary file: skip it, like ripgrep
                        if regex.search(line):
                            text = line.rstrip(b"\n").hex()
                            out.append(f"{os.fsencode(path).hex()}\t{number}\t{text}")
                            found += 1
                            if found >= max_results:
                                _write_all(1, ("\n".join(out) + "\n").encode())
                                return
            except OSError:
                continue
    if out:
        _write_all(1, ("\n".join(out) + "\n").encode())
