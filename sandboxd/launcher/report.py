"""The report channel: how a child tells its parent that setup failed, and why;
and how init tells the parent how the command ended.

Both are close-on-exec pipes carrying one line of ``key<US>value`` pairs
separated by ``<RS>`` (ASCII unit/record separators). Not JSON: the ``json``
module imports ``re``, and this is on the path of every ``sandboxd run``.

- Setup: a failing child writes one line describing a ``SetupError`` and
  exits 125; a successful exec closes the pipe with nothing written, so EOF
  alone means "the command is running".
- Status: init writes the command's wait status and resource usage.
"""

from __future__ import annotations

import os
import sys

from sandboxd.errors import SetupError
from sandboxd.printable import printable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

SETUP_FAILED_EXIT = 125
_UNIT, _RECORD = "\x1f", "\x1e"


def encode(fields: dict[str, object]) -> bytes:
    def clean(value: object) -> str:
        return str(value).replace(_UNIT, " ").replace(_RECORD, " ").replace("\n", " ")
    return (_RECORD.join(f"{k}{_UNIT}{clean(v)}" for k, v in fields.items() if v is not None) + "\n").encode()


def decode(data: bytes) -> dict[str, str]:
    line = data.decode(errors="replace").split("\n", 1)[0]
    return dict(item.split(_UNIT, 1) for item in line.split(_RECORD) if _UNIT in item)


def fail(fd: int, error: BaseException, step: str = "setup") -> "NoReturn":
    """Report ``error`` on ``fd`` and end this child process without running anything else."""
    if not isinstance(error, SetupError):
        if isinstance(error, OSError):
            error = SetupError(step, error.errno or 0, error.filename, detail=error.strerror)
        else:
            error = SetupError(step, 0, detail=f"{type(error).__name__}: {error}")
    try:
        os.write(fd, encode(error.to_dict()))
    except OSError:
        try:
            sys.stderr.write(f"sandboxd: {printable(str(error))}\n")   # it may quote the caller's paths
        except Exception:  # noqa: BLE001 - last resort in a dying child
            pass
    os._exit(SETUP_FAILED_EXIT)


def read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def read_outcome(fd: int) -> tuple[SetupError | None, int | None]:
    """Read until EOF: (the reported error or None when the command was executed,
    the command's pid inside its sandbox if a call's init announced it)."""
    return parse_outcome(read_all(fd))


def parse_outcome(data: bytes) -> tuple[SetupError | None, int | None]:
    """``read_outcome`` of a report read to its end already (by a poll loop)."""
    pid = None
    for line in data.splitlines():
        if not line.strip():
            continue
        fields = decode(line)
        if "step" in fields:
            if "native" in fields:                        # sandboxd-call: errno only, hints are added here
                return _native_error(fields), pid
            return SetupError.from_dict(fields), pid
        if "pid" in fields:
            pid = int(fields["pid"])
        else:
            return SetupError("report", 0, detail=f"unreadable setup report: {line[:200]!r}"), pid
    return None, pid


def _native_error(fields: dict[str, str]) -> SetupError:
    """The error the native call helper (sandboxd_call.c) reported, with the hint the Python
    path would have given for the same step and errno."""
    from sandboxd.errors import ExecFailed
    from sandboxd.kernel._libc import setup_error

    error = setup_error(fields["step"], int(fields.get("errno") or 0), fields.get("path"))
    if fields["step"] == "exec":
        return ExecFailed(error.step, error.errno, error.path, hint=error.hint)
    return error


def read_error(fd: int) -> SetupError | None:
    """Read until EOF; return the reported error, or None when the command was executed."""
    return read_outcome(fd)[0]


def write_status(fd: int, status: int, utime: float, stime: float, maxrss_kib: int) -> None:
    try:
        os.write(fd, encode({"status": status, "utime": utime, "stime": stime, "maxrss_kib": maxrss_kib}))
    except OSError:
        pass


def read_status(fd: int) -> dict[str, float]:
    """What init wrote about the command, or {} if init died without a word."""
    try:
        fields = decode(read_all(fd))
        return {key: float(value) for key, value in fields.items()}
    except (OSError, ValueError):
        return {}
