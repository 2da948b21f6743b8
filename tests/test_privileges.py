"""Privileges: capabilities, no_new_privs, seccomp, setuid binaries, users.

The dangerous system calls are made directly with ctypes ``syscall(nr, ...)``
(x86_64 numbers) and with arguments the kernel itself would reject with some
*other* error (EFAULT, EINVAL, EBADF, ENOSYS...) or accept harmlessly. The
danger-full-access control (no filter but TIOCSTI, full root) shows those
kernel answers, so the EPERM seen in confined sandboxes is the filter's.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    BASE_ENV,
    CONFINED,
    WRITABLE,
    describe,
    make_dir,
    py,
    run_sbx,
)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="system call numbers in this module are x86_64's")

BAD = 1  # an unmapped user address
CLONE_SIGHAND = 0x800  # without CLONE_VM the kernel answers EINVAL before looking at namespace flags

# name -> (syscall number, args, errno the confined filter must give)
SYSCALLS: dict[str, tuple[int, tuple[int, ...], str]] = {
    "mount": (165, (0, 0, BAD, 0, 0), "EPERM"),
    "umount2": (166, (0, 0xFFFFFFFF), "EPERM"),
    "pivot_root": (155, (BAD, BAD), "EPERM"),
    "chroot": (161, (BAD,), "EPERM"),
    "unshare": (272, (0,), "EPERM"),                       # unshare(0) is a harmless no-op for the kernel
    "setns": (308, (0xFFFFFFFF, 0), "EPERM"),
    "kexec_load": (246, (0, 0, 0, 0xFFFF0000), "EPERM"),
    "kexec_file_load": (320, (0xFFFFFFFF, 0xFFFFFFFF, 0, 0, 0xFFFF0000), "EPERM"),
    "init_module": (175, (0, 0, 0), "EPERM"),
    "finit_module": (313, (0xFFFFFFFF, 0, 0), "EPERM"),
    "delete_module": (176, (BAD, 0), "EPERM"),
    "bpf": (321, (1000, 0, 0), "EPERM"),
    "keyctl": (250, (9999, 0, 0, 0, 0), "EPERM"),
    "add_key": (248, (BAD, BAD, 0, 0, 0), "EPERM"),
    "request_key": (249, (BAD, BAD, 0, 0), "EPERM"),
    "perf_event_open": (298, (BAD, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0), "EPERM"),
    "open_by_handle_at": (304, (0xFFFFFFFF, BAD, 0), "EPERM"),
    "name_to_handle_at": (303, (0xFFFFFFFF, BAD, BAD, BAD, 0), "EPERM"),
    "userfaultfd": (323, (0xFFFFFF00,), "EPERM"),
    "io_uring_setup": (425, (0, BAD), "EPERM"),
    "io_uring_enter": (426, (0xFFFFFFFF, 0, 0, 0, 0, 0), "EPERM"),
    "io_uring_register": (427, (0xFFFFFFFF, 0, 0, 0), "EPERM"),
    "syslog": (103, (10, 0, 0), "EPERM"),                  # SYSLOG_ACTION_SIZE_BUFFER
    "acct": (163, (BAD,), "EPERM"),
    "swapon": (167, (BAD, 0), "EPERM"),
    "swapoff": (168, (BAD,), "EPERM"),
    "reboot": (169, (0, 0, 0, 0), "EPERM"),                # wrong magic: EINVAL for the kernel
    "iopl": (172, (4,), "EPERM"),
    "ioperm": (173, (0, 0, 0), "EPERM"),
    "settimeofday": (164, (BAD, BAD), "EPERM"),
    "clock_settime": (227, (999, BAD), "EPERM"),
    "clone3": (435, (0, 0), "ENOSYS"),
    **{f"clone({name})": (56, (flag | CLONE_SIGHAND, 0, 0, 0, 0), "EPERM") for name, flag in (
        ("CLONE_NEWNS", 0x00020000), ("CLONE_NEWCGROUP", 0x02000000), ("CLONE_NEWUTS", 0x04000000),
        ("CLONE_NEWIPC", 0x08000000), ("CLONE_NEWUSER", 0x10000000), ("CLONE_NEWPID", 0x20000000),
        ("CLONE_NEWNET", 0x40000000), ("CLONE_NEWTIME", 0x80))},
}

# ioctl on /dev/null: the kernel answers ENOTTY, the filter EPERM. Upper 32 bits must be ignored.
IOCTLS: dict[str, int] = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C, "TIOCSTI|1<<32": 0x100005412,
                          "TIOCSTI|0xffffffff<<32": 0xFFFFFFFF00005412, "TIOCLINUX|1<<40": 0x1000000541C}
# TIOCSETD (set a line discipline, loading its module on demand) in confined sandboxes only: the
# filter cannot read the number it points to, so it refuses every one; the kernel says ENOTTY here.
LINE_DISCIPLINE: dict[str, int] = {"TIOCSETD": 0x5423, "TIOCSETD|1<<32": 0x100005423}

# socket(family, type): name -> (family, type, errno in every confined sandbox, whatever its network); None = allowed
SOCKETS: dict[str, tuple[int, int, str | None]] = {
    "AF_PACKET/SOCK_RAW": (17, 3, "EPERM"),
    "AF_PACKET/SOCK_DGRAM": (17, 2, "EPERM"),
    "AF_VSOCK/SOCK_STREAM": (40, 1, "EPERM"),
    "AF_UNIX/SOCK_DGRAM": (1, 2, "EACCES"),
    "AF_UNIX/SOCK_DGRAM|SOCK_CLOEXEC|SOCK_NONBLOCK": (1, 2 | 0x80000 | 0x800, "EACCES"),
    "AF_UNIX/SOCK_STREAM": (1, 1, None),
    "AF_UNIX/SOCK_SEQPACKET": (1, 5, None),
    "AF_INET/SOCK_STREAM": (2, 1, None),
}

PROBE = r"""
import ctypes, errno, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF) for a in args])
    return r, ctypes.get_errno()
def name(r, e):
    return 'OK' if r != -1 else errno.errorcode.get(e, str(e))
out = {'syscall': {}, 'ioctl': {}, 'socket': {}}
for key, (nr, args) in spec['syscall'].items():
    r, e = call(nr, *args)
    if r == 0 and nr == 56:
        os._exit(0)                      # a clone that got through: the child leaves at once
    out['syscall'][key] = name(r, e)
null = os.open('/dev/null', os.O_RDWR)
buf = ctypes.create_string_buffer(b'x')
for key, request in spec['ioctl'].items():
    out['ioctl'][key] = name(*call(16, null, request, ctypes.addressof(buf)))
for key, (family, kind) in spec['socket'].items():
    r, e = call(41, family, kind, 0)
    if r >= 0:
        os.close(r)
    out['socket'][key] = name(r, e)
print(json.dumps(out))
"""

_results: dict[str, dict[str, dict[str, str]]] = {}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, dict[str, str]]]:
    """Run the system call probe once per policy (inside the sandbox) and cache its answers."""
    workspace = make_dir(tmp_path_factory.mktemp("syscalls") / "ws")
    spec = {"syscall": {k: [nr, list(args)] for k, (nr, args, _) in SYSCALLS.items()},
            "ioctl": {**IOCTLS, **LINE_DISCIPLINE}, "socket": {k: [f, t] for k, (f, t, _) in SOCKETS.items()}}

    def get(policy: str) -> dict[str, dict[str, str]]:
        if policy not in _results:
            result = run_sbx(py(PROBE, json.dumps(spec)), workspace=workspace, policy=policy)
            assert result.returncode == 0, describe(result)
            _results[policy] = json.loads(result.stdout)
        return _results[policy]

    return get


@pytest.mark.parametrize("policy", CONFINED)
@pytest.mark.parametrize("syscall", list(SYSCALLS))
def test_dangerous_syscall_is_filtered(policy: str, syscall: str,
                                       probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """Each dangerous system call fails with the filter's errno (EPERM; clone3 ENOSYS) in confined sandboxes."""
    assert probe(policy)["syscall"][syscall] == SYSCALLS[syscall][2]


@pytest.mark.parametrize("syscall", list(SYSCALLS))
def test_control_kernel_answers_differently_without_filter(
        syscall: str, probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """Control: under danger-full-access (no such rules) the kernel gives another answer for the same call,
    so the confined answer above can only come from the seccomp filter."""
    assert probe("danger-full-access")["syscall"][syscall] != SYSCALLS[syscall][2]


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("request_name", list(IOCTLS))
def test_terminal_injection_ioctls_are_filtered(policy: str, request_name: str,
                                                probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """TIOCSTI/TIOCLINUX fail with EPERM under every policy, whatever the upper 32 bits (the kernel says ENOTTY)."""
    assert probe(policy)["ioctl"][request_name] == "EPERM"


@pytest.mark.parametrize("policy", CONFINED)
@pytest.mark.parametrize("request_name", list(LINE_DISCIPLINE))
def test_line_discipline_changes_are_filtered(policy: str, request_name: str,
                                              probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """TIOCSETD fails with EPERM in confined sandboxes, whatever the upper 32 bits; control: without
    the confined filter (danger-full-access) the kernel's own answer on /dev/null, ENOTTY."""
    assert probe(policy)["ioctl"][request_name] == "EPERM"
    assert probe("danger-full-access")["ioctl"][request_name] == "ENOTTY"


@pytest.mark.parametrize("policy", CONFINED)
@pytest.mark.parametrize("kind", list(SOCKETS))
def test_socket_families(policy: str, kind: str, probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """AF_PACKET/AF_VSOCK are EPERM (test_socket_families tries every family); AF_UNIX datagrams are EACCES whatever the network; others work."""
    assert probe(policy)["socket"][kind] == (SOCKETS[kind][2] or "OK")


def test_control_af_packet_without_filter(probe: Callable[[str], dict[str, dict[str, str]]]) -> None:
    """Control: without the confined filter root gets an AF_PACKET socket and an AF_UNIX datagram socket."""
    answers = probe("danger-full-access")["socket"]
    assert answers["AF_PACKET/SOCK_RAW"] == "OK" and answers["AF_UNIX/SOCK_DGRAM"] == "OK"


# --------------------------------------------------------------------------- process credentials

STATUS_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")


def status_of(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    fields = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@pytest.mark.parametrize("policy", CONFINED)
def test_no_capabilities_no_new_privs_seccomp(policy: str, workspace: Path) -> None:
    """Confined: every capability set is empty, NoNewPrivs is 1 and a seccomp filter is on (2)."""
    result = run_sbx(["cat", "/proc/self/status"], workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    status = status_of(result)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, f"{cap}={status[cap]}"
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"


def test_danger_full_access_still_has_a_filter(workspace: Path) -> None:
    """danger-full-access keeps a seccomp filter (for TIOCSTI/TIOCLINUX) and the caller's capabilities."""
    result = run_sbx(["cat", "/proc/self/status"], workspace=workspace, policy="danger-full-access")
    status = status_of(result)
    assert status["Seccomp"] == "2", describe(result)
    assert int(status["CapEff"], 16) != 0


@pytest.mark.parametrize("policy", CONFINED)
def test_runs_as_workspace_owner(policy: str, workspace: Path) -> None:
    """The command runs as the owner of the workspace (here root, uid 0), yet without capabilities."""
    os.chown(workspace, 65534, 65534)
    result = run_sbx(["id", "-u"], workspace=workspace, policy=policy)
    assert result.stdout == "65534\n", describe(result)
    os.chown(workspace, 0, 0)
    result = run_sbx(["id", "-u"], workspace=workspace, policy=policy)
    assert result.stdout == "0\n", describe(result)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_user_option_runs_as_nobody(policy: str, workspace: Path) -> None:
    """--user 65534 runs the command as nobody (uid and gid 65534, no supplementary root group)."""
    result = run_sbx(["sh", "-c", "id -u; id -g; grep -E '^(Uid|Gid|Groups):' /proc/self/status"],
                     workspace=workspace, policy=policy, options=("--user", "65534"))
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert lines[:2] == ["65534", "65534"], describe(result)
    assert lines[2].split()[1:] == ["65534"] * 4 and lines[3].split()[1:] == ["65534"] * 4
    assert lines[4].split()[1:] in ([], ["65534"]), lines[4]


def test_user_option_with_group(workspace: Path) -> None:
    """--user UID:GID sets both."""
    result = run_sbx(["sh", "-c", "echo $(id -u) $(id -g)"], workspace=workspace, options=("--user", "65534:100"))
    assert result.stdout == "65534 100\n", describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_mount_fails(policy: str, workspace: Path) -> None:
    """`mount` cannot mount anything, even as uid 0."""
    result = run_sbx(["sh", "-c", "mount -t tmpfs none /tmp && echo MOUNTED; mount --bind /tmp /mnt && echo BOUND"],
                     workspace=workspace, policy=policy)
    assert "MOUNTED" not in result.stdout and "BOUND" not in result.stdout, describe(result)


@pytest.mark.parametrize("policy", CONFINED)
@pytest.mark.parametrize("flags", [["-r"], ["-m"], ["-U"], ["-n"], ["-p", "-f"], ["-r", "-m"]])
def test_unshare_fails(policy: str, flags: list[str], workspace: Path) -> None:
    """`unshare` cannot create any namespace (user namespaces included) inside the sandbox."""
    result = run_sbx(["unshare", *flags, "sh", "-c", "echo INSIDE; id -u"], workspace=workspace, policy=policy)
    assert result.returncode != 0 and "INSIDE" not in result.stdout, describe(result)
    assert "Operation not permitted" in result.stderr, describe(result)


@pytest.fixture
def setuid_env(base_dir: Path) -> Path:
    """A setuid-root copy of /usr/bin/env in a host directory everybody can traverse."""
    target = base_dir / "suenv"
    shutil.copy2("/usr/bin/env", target)
    os.chown(target, 0, 0)
    os.chmod(target, 0o4755)
    return target


def test_control_setuid_copy_elevates_on_host(setuid_env: Path) -> None:
    """Control: on the host, nobody running the setuid copy gets euid 0 (so the sandbox test can fail)."""
    result = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                             str(setuid_env), "id", "-u"], capture_output=True, text=True, env=BASE_ENV)
    assert result.stdout == "0\n", describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_setuid_binary_does_not_elevate(policy: str, workspace: Path, setuid_env: Path) -> None:
    """A setuid-root binary run by nobody inside the sandbox keeps euid 65534 (nosuid + no_new_privs)."""
    result = run_sbx([str(setuid_env), "sh", "-c", "id -u; grep -E '^(Uid|CapEff)' /proc/self/status"],
                     workspace=workspace, policy=policy, options=("--user", "65534"))
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert lines[0] == "65534", describe(result)
    assert lines[1].split()[1:] == ["65534"] * 4
    assert int(lines[2].split()[1], 16) == 0


@pytest.mark.parametrize("policy", WRITABLE)
def test_setuid_binary_in_workspace_does_not_elevate(policy: str, workspace: Path) -> None:
    """A setuid-root binary placed in the (writable) workspace does not elevate either."""
    target = workspace / "suenv"
    shutil.copy2("/usr/bin/env", target)
    os.chmod(target, 0o4755)
    result = run_sbx([str(target), "id", "-u"], workspace=workspace, policy=policy, options=("--user", "65534"))
    assert result.stdout == "65534\n", describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_uid0_through_setuid_binary_gets_no_capabilities(policy: str, workspace: Path, setuid_env: Path) -> None:
    """uid 0 without capabilities exec'ing a setuid-root binary regains no capability."""
    result = run_sbx([str(setuid_env), "grep", "^Cap", "/proc/self/status"], workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    for line in result.stdout.splitlines():
        assert int(line.split()[1], 16) == 0, line


# su and passwd are always there on Debian; ping only when installed (then usually setuid or file caps).
SETUID_PROGRAMS = [["su", "-c", "id -u", "root"], ["su", "root", "-c", "touch /etc/sbx-su"], ["passwd", "-d", "nobody"]]
if shutil.which("ping", path=BASE_ENV["PATH"]):
    SETUID_PROGRAMS.append(["ping", "-c", "1", "127.0.0.1"])


@pytest.mark.parametrize("policy", CONFINED)
@pytest.mark.parametrize("program", SETUID_PROGRAMS, ids=lambda p: " ".join(p))
def test_setuid_system_binaries_gain_nothing(policy: str, program: list[str], workspace: Path) -> None:
    """su, passwd (and ping, when installed) run by nobody fail and never act as root."""
    before = subprocess.run(["passwd", "-S", "nobody"], capture_output=True, text=True).stdout
    result = run_sbx(program, workspace=workspace, policy=policy, options=("--user", "65534"))
    assert result.returncode != 0 or program[0] == "ping", describe(result)
    assert "0\n" != result.stdout
    assert not os.path.exists("/etc/sbx-su")
    assert subprocess.run(["passwd", "-S", "nobody"], capture_output=True, text=True).stdout == before


@pytest.mark.parametrize("policy", CONFINED)
def test_root_in_sandbox_cannot_write_root_owned_files(policy: str, workspace: Path) -> None:
    """uid 0 inside is not the host's root: /etc/passwd (owner-writable by uid 0) cannot be modified."""
    before = Path("/etc/passwd").read_bytes()
    result = run_sbx(["sh", "-c", "echo 'x::0:0::/:/bin/sh' >> /etc/passwd && echo WROTE"], workspace=workspace,
                     policy=policy)
    assert "WROTE" not in result.stdout, describe(result)
    assert Path("/etc/passwd").read_bytes() == before


@pytest.mark.parametrize("policy", CONFINED)
def test_cannot_change_hostname_or_time(policy: str, workspace: Path) -> None:
    """Setting the hostname or the clock fails (no CAP_SYS_ADMIN / CAP_SYS_TIME, clock calls filtered)."""
    host_name = os.uname().nodename
    result = run_sbx(["sh", "-c", "hostname sbx-renamed && echo RENAMED; date -s '2001-01-01' && echo DATED"],
                     workspace=workspace, policy=policy)
    assert "RENAMED" not in result.stdout and "DATED" not in result.stdout, describe(result)
    assert os.uname().nodename == host_name
