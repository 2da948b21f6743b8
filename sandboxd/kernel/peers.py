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

from sandboxd.kernel.addresses import proc_net_address

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
        except OSError:
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
    found = set()
    for pid in psutil.pids():
        if pid_namespace(pid) in (ours, None):
            continue
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"/proc/{pid}/fd/{name}") in wanted:
                    found.add(pid)
                    break
            except OSError:
                continue
    return found


def tcp_client_inodes(peer_host: str, peer_port: int, server_port: int) -> frozenset[int]:
    """Inodes of sockets whose local address is the peer's and remote port is ours (the client
    ends of such connections), from the host's /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    local, remote, inode = fields[1], fields[2], int(fields[9])
                    if int(local.rsplit(":", 1)[1], 16) != peer_port or int(remote.rsplit(":", 1)[1], 16) != server_port:
                        continue
                    if _same_host(local.rsplit(":", 1)[0], peer_host):
                        inodes.add(inode)
        except OSError:
            continue
    return frozenset(inodes)


def _same_host(hex_address: str, host: str) -> bool:
    """Whether /proc/net/tcp's hex address is ``host``."""
    try:
        return proc_net_address(hex_address) == ipaddress.ip_address(host.strip("[]"))
    except ValueError:                    # not an address: nothing there is it
        return False
