"""`sandboxd doctor`'s checks of what the daemon's configuration names (``--config FILE``, else
``$SANDBOXD_CONFIG`` or /etc/sandboxd/sandboxd.toml): the configuration itself (what `serve`
would refuse), the isolated networks' address pool against the host's routes, the state
directory (there or makeable, root's, its mode, its disk's free space against ``audit.min_free``)
and the audit database (opened read-only: its integrity, its schema version). Each is one line,
ok / warn / FAIL, with what to do; nothing is changed (the database is opened read-only, the
state directory is not made)."""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass

from sandboxd.printable import printable

ROUTES = "/proc/net/route"
RTF_UP = 0x1


def _line(status: str, what: str, detail: str, fix: str = "") -> tuple[str, str]:
    text = f"{status:<5} {printable(what)}: {printable(detail)}"
    if fix:
        text += f"\n      fix: {printable(fix)}"
    return status, text


@dataclass(frozen=True)
class Configured:
    """What the checks read from the configuration, and where it came from."""
    path: str | None
    pool: str
    state_dir: str
    min_free: str
    problem: str = ""              # why `serve` would refuse it ("" if it would not)


def configured(path: str | None) -> Configured:
    """The configuration as `serve` loads it (config.load); when that refuses it, the file alone
    (or the defaults), with the refusal kept for the configuration line."""
    from sandboxd import config

    try:
        values = config.load(path).source
    except config.ConfigError as exc:
        # The other checks still look at what the file names, each key taken if its own check passes.
        path = path or config.default_path()
        return Configured(path=path, pool=_lenient(path, "network.pool"), state_dir=_lenient(path, "state.dir"),
                          min_free=_lenient(path, "audit.min_free"), problem=str(exc))
    return Configured(path=path or config.default_path(), pool=values.text("network.pool"),
                      state_dir=values.text("state.dir"), min_free=values.text("audit.min_free"))


def _lenient(path: str | None, dotted: str) -> str:
    """``dotted``'s value in the file at ``path`` if it is there and passes its key's check, else its default."""
    import tomllib

    from sandboxd import config

    key = next(key for key in config.KEYS if key.dotted == dotted)
    try:
        with open(path or "", "rb") as f:
            value = tomllib.load(f).get(key.section, {}).get(key.name, key.default)
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        value = key.default
    return value if isinstance(value, str) and key.check(value) is None else str(key.default)


def check_configuration(c: Configured) -> tuple[str, str]:
    where = c.path or "(no file: the built-in defaults)"
    if c.problem:
        return _line("FAIL", "configuration", f"sandboxd serve would refuse it: {c.problem}",
                     "fix the key named (sandboxd config check FILE says the same)")
    return _line("ok", "configuration", f"{where}: sandboxd serve would accept it (and this environment's SANDBOXD_*)")


# -- the address pool -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    device: str
    network: ipaddress.IPv4Network


def host_routes(table: str = ROUTES) -> list[Route]:
    """The main table's IPv4 routes that are up, but the default route (/proc/net/route: hex,
    little-endian)."""
    routes = []
    with open(table) as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) < 8 or not int(fields[3], 16) & RTF_UP:
                continue
            destination = ipaddress.IPv4Address(int(fields[1], 16).to_bytes(4, "little"))
            mask = ipaddress.IPv4Address(int(fields[7], 16).to_bytes(4, "little"))
            if int(mask) == 0:
                continue
            routes.append(Route(fields[0], ipaddress.IPv4Network(f"{destination}/{mask}", strict=False)))
    return routes


def check_address_pool(c: Configured, table: str = ROUTES) -> tuple[str, str]:
    """The pool a /30 per isolated network is taken from (network.pool): the blocks sandboxes hold
    now (routes through sandbox links, any daemon's), and any route of the host's own inside or
    around the pool, which a sandbox's block would shadow or be shadowed by."""
    from sandboxd.kernel.netns import LINK_PREFIX

    pool = ipaddress.IPv4Network(c.pool)
    total = 2 ** (30 - pool.prefixlen)
    used = 0
    clashes = []
    for route in host_routes(table):
        if not route.network.overlaps(pool):
            continue
        if route.device.startswith(LINK_PREFIX):
            used += 1
        else:
            clashes.append(route)
    detail = f"{pool} (network.pool): {total - used} of {total} isolated networks free"
    if clashes:
        named = ", ".join(f"{r.network} dev {r.device}" for r in clashes[:4]) + (" ..." if len(clashes) > 4 else "")
        return _line("FAIL", "address pool", f"{detail}; the host routes {named} inside it: a sandbox given a block "
                     "there would take those addresses from the host", "set network.pool to a range this host does not "
                     "use (ip route shows the ones it does)")
    if used >= total:
        return _line("FAIL", "address pool", detail, "close sessions, or give network.pool a larger range")
    return _line("ok", "address pool", f"{detail}; no route of the host's inside it")


# -- the state directory ----------------------------------------------------------------------------

def _mib(size: int) -> str:
    return f"{size >> 20} MiB"


def _existing_ancestor(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_state_dir(c: Configured) -> tuple[str, str]:
    """There, or makeable; root's (serve refuses another owner's); its mode (serve sets 0700); its
    disk's free space against audit.min_free (below it, serve starts but refuses every new call)."""
    from sandboxd.policy.audit_limits import parse_min_free

    path = c.state_dir
    notes = []
    status = "ok"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        ancestor = _existing_ancestor(path)
        if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
            return _line("FAIL", "state directory", f"{path} (state.dir) does not exist and cannot be made under "
                         f"{ancestor}", f"make {path} (root's, 0700), or set state.dir to a directory root may make")
        notes.append("does not exist yet: serve makes it (root's, 0700)")
        where = ancestor
    except OSError as exc:
        return _line("FAIL", "state directory", f"{path} (state.dir) cannot be examined ({exc.strerror})",
                     "set state.dir to a directory of root's")
    else:
        if not stat.S_ISDIR(info.st_mode):
            return _line("FAIL", "state directory", f"{path} (state.dir) is not a directory",
                         "remove it, or set state.dir to a directory")
        if info.st_uid != os.geteuid():
            return _line("FAIL", "state directory", f"{path} (state.dir) belongs to uid {info.st_uid}, not to the "
                         f"daemon's uid {os.geteuid()}: serve refuses to start on it",
                         f"chown root {path}, or set state.dir to a directory of root's")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            notes.append(f"mode {mode:04o}: serve makes it 0700 at start (the audit log is root's to read)")
        else:
            notes.append(f"root's, mode {mode:04o}")
        where = path
    min_bytes, min_percent = parse_min_free(c.min_free)
    disk = os.statvfs(where)
    free, size = disk.f_bfree * disk.f_frsize, disk.f_blocks * disk.f_frsize
    floor = min_bytes or int(size * min_percent / 100)
    space = f"{_mib(free)} free of {_mib(size)}, audit.min_free {c.min_free} ({_mib(floor)})"
    if floor and free < floor:
        return _line("FAIL", "state directory", f"{path}: {'; '.join(notes)}; {space}: below the floor, serve "
                     "refuses every new call, session and policy change", "free space on that disk, give state.dir "
                     "a disk of its own, or lower audit.min_free")
    if floor and free < 2 * floor:
        status = "warn"
        notes.append("less than twice the floor left")
    return _line(status, "state directory", f"{path}: {'; '.join(notes)}; {space}",
                 "free space on that disk, or give state.dir a disk of its own" if status == "warn" else "")


# -- the audit database -----------------------------------------------------------------------------

def check_audit_db(c: Configured) -> tuple[str, str]:
    """events.db in the state directory, opened read-only (a daemon may be using it): SQLite's
    quick integrity check, and its schema version against this sandboxd's."""
    import sqlite3

    from sandboxd.audit.store import MIGRATIONS

    path = os.path.join(c.state_dir, "events.db")
    if not os.path.lexists(path):
        return _line("ok", "audit database", f"{path}: none yet (serve makes it)")
    if not os.path.isfile(path) or os.path.islink(path):
        return _line("FAIL", "audit database", f"{path} is not a regular file", "move it away; serve makes a new one")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        return _line("FAIL", "audit database", f"{path} cannot be opened read-only ({exc})",
                     "check its owner and mode (root's, 0600)")
    try:
        verdict = [row[0] for row in db.execute("PRAGMA quick_check")]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = (int(db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
                   if "schema_version" in tables else 0)
        events = int(db.execute("SELECT COUNT(*) FROM events").fetchone()[0]) if "events" in tables else 0
    except sqlite3.DatabaseError as exc:
        return _line("FAIL", "audit database", f"{path} is not a readable SQLite database ({exc})",
                     "stop the daemon, keep a copy for the record, move it away: serve starts a new one")
    finally:
        db.close()
    if verdict != ["ok"]:
        shown = "; ".join(verdict[:3]) + (" ..." if len(verdict) > 3 else "")
        return _line("FAIL", "audit database", f"{path}: SQLite's quick_check found damage: {shown}",
                     "stop the daemon, keep a copy for the record, then sqlite3 events.db '.recover' into a new file "
                     "or move it away")
    ours = len(MIGRATIONS)
    if version > ours:
        return _line("FAIL", "audit database", f"{path}: schema version {version}, newer than this sandboxd's "
                     f"({ours}): serve refuses it", "run the sandboxd that wrote it, or a newer one")
    upgrade = f" (serve migrates it to {ours})" if version < ours else ""
    return _line("ok", "audit database", f"{path}: intact (quick_check), schema version {version}{upgrade}, "
                 f"{events} events")


CHECKS = (check_configuration, check_address_pool, check_state_dir, check_audit_db)
