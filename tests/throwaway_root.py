"""A throw-away root: this machine's root file system with a layer on top that goes away.

For tests that install things system-wide (the Debian package: dpkg's database, /usr, /etc, /opt,
its maintainer scripts). The layer is an overlay (lower: the host's /, read-only to it; upper: a
tmpfs) in a mount namespace of its own, which one holder process keeps: everything written there
is gone when the holder ends (the test closes its stdin, or dies), and nothing is written to the
host's root. What a daemon inside needs is the host's: /proc, /sys (its cgroups), /dev, and
/var/tmp (where the daemon fixture keeps sockets, state and workspaces, so the test reaches them
from outside). /run and /tmp are private tmpfs: a maintainer script that looks for systemd
(/run/systemd/system) finds none and never talks to the host's.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HOLDER = r"""
set -e
top=$1
mount -t tmpfs -o mode=0755 sandboxd-throwaway "$top"
mkdir "$top/upper" "$top/work" "$top/root"
mount -t overlay sandboxd-throwaway -o "lowerdir=/,upperdir=$top/upper,workdir=$top/work" "$top/root"
for dir in proc sys dev var/tmp; do mount --rbind "/$dir" "$top/root/$dir"; done
mount -t tmpfs -o mode=0755 tmpfs "$top/root/run"
mount -t tmpfs -o mode=1777 tmpfs "$top/root/tmp"
echo ready
exec cat >/dev/null
"""


class ThrowawayRoot:
    def __init__(self, holder: subprocess.Popen[str], top: Path) -> None:
        self.holder, self.top = holder, top
        self.root = top / "root"                        # its / (seen from the host only through ``run``)

    def wrapper(self) -> list[str]:
        """An argv prefix that runs the rest inside (the daemon fixture's ``wrapper``): the mount
        namespace entered and the root changed, the same process (nsenter and chroot exec)."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", "chroot", str(self.root)]

    def run(self, argv: Sequence[str], **options: Any) -> subprocess.CompletedProcess[str]:
        """``argv`` inside, its output captured."""
        return subprocess.run([*self.wrapper(), *argv], capture_output=True, text=True, **options)


@contextmanager
def throwaway_root() -> Iterator[ThrowawayRoot]:
    top = Path(tempfile.mkdtemp(prefix="sbxt-root-", dir="/tmp"))      # not under /var/tmp: that is bound inside
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", HOLDER, "sh", str(top)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        ready = holder.stdout.readline().strip()
        if ready != "ready":
            holder.wait(30)
            raise AssertionError(f"no throw-away root: {holder.stderr.read() if holder.stderr else ''}")
        yield ThrowawayRoot(holder, top)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()                        # the holder ends, and its namespace with it
        holder.wait(60)
        shutil.rmtree(top, ignore_errors=True)
