"""Approval channels: processes that answer approvals for their user's sessions on sockets of
their own (`sandboxd mcp --http`), kept out of every sandbox's reach (RegisterApprovalChannel).

The daemon's sockets are out of reach in every sandbox (hidden, refused by the connect broker,
refused again by the daemon). An MCP server that answers elicitations is as much an approval
channel as the daemon, but it listens where its user says (a loopback port, a Unix socket), and
a command in a `--network=host` sandbox, running as that user, could connect to it and approve
its own calls. So such a process registers with the daemon:

- the daemon finds the listening sockets the calling process holds itself (the front door's
  SO_PEERCRED pid; its descriptors, then /proc/net/tcp{,6} and sock_diag): nothing the request
  could name, so a user registers only sockets of its own process, never another program's
  port (which every sandbox would then lose). A TCP listener must be on a loopback address.
- it writes one entry per socket to the registry (launcher.channel_registry) that the connect
  broker of every sandbox reads on each connect(): this daemon's sessions and every
  `sandboxd run` on the machine (which opens the default daemon's registry and $SANDBOXD_SOCKET's).
  An entry names the socket (its inode) beside its address or file, and a broker refuses only
  while the socket found there is that one: a registration whose socket was closed blocks
  nobody's port or file, although it lasts as long as its process (and counts towards the bound);
- the entries are removed when that process exits (service.process_ties), and at start-up for
  processes that exited while no daemon ran;
- it answers with the caller's own directory (mode 0700) inside the daemon's place, which every
  sandbox hides: where `sandboxd mcp` writes its bearer token.

Bounds: at most MAX_LISTENERS_PER_UID registered listeners per user, and the caller's descriptor
table is walked only up to MAX_DESCRIPTORS entries.
"""

from __future__ import annotations

import errno
import functools
import logging
import contextlib
import os
import stat
import threading

import psutil

from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.kernel import peers, unix_diag
from sandboxd.launcher import channel_registry
from sandboxd.network.socket_files import own_directory
from sandboxd.service.callers import Caller
from sandboxd.service.process_ties import ProcessTies
from sandboxd.service.quotas import uid_owner
from sandboxd.v1 import sandboxd_pb2 as pb

log = logging.getLogger("sandboxd")
MAX_LISTENERS_PER_UID = 16
MAX_DESCRIPTORS = 4096


class ApprovalChannels:
    def __init__(self, place: str, ties: ProcessTies) -> None:
        """``place``: defaults.channels_dir of the daemon's socket; made here (root's, 0755: brokers
        trust nothing else, launcher.channel_registry.open_registries) if the daemon has not made it,
        with its registry, and what a dead daemon registered for processes now gone is removed."""
        self._place, self._registry = place, os.path.join(place, "listeners")
        self._ties = ties
        self._lock = threading.Lock()
        self._by_uid: dict[int, set[str]] = {}        # uid -> its entries in the registry
        own_directory(self._place, 0o755, role="the approval channels' directory")
        own_directory(self._registry, 0o755, role="the registry of approval channels")
        self._restore()
        # Where the registered sockets are: a broker asks there whether a Unix channel still is
        # bound to its file, and refuses when it cannot (channel_registry).
        self._namespace_entry = os.path.join(self._registry, channel_registry.network_namespace_entry(
            os.stat("/proc/self/ns/net").st_ino))
        _touch(self._namespace_entry)

    def withdraw(self) -> None:
        """Take back what the constructor wrote (a start that failed later: its directories are
        removed only when empty)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._namespace_entry)

    @property
    def registry(self) -> str:
        return self._registry

    def register(self, who: Caller) -> pb.ApprovalChannel:
        if who.principal or who.pid <= 0:
            raise InvalidPolicy("an approval channel registers from a local process on the daemon's Unix socket "
                                "(not through TLS; not from a pod: channels and their directory are kept per uid, "
                                "which pods share)")
        key = peers.process_key(who.pid)
        try:
            if key is None or psutil.Process(who.pid).uids().real != who.uid:
                raise InvalidPolicy(f"the calling process (pid {who.pid}) has exited")
            inodes = peers.socket_inodes(who.pid, MAX_DESCRIPTORS)
        except (OSError, psutil.Error):
            raise InvalidPolicy(f"the calling process (pid {who.pid}) has exited") from None
        except OverflowError as exc:
            raise InvalidPolicy(f"cannot register the approval channel: {exc}; register from a process "
                                "holding fewer descriptors") from None
        entries, shown = self._listeners(inodes, _entry_key(who.uid, key))
        if not entries:
            raise InvalidPolicy(f"the calling process (pid {who.pid}) holds no listening socket: listen first, "
                                "then register the channel")
        with self._lock:
            mine = self._by_uid.setdefault(who.uid, set())
            fresh = [name for name in entries if name not in mine]
            if len(mine) + len(fresh) > MAX_LISTENERS_PER_UID:
                raise Exhausted(f"uid {who.uid} has {len(mine)} approval channel listeners registered; at most "
                                f"{MAX_LISTENERS_PER_UID} (they go when their processes exit)")
            for name in fresh:
                _touch(os.path.join(self._registry, name))
                mine.add(name)
        if fresh and self._ties.tie(key, lambda: self._forget(who.uid, fresh), uid_owner(who.uid)) is None:
            self._forget(who.uid, fresh)              # it exited meanwhile
            raise InvalidPolicy(f"the calling process (pid {who.pid}) has exited")
        log.info("approval channel registered", extra={"fields": {"uid": who.uid, "pid": who.pid,
                                                                  "listeners": shown}})
        return pb.ApprovalChannel(listeners=shown, secrets_dir=self._secrets_dir(who))

    def _listeners(self, inodes: frozenset[int], key: str) -> tuple[list[str], list[str]]:
        """The registry entries of the listening sockets among ``inodes``, and how each is said."""
        entries, shown = [], []
        for address, port, inode in peers.tcp_listeners(inodes):
            if not address.is_loopback:
                raise InvalidPolicy(f"the calling process listens on {address}:{port}, not a loopback address: an "
                                    "approval channel listens on loopback or on a Unix socket only")
            entries.append(channel_registry.tcp_entry(address.packed, port, inode, key))
            shown.append(f"tcp {address}:{port}" if address.version == 4 else f"tcp [{address}]:{port}")
        for inode, identity in unix_diag.listening_socket_files().items():
            if inode in inodes:
                entries.append(channel_registry.unix_entry(identity, inode, key))
                shown.append(f"unix {identity[0]}:{identity[1]} inode {identity[2]}")
        return entries, shown

    def _secrets_dir(self, who: Caller) -> str:
        """The caller's own directory here: made for it (0700, its uid and gid), or checked to be that."""
        path = os.path.join(self._place, str(who.uid))
        try:
            os.mkdir(path, 0o700)
            os.chown(path, who.uid, who.gid)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != who.uid:
            raise OSError(errno.EEXIST, "not the caller's directory", path)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
        return path

    def _forget(self, uid: int, names: list[str]) -> None:
        with self._lock:
            mine = self._by_uid.get(uid, set())
            for name in names:
                mine.discard(name)
                try:
                    os.unlink(os.path.join(self._registry, name))
                except FileNotFoundError:
                    pass
            if not mine:
                self._by_uid.pop(uid, None)

    def _restore(self) -> None:
        """Entries a previous daemon made: kept (and tied again) while their process lives."""
        by_key: dict[str, list[str]] = {}
        for name in os.listdir(self._registry):
            if name.startswith(channel_registry.NETNS + "-"):
                os.unlink(os.path.join(self._registry, name))   # written again for this daemon
                continue
            by_key.setdefault(name.rsplit("-", 1)[-1], []).append(name)
        for entry_key, names in by_key.items():
            uid, key = _parse_entry_key(entry_key)
            if uid is None or key is None or \
                    self._ties.tie(key, functools.partial(self._forget, uid, names), uid_owner(uid)) is None:
                for name in names:
                    os.unlink(os.path.join(self._registry, name))
                continue
            self._by_uid.setdefault(uid, set()).update(names)


def _entry_key(uid: int, process_key: str) -> str:
    """The KEY of an entry (launcher.channel_registry): the uid and the process (peers.process_key:
    boot:pid:start), without the dashes entry names are split on."""
    boot, pid, start = process_key.split(":")
    return f"{uid}.{pid}.{start}.{boot.replace('-', '')}"


def _parse_entry_key(entry_key: str) -> tuple[int | None, str | None]:
    parts = entry_key.split(".")
    if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]) or len(parts[3]) != 32:
        return None, None
    boot = parts[3]
    return int(parts[0]), f"{boot[:8]}-{boot[8:12]}-{boot[12:16]}-{boot[16:20]}-{boot[20:]}:{parts[1]}:{parts[2]}"


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))

