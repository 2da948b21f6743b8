"""Where sandboxd keeps its own things by default: one place, light enough for `sandboxd run` to import.

Every sandbox hides these (launcher.rootfs step 8c) and refuses connect() to the socket
(launcher.connect_broker): a sandboxed command must never reach the daemon or its audit log,
also a one-shot `sandboxd run` next to a daemon on the same machine.
"""

SOCKET_DIR = "/run/sandboxd"
SOCKET = SOCKET_DIR + "/sandboxd.sock"
STATE_DIR = "/var/lib/sandboxd"
