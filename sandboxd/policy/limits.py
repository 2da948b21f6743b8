"""Resource limits of one launch (pure data and parsing)."""

from __future__ import annotations

import math

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sized

_FACTORS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

DEFAULT_TMP_SIZE = 512 << 20
# Terminals (ptys) one sandbox's own devpts may hold at once (its `max=`). Every devpts instance
# but the host's draws on one kernel-wide pool, kernel.pty.max minus kernel.pty.reserve (4096 - 1024
# by default): without a cap one sandbox took all 3,071 and every other user's terminal failed.
# 8 holds a person's shells into the session and the ptys its commands open (script, expect, a
# tmux: one to three each); an owner's 64 sessions (quotas.sessions_per_uid) hold 512 at most, so
# four owners at theirs leave a third of the default pool to everyone else.
DEFAULT_PTYS = 8

# Review mode's change sets (kernel.review_space): one session's, and one owner's together.
DEFAULT_REVIEW_SESSION_BYTES = "1G"
DEFAULT_REVIEW_OWNER_BYTES = "4G"

# The ranges of every limit: what the kernel takes, and what makes sense for a sandboxed call.
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600      # a week: longer is a service, not a call
MAX_BYTES = 1 << 53                      # 8 PiB: far above any machine, exact as a float
MAX_PIDS = 1 << 22                       # the kernel's largest pid_max
MAX_OPEN_FILES = 1 << 20                 # the kernel's default fs.nr_open
# The kernel's PATH_MAX, with its NUL: the longest path a caller may name (service.convert.check_path)
# and the size of the call helper's path buffers, which refuse a longer one (never cut it short).
PATH_MAX = 4096
MAX_PTYS = 1 << 20                       # the most devpts takes for max= (NR_UNIX98_PTY_MAX)
_MAXIMA = {"timeout_seconds": (MAX_TIMEOUT_SECONDS, "604800 seconds (7 days)"),
           "memory_bytes": (MAX_BYTES, "2^53 bytes"), "pids": (MAX_PIDS, "4194304 (the kernel's pid_max)"),
           "cpu_seconds": (MAX_TIMEOUT_SECONDS, "604800 seconds (7 days)"),
           "open_files": (MAX_OPEN_FILES, "1048576 (the kernel's nr_open)"),
           "tmp_size_bytes": (MAX_BYTES, "2^53 bytes"), "ptys": (MAX_PTYS, "1048576 (the kernel's pty maximum)"),
           "total_pids": (MAX_PIDS, "4194304 (the kernel's pid_max)"), "total_memory_bytes": (MAX_BYTES, "2^53 bytes"),
           "owner_pids": (MAX_PIDS, "4194304 (the kernel's pid_max)"), "owner_memory_bytes": (MAX_BYTES, "2^53 bytes")}


def check_timeout(value: float, what: str = "timeout_seconds") -> float:
    """A timeout in seconds: a finite number above 0, at most a week. InvalidPolicy otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidPolicy(f"{what} must be a number of seconds above 0 (0 or unset: none), got {value!r}")
    if value > MAX_TIMEOUT_SECONDS:
        raise InvalidPolicy(f"{what} {value!r} is above the maximum of {MAX_TIMEOUT_SECONDS} seconds (7 days)")
    return float(value)


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse ``1048576``, ``512K``, ``64M``, ``2G`` (binary multiples) into bytes."""
    if isinstance(text, int):
        value = text
    else:
        # "<digits> [K|M|G|T][B|iB]", case-insensitive; parsed by hand to keep `re` off the launch path.
        body = str(text).strip().lower()
        digits = body[: len(body) - len(body.lstrip("0123456789"))]
        unit = body[len(digits):].strip()
        unit = unit[:-2] if unit.endswith("ib") and len(unit) == 3 else unit[:-1] if unit.endswith("b") else unit
        if not digits or unit not in _FACTORS:
            raise InvalidPolicy(f"bad {what} {text!r}: give plain bytes or a number with K, M or G (e.g. 512M)")
        value = int(digits) * _FACTORS[unit]
    if value <= 0:
        raise InvalidPolicy(f"bad {what} {text!r}: must be greater than zero")
    return value


class Limits(Record):
    """What one launch may consume. ``None`` means no limit of that kind."""

    timeout_seconds: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    tmp_size_bytes: int = DEFAULT_TMP_SIZE
    ptys: int = DEFAULT_PTYS             # the `max=` of the sandbox's own devpts (limits.session_ptys)
    # Not this launch's own: the caps of the parent cgroup all sandboxes of this daemon (or of this
    # `sandboxd run`'s cgroup) live under, written there when the launch prepares that group.
    total_pids: int | None = None
    total_memory_bytes: int | None = None
    # Likewise: the caps of the group of the launch's owner (LaunchSpec.owner), its share of the above.
    owner_pids: int | None = None
    owner_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, (maximum, said) in _MAXIMA.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidPolicy(f"limit {name} must be a finite number, got {value!r}")
            if value <= 0:
                raise InvalidPolicy(f"limit {name} must be greater than zero, got {value!r}")
            if value > maximum:
                raise InvalidPolicy(f"limit {name} {value!r} is above its maximum of {said}")
        if self.memory_bytes is not None and self.memory_bytes < (4 << 20):
            raise InvalidPolicy("memory limit below 4M cannot even start a shell: give at least 4M")
        if self.open_files is not None and self.open_files < 16:
            raise InvalidPolicy("open-files limit below 16 breaks most programs: give at least 16")


# The most entries each list of a policy or a request may hold, checked before anything is
# built (check_count). Each is far above what a real user writes by hand or a client generates
# (a policy names a handful of roots, sockets and hosts; an environment holds a few hundred
# variables), and low enough that the biggest policy still fits one fork-server message and
# costs the kernel a bounded number of mounts, Landlock rules and nftables rules.
MAX_WRITABLE_ROOTS = 256                 # one bind mount and one Landlock rule each
MAX_WRITABLE_PATHS = MAX_WRITABLE_ROOTS + 1   # a call's writable paths: those roots and the workspace
MAX_PROTECTED_SUBPATHS = 256             # one read-only bind mount per root and entry
MAX_ALLOWED_UNIX_SOCKETS = 64            # one connect rule each; an agent needs an ssh-agent, a database, docker
MAX_ALLOWED_HOSTS = 256                  # one nftables rule each (CIDRs cover ranges)
MAX_ALLOWED_DOMAINS = 256                # matched per connection by the egress proxy
MAX_ALLOWED_ENDPOINTS = 256              # matched per request on an intercepted host
MAX_CREDENTIALS = 32                     # a secret each, held in the daemon's memory for the session
MAX_PUBLISHED_PORTS = 64                 # one listener thread each on the host
MAX_LABELS = 64                          # free-form tags kept in every session row and event
MAX_LABEL_KEY = 256                      # characters
MAX_LABEL_VALUE = 1024                   # characters
# A command's strings also cross to the fork server in one message: at these limits (short
# strings) they fit; their bytes are bounded by ARG_MAX (policy.spec.check_command).
MAX_ARGV = 1 << 14                       # arguments given to one command directly (xargs-style lists run inside)
MAX_ENV_ENTRIES = 4096                   # variables of one call's environment (a real one has tens to hundreds)
MAX_ENV_BYTES = 128 << 10                # NAME=value bytes of one call's environment together (a real one: a few KiB)
# A session's own environment (CreateSessionRequest.env: --env / --env-file), kept with the session
# (and in the store) and added to each of its calls': bounded so a session costs the daemon little,
# with room left in MAX_ENV_BYTES for the defaults and a call's own variables.
MAX_SESSION_ENV_ENTRIES = 256            # variables a session sets (a real .env file holds tens)
MAX_ENV_NAME = 256                       # bytes of one variable's name
MAX_ENV_VALUE = 32 << 10                 # bytes of one variable's value (a certificate or a token fits)
MAX_SESSION_ENV_BYTES = 64 << 10         # NAME=value bytes of a session's variables together
# What a client passes of its own environment (ExecStart.caller_env): PATH's entries are each
# stat'ed inside the sandbox, so their number is bounded; LANG and TERM are short names.
MAX_PATH_ENTRIES = 256
# ... and its bytes: the daemon remembers what it found per PATH (service.environment), so a caller
# cycling huge PATHs must not grow that memory (a long Nix PATH is a few KiB).
MAX_CALLER_PATH_BYTES = 16 << 10
MAX_CALLER_VALUE = 256                   # bytes of LANG or TERM
# All the paths, hosts, domains and ports of one policy together: the policy crosses to the fork
# server in one SOCK_SEQPACKET message (below net.core.wmem_default, about 200 KiB), with room
# left for the rest of the launch.
MAX_POLICY_LIST_BYTES = 64 << 10


def check_count(field: str, items: Sized, limit: int) -> None:
    """InvalidPolicy naming ``field`` and its limit when ``items`` has more than ``limit`` entries."""
    count = len(items)
    if count > limit:
        raise InvalidPolicy(f"{field} has {count} entries; the limit is {limit}")


def check_bytes(field: str, items: Iterable[str], limit: int) -> None:
    """InvalidPolicy when the strings of ``items`` take more than ``limit`` bytes together."""
    total = sum(len(item.encode(errors="surrogateescape")) for item in items)
    if total > limit:
        raise InvalidPolicy(f"{field} take {total} bytes together; the limit is {limit}")
