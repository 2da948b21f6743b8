"""Plain local users for tests (useradd, random name, removed afterwards)."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import uuid
from typing import Iterator


@contextlib.contextmanager
def plain_user() -> Iterator[tuple[int, int]]:
    """A fresh unprivileged user ``sbxt-<random>`` (no home, no shell): its (uid, gid)."""
    name = f"sbxt-{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)
