"""Which process is on the other end of a connection, and which PID namespace it runs in (/proc).

The daemon refuses callers that run inside a sandbox (service.sandboxed_peers). For a Unix
connection the kernel names the peer's pid (SO_PEERCRED); for a TCP connection only its address
is known, so the socket is looked up in /proc/net/tcp{,6} (its inode) and then among the open
descriptors of the processes that live in a PID namespace other than ours (the only ones that
can be sandboxed).

Processes are listed and read through psutil (the daemon's side only: ``sandboxd run`` never
imports this module). Three reads stay by hand, for what psutil does not give:

- a process's pid inside its own namespace (``NSpid`` of /proc/PID/status);
- the socket inodes a process holds (psutil's ``Process.net_connections`` gives no inode, and
  re-reads the TCP tables of the process's network namespace for every process asked);
- the client sockets of a connection, from /proc/net/tcp{,6}: ``psutil.net_connections`` gives no
  inode either (the verdict cache of sandboxed_peers keys on it), and it finds each socket's
  process by reading every descriptor of every process on the host on each call: a pass a local
  user can inflate at will, on every call of a TCP caller. Here only the sockets are read, and the
  descriptors of the processes outside our PID namespace only when the connection is new.
"""

from __future__ import annotations

import ipaddress
import os

import psutil

from sandboxd.kernel.addresses import SHORT_OF_RESOURCES, proc_net_address, tcp_table_rows
from sandboxd.kernel.process import descriptor_targets

def pid_namespace(pid: int) -> int | None:
    """The inode number of ``pid``'s PID namespace, or None when the process is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def namespace_init(namespace: int) -> int | None:
    """The host pid of the process that is PID 1 of ``namespace``, if it still runs."""
    for pid in psutil.pids():
        if pid_namespace(pid) != namespace:
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NSpid:"):
                        if line.split()[-1] == b"1":
                            return pid
                        break
        except OSError as exc:
            if exc.errno in SHORT_OF_RESOURCES:
                raise                             # nothing is known: not "no such process"
            continue
    return None


def start_time(pid: int) -> float | None:
    """When ``pid`` started (the kernel's start time, in clock ticks since boot, as seconds since
    the epoch): with the pid, names one process for good. A step of the wall clock changes it
    (psutil adds the boot time as the clock says it now): a verdict kept by it is then judged
    again, never matched to another process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def command_line(pid: int) -> str:
    """``pid``'s command line, its arguments joined by spaces ("" when it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def pids_holding(inodes: "set[int] | frozenset[int]") -> set[int]:
    """Host pids holding a socket of ``inodes``, among processes outside our own PID namespace
    (an empty set when the sockets are gone, or their owners share our namespace)."""
    if not inodes:
        return set()
    wanted = {f"socket:[{inode}]" for inode in inodes}
    ours = pid_namespace(os.getpid())
    return {pid for pid in psutil.pids() if pid_namespace(pid) not in (ours, None) and _holds(pid, wanted)}


def _holds(pid: int, wanted: set[str]) -> bool:
    try:
        return not wanted.isdisjoint(descriptor_targets(pid))
    except OSError as exc:
        if exc.errno in SHORT_OF_RESOURCES:
            raise                                 # could not look: not "holds none"
        return False


def tcp_client_inodes(peer_host: str, peer_port: int, server_port: int) -> frozenset[int]:
    """Inodes of sockets whose local address is the peer's and remote port is ours (the client
    ends of such connections), from the host's /proc/net/tcp and tcp6. OSError when a table cannot
    be read for want of a descriptor or memory (SHORT_OF_RESOURCES): "none" would be a wrong answer."""
    inodes = set()
    for fields in tcp_table_rows(strict=True):
        local, remote, inode = fields[1], fields[2], int(fields[9])
        if int(local.rsplit(":", 1)[1], 16) != peer_port or int(remote.rsplit(":", 1)[1], 16) != server_port:
            continue
        if _same_host(local.rsplit(":", 1)[0], peer_host):
            inodes.add(inode)
    return frozenset(inodes)


def _same_host(hex_address: str, host: str) -> bool:
    """Whether /proc/net/tcp's hex address is ``host``."""
    try:
        return proc_net_address(hex_address) == ipaddress.ip_address(host.strip("[]"))
    except ValueError:                    # not an address: nothing there is it
        return False


def socket_inodes(pid: int, limit: int) -> frozenset[int]:
    """The inodes of the sockets ``pid`` holds open; OSError when the process is gone, or when it
    holds more than ``limit`` descriptors (OverflowError: the walk is bounded, a caller's
    descriptor table is its own to inflate)."""
    count = len(os.listdir(f"/proc/{pid}/fd"))
    if count > limit:
        raise OverflowError(f"the process holds {count} descriptors (more than {limit})")
    return frozenset(int(target[len("socket:["):-1]) for target in descriptor_targets(pid)
                     if target.startswith("socket:[") and target.endswith("]"))


def tcp_listeners(inodes: "set[int] | frozenset[int]") -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address,
                                                                    int, int]]:
    """(address, port, inode) of the listening TCP sockets among ``inodes``, from this network
    namespace's /proc/net/tcp{,6} (an IPv4-mapped address as the IPv4 one)."""
    found = []
    for fields in tcp_table_rows():
        if fields[3] != "0A" or int(fields[9]) not in inodes:      # 0A: TCP_LISTEN
            continue
        host, _, port = fields[1].rpartition(":")
        found.append((proc_net_address(host), int(port, 16), int(fields[9])))
    return found


def process_key(pid: int) -> str | None:
    """A name for the process ``pid`` that no other process ever has: this boot's id, the pid and
    its start time (clock ticks since boot, /proc/PID/stat). None when it is gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields are counted after its last ")".
    fields = stat[stat.rindex(b")") + 2:].split()
    return f"{boot}:{pid}:{int(fields[19])}"


def namespace_depth(pid: int) -> int | None:
    """How many PID namespaces ``pid`` is in, counted from the one /proc shows (``NSpid`` of
    /proc/PID/status, which any user may read, whatever the process): 1 in ours, more in a
    namespace below it (a sandbox, a container). None when the process is gone; OSError when its
    status could not be opened for want of a descriptor (SHORT_OF_RESOURCES)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return len(line.split()) - 1
    except OSError as exc:
        if exc.errno in SHORT_OF_RESOURCES:
            raise
        return None
    return 1                                  # a kernel before 4.1: no NSpid, no way to tell


def holder_in_namespace(inodes: "set[int] | frozenset[int]", uid: int, namespace: int, first: int = 0) -> int:
    """A process of ``uid`` in the PID namespace ``namespace`` that holds a socket of ``inodes``,
    among those whose descriptors this process may list (its own user's dumpable ones), ``first``
    looked at first (the one found last time: a client keeps its process); 0 when there is none.
    A process below that namespace (a sandbox) never counts. OSError when the processes could
    not be read for want of a descriptor (SHORT_OF_RESOURCES): 0 would then be a wrong answer."""
    wanted = {f"socket:[{inode}]" for inode in inodes}

    def holds(pid: int) -> bool:
        try:
            return (os.stat(f"/proc/{pid}").st_uid == uid and os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace
                    and not wanted.isdisjoint(descriptor_targets(pid)))
        except OSError as exc:
            if exc.errno in SHORT_OF_RESOURCES:
                raise
            return False                    # gone, or not ours to read
    if first > 0 and holds(first):
        return first
    return next((int(name) for name in os.listdir("/proc") if name.isdigit() and holds(int(name))), 0)
