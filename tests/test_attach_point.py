"""Who may attach to a surviving supervisor (supervisor.attach_point), with real processes on the
real socket: root running the supervisor's interpreter, as the same file or as another file with
the same bytes (a replaced pod's new container: its own root file system); not a copy whose bytes
differ (the same size or not), nor another program. The peers here run as root: the uid check
has its own tests (test_supervisor_survival)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.supervisor import attach_point

# The supervisor's interpreter: this process's (what /proc/self/exe names).
OURS = os.readlink("/proc/self/exe")
CONNECT = ("import socket, sys, time\n"
           "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
           "s.connect(sys.argv[1])\n"
           "print('connected', flush=True)\n"
           "time.sleep(60)\n")


@pytest.fixture
def point(tmp_path: Path) -> Iterator[attach_point.AttachPoint]:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    listening = attach_point.AttachPoint(attach_point.path_in(str(private)))
    try:
        yield listening
    finally:
        listening.close()


def refusal_of(point: attach_point.AttachPoint, argv: list[str]) -> str:
    """What the attach point says to a connection from a process running ``argv`` (given the socket's path)."""
    peer = subprocess.Popen([*argv, point.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONHOME": "/usr"})
    try:
        assert peer.stdout is not None and peer.stdout.readline() == "connected\n", peer.stderr
        for _ in range(100):
            conn, why = point.accept()
            if conn is not None:
                conn.close()
                return why
            time.sleep(0.05)
        raise AssertionError("no connection came")
    finally:
        peer.kill()
        peer.wait()


def copy_of_ours(tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name / os.path.basename(OURS)
    copy.parent.mkdir()
    shutil.copy2(OURS, copy)
    return copy


def test_the_same_interpreter_file_attaches(point: attach_point.AttachPoint) -> None:
    assert refusal_of(point, [OURS, "-I", "-c", CONNECT]) == ""


def test_another_file_with_the_same_bytes_attaches(point: attach_point.AttachPoint, tmp_path: Path) -> None:
    """A replaced pod's daemon: its interpreter is another file (here another inode; in a new
    container another overlay mount) with the image's same Python."""
    copy = copy_of_ours(tmp_path, "same")
    assert os.stat(copy).st_ino != os.stat(OURS).st_ino
    assert refusal_of(point, [str(copy), "-I", "-c", CONNECT]) == ""


@pytest.mark.parametrize("change", ["one-byte-flipped", "one-byte-appended"])
def test_a_copy_whose_bytes_differ_is_refused(point: attach_point.AttachPoint, tmp_path: Path, change: str) -> None:
    """The control: the same program with other bytes (an ELF's loader reads neither its last byte,
    in the section headers, nor what follows the file's end, so both still run) is refused."""
    copy = copy_of_ours(tmp_path, change)
    with open(copy, "r+b") as f:
        if change == "one-byte-flipped":
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"\0")
    why = refusal_of(point, [str(copy), "-I", "-c", CONNECT])
    assert "does not run sandboxd's interpreter" in why, why


def test_another_program_is_refused(point: attach_point.AttachPoint) -> None:
    perl = shutil.which("perl")
    assert perl is not None, "perl (Debian's perl-base, essential) is missing"
    why = refusal_of(point, [perl, "-e", 'use Socket; socket(my $s, AF_UNIX, SOCK_SEQPACKET, 0) or die $!; '
                                       'connect($s, pack_sockaddr_un($ARGV[0])) or die $!; $| = 1; '
                                       'print "connected\\n"; sleep 60'])
    assert "does not run sandboxd's interpreter" in why, why


def test_a_file_of_another_size_is_not_read(tmp_path: Path) -> None:
    """The digest is taken only of a file as long as ours: a root peer cannot make the supervisor
    read a file of any size (a sparse 6 MiB here; the control: a copy of ours is read and matches)."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(os.stat(OURS).st_size + 1)
    assert not attach_point.same_executable(str(big), "/proc/self/exe")
    same = tmp_path / "same"
    shutil.copy2(OURS, same)
    assert attach_point.same_executable(str(same), "/proc/self/exe")
