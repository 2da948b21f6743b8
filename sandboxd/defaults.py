"""Where sandboxd keeps its own things by default: one place, light enough for `sandboxd run` to import.

Every sandbox hides these (launcher.rootfs step 8c) and refuses connect() to the socket
(launcher.connect_broker): a sandboxed command must never reach the daemon or its audit log,
also a one-shot `sandboxd run` next to a daemon on the same machine.
"""

import os

SOCKET_DIR = "/run/sandboxd"
SOCKET = SOCKET_DIR + "/sandboxd.sock"
STATE_DIR = "/var/lib/sandboxd"
SOCKET_ENV = "SANDBOXD_SOCKET"           # the clients' choice of another daemon socket (`sandboxd run` hides it too)

# Directories a socket may sit in that are not sandboxd's own: hiding one of them would hide far
# more than sandboxd (resolv.conf's stub, other services' sockets), so only sandboxd's own
# entries in it are hidden then.
SHARED_DIRECTORIES = frozenset({"/", "/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm", "/var", "/var/lib", "/home",
                                "/root", "/srv", "/opt", "/etc", "/usr", "/mnt", "/media"})
# Beside the socket: the daemon's private directory (its gRPC server's socket, the front door's
# relay files), and what `sandboxd mcp --http` needs of the daemon (service.approval_channels):
# the registry of approval channels every sandbox's connect broker reads (launcher.channel_registry)
# and each user's secrets directory. In a directory of the daemon's own (/run/sandboxd) they are
# these two names; in a shared one, where any user may make a name first, both sit in one
# directory named after the socket (own_dir), which the daemon makes or refuses to start beside.
PRIVATE_DIR_NAME = ".sandboxd-private"
CHANNELS_DIR_NAME = ".sandboxd-mcp"
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def own_dir(socket_path: str) -> str | None:
    """The directory of the daemon of ``socket_path`` beside it when the socket sits in a shared
    directory (SHARED_DIRECTORIES), else None (the socket's directory is the daemon's own). Named
    after the socket, so daemons in one shared directory never share one: ``.sandboxd-`` and the
    socket's name (letters, digits and ``._-`` only, at most 24 of them: the front door's relay
    directory is below it, and Unix socket paths are short), then 8 hex digits of the SHA-256 of
    the socket's absolute path."""
    socket_path = os.path.abspath(socket_path)
    base, name = os.path.split(socket_path)
    if base not in SHARED_DIRECTORIES:
        return None
    import hashlib

    plain = "".join(c if c in _PLAIN else "_" for c in name)[:24]
    return os.path.join(base, f".sandboxd-{plain}-{hashlib.sha256(os.fsencode(socket_path)).hexdigest()[:8]}")


def private_dir(socket_path: str) -> str:
    """The private directory (0700) of the daemon of ``socket_path`` (see above)."""
    shared = own_dir(socket_path)
    if shared is not None:
        return os.path.join(shared, "private")
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), PRIVATE_DIR_NAME)


def channels_dir(socket_path: str) -> str:
    """Where the daemon of ``socket_path`` keeps what approval channels need (see above)."""
    shared = own_dir(socket_path)
    if shared is not None:
        return os.path.join(shared, "mcp")
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), CHANNELS_DIR_NAME)


def channel_registry(socket_path: str) -> str:
    """The registry of approval channels of the daemon of ``socket_path`` (launcher.channel_registry)."""
    return channels_dir(socket_path) + "/listeners"


def daemon_hidden_paths(socket_path: str) -> tuple[str, ...]:
    """What of the daemon of ``socket_path`` every sandbox hides, its state directory aside: the
    socket's directory, or in a shared directory the daemon's own entries there."""
    socket_path = os.path.abspath(socket_path)
    shared = own_dir(socket_path)
    if shared is not None:
        return (socket_path, shared)
    return (os.path.dirname(socket_path),)

def review_bases(uid: int, home: str, state_home: str = "") -> tuple[str, ...]:
    """Where `sandboxd run --review` keeps a user's change sets (cli.run_review.base_dir), in the
    order it tries them: ``$XDG_STATE_HOME/sandboxd/reviews`` (``state_home``) when set; else for
    root STATE_DIR/run-reviews (hidden with the rest of the state), for a plain user
    ``~/.local/state/sandboxd/reviews`` then ``/var/tmp/sandboxd-reviews-UID``."""
    if not os.path.isabs(state_home):
        state_home = ""                     # the XDG spec: a relative path is invalid, to be ignored
    if uid == 0:
        return (os.path.join(state_home, "sandboxd", "reviews") if state_home else STATE_DIR + "/run-reviews",)
    state = state_home or os.path.join(home, ".local", "state")
    return (os.path.join(state, "sandboxd", "reviews"), f"/var/tmp/sandboxd-reviews-{uid}")


def owner_hidden_paths(uid: int, home: str, state_home: str = "") -> tuple[str, ...]:
    """A user's places every sandbox of that user hides (LaunchSpec.owner_hidden): the bases of
    their kept change sets, with and without ``state_home``, so that no sandbox of theirs rewrites
    a change set kept for their review."""
    return tuple(dict.fromkeys((*review_bases(uid, home, state_home), *review_bases(uid, home))))


# Sandboxes' own defaults, one constant each, used wherever the default applies.
# A workspace-write sandbox with network access gets a network namespace of its own (the other
# mode, "host", must be asked for: policy.sandbox.NETWORK_MODES).
NETWORK_MODE = "isolated"
# The egress proxy's port: on the host side of an isolated sandbox's link (network.egress_proxy,
# kernel.nftables lets the sandbox reach it), and on 127.0.0.1 inside a rootless one (launcher.rootless).
PROXY_PORT = 3128
# Transparent capture's port, on 127.0.0.1 inside a proxied isolated sandbox: its TCP to ports 80
# and 443 of any address but its own is redirected there (kernel.nftables.egress_ruleset), and the
# egress proxy serves it by the name the connection carries (network.transparent).
TRANSPARENT_PORT = 3129
