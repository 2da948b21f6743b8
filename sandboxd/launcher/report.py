"""The report channel: how a child tells its parent that setup failed, and why.

A close-on-exec pipe. The child writes one JSON line describing a
``SetupError`` and exits 125; a successful exec closes the pipe with nothing
written, so EOF alone means "the command is running".
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

from sandboxd.errors import SetupError

SETUP_FAILED_EXIT = 125


def fail(fd: int, error: BaseException, step: str = "setup") -> NoReturn:
    """Report ``error`` on ``fd`` and end this child process without running anything else."""
    if not isinstance(error, SetupError):
        if isinstance(error, OSError):
            error = SetupError(step, error.errno or 0, error.filename, detail=error.strerror)
        else:
            error = SetupError(step, 0, detail=f"{type(error).__name__}: {error}")
    try:
        os.write(fd, (json.dumps({"error": error.to_dict()}) + "\n").encode())
    except OSError:
        try:
            sys.stderr.write(f"sandboxd: {error}\n")
        except Exception:  # noqa: BLE001 - last resort in a dying child
            pass
    os._exit(SETUP_FAILED_EXIT)


def read_error(fd: int) -> SetupError | None:
    """Read until EOF; return the reported error, or None when the command was executed."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        chunks.append(data)
    text = b"".join(chunks).decode(errors="replace").strip()
    if not text:
        return None
    try:
        message = json.loads(text.splitlines()[0])
        return SetupError.from_dict(message["error"])
    except (ValueError, KeyError, TypeError):
        return SetupError("report", 0, detail=f"unreadable setup report: {text[:200]!r}")
