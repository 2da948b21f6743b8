"""Socket families and protocols: a confined command creates only the sockets a tool needs.

Every family number from 0 to past AF_MAX (46), and a few beyond, is tried with a real
socket() and socketpair() system call (raw syscall(2), so neither Python's socket module nor
libc second-guesses an argument) from inside a session's sandbox, as a plain user created here,
on both call paths (the native helper and the Python reference), in every confined policy. The
filter must answer EPERM for every family but AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK, before the
kernel's family lookup (which would load the family's module on demand); on AF_INET/AF_INET6 for
every type and protocol but TCP, UDP and ping; on AF_NETLINK for every protocol but NETLINK_ROUTE.
Controls: the allowed ones work (or get the kernel's own answer, never EPERM) in the same sandbox,
and under danger-full-access (no such rules, root) the kernel answers every refused one with
something other than EPERM, so the EPERM seen in confined sandboxes can only be the filter's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BASE_ENV, PY, make_dir
from plain_users import plain_user
from sandboxd.kernel.seccomp import (AF_INET, AF_INET6, AF_NETLINK, ALLOWED_FAMILIES, ALLOWED_INET_TYPES,
                                     refused_blocks)
from sandboxd.policy import DangerFullAccess, LaunchSpec, ReadOnly, SandboxPolicy, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer
from test_call_paths import run, server  # noqa: F401 - its fork server on each call path

pytestmark = pytest.mark.timeout(180)

SOCKET_NUMBERS = {"x86_64": (41, 53), "aarch64": (198, 199)}   # socket(), socketpair()
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET, SOCK_RDM, SOCK_DCCP = 1, 2, 3, 5, 4, 6
SOCK_CLOEXEC = 0o2000000
IPPROTO_DCCP, IPPROTO_L2TP, IPPROTO_SCTP, IPPROTO_UDPLITE, IPPROTO_MPTCP = 33, 115, 132, 136, 262
NETLINK_SOCK_DIAG, NETLINK_GENERIC = 4, 16
HIGH = 1 << 32                               # garbage above the int the kernel reads

FAMILIES = [*range(0, 50), 63, 64, 255, 1 << 31, HIGH | 38]   # 38 = AF_ALG with high bits set
TYPES = (SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET)

PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
spec = json.loads(sys.argv[1])
socket_nr, pair_nr = spec["numbers"]
pair = (ctypes.c_int * 2)()
out = {}
for key, (call, family, kind, proto) in spec["calls"].items():
    args = [ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF) for a in (family, kind, proto)]
    if call == "socketpair":
        args.append(ctypes.c_void_p(ctypes.addressof(pair)))
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(socket_nr if call == "socket" else pair_nr), *args)
    e = ctypes.get_errno()
    if r >= 0:
        for fd in ((pair[0], pair[1]) if call == "socketpair" else (r,)):
            os.close(fd)
    out[key] = "OK" if r >= 0 else errno.errorcode.get(e, str(e))
out["uid"] = str(os.getuid())
print(json.dumps(out))
"""


def family_calls() -> dict[str, tuple[str, int, int, int]]:
    calls = {}
    for family in FAMILIES:
        for kind in TYPES:
            calls[f"socket {family:#x} {kind}"] = ("socket", family, kind | SOCK_CLOEXEC, 0)
        calls[f"socketpair {family:#x}"] = ("socketpair", family, SOCK_STREAM, 0)
    return calls


# name -> (call, family, type, protocol) on the allowed families: refused ones (the filter's EPERM)
INET_REFUSED = {
    f"{name} {family}": ("socket", family, kind, proto) for family in (AF_INET, AF_INET6)
    for name, kind, proto in (
        ("SCTP stream", SOCK_STREAM, IPPROTO_SCTP), ("SCTP seqpacket", SOCK_SEQPACKET, IPPROTO_SCTP),
        ("seqpacket (SCTP when loaded)", SOCK_SEQPACKET, 0), ("DCCP", SOCK_DCCP, IPPROTO_DCCP),
        ("SOCK_DCCP", SOCK_DCCP, 0), ("RDM", SOCK_RDM, 0), ("UDP-Lite", SOCK_DGRAM, IPPROTO_UDPLITE),
        ("L2TP", SOCK_DGRAM, IPPROTO_L2TP), ("MPTCP", SOCK_STREAM, IPPROTO_MPTCP),
        ("TCP with high bits", SOCK_STREAM, HIGH | 6), ("protocol 255", SOCK_DGRAM, 255),
        ("protocol 511", SOCK_DGRAM, 511), ("protocol 4096", SOCK_DGRAM, 4096))}
NETLINK_REFUSED = {f"netlink protocol {proto}": ("socket", AF_NETLINK, SOCK_RAW, proto)
                   for proto in (*range(1, 32), 32, 255, HIGH)}
# ... and the allowed ones, which must work
ALLOWED = {
    **{f"{name} {family}": ("socket", family, kind, proto) for family in (AF_INET, AF_INET6)
       for name, kind, proto in (("TCP", SOCK_STREAM, 0), ("TCP by number", SOCK_STREAM, 6),
                                 ("UDP", SOCK_DGRAM, 0), ("UDP by number", SOCK_DGRAM, 17))},
    "unix stream": ("socket", 1, SOCK_STREAM, 0), "unix seqpacket": ("socket", 1, SOCK_SEQPACKET, 0),
    "unix socketpair": ("socketpair", 1, SOCK_STREAM, 0),
    "netlink route": ("socket", AF_NETLINK, SOCK_RAW, 0), "netlink route dgram": ("socket", AF_NETLINK, SOCK_DGRAM, 0),
}
# Ping sockets (ICMP over SOCK_DGRAM): the kernel's ping_group_range decides (EACCES), never the filter.
KERNEL_DECIDES = {f"ping {family}": ("socket", family, SOCK_DGRAM, proto)
                  for family, proto in ((AF_INET, 1), (AF_INET6, 58))}

CONFINED_POLICIES: dict[str, SandboxPolicy] = {
    "read-only": ReadOnly(),
    "workspace-write": WorkspaceWrite(),
    "workspace-write+isolated-network": WorkspaceWrite(network_access=True),
    "workspace-write+host-network": WorkspaceWrite(network_access=True, network_mode="host"),
}


def unused_ids() -> tuple[int, int]:
    """A uid (and gid) no account names and no process runs as: a plain user the kernel knows by
    number alone."""
    running = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                running.update(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, ValueError):
            continue
    for uid in range(61000, 62000):
        if uid not in running:
            try:
                pwd.getpwuid(uid)
            except KeyError:
                return uid, uid
    raise AssertionError("no unused uid in 61000..61999")


@pytest.fixture(scope="module")
def attacker() -> Iterator[tuple[int, int]]:
    """A plain user made here; where useradd cannot add one (the 6.1 matrix guest), an unused uid."""
    with contextlib.ExitStack() as stack:
        try:
            ids = stack.enter_context(plain_user())
        except subprocess.CalledProcessError:
            ids = unused_ids()
        yield ids


@pytest.fixture(scope="module")
def answers(server: ForkServer, attacker: tuple[int, int],  # noqa: F811 - the imported fixture
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, str]]]:
    """policy -> {call: answer}: the probe run once per policy in a session of its own, as the
    plain user (the danger-full-access control as root, so no missing capability answers EPERM)."""
    numbers = SOCKET_NUMBERS.get(os.uname().machine)
    if numbers is None:
        pytest.skip(f"socket system call numbers unknown for {os.uname().machine}")
    base = tmp_path_factory.mktemp("families")
    calls = {**family_calls(), **INET_REFUSED, **NETLINK_REFUSED, **ALLOWED, **KERNEL_DECIDES}
    spec = json.dumps({"numbers": numbers, "calls": calls})
    results: dict[str, dict[str, str]] = {}
    for name, policy in [*CONFINED_POLICIES.items(), ("danger-full-access", DangerFullAccess())]:
        workspace = make_dir(base / name)
        if name != "danger-full-access":
            shutil.chown(workspace, *attacker)            # the session runs as the workspace's owner
        session = f"families-{os.urandom(4).hex()}"
        server.open_session(session, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                                policy=policy))
        try:
            output, info = run(server, session, [PY, "-c", PROBE, spec], str(workspace))
        finally:
            server.close_session(session)
        assert getattr(info, "exit_code", None) == 0, (name, output, info)
        results[name] = json.loads(output)
        assert results[name]["uid"] == str(0 if name == "danger-full-access" else attacker[0])
    yield results


def refused_family_calls() -> list[str]:
    return [key for key, (_, family, _, _) in family_calls().items() if family not in ALLOWED_FAMILIES]


@pytest.mark.parametrize("policy", CONFINED_POLICIES)
def test_every_other_family_is_refused_with_eperm(policy: str, answers: dict[str, dict[str, str]]) -> None:
    """socket() and socketpair() of every family but the four, for every type, and any family number
    with bits above the int (AF_ALG | 1<<32): EPERM from the filter."""
    got = answers[policy]
    wrong = {key: got[key] for key in refused_family_calls() if got[key] != "EPERM"}
    assert not wrong


@pytest.mark.parametrize("policy", CONFINED_POLICIES)
def test_refused_protocols_on_allowed_families(policy: str, answers: dict[str, dict[str, str]]) -> None:
    """SCTP, DCCP, UDP-Lite, L2TP, MPTCP and the types only they serve, on AF_INET and AF_INET6, and
    every netlink protocol but NETLINK_ROUTE (sock_diag, generic netlink...): EPERM from the filter."""
    got = answers[policy]
    wrong = {key: got[key] for key in (*INET_REFUSED, *NETLINK_REFUSED) if got[key] != "EPERM"}
    assert not wrong


@pytest.mark.parametrize("policy", CONFINED_POLICIES)
def test_control_allowed_sockets_work(policy: str, answers: dict[str, dict[str, str]]) -> None:
    """Control, in the same sandbox: TCP and UDP over IPv4 and IPv6, Unix sockets and NETLINK_ROUTE are
    created; ping sockets get the kernel's answer (created, or EACCES outside ping_group_range);
    every allowed family gets something other than EPERM for each type (the kernel's own verdict)."""
    got = answers[policy]
    assert {key: got[key] for key in ALLOWED if got[key] != "OK"} == {}
    assert all(got[key] in ("OK", "EACCES") for key in KERNEL_DECIDES), {key: got[key] for key in KERNEL_DECIDES}
    for family in ALLOWED_FAMILIES:
        for kind in TYPES:
            if family in (AF_INET, AF_INET6) and kind not in ALLOWED_INET_TYPES:
                continue                                  # refused above (SCTP's seqpacket)
            if family in (AF_INET, AF_INET6) and kind == SOCK_RAW:
                continue                                  # the kernel's EPERM: no CAP_NET_RAW
            if kind in (2, 3) and family == 1:
                continue                                  # AF_UNIX datagrams: EACCES, whatever the network
            assert got[f"socket {family:#x} {kind}"] != "EPERM", (family, kind)


def test_control_kernel_answers_otherwise_without_the_filter(answers: dict[str, dict[str, str]]) -> None:
    """Control: under danger-full-access, as root, no call refused above gets EPERM from the kernel
    (it answers EAFNOSUPPORT, EPROTONOSUPPORT, ESOCKTNOSUPPORT... or creates the socket)."""
    got = answers["danger-full-access"]
    refused = [*refused_family_calls(), *INET_REFUSED, *NETLINK_REFUSED]
    assert {key: got[key] for key in refused if got[key] == "EPERM"} == {}


@settings(max_examples=300, deadline=None, database=None)
@given(bits=st.integers(1, 9), data=st.data())
def test_refused_blocks_cover_exactly_the_complement(bits: int, data: st.DataObject) -> None:
    """The filter's mask/value blocks match every number below 2**bits but the allowed ones, and
    never an allowed one (the rows above are built from them)."""
    allowed = frozenset(data.draw(st.sets(st.integers(0, (1 << bits) - 1), max_size=8)))
    blocks = refused_blocks(allowed, bits)
    for n in range(1 << bits):
        assert any(n & mask == value for mask, value in blocks) == (n not in allowed), n
