"""Where sandboxd keeps its own things by default: one place, light enough for `sandboxd run` to import.

Every sandbox hides these (launcher.rootfs step 8c) and refuses connect() to the socket
(launcher.connect_broker): a sandboxed command must never reach the daemon or its audit log,
also a one-shot `sandboxd run` next to a daemon on the same machine.
"""

SOCKET_DIR = "/run/sandboxd"
SOCKET = SOCKET_DIR + "/sandboxd.sock"
STATE_DIR = "/var/lib/sandboxd"

# Sandboxes' own defaults, one constant each, used wherever the default applies.
# A workspace-write sandbox with network access gets a network namespace of its own (the other
# mode, "host", must be asked for: policy.sandbox.NETWORK_MODES).
NETWORK_MODE = "isolated"
# The egress proxy's port: on the host side of an isolated sandbox's link (network.egress_proxy,
# kernel.nftables lets the sandbox reach it), and on 127.0.0.1 inside a rootless one (launcher.rootless).
PROXY_PORT = 3128
