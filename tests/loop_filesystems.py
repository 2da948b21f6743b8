"""A small file system of a given kind in an image file, loop-mounted for a test and removed after."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

MKFS = {"btrfs": ["mkfs.btrfs", "-q", "-f"], "ext4": ["mkfs.ext4", "-q", "-F"]}
SIZE = {"btrfs": 300 << 20, "ext4": 64 << 20}      # mkfs.btrfs wants more than 114 MiB


@contextlib.contextmanager
def loop_mounted(kind: str, where: Path) -> Iterator[Path]:
    """A fresh ``kind`` file system mounted on ``where`` (made here, 0755) from ``where``.img;
    unmounted, and both removed, afterwards. Close what holds files in it first."""
    with open("/proc/filesystems") as known:
        if kind not in known.read().split():
            pytest.skip(f"the kernel has no {kind} file system")
    assert shutil.which(MKFS[kind][0]), f"{MKFS[kind][0]} is missing: packaging/setup.sh test installs it"
    image = where.with_name(where.name + ".img")
    with open(image, "wb") as f:
        f.truncate(SIZE[kind])
    try:
        subprocess.run([*MKFS[kind], str(image)], check=True, capture_output=True, timeout=120)
        where.mkdir(mode=0o755)
        subprocess.run(["mount", "-o", "loop", str(image), str(where)], check=True, capture_output=True, timeout=120)
        try:
            os.chmod(where, 0o755)
            yield where
        finally:
            if subprocess.run(["umount", str(where)], capture_output=True, timeout=120).returncode != 0:
                subprocess.run(["umount", "-l", str(where)], check=True, capture_output=True, timeout=120)
    finally:
        with contextlib.suppress(FileNotFoundError):
            where.rmdir()
        image.unlink()
