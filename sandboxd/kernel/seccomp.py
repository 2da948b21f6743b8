"""The seccomp filter: a second wall for dangerous system calls, even for root.

Rules are plain data here. They are compiled to BPF with libseccomp
(pyseccomp) once and cached by content hash, because importing the binding
costs more than a whole sandbox launch; the child loads the cached program
with one seccomp(2) call, the last step before exec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import zlib

from sandboxd import __version__
from sandboxd._record import Record
from sandboxd.kernel._libc import checked, raw_syscall

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCSETD = 0x5423
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16
SOCK_STREAM = 1
SOCK_DGRAM = 2
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF
NETLINK_ROUTE = 0
IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMPV6 = 1, 6, 17, 58
# The socket families a confined command may create, whatever its network: the Unix sockets
# every tool uses; TCP/UDP over IPv4 and IPv6, which the network namespace confines (without
# network only the sandbox's own loopback, which dev servers and tests use: probe NET-06);
# netlink for NETLINK_ROUTE alone, which getifaddrs() and getaddrinfo(AI_ADDRCONFIG) use to list
# the namespace's own interfaces. Every other family (AF_ALG, CAN, TIPC, RDS, Bluetooth, AF_PACKET,
# AF_VSOCK...) and every other netlink protocol is refused with EPERM before the kernel looks the
# family up, so a command never gets to load a family's module on demand.
ALLOWED_FAMILIES = frozenset({AF_UNIX, AF_INET, AF_INET6, AF_NETLINK})
# On AF_INET/AF_INET6: stream, datagram and raw sockets (raw needs CAP_NET_RAW, which no command
# has) of TCP, UDP and ping (ICMP); protocol 0 picks TCP or UDP. SCTP (132), DCCP (33), UDP-Lite,
# L2TP, MPTCP... and the types only they serve (SOCK_SEQPACKET, SOCK_RDM, SOCK_DCCP) are refused.
ALLOWED_INET_TYPES = frozenset({SOCK_STREAM, SOCK_DGRAM, SOCK_RAW})
ALLOWED_INET_PROTOCOLS = frozenset({0, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMPV6})
ALLOWED_NETLINK_PROTOCOLS = frozenset({NETLINK_ROUTE})
FAMILY_BITS, PROTOCOL_BITS, NETLINK_PROTOCOL_BITS = 6, 9, 5   # AF_MAX 46, IPPROTO_MAX 263, MAX_LINKS 32
MSG_FASTOPEN = 0x20000000
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                   0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

# Denied outright (EPERM): changing the mount tree or namespaces, loading code
# into the kernel, kernel keyrings, BPF, perf, handle-based opens that bypass
# the mount tree, userfaultfd (race amplifier for kernel exploits), io_uring
# (runs system calls this filter never sees), and clock/reboot/swap/accounting.
DENIED_SYSCALLS: tuple[str, ...] = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "keyctl", "add_key", "request_key", "perf_event_open",
    "open_by_handle_at", "name_to_handle_at", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "syslog", "acct", "swapon", "swapoff", "reboot", "iopl", "ioperm", "lookup_dcookie",
    "quotactl", "quotactl_fd", "nfsservctl", "uselib", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
)

S_ISUID = 0o4000
S_ISGID = 0o2000
O_CREAT = 0o100
O_TMPFILE_BIT = 0o20000000          # __O_TMPFILE: an unnamed file, linkable later, created with the mode given
# Calls that set a file's mode, by (syscall, index of the mode argument, index of the flags argument
# that must carry one of CREATING_FLAGS for the mode to be used, or -1 when it always is).
MODE_SETTING_CALLS: tuple[tuple[str, int, int], ...] = (
    ("chmod", 1, -1), ("fchmod", 1, -1), ("fchmodat", 2, -1), ("fchmodat2", 2, -1),
    ("creat", 1, -1), ("mkdir", 1, -1), ("mkdirat", 2, -1), ("mknod", 1, -1), ("mknodat", 2, -1),
    ("open", 2, 1), ("openat", 3, 2),
)
CREATING_FLAGS = (O_CREAT, O_TMPFILE_BIT)
# Numbers of calls newer than the system libseccomp may know by name; from 424 on every
# architecture shares one table, so one number serves all.
NEWER_SYSCALLS = {"fchmodat2": 452}
UNKNOWN_SYSCALL = -1                # what libseccomp resolves a name it does not know to (__NR_SCMP_ERROR)


MASKED_EQ, GREATER = 7, 6           # libseccomp's SCMP_CMP_MASKED_EQ and SCMP_CMP_GT
Rule = tuple[str, str, int, tuple[tuple[int, int, int, int], ...]]


def refused_blocks(allowed: frozenset[int], bits: int) -> list[tuple[int, int]]:
    """(mask, value) pairs that together match every number below 2**bits but ``allowed``, as
    aligned blocks (like CIDR prefixes), so a handful of comparisons covers a whole range."""
    blocks: list[tuple[int, int]] = []

    def cover(start: int, size: int) -> None:
        if not any(start <= n < start + size for n in allowed):
            blocks.append((0xFFFFFFFF & ~(size - 1), start))
        elif size > 1:
            cover(start, size // 2)
            cover(start + size // 2, size // 2)

    cover(0, 1 << bits)
    return blocks


def socket_rows() -> list[Rule]:
    """EPERM for every socket()/socketpair() a confined command has no use for: families outside
    ALLOWED_FAMILIES, and on the allowed ones the types and protocols outside their lists. The
    kernel reads these arguments as ints (the low 32 bits); any value with a bit set above the
    checked range, high bits included, is refused whole (GREATER compares all 64 bits)."""
    rows: list[Rule] = []
    for call in ("socket", "socketpair"):
        rows.append(("errno", call, errno.EPERM, ((0, GREATER, (1 << FAMILY_BITS) - 1, 0),)))
        rows.extend(("errno", call, errno.EPERM, ((0, MASKED_EQ, mask, value),))
                    for mask, value in refused_blocks(ALLOWED_FAMILIES, FAMILY_BITS))
        for family in (AF_INET, AF_INET6):
            is_family = (0, MASKED_EQ, 0xFFFFFFFF, family)
            rows.extend(("errno", call, errno.EPERM, (is_family, (1, MASKED_EQ, mask & SOCK_TYPE_MASK, value)))
                        for mask, value in refused_blocks(ALLOWED_INET_TYPES, 4))
            rows.append(("errno", call, errno.EPERM, (is_family, (2, GREATER, (1 << PROTOCOL_BITS) - 1, 0))))
            rows.extend(("errno", call, errno.EPERM, (is_family, (2, MASKED_EQ, mask, value)))
                        for mask, value in refused_blocks(ALLOWED_INET_PROTOCOLS, PROTOCOL_BITS))
        is_netlink = (0, MASKED_EQ, 0xFFFFFFFF, AF_NETLINK)
        rows.append(("errno", call, errno.EPERM, (is_netlink, (2, GREATER, (1 << NETLINK_PROTOCOL_BITS) - 1, 0))))
        rows.extend(("errno", call, errno.EPERM, (is_netlink, (2, MASKED_EQ, mask, value)))
                    for mask, value in refused_blocks(ALLOWED_NETLINK_PROTOCOLS, NETLINK_PROTOCOL_BITS))
    return rows


class FilterSpec(Record):
    """Which filter a launch gets. ``confined`` is every policy but DangerFullAccess. A confined
    sandbox gets the same filter in every network mode: where its network matters (which Unix
    socket or listener a connect() may reach), init's connect broker judges (launcher.connect_broker)."""

    confined: bool

    def rules(self) -> list[tuple[str, str, int, tuple[tuple[int, int, int, int], ...]]]:
        """(action, syscall, errno, ((arg, op, mask/value, value), ...)) rows, in a stable order."""
        rows: list[tuple[str, str, int, tuple[tuple[int, int, int, int], ...]]] = []
        masked_eq = 7
        # TIOCSTI/TIOCLINUX push input into a terminal. The kernel compares only
        # the low 32 bits of the request, so the rule does too (CVE-2019-10063).
        for request in (TIOCSTI, TIOCLINUX):
            rows.append(("errno", "ioctl", errno.EPERM, ((1, masked_eq, 0xFFFFFFFF, request),)))
        if not self.confined:
            return rows
        rows.extend(("errno", name, errno.EPERM, ()) for name in DENIED_SYSCALLS)
        # clone3 passes flags in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
        rows.append(("errno", "clone3", errno.ENOSYS, ()))
        for flag in NAMESPACE_FLAGS:
            rows.append(("errno", "clone", errno.EPERM, ((0, masked_eq, flag, flag),)))
        rows.extend(socket_rows())
        # TIOCSETD sets a terminal's line discipline, and for one not built in the kernel loads its
        # module (tty_ldisc_get: with dev.tty.ldisc_autoload=1, distributions' default, anyone may):
        # SLIP, PPP, CAN, HCI UART, ..., the module surface the socket rows close for families. Its
        # argument is a pointer to the number, which seccomp cannot read (it compares registers),
        # so "only N_TTY" cannot be said here; and checking it from a notifier would read memory
        # another thread of the sandbox can rewrite before the kernel reads it again. A confined
        # command has no use for another discipline, nor for setting N_TTY on a terminal that has
        # it already (every pty starts with N_TTY): refused outright.
        rows.append(("errno", "ioctl", errno.EPERM, ((1, masked_eq, 0xFFFFFFFF, TIOCSETD),)))
        # No set-uid or set-gid file, for any uid: root in a root-owned workspace would otherwise
        # leave a root shell any host user can run (capabilities do not stop an owner's chmod), and
        # a plain user one that runs as itself for everybody. A mode with either bit is refused on
        # every call that sets or creates a mode. openat2 passes its mode in memory seccomp cannot
        # read: ENOSYS makes libc fall back to openat. File capabilities need CAP_SETFCAP, which
        # no command has.
        for name, mode_arg, flags_arg in MODE_SETTING_CALLS:
            for bit in (S_ISUID, S_ISGID):
                if flags_arg < 0:
                    rows.append(("errno", name, errno.EPERM, ((mode_arg, masked_eq, bit, bit),)))
                    continue
                for flag in CREATING_FLAGS:
                    rows.append(("errno", name, errno.EPERM,
                                 ((flags_arg, masked_eq, flag, flag), (mode_arg, masked_eq, bit, bit))))
        rows.append(("errno", "openat2", errno.ENOSYS, ()))
        if self.brokers_connect:
            # An AF_UNIX datagram socket, even one from socketpair(), can sendto() (or sendmsg(),
            # whose address seccomp cannot read) any host socket path (syslog, journald, systemd
            # notify) without a connect, and with the host's network any abstract name of the
            # host: a confined sandbox gets none, whatever its network. Stream and seqpacket
            # sockets reach a path or a name only through connect(), which init brokers
            # (see sandboxd.launcher.connect_broker).
            # SOCK_RAW is turned into a datagram socket for AF_UNIX, so it goes too.
            for call in ("socket", "socketpair"):
                for kind in (SOCK_DGRAM, SOCK_RAW):
                    rows.append(("errno", call, errno.EACCES,
                                 ((0, 4, AF_UNIX, 0), (1, masked_eq, SOCK_TYPE_MASK, kind))))
            rows.append(("notify", "connect", 0, ()))
            # TCP Fast Open connects from sendto/sendmsg without a connect() the broker would see:
            # with the host's network that could reach sandboxd's own listeners.
            for call, flags_arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
                rows.append(("errno", call, errno.EPERM, ((flags_arg, masked_eq, MSG_FASTOPEN, MSG_FASTOPEN),)))
        return rows

    @property
    def brokers_connect(self) -> bool:
        # Every confined sandbox, the host's network included: init refuses sandboxd's own sockets
        # and listeners in every mode (launcher.connect_broker).
        return self.confined

    def cache_key(self) -> str:
        # Names the cached program; its integrity comes from the cache being root-only,
        # so a checksum is enough (hashlib would cost an OpenSSL load on every run).
        rules = repr(self.rules()).encode()
        kind = "confined" if self.confined else "open"
        return f"{__version__}-{os.uname().machine}-{kind}-{zlib.crc32(rules):08x}-{len(rules)}"


CACHE_DIR = "/var/cache/sandboxd/seccomp"
_memory_cache: dict[str, bytes] = {}


def program_for(spec: FilterSpec) -> bytes:
    """The BPF program for ``spec``: from memory, from the root-owned cache, or compiled now."""
    key = spec.cache_key()
    program = _memory_cache.get(key)
    if program is None:
        program = _read_cache(key)
        if program is None:
            program = compile_bpf(spec)
            _write_cache(key, program)
        _memory_cache[key] = program
    return program


def compile_bpf(spec: FilterSpec) -> bytes:
    import tempfile

    import pyseccomp  # slow to import: only on a cache miss

    action_of = {"errno": pyseccomp.ERRNO, "notify": lambda _code: pyseccomp.NOTIFY}
    filt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    # A system call from another ABI (int 0x80, x32) would bypass every rule
    # below, keyed on native numbers: kill the process instead.
    filt.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    for action, name, code, args in spec.rules():
        syscall: str | int = name
        if pyseccomp.resolve_syscall(pyseccomp.system_arch(), name) == UNKNOWN_SYSCALL:
            syscall = NEWER_SYSCALLS.get(name, UNKNOWN_SYSCALL)   # too new for this libseccomp's names
            if syscall == UNKNOWN_SYSCALL:
                continue                                # a syscall this architecture does not have needs no rule
        filt.add_rule(action_of[action](code), syscall, *[pyseccomp.Arg(a, op, x, y) for a, op, x, y in args])
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()


def _read_cache(key: str) -> bytes | None:
    path = os.path.join(CACHE_DIR, key + ".bpf")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # Only trust a file nobody but root could have written.
        if st.st_uid != 0 or st.st_mode & 0o022 or st.st_size % 8 or st.st_size == 0:
            return None
        return os.read(fd, st.st_size)
    finally:
        os.close(fd)


def _write_cache(key: str, program: bytes) -> None:
    if os.geteuid() != 0:
        return
    try:
        os.makedirs(CACHE_DIR, mode=0o755, exist_ok=True)
        tmp = os.path.join(CACHE_DIR, f".{key}.{os.getpid()}")
        with open(tmp, "wb") as out:
            out.write(program)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(CACHE_DIR, key + ".bpf"))
    except OSError:
        pass  # a cache we cannot write only costs speed


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3


def load(program: bytes, *, new_listener: bool = False) -> int:
    """Install the filter on the calling thread (no_new_privs must be set); return the listener fd or 0."""
    prog = _SockFprog(len(program) // 8, program)
    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER if new_listener else 0
    return checked(raw_syscall("seccomp", SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog)), "seccomp load")
