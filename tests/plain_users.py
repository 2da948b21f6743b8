"""Plain local users for tests (useradd, random name, removed afterwards)."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import time
import uuid
from typing import Iterator


@contextlib.contextmanager
def plain_user() -> Iterator[tuple[int, int]]:
    """A fresh unprivileged user ``sbxt-<random>`` (no home, no shell): its (uid, gid).

    Removed afterwards: close its sessions (or stop the daemon) before leaving, since userdel
    refuses a user that still has processes; a sandbox's processes may take a moment to go."""
    name = f"sbxt-{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        deadline = time.monotonic() + 30
        while True:
            removed = subprocess.run(["userdel", name], capture_output=True, text=True)
            if removed.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"test user {name} left behind: {removed.stderr.strip()}")
            time.sleep(0.2)
