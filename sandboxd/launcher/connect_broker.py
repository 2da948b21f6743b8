"""The connect broker: init performs every connect() of every confined sandbox.

Why: a network namespace cuts off TCP and abstract Unix sockets, but not
*pathname* Unix sockets: any host socket file the sandbox can see and write
(a Docker socket, a database socket, the D-Bus system bus, whatever its mode)
could be connected to. Landlock can restrict that only from ABI 8
(LANDLOCK_ACCESS_FS_RESOLVE_UNIX); this machine has ABI 7. So the command's
seccomp filter turns connect() into a user notification, and init, which
shares the sandbox's mount namespace, root and uid, performs the call:

- sandboxd's own sockets (its public socket, its private backend, by inode) and, with the
  host's network, its TCP listeners (TLS, metrics: their port at any address of this host, in
  any spelling, see kernel.addresses): EACCES in every mode, whatever else the
  policy allows. The daemon also hides their directory inside every sandbox (rootfs step 8c)
  and refuses a connection whose peer runs in a sandbox; this is the wall between the two.
- AF_UNIX pathname: resolved as the caller would (its cwd, our shared root); allowed only when
  the socket is the sandbox's own, or is one the policy names (allowed_unix_sockets) and the
  caller may connect to. Anything else: EACCES, in every network mode. The connect goes through
  /proc/self/fd/N of the inode that was checked, so a rename in between changes nothing.
  "The sandbox's own", without network or with an isolated one: the socket file is bound by a
  socket of the sandbox's network namespace (NETLINK_SOCK_DIAG), i.e. made inside it. With the
  host's network every socket is the host namespace's, so that says nothing: there the socket
  bound to the file must be one a process of the sandbox holds open. Init looks at the sockets
  the sandbox's processes hold (their descriptors, read in /proc, which shows init the sandbox's
  PID namespace only; each duplicated with pidfd_getfd and asked what it is) and asks sock_diag
  which file each Unix socket bound to a path is bound to, once per socket (by its SO_COOKIE:
  a binding is for good). The cost grows with the sandbox's sockets, never with the host's. A
  file is bound by one socket for good, and init holds the file open: the connect reaches that
  socket or none. Bound by none: ECONNREFUSED, as the kernel would answer, without connecting
  (told by a datagram probe, which the kernel refuses with EPROTOTYPE when a stream or seqpacket
  socket is bound there and with ECONNREFUSED when none is, and which reaches nobody). Files
  are named as sock_diag names them: by their superblock's device (kernel.superblocks; stat()
  reports another for btrfs subvolumes).
- AF_UNIX abstract, with the host's network: the host's abstract namespace (an X server's
  @/tmp/.X11-unix/X0, an abstract D-Bus address), so the same rule: a process of the sandbox must
  hold a socket of the caller's type bound to that name (names are unique per type: the one the
  connect reaches), else ECONNREFUSED, as if the name were free, which it is in the sandbox's own
  namespace without network: the host's names are not the sandbox's to see. Unlike a file, a
  name can pass to another socket between the check and the connect: only if the sandbox's
  socket closes and a host process binds the same name in those microseconds (see
  docs/policies.md). Without network or with an isolated one: performed as asked, the sandbox's
  own namespace confines them.
- Approval channels (`sandboxd mcp --http`'s listeners, registered with the daemon while their
  process lives: launcher.channel_registry): EACCES in every mode, by the bound file for a Unix
  socket (whatever allowed_unix_sockets names), by address and port with the host's network; the
  registry is read on each such connect, so a channel that appeared after the sandbox was built is
  refused too. An entry stands for its socket, not its address: a connect is refused only while
  the socket found there is the registered one (the listener the kernel finds at that address and
  port, inet_diag; the registered socket still bound to that file, unix_diag in the daemon's
  network namespace), so a channel that closed its listener blocks nobody's port or file. When
  that cannot be told, the connect is refused. No sandboxed code reaches a channel that answers
  approvals.
- Cloud metadata services (policy.network.METADATA_ADDRESSES, in every spelling a sockaddr can
  hold: IPv4, IPv6, IPv4-mapped, IPv4-compatible, NAT64's 64:ff9b::/96; policy.network.metadata_packed):
  EACCES in every mode, TCP and UDP, whatever the policy allows; with the host's network nothing
  else stands between the sandbox and them. One exception: port 53 of one that is the sandbox's DNS
  resolver (Google's 169.254.169.254), as the host itself resolves. TCP Fast Open, which connects
  without a connect(), is refused outright by the seccomp filter.
- Any other family (TCP): performed as asked; the network namespace confines it (with the
  host's network, only sandboxd's listeners and approval channels are refused). Unix datagram
  sockets, which reach a path by sendto() without a connect(), are refused in every confined
  sandbox by the seccomp filter (kernel.seccomp).

Init never lets the kernel continue a call it inspected: another thread of
the caller could rewrite the address in between (the documented seccomp
user-notification race). It connects a duplicate of the caller's socket
(pidfd_getfd) with its own copy of the address.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import _thread
import errno
import fcntl
import os
import stat
import struct

# addresses (ipaddress, functools and collections with it: about 5 ms, a tenth of `sandboxd run`)
# is needed only when there are sandboxd listeners to refuse (the daemon's sessions), and then
# plan.prepare imports it in the process that forks init: init runs as the sandbox's user, who may
# be unable to read the interpreter's library or the package (a pyenv Python under /root, say), so
# an import there would fail. _is_sandboxd_listener finds it in sys.modules.
from sandboxd.kernel import inet_diag, process, seccomp_notify, superblocks, unix_diag
from sandboxd.kernel._libc import raw_syscall
from sandboxd.launcher import channel_registry
from sandboxd.policy.network import metadata_packed  # pure, loaded with the policy before init forks

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import TypeVar

    from sandboxd.launcher.plan import BrokerRules

    K = TypeVar("K")
    V = TypeVar("V")

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
SOL_SOCKET = 1
SO_COOKIE = 57
COOKIE_SIZE = 8
MAX_SOCKADDR = 128
SOCKADDR_UN_SIZE = 110                   # sizeof(struct sockaddr_un): the kernel refuses a longer one (EINVAL)
MAX_REMEMBERED = 4096                    # entries of each cache below; past it, it starts again

# What the brokers of this init learnt for good (a session's calls have a broker each):
# the file a Unix socket is bound to, by the socket's SO_COOKIE (a binding is for good, and a
# cookie never names another socket); and the approval channels' Unix sockets found closed, as
# (file, socket inode) (a socket bound to a file that is gone never binds it again).
_bound_files: dict[bytes, tuple[int, int, int]] = {}
_closed_channels: dict[tuple[tuple[int, int, int], int], bool] = {}


class ConnectBroker:
    def __init__(self, listener: int, rules: "BrokerRules") -> None:
        """``rules``: what the policy allows and what is sandboxd's own (launcher.plan.BrokerRules)."""
        self.listener = listener
        self.rules = rules
        self._last_holder = 0             # a hint only: every verdict reads the descriptors again

    def handle_one(self) -> None:
        notification = seccomp_notify.receive(self.listener)
        if notification is None:
            return
        prepared = self._prepare(notification)
        if not isinstance(prepared, tuple):
            if prepared is not None:
                seccomp_notify.respond(self.listener, notification.id, prepared)
            return
        sock, address = prepared
        if fcntl.fcntl(sock, fcntl.F_GETFL) & os.O_NONBLOCK:
            self._finish(notification, sock, address)
        else:
            # A blocking connect may wait on a full backlog for as long as it likes;
            # doing it here would stall every other connect in the sandbox and the
            # reaping of its processes. (_thread: always loaded, nothing to import.)
            _thread.start_new_thread(self._finish, (notification, sock, address))

    def _prepare(self, n: seccomp_notify.Notification) -> "tuple[int, bytes] | int | None":
        """(duplicate of the caller's socket, copy of the address), or the answer (-errno), or None
        when the caller is gone."""
        fd, address_ptr, length = n.args[0] & 0xFFFFFFFF, n.args[1], n.args[2] & 0xFFFFFFFF
        if length < 2 or length > MAX_SOCKADDR:
            return -errno.EINVAL
        # n.pid is the calling *thread*; pidfd_open wants its thread group (the process: its
        # descriptor table is what pidfd_getfd reads). A connect() from any thread but the main
        # one would otherwise never be answered, and hang.
        pidfd = raw_syscall("pidfd_open", _thread_group(n.pid), 0)
        if pidfd < 0:
            return None  # the caller is gone
        try:
            try:
                address = seccomp_notify.read_memory(n.pid, address_ptr, length)
            except OSError as exc:
                # EPERM: a ptrace-attach check refused init (Yama's ptrace_scope: docs/policies.md),
                # the sandbox's wall, not the caller's address; anything else is the address's fault.
                return -errno.EPERM if exc.errno == errno.EPERM else -errno.EFAULT
            # The caller still waits, so the pidfd opened above is really it.
            if not seccomp_notify.still_valid(self.listener, n.id):
                return None
            sock = raw_syscall("pidfd_getfd", pidfd, fd, 0)
            return sock if sock < 0 else (sock, address)
        finally:
            os.close(pidfd)

    def _finish(self, n: seccomp_notify.Notification, sock: int, address: bytes) -> None:
        try:
            family = struct.unpack_from("=H", address)[0]
            if family == AF_UNIX:
                result = self._connect_unix(n.pid, sock, address)
            elif family in (AF_INET, AF_INET6) and _is_metadata(address, self.rules.metadata_resolvers):
                result = -errno.EACCES           # a cloud metadata service, in every mode
            elif family in (AF_INET, AF_INET6) and self.rules.host_network and (
                    _is_sandboxd_listener(address, self.rules.denied_listeners)
                    or self._is_approval_channel(address)):
                result = -errno.EACCES           # sandboxd's own TLS or metrics listener, or an approval channel
            else:
                result = seccomp_notify.connect_raw(sock, address)
        except OSError as exc:
            result = -(exc.errno or errno.EIO)
        except Exception:  # noqa: BLE001 - a judgement that fails refuses, and init lives on
            result = -errno.EACCES
        finally:
            os.close(sock)
        try:
            seccomp_notify.respond(self.listener, n.id, result)
        except OSError:
            pass  # the caller was killed meanwhile

    def _is_approval_channel(self, address: bytes) -> bool:
        """Whether a TCP connect() would reach a registered approval channel (launcher.channel_registry):
        its address and port are registered, and the listener the kernel finds there is the
        registered socket (asked in the sandbox's network namespace, the host's: where the connect
        goes). OSError when the registry cannot be read or the listener told (the connect is refused)."""
        if not self.rules.channel_fds:
            return False
        destination = channel_registry.tcp_destination(address)
        if destination is None:
            return False
        registered = channel_registry.read(self.rules.channel_fds).tcp.get(destination)
        if not registered:
            return False                                  # most connects stop here
        listener = inet_diag.tcp_listener_at(*destination)
        return listener is not None and listener[1] in registered

    def _connect_unix(self, pid: int, sock: int, address: bytes) -> int:
        if len(address) > SOCKADDR_UN_SIZE:
            return -errno.EINVAL
        path = address[2:].split(b"\0", 1)[0] if address[2:3] != b"\0" else b""
        if not path:
            if self.rules.host_network and len(address) > 2:
                return self._connect_abstract(sock, address)
            # Abstract without the host's network: scoped to the sandbox's own network namespace.
            # Unnamed (the family alone): the kernel's EINVAL.
            return seccomp_notify.connect_raw(sock, address)
        try:
            if path.startswith(b"/"):
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            else:
                cwd = os.open(f"/proc/{pid}/cwd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    target = os.open(path, os.O_PATH | os.O_CLOEXEC, dir_fd=cwd)
                finally:
                    os.close(cwd)
        except OSError as exc:
            return -(exc.errno or errno.ENOENT)
        try:
            st = os.fstat(target)
            if not stat.S_ISSOCK(st.st_mode):
                return -errno.ECONNREFUSED
            seen = unix_diag.file_identity(st)            # as stat() says: how the plan names files
            if seen in self.rules.denied:
                return -errno.EACCES  # sandboxd's own socket, reached through a link or a leftover name
            channels = channel_registry.read(self.rules.channel_fds) if self.rules.channel_fds else None
            allowed = seen in self.rules.allowed
            if allowed and not (channels and channels.unix):
                return self._connect_through(sock, target)
            file = superblocks.identity(target, st)      # as sock_diag says: how sockets name their files
            if channels and file in channels.unix and self._is_channel_bound(file, channels):
                return -errno.EACCES  # an approval channel (`sandboxd mcp --http`), whatever the policy allows
            if not allowed:
                refusal = self._unless_own_file(target, path, file)
                if refusal:
                    return refusal    # a host socket the policy does not name
            return self._connect_through(sock, target)
        finally:
            os.close(target)

    @staticmethod
    def _connect_through(sock: int, target: int) -> int:
        """connect() to the file open on ``target``, the one that was checked."""
        return seccomp_notify.connect_raw(sock, struct.pack("=H", AF_UNIX) + b"/proc/self/fd/%d\0" % target)

    def _is_channel_bound(self, file: tuple[int, int, int], channels: channel_registry.Registered) -> bool:
        """Whether one of the approval channels registered as bound to ``file`` still is: asked of
        sock_diag in the host's network namespace (the daemon's, where the channels are), on the
        socket init opened there; True when that cannot be told (init could not open that socket,
        or a registry's daemon runs in another namespace): the connect is refused."""
        if self.rules.host_diag_fd < 0 or channels.network_namespaces != {self.rules.host_network_namespace}:
            return True
        for socket_inode in channels.unix[file]:
            if (file, socket_inode) in _closed_channels:
                continue
            if unix_diag.socket_file(socket_inode, fd=self.rules.host_diag_fd) == file:
                return True
            _remember(_closed_channels, (file, socket_inode), True)
        return False

    def _unless_own_file(self, target: int, path: bytes, file: tuple[int, int, int]) -> int:
        """0 when the socket file ``file`` is the sandbox's own (see the module's docstring), else
        the answer: -EACCES, or -ECONNREFUSED when no socket is bound to it (host network)."""
        if not self.rules.host_network:
            return 0 if file in unix_diag.bound_socket_files() else -errno.EACCES
        # The sandbox's Unix sockets bound to a path: the one whose binding is known is judged at
        # once; the others are asked of sock_diag, those bound by the name the caller gave first.
        unknown = []
        for pid, socket_inode, _, name, cookie in self._held_unix_sockets():
            if isinstance(name, bytes):
                continue                                  # abstract
            if cookie in _bound_files:
                if _bound_files[cookie] == file:
                    self._last_holder = pid
                    return 0
            else:
                unknown.append((os.fsencode(name) != path, pid, socket_inode, cookie))
        for _, pid, socket_inode, cookie in sorted(unknown):
            bound = unix_diag.socket_file(socket_inode, cookie)
            if bound is not None:
                _remember(_bound_files, cookie, bound)
            if bound == file:
                self._last_holder = pid
                return 0
        return -errno.ECONNREFUSED if _nothing_bound(target) else -errno.EACCES

    def _connect_abstract(self, sock: int, address: bytes) -> int:
        """A connect() to an abstract name with the host's network: only to a socket a process of
        the sandbox holds (the module's docstring)."""
        caller = _socket.socket(fileno=sock)
        try:
            kind = caller.type
        finally:
            caller.detach()                 # ``sock`` stays open: _finish closes it
        name = address[2:]
        for pid, _, held_kind, held_name, _ in self._held_unix_sockets():
            if held_kind == kind and held_name == name:
                self._last_holder = pid
                return seccomp_notify.connect_raw(sock, address)
        return -errno.ECONNREFUSED          # the host's (an X server, a D-Bus bus, an agent), or nobody's

    def _held_unix_sockets(self) -> "Iterator[tuple[int, int, int, str | bytes, bytes]]":
        """(pid, socket inode, type, address as getsockname() gives it: a path as str, an abstract
        name as bytes, SO_COOKIE) of each Unix socket bound to an address that a process of the
        sandbox holds (kernel.process.held_sockets; the one that held the last match looked at
        first: its clients come back to it). Each is a duplicate (pidfd_getfd) asked, then closed."""
        pidfds: dict[int, int] = {}
        try:
            for pid, fd, socket_inode in process.held_sockets(self._last_holder):
                if pid not in pidfds:
                    pidfds[pid] = raw_syscall("pidfd_open", pid, 0)
                duplicate = raw_syscall("pidfd_getfd", pidfds[pid], fd, 0) if pidfds[pid] >= 0 else -1
                if duplicate < 0:
                    continue                              # gone, or not ours to take
                try:
                    held = _socket.socket(fileno=duplicate)
                except OSError:
                    os.close(duplicate)                   # no longer a socket
                    continue
                try:
                    if held.family != AF_UNIX:
                        continue
                    name = held.getsockname()
                    if not name:
                        continue                          # bound to nothing
                    cookie = held.getsockopt(SOL_SOCKET, SO_COOKIE, COOKIE_SIZE)
                    described = (pid, socket_inode, held.type, name, cookie)
                except OSError:
                    continue
                finally:
                    held.close()
                yield described
        finally:
            for pidfd in pidfds.values():
                if pidfd >= 0:
                    os.close(pidfd)


def _nothing_bound(target: int) -> bool:
    """Whether no socket is bound to the socket file open on ``target``: a datagram socket's
    connect() to it fails with ECONNREFUSED then, and with EPROTOTYPE when a stream or seqpacket
    socket is bound there; it reaches nobody (a datagram connect only names the peer)."""
    probe = _socket.socket(AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
    try:
        probe.connect(b"/proc/self/fd/%d" % target)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _remember(cache: "dict[K, V]", key: "K", value: "V") -> None:
    if len(cache) >= MAX_REMEMBERED:
        cache.clear()                     # bounded; what was known is asked again
    cache[key] = value


def _thread_group(tid: int) -> int:
    """The process (thread group id) a thread belongs to; ``tid`` itself if it cannot be read."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return tid


def _is_metadata(address: bytes, resolvers: "frozenset[bytes]") -> bool:
    """Whether an AF_INET/AF_INET6 sockaddr is a cloud metadata service's (not port 53 of one of
    ``resolvers``). A sockaddr too short to hold an address is the kernel's to refuse (EINVAL)."""
    family = struct.unpack_from("=H", address)[0]
    packed = address[4:8] if family == AF_INET else address[8:24]
    if len(packed) not in (4, 16) or not metadata_packed(packed):
        return False
    return not (packed in resolvers and struct.unpack_from("!H", address, 2)[0] == 53)


def _is_sandboxd_listener(address: bytes, listeners: "tuple[tuple[str, int], ...]") -> bool:
    """Whether an AF_INET/AF_INET6 sockaddr may reach one of sandboxd's listeners: the same port
    at any address of this host, in any spelling (0.0.0.0, ::, all of 127/8, ::1, IPv4-mapped or
    -compatible IPv6, every interface's address: kernel.addresses). Judging "this host" rather
    than the listener's own address means no spelling of it can slip past a comparison."""
    if not listeners or len(address) < 4:
        return False
    port = struct.unpack_from("!H", address, 2)[0]
    if all(port != listen_port for _, listen_port in listeners):
        return False                                      # most connects stop here
    from sandboxd.kernel import addresses              # loaded already: plan.prepare (see the imports)
    destination = addresses.sockaddr_destination(address)
    return destination is not None and addresses.is_this_host(destination[0], destination[2])
