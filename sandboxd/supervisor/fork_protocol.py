"""The fork server's protocol: one record type per request and per event, and one codec.

Both ends use it: the fork server (``fork_server._Server``) decodes requests and encodes events, its
client in the daemon (``fork_client.ForkServer``) the other way round. A message is one
SOCK_SEQPACKET datagram holding one JSON object, tagged with its kind (``"op"`` for a request,
``"event"`` for an event) and its request ``"id"``, plus the record's fields by name; the
descriptors a request carries (stdin, stdout, stderr of a launch or call) travel as SCM_RIGHTS.

Each record's annotations are its schema: ``decode`` checks every field's JSON type against them
(``int`` is never a bool, ``float`` takes an int, ``list[str]`` checks each item, ``X | None`` may
be absent), and the descriptor count against ``descriptors``. A field may also be a nested record
(a launch's ``SpecRecord``, its ``PolicyRecord``, ``Limits``), checked the same way field by field,
or a ``Choice`` (a policy's modes), which must be one of its names. What does not fit is
``Malformed``, naming the field by its path (``spec.policy.network_mode``) and carrying the
request's id when it had a usable one, so the server answers it as InvalidPolicy and goes on: a
bug in the daemon costs one request, never every sandbox of every user.

JSON, not marshal or pickle: the decoder must be safe on any bytes (marshal's documentation says
it is not), and the codec is a few microseconds per message against about a millisecond of work
per call (docs/perf-notes/18-forkproto.md has the measurement).
"""

from __future__ import annotations

import array
import json
import socket
from typing import TYPE_CHECKING, Any, ClassVar

from sandboxd._record import Choice, Factory, Record
from sandboxd.errors import InvalidPolicy, SandboxdError
from sandboxd.policy.limits import Limits
from sandboxd.policy.network import Unlisted
from sandboxd.policy.limits import check_timeout as limits_check_timeout
from sandboxd.policy.sandbox import (DangerFullAccess, NetworkMode, ReadOnly, SandboxMode, SandboxPolicy,
                                     WorkspaceWrite, validate_policy)
from sandboxd.policy.spec import LaunchSpec

if TYPE_CHECKING:
    from collections.abc import Callable

MAX_MESSAGE = 1 << 20
SO_SNDBUFFORCE = 32
MAX_DESCRIPTORS = 16                    # the most one message may carry (a request takes 0 or 3)

# -- the server's bounds (its command-line flags: the client passes them when it starts it) --------

# How long a request may wait on a caller's paths, a session's build or a command's start
# (``fork_server.wait_seconds``): a lookup that takes longer is on a file system that does not answer.
DEFAULT_WAIT_SECONDS = 10.0
# How many path-opening children one owner may have alive at once (``fork_server.stuck_openers_per_uid``):
# each one stuck on a file system that does not answer holds a pid, ~2 MB and a descriptor here until
# that mount goes (supervisor/openers.py). Eight: an owner's ordinary lookups take milliseconds each (a
# burst beyond it waits its turn, never refused), and the quotas let one user have 8 requests in progress
# (quotas.requests_per_uid), so a user whose mount hangs sees as many DeadlineExceeded as it has requests
# in flight, then a refusal at once naming the mount; 8 x 2 MB and 8 descriptors per owner.
DEFAULT_STUCK_OPENERS = 8
# How long a session's close may take before it is answered anyway (``gone=False``): a process
# stuck on a file system that does not answer may hold the session's init; it is released when it
# goes. Only the closing caller waits this long; the loop goes on serving everyone meanwhile.
CLOSE_WAIT_SECONDS = 5.0
# How long a review request's child may run (listing, diffing, applying a change set) before the
# fork server SIGKILLs it; the daemon then answers DEADLINE_EXCEEDED.
REVIEW_SECONDS = 120.0
# How long a surviving supervisor waits for a daemon to attach once its daemon is gone
# (supervisor.orphan_seconds) before it stops everything as a shutdown does.
DEFAULT_ORPHAN_SECONDS = 600.0


def check_timeout(timeout: object, what: str = "timeout_seconds") -> float | None:
    """A call's time limit as a float (None or 0: no limit), or InvalidPolicy for what no clock can
    hold; the same range as the policy's (policy.limits.check_timeout), checked again at this edge."""
    if timeout is None or (timeout == 0 and not isinstance(timeout, bool)):
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidPolicy(f"{what} must be a number of seconds, got {timeout!r}")
    return limits_check_timeout(timeout, what)


def _record_fields(value: object) -> object:
    """How the encoder writes a nested record: its fields (a Record keeps exactly those in its __dict__)."""
    if isinstance(value, Record):
        return value.__dict__
    raise TypeError(f"a fork server message cannot carry {type(value).__name__}")


_encoder = json.JSONEncoder(separators=(",", ":"), check_circular=False, default=_record_fields)
_decoder = json.JSONDecoder()


# -- field checks from the annotations ------------------------------------------------------------

def _union(annotation: str) -> list[str]:
    """``"a[b | c] | None"`` -> ``["a[b | c]", "None"]``: the top-level alternatives."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(annotation):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:
            parts.append(annotation[start:index].strip())
            start = index + 1
    parts.append(annotation[start:].strip())
    return parts


_SIMPLE: dict[str, "Callable[[object], bool]"] = {
    "None": lambda v: v is None,
    "int": lambda v: type(v) is int,                      # never a bool
    "float": lambda v: type(v) in (int, float),
    "bool": lambda v: type(v) is bool,
    "str": lambda v: type(v) is str,
    "object": lambda v: True,
}


def _checker(annotation: str) -> "Callable[[object], bool]":
    """A check of a decoded JSON value against the annotation it is declared with (the subset the
    records use: the simple names above, ``list[X]``, ``dict[str, X]`` and unions of them)."""
    parts = _union(annotation)
    if len(parts) == 2 and "None" in parts:               # X | None, the common union: no generator
        check = _one_checker(parts[1 - parts.index("None")])
        return lambda value: value is None or check(value)
    options = [_one_checker(part) for part in parts]
    if len(options) == 1:
        return options[0]
    return lambda value: any(check(value) for check in options)


# The JSON types each simple item annotation admits, for containers checked with one set of their
# items' types (C loops: an environment of fifty entries costs about what one entry costs in Python).
_ITEM_TYPES: dict[str, frozenset[type]] = {"int": frozenset({int}), "float": frozenset({int, float}),
                                           "bool": frozenset({bool}), "str": frozenset({str})}


def _one_checker(annotation: str) -> "Callable[[object], bool]":
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    if annotation.startswith("list[") and annotation.endswith("]"):
        inner = annotation[5:-1]
        if inner == "object":
            return lambda value: type(value) is list
        if inner in _ITEM_TYPES:
            types = _ITEM_TYPES[inner]
            return lambda value: type(value) is list and set(map(type, value)) <= types
        item = _checker(inner)
        return lambda value: type(value) is list and all(item(v) for v in value)
    if annotation.startswith("dict[str, ") and annotation.endswith("]"):
        inner, keys = annotation[10:-1], _ITEM_TYPES["str"]
        if inner == "object":
            return lambda value: type(value) is dict and set(map(type, value)) <= keys
        if inner in _ITEM_TYPES:
            types = _ITEM_TYPES[inner]
            return lambda value: (type(value) is dict and set(map(type, value)) <= keys
                                  and set(map(type, value.values())) <= types)
        item = _checker(inner)
        return lambda value: (type(value) is dict and set(map(type, value)) <= keys
                              and all(item(v) for v in value.values()))
    raise TypeError(f"a fork server record field cannot be declared {annotation!r}")


# -- nested records and choices: fields read (not only checked) from their JSON --------------------

class FieldRefused(Exception):
    """A nested field that does not fit its declaration: ``path`` names it from the message's field."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail


# The record and choice types a field may be declared as, by the name its annotation gives.
_NESTED: dict[str, type[Record]] = {}
_CHOICES: dict[str, type[Choice]] = {"SandboxMode": SandboxMode, "NetworkMode": NetworkMode, "Unlisted": Unlisted}
# Each nested record's fields: (name, check, annotation, read); read is None for a plain field.
_FieldReads = tuple[tuple[str, "Callable[[object], bool]", str, "Callable[[object, str], object] | None"], ...]
_NESTED_FIELDS: dict[type[Record], _FieldReads] = {}


def _annotations(cls: type) -> dict[str, str]:
    annotations: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        annotations.update({name: text for name, text in klass.__dict__.get("__annotations__", {}).items()
                            if not name.startswith("_") and not text.startswith("ClassVar")})
    return annotations


def _field_reads(cls: type[Record]) -> _FieldReads:
    """How each field of ``cls`` is checked, or read when it is a nested record or a choice."""
    annotations = _annotations(cls)
    reads = []
    for name in cls._fields:
        read = _reader(annotations[name])
        reads.append((name, _SIMPLE["object"] if read else _checker(annotations[name]), annotations[name], read))
    return tuple(reads)


def nested(cls: type[Record]) -> type[Record]:
    """Let fields be declared as the record ``cls`` (by its class name): decoded field by field."""
    _NESTED[cls.__name__] = cls
    _NESTED_FIELDS[cls] = _field_reads(cls)
    return cls


def _reader(annotation: str) -> "Callable[[object, str], object] | None":
    """The reader of a field declared a nested record or a choice (``X`` or ``X | None``); None
    for the plain fields, which are only checked."""
    parts = _union(annotation)
    optional = len(parts) == 2 and "None" in parts
    name = parts[1 - parts.index("None")] if optional else annotation
    read: "Callable[[object, str], object]"
    if name in _NESTED:
        record = _NESTED[name]
        read = lambda value, path: _read_record(record, value, path)  # noqa: E731
    elif name in _CHOICES:
        choice = _CHOICES[name]
        read = lambda value, path: _read_choice(choice, value, path)  # noqa: E731
    else:
        return None
    if optional:
        return lambda value, path: None if value is None else read(value, path)
    return read


def _read_choice(choice: type[Choice], value: object, path: str) -> Choice:
    try:
        return choice.parse(value)
    except ValueError:
        raise FieldRefused(path, f"must be one of {', '.join(choice.all())}, got {value!r}"[:300]) from None


def _read_record(cls: type[Record], value: object, path: str) -> Record:
    """A nested record from its JSON object: every field checked (or read) under its path; no field
    it does not have; then built as usual, so its own checks (``__post_init__``) run too."""
    if type(value) is not dict:
        raise FieldRefused(path, f"must be an object of {cls.__name__}'s fields, got {value!r}"[:300])
    reads = _NESTED_FIELDS[cls]
    unknown = set(value) - set(cls._fields)
    if unknown:
        raise FieldRefused(path, f"{cls.__name__} has no field {sorted(map(str, unknown))[0]!r}"[:300])
    values: dict[str, object] = {}
    for name, check, annotation, read in reads:
        if name not in value:
            if name in cls._defaults:
                continue
            raise FieldRefused(f"{path}.{name}", f"is missing (it must be {annotation})")
        item = value[name]
        if read is not None:
            item = read(item, f"{path}.{name}")
        elif not check(item):
            raise FieldRefused(f"{path}.{name}", f"must be {annotation}, got {item!r}"[:300])
        values[name] = item
    try:
        return cls(**values)
    except SandboxdError as exc:                          # its own check (Limits' ranges, say)
        raise FieldRefused(path, f"is refused: {exc}") from None


@nested
class PolicyRecord(Record):
    """A sandbox policy as it crosses to the fork server: its kind and every field, typed (every kind
    has every field: policy.sandbox.SandboxPolicy), but ``hide_home``: the daemon turns it into the
    spec's ``hidden_homes`` (service.sessions.lifecycle), which a fork server that outlived an
    upgrade knows already, where a new field would be refused by it."""
    name: SandboxMode
    network_access: bool
    writable_roots: list[str]
    protected_subpaths: list[str]
    network_mode: NetworkMode
    allowed_unix_sockets: list[str]
    allowed_hosts: list[str]
    published_ports: list[str]
    allowed_domains: list[str]
    allowed_endpoints: list[str]
    unlisted: Unlisted
    credentials: list[str]              # the public specifications: a secret never crosses


@nested
class CallerRecord(Record):
    """Whose rights a launch's paths are checked with (LaunchSpec.caller)."""
    uid: int
    gid: int
    groups: list[int]


nested(Limits)      # its annotations are its wire form; its own __post_init__ checks the ranges


@nested
class SpecRecord(Record):
    """A LaunchSpec as it crosses to the fork server (``spec_record``, ``launch_spec``): the fields the
    server builds from (not ``git_dirs``: a session's build walks its roots itself)."""
    argv: list[str]
    workspace: str
    env: dict[str, str]
    cwd: str | None
    policy: PolicyRecord
    limits: Limits
    user: list[int] | None
    dns: list[str]
    network_pool: str
    caller: CallerRecord | None
    hidden_paths: list[str]
    denied_sockets: list[str]
    denied_listeners: list[str]
    approval_channels: list[str]
    owner: str
    hidden_homes: list[str]
    private_home: str
    owner_hidden: list[str] = Factory(list)
    trust_pem: str = ""                 # LaunchSpec.trust_pem: public certificates only
    placement: dict[str, str] = Factory(dict)   # LaunchSpec.placement: a pod's cgroups, checked at build


_POLICY_KINDS: dict[SandboxMode, type[SandboxPolicy]] = {
    SandboxMode.READ_ONLY: ReadOnly, SandboxMode.WORKSPACE_WRITE: WorkspaceWrite,
    SandboxMode.DANGER_FULL_ACCESS: DangerFullAccess}


def policy_record(policy: SandboxPolicy) -> PolicyRecord:
    return PolicyRecord(policy.mode, policy.network_access, list(policy.writable_roots),
                        list(policy.protected_subpaths), policy.network_mode, list(policy.allowed_unix_sockets),
                        list(policy.allowed_hosts), list(policy.published_ports), list(policy.allowed_domains),
                        list(policy.allowed_endpoints), policy.unlisted, list(policy.credentials))


def sandbox_policy(record: PolicyRecord) -> SandboxPolicy:
    """The policy a record describes, exactly (its kind refuses the fields it does not take)."""
    policy = _POLICY_KINDS[record.name](
        network_access=record.network_access, writable_roots=tuple(record.writable_roots),
        protected_subpaths=tuple(record.protected_subpaths), network_mode=record.network_mode,
        allowed_unix_sockets=tuple(record.allowed_unix_sockets), allowed_hosts=tuple(record.allowed_hosts),
        published_ports=tuple(record.published_ports), allowed_domains=tuple(record.allowed_domains),
        allowed_endpoints=tuple(record.allowed_endpoints), unlisted=record.unlisted,
        credentials=tuple(record.credentials))
    validate_policy(policy)
    return policy


def spec_record(spec: LaunchSpec) -> SpecRecord:
    caller = None if spec.caller is None else CallerRecord(spec.caller[0], spec.caller[1], list(spec.caller[2]))
    return SpecRecord(list(spec.argv), spec.workspace, dict(spec.env), spec.cwd, policy_record(spec.policy),
                      spec.limits, None if spec.user is None else list(spec.user), list(spec.dns), spec.network_pool,
                      caller, list(spec.hidden_paths), list(spec.denied_sockets), list(spec.denied_listeners),
                      list(spec.approval_channels), spec.owner, list(spec.hidden_homes), spec.private_home,
                      list(spec.owner_hidden), spec.trust_pem, dict(spec.placement))


def launch_spec(record: SpecRecord) -> LaunchSpec:
    """The LaunchSpec a decoded record describes; every field's type was checked by the codec, what
    is left (ranges, paths, the policy's rules) LaunchSpec and the policy check, as InvalidPolicy."""
    if record.user is not None and len(record.user) != 2:
        raise InvalidPolicy(f"fork server field 'spec.user' must be [uid, gid], got {record.user!r}")
    caller = None if record.caller is None else (record.caller.uid, record.caller.gid, tuple(record.caller.groups))
    return LaunchSpec(argv=tuple(record.argv), workspace=record.workspace, env=dict(record.env), cwd=record.cwd,
                      policy=sandbox_policy(record.policy), limits=record.limits,
                      user=None if record.user is None else (record.user[0], record.user[1]), dns=tuple(record.dns),
                      network_pool=record.network_pool, caller=caller, hidden_paths=tuple(record.hidden_paths),
                      denied_sockets=tuple(record.denied_sockets), denied_listeners=tuple(record.denied_listeners),
                      approval_channels=tuple(record.approval_channels), owner=record.owner,
                      hidden_homes=tuple(record.hidden_homes), private_home=record.private_home,
                      owner_hidden=tuple(record.owner_hidden), trust_pem=record.trust_pem,
                      placement=dict(record.placement))


class Malformed(Exception):
    """A message that is not one of the protocol's records; ``id`` is its request's, when usable (else 0)."""

    def __init__(self, call_id: int, detail: str) -> None:
        super().__init__(detail)
        self.id = call_id


class Message(Record):
    """A request or event: ``id`` ties an event to the request it answers."""

    id: int
    _tag: ClassVar[str] = ""            # "op" (requests) or "event" (events)
    _kind: ClassVar[str] = ""           # the value of the tag
    _checks: ClassVar[_FieldReads] = ()
    descriptors = 0                     # how many SCM_RIGHTS descriptors come with it
    # Or, when they come only sometimes: the names of the bool fields that say each does, in the
    # order the descriptors come (one per field that is true).
    descriptor_flags: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not kind:
            return
        cls._kind = kind
        cls._checks = _field_reads(cls)
        table = _REQUESTS if cls._tag == "op" else _EVENTS
        table[kind] = cls

    def __init__(self, *args: object, **kwargs: object) -> None:
        # Every field given by position (how this module's users build them, three or four per
        # call): set at once. Anything else takes Record's checked path.
        if len(args) == len(self._fields) and not kwargs:
            self.__dict__.update(zip(self._fields, args, strict=True))
        else:
            super().__init__(*args, **kwargs)

    def encode(self) -> bytes:
        # A Record keeps exactly its fields in its __dict__: no per-field getattr.
        return _encoder.encode({**self.__dict__, self._tag: self._kind}).encode()


class Request(Message):
    _tag = "op"


class Event(Message):
    _tag = "event"


_REQUESTS: dict[str, type[Message]] = {}
_EVENTS: dict[str, type[Message]] = {}


# -- requests (daemon -> fork server) -------------------------------------------------------------

class Launch(Request, kind="launch"):
    """A one-shot sandbox running ``spec`` (``spec_record``); with stdin, stdout, stderr."""
    spec: SpecRecord
    descriptors = 3


class SessionOpen(Request, kind="session_open"):
    """Build a session's sandbox from ``spec`` (its argv is not run). ``review_dir``: review mode,
    the session's change set there (made 0700 by the fork server; an earlier build's layers are
    reused: kernel.overlay.reuse_layers); "": the roots are written directly. A new review
    directory is a bounded store (kernel.review_space) of ``session_bytes`` (0: none) or what
    ``owner_stores`` (the owner's other review directories, by the daemon's records) leave of
    ``owner_bytes``, whichever is smaller: the fork server reads their bounds from the kernel; refused
    when they are ``owner_stores_max`` already (review.owner_stores; 0: no cap)."""
    session: str
    spec: SpecRecord
    review_dir: str = ""
    session_bytes: int = 0
    owner_bytes: int = 0
    owner_stores: list[str] = Factory(list)
    owner_stores_max: int = 0


class SessionClose(Request, kind="session_close"):
    """Kill all of a session; answered ``SessionClosed`` when it is gone (or at the close's bound)."""
    session: str


class Call(Request, kind="call"):
    """One command (or file ``tool``) in a session; with stdin, stdout, stderr. With ``terminal``
    [rows, columns] it runs on a terminal, whose master goes back on the stdin socket.
    A surviving supervisor (``Attach``) keeps what a daemon that is gone cannot: ``tag`` (the
    daemon's own name for the call, its audit call id and tool: returned as it was at attach), and
    with ``stdout_tap``/``stderr_tap`` a copy of the read end of the call's output pipes, after
    stdin, stdout, stderr: read by nobody while the daemon is attached, drained into bounded tails
    (supervisor.tails) once it is gone, so the command neither blocks on a full pipe nor gets SIGPIPE."""
    session: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout: float | None = None
    tool: dict[str, object] | None = None
    terminal: list[object] | None = None     # [rows, columns]: the server checks the range, and says it
    tag: str = ""
    stdout_tap: bool = False
    stderr_tap: bool = False
    descriptors = 3
    descriptor_flags = ("stdout_tap", "stderr_tap")


class Signal(Request, kind="signal"):
    """Deliver ``signum`` to a running launch or call (``id`` is that request's)."""
    signum: int


class Cancel(Request, kind="cancel"):
    """Kill everything a running launch or call started (``id`` is that request's)."""


class CheckPaths(Request, kind="check_paths"):
    """May ``caller`` (None: root) write each of ``paths``? ``owner``: whom the lookup counts against
    (LaunchSpec.owner; "": the caller's uid)."""
    caller: CallerRecord | None
    paths: list[str]
    owner: str = ""


class Review(Request, kind="review"):
    """A request on a review session's change set in ``review_dir``, run in a child of the fork
    server (supervisor.review_child): as root it reads the upper layers (overlay's trusted.*
    attributes) and, for ``discard``, removes entries (the session's sandbox is closed meanwhile);
    as ``caller`` (None: the workspace's owner) it compares them with the host, shows or applies
    them. Answered ReviewStarted with the read end of a pipe the child writes its answer to (one
    JSON object) and closes: the daemon reads it, the loop never does. ``roots``: the session's
    real roots as built (the workspace first); ``paths``: [root, path below it] pairs (none: all);
    ``page``: where a listing goes on (review_child.Page's token)."""
    review_dir: str
    caller: CallerRecord | None
    owner: str
    action: str                         # list, diff, apply, discard, checkpoint, checkpoints, rollback
    roots: list[str]
    paths: list[list[str]]
    include_flagged: list[list[str]]
    page: str = ""
    limit: int = 1000
    max_bytes: int = 1 << 20
    force: bool = False
    label: str = ""                     # checkpoint's label (its ``limit``: review.max_checkpoints)
    checkpoint: int = 0                 # rollback's checkpoint (0: the session's start)
    # apply's [root, path, fingerprint] triples a person was shown, as JSON in a memfd that comes
    # with the request (they may be megabytes: the loop passes them on, only the child reads them)
    reviewed_fd: bool = False
    only_reviewed: bool = False         # apply only those, each while its fingerprint is the same
    before_call: str = ""               # checkpoint: marked before this call, only if anything changed
    descriptor_flags = ("reviewed_fd",)


class Ping(Request, kind="ping"):
    """The daemon's watchdog: answered ``Pong`` at once."""


class Attach(Request, kind="attach"):
    """A new daemon, connected to a surviving supervisor's attach socket: answered with what it
    holds, ``HeldSession`` per session (its listeners with it), ``HeldCall`` per call still running
    that no daemon reads, ``CallEnded`` per call that ended while no daemon was attached, then
    ``Attached``. Every event about those calls goes to this daemon from now on."""


class Stop(Request, kind="stop"):
    """The daemon stops for good (shutdown = stop): the end of its connection kills everything, as
    with a fork server that does not survive. Without it a surviving supervisor keeps every sandbox
    running when the connection ends (a crash, a SIGKILL, a handover) and waits for the next daemon."""


# -- events (fork server -> daemon) ---------------------------------------------------------------

class Started(Event, kind="started"):
    pid: int
    inner_pid: int | None = None


class Exited(Event, kind="exited"):
    """How a launch or call ended (``spawner.ExitInfo``'s fields)."""
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_seconds: float
    cpu_seconds: float | None
    peak_memory_bytes: int | None
    oom_killed: bool


class SessionReady(Event, kind="session_ready"):
    """What the fork server built, as facts the daemon keeps (and never looks up again itself): the
    workspace and the writable roots by the real paths the owner's own lookup resolved (by
    descriptor, as the owner: kernel.paths.resolve), which are what the sandbox binds; with an
    isolated network its addresses and resolvers. With ``proxy_listener``, the egress proxy's
    listening socket comes with it, still bound: the daemon serves it, and its address is never
    free for another user to bind meanwhile."""
    init_pid: int | None
    workspace: str
    writable_roots: list[str]       # the policy's writable roots, real (the workspace is not repeated)
    host_address: str | None = None
    sandbox_address: str | None = None
    resolvers: list[str] | None = None
    proxy_listener: bool = False
    pid_namespace: int = 0          # its PID namespace's inode (0: none of its own, danger-full-access)
    # With transparent capture (a proxied root sandbox): the listener its ports 80/443 are redirected
    # to, after proxy_listener's descriptor.
    transparent_listener: bool = False
    descriptor_flags = ("proxy_listener", "transparent_listener")


class HeldSession(Event, kind="held_session"):
    """A session a surviving supervisor holds (``Attach``'s answer): its sandbox's name and the
    SessionReady facts it answered at the build, with the listeners it passed then, passed again."""
    session: str
    init_pid: int | None
    workspace: str
    writable_roots: list[str]
    host_address: str | None = None
    sandbox_address: str | None = None
    resolvers: list[str] | None = None
    proxy_listener: bool = False
    pid_namespace: int = 0
    transparent_listener: bool = False
    descriptor_flags = ("proxy_listener", "transparent_listener")


class HeldCall(Event, kind="held_call"):
    """A call still running that a daemon started and no daemon reads now (``Attach``'s answer):
    its end comes as ``CallEnded`` with ``id`` = ``call``."""
    call: int
    session: str                    # its sandbox's name; "" for a one-shot launch
    pid: int
    inner_pid: int | None
    started_at: float               # wall clock (time.time) of its start
    tag: str


class CallEnded(Event, kind="call_ended"):
    """How a held call ended (Exited's facts) and the last bytes of its output (supervisor.tails),
    as latin-1 text of the bytes (JSON carries no bytes; one char per byte)."""
    call: int
    session: str
    started_at: float
    tag: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_seconds: float
    cpu_seconds: float | None
    peak_memory_bytes: int | None
    oom_killed: bool
    stdout_tail: str = ""
    stderr_tail: str = ""
    dropped: int = 0                # output bytes read and not kept (before the tails)


class Attached(Event, kind="attached"):
    """The end of ``Attach``'s answer: request ids from ``next_id`` on are fresh in this supervisor."""
    next_id: int
    pid: int


class ReviewStarted(Event, kind="review_started"):
    """A Review's child runs; its answer comes on the pipe passed with this (the daemon's to close)."""
    descriptors = 1


class SessionClosed(Event, kind="session_closed"):
    """``gone``: every process of the session was reaped and its sandbox released; False when the
    close's bound passed first (a process stuck in the kernel): it is released when it goes."""
    gone: bool = True


class PathsChecked(Event, kind="paths_checked"):
    paths: list[str]


class Pong(Event, kind="pong"):
    pass


class Error(Event, kind="error"):
    """A request's failure: the error's ``to_dict`` (``SandboxdError.from_dict`` raises it again)."""
    error: dict[str, object]


# -- the codec ------------------------------------------------------------------------------------

def decode(data: bytes, fds: int, table: "dict[str, type[Message]]") -> Message:
    """``data`` as a record of ``table`` (requests or events), checked field by field; Malformed if not."""
    try:
        fields = _decoder.decode(data.decode())
    except (ValueError, RecursionError):                  # also UnicodeDecodeError
        raise Malformed(0, f"a fork server message must be one JSON object below {MAX_MESSAGE} bytes") from None
    if not isinstance(fields, dict):
        raise Malformed(0, "a fork server message must be one JSON object")
    call_id = fields.get("id")
    if type(call_id) is not int:
        raise Malformed(0, f"a fork server message needs an integer id, got {call_id!r}")
    tag = "op" if table is _REQUESTS else "event"
    cls = table.get(str(fields.get(tag)))
    if cls is None:
        raise Malformed(call_id, f"unknown fork server {'operation' if tag == 'op' else 'event'} {fields.get(tag)!r}")
    flags = cls.descriptor_flags
    wanted = cls.descriptors + sum(fields.get(flag) is True for flag in flags)
    if fds != wanted:
        said = ", ".join(f"{flag} is {fields.get(flag)!r}" for flag in flags)
        raise Malformed(call_id, f"a fork server {cls._kind} takes {wanted} descriptors, got {fds}"
                        + (" (stdin, stdout, stderr)" if wanted == 3 else "") + (f" ({said})" if flags else ""))
    values: dict[str, object] = {}
    for name, check, annotation, read in cls._checks:
        if name not in fields and name in cls._defaults:
            values[name] = cls._defaults[name]            # its default (the records' are all immutable)
            continue
        value = fields.get(name)                          # None when absent: fine if optional
        if read is not None:
            try:
                value = read(value, name)
            except FieldRefused as refused:
                detail = f"fork server {cls._kind} field {refused.path!r} {refused.detail}"
                raise Malformed(call_id, detail[:500]) from None
        elif not check(value):
            raise Malformed(call_id, f"fork server {cls._kind} field {name!r} must be {annotation}, got {value!r}"[:500])
        values[name] = value
    # Every field is set and checked: filled in directly, without Record.__init__'s per-field walk
    # (the decoder's largest cost); the record is as immutable as one built the usual way.
    message = cls.__new__(cls)
    message.__dict__.update(values)
    return message


def requests() -> "dict[str, type[Message]]":
    """The request table, for ``decode`` and ``receive`` on the fork server's side."""
    return _REQUESTS


def events() -> "dict[str, type[Message]]":
    """The event table, for the client's side."""
    return _EVENTS


def send(sock: socket.socket, data: bytes, fds: "list[int] | None" = None, flags: int = 0) -> None:
    """One encoded message (``Message.encode``), with ``fds`` as SCM_RIGHTS."""
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], flags)
    else:
        sock.send(data, flags)


def receive_buffer() -> bytearray:
    """A buffer for ``receive``, made once per reader and used for every message it reads."""
    return bytearray(MAX_MESSAGE)


def receive(sock: socket.socket, table: "dict[str, type[Message]]",
            buffer: bytearray) -> "tuple[Message | Malformed | None, list[int]]":
    """The next message (None at EOF) and the descriptors that came with it (the caller's to close).
    A message that is not a record of ``table`` comes back as Malformed, never raised: the loop
    answers it and goes on. ``buffer`` (``receive_buffer``) is read into and reused: recvmsg would
    allocate MAX_MESSAGE afresh per message, which glibc serves with an mmap, an mremap and a
    munmap; in the fork server each of those may wait on the anonymous-memory lock it shares with
    every session's init (forked from it) while the kernel walks their pages, a cost that grew with
    the number of open sessions (docs/performance.md, "Session calls and the cgroup join")."""
    fds = array.array("i")
    size, ancdata, flags, _ = sock.recvmsg_into([buffer], socket.CMSG_SPACE(MAX_DESCRIPTORS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not size and not flags & socket.MSG_TRUNC:
        return None, list(fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return Malformed(0, f"a fork server message must be below {MAX_MESSAGE} bytes and carry at most "
                            f"{MAX_DESCRIPTORS} descriptors"), list(fds)
    try:
        return decode(bytes(memoryview(buffer)[:size]), len(fds), table), list(fds)
    except Malformed as malformed:
        return malformed, list(fds)


def message_limit(sock: socket.socket) -> int:
    """The largest request ``sock`` carries in one message: what its send buffer allows (the
    kernel refuses a SEQPACKET message over SO_SNDBUF - 32 bytes with EMSGSIZE), raised to
    MAX_MESSAGE when it can be (root: SO_SNDBUFFORCE), never above what the server reads."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 2 * MAX_MESSAGE)
    except OSError:
        pass                                              # not root: the default buffer
    return min(MAX_MESSAGE, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32 - 1024)
