"""One audit event as an OCSF 1.3 record (https://schema.ocsf.io): the class and activity its
type and tool map to, the common attributes every class requires, and the rest under
``unmapped``. docs/operations.md has the table (our field -> OCSF attribute).

Classes:
- Process Activity (1007): a command call (``shell.exec``, ``monitor.start``) starting (Launch)
  and ending (Terminate, with its exit code).
- File System Activity (1001): the file tools (``fs.read``, ``fs.list``, ``search``: Read;
  ``fs.write``: Create; ``patch.apply``: Update) and the git guard's removal of planted git
  configuration (Update).
- Network Activity (4001): the egress proxy's decisions (tool ``network``): a refused connection
  (Refuse) and an allowed one (Open).
- API Activity (6003): what a person or the daemon does through the API: sessions created and
  closed, policy changes, approvals asked and denied, review mode's apply, discard, checkpoint and
  rollback, and calls of tools the daemon does not run itself (``Authorize``'s tools).

A string a caller chose (a command, a path, a label) stays a JSON string value: it is never
parsed or interpreted here, and ``json.dumps`` escapes every control and non-ASCII character, so
a line of the export is one line whatever the caller sent.
"""

from __future__ import annotations

import json
import shlex
import socket
from typing import Any

from sandboxd import __version__
from sandboxd.audit.store import Event, EventType

OCSF_VERSION = "1.3.0"
PRODUCT = {"name": "sandboxd", "vendor_name": "sandboxd", "version": __version__}

PROCESS_ACTIVITY = (1007, "Process Activity", 1, "System Activity")
FILE_SYSTEM_ACTIVITY = (1001, "File System Activity", 1, "System Activity")
NETWORK_ACTIVITY = (4001, "Network Activity", 4, "Network Activity")
API_ACTIVITY = (6003, "API Activity", 6, "Application Activity")

# Activity ids by name, per class (OCSF 1.3).
PROCESS_LAUNCH, PROCESS_TERMINATE = (1, "Launch"), (2, "Terminate")
FILE_CREATE, FILE_READ, FILE_UPDATE = (1, "Create"), (2, "Read"), (3, "Update")
NETWORK_OPEN, NETWORK_REFUSE = (1, "Open"), (5, "Refuse")
API_CREATE, API_READ, API_UPDATE, API_DELETE, API_OTHER = (1, "Create"), (2, "Read"), (3, "Update"), (4, "Delete"), \
    (99, "Other")

STATUS_UNKNOWN, STATUS_SUCCESS, STATUS_FAILURE = (0, "Unknown"), (1, "Success"), (2, "Failure")
SEVERITY_INFO, SEVERITY_LOW, SEVERITY_MEDIUM, SEVERITY_HIGH = (1, "Informational"), (2, "Low"), (3, "Medium"), \
    (4, "High")

COMMAND_TOOLS = frozenset(("shell.exec", "monitor.start"))
FILE_TOOLS = {"fs.read": FILE_READ, "fs.list": FILE_READ, "search": FILE_READ, "fs.write": FILE_CREATE,
              "patch.apply": FILE_UPDATE}
NETWORK_TOOL = "network"
TOOL_EVENTS = frozenset((EventType.PERMISSION_GRANTED, EventType.TOOL_STARTED, EventType.TOOL_COMPLETED,
                         EventType.TOOL_FAILED))
# The API operation and activity of the events that are API actions in themselves.
API_EVENTS: dict[str, tuple[str, tuple[int, str]]] = {
    EventType.SESSION_CREATED: ("CreateSession", API_CREATE),
    EventType.SESSION_CLOSED: ("CloseSession", API_DELETE),
    EventType.POLICY_CHANGED: ("UpdateSessionPolicy", API_UPDATE),
    EventType.PERMISSION_REQUESTED: ("RequestApproval", API_OTHER),
    EventType.PERMISSION_GRANTED: ("Authorize", API_OTHER),
    EventType.PERMISSION_DENIED: ("Authorize", API_OTHER),
    EventType.CHANGES_APPLIED: ("ApplyChanges", API_UPDATE),
    EventType.CHANGES_DISCARDED: ("DiscardChanges", API_DELETE),
    EventType.CHECKPOINT_CREATED: ("CreateCheckpoint", API_CREATE),
    EventType.CHANGES_ROLLED_BACK: ("RollbackChanges", API_UPDATE),
    EventType.TOOL_STARTED: ("CallTool", API_OTHER),
    EventType.TOOL_COMPLETED: ("CallTool", API_OTHER),
    EventType.TOOL_FAILED: ("CallTool", API_OTHER),
    EventType.CALL_STOPPED: ("StopCall", API_OTHER),     # the daemon ended a call (a drain, a stop)
}

_HOSTNAME = socket.gethostname()
# How a pod's owner string begins (service.principals.POD_PREFIX: that layer is above this one).
POD_PREFIX = "pod:"


class Owner:
    """Whose session an event is in: its uid and principal (a TLS principal, or a pod's key)."""

    __slots__ = ("uid", "principal")

    def __init__(self, uid: int, principal: str) -> None:
        self.uid, self.principal = uid, principal


def record(event: Event, owner: Owner | None) -> dict[str, Any]:
    """The OCSF record of ``event`` (in a session ``owner`` owns; None: a session without a row)."""
    data = event.data
    kind, tool = event.type, event.tool
    status = _status(event)
    severity = _severity(event)
    body: dict[str, Any]
    if tool in COMMAND_TOOLS and kind in (EventType.TOOL_STARTED, EventType.TOOL_COMPLETED, EventType.TOOL_FAILED):
        activity = PROCESS_LAUNCH if kind == EventType.TOOL_STARTED else PROCESS_TERMINATE
        klass, body = PROCESS_ACTIVITY, {"process": _process(event)}
        if kind != EventType.TOOL_STARTED and isinstance(data.get("exit_code"), int):
            body["exit_code"] = data["exit_code"]
    elif tool in FILE_TOOLS and kind in (EventType.TOOL_STARTED, EventType.TOOL_COMPLETED, EventType.TOOL_FAILED):
        klass, activity, body = FILE_SYSTEM_ACTIVITY, FILE_TOOLS[tool], {"file": _file(event)}
    elif kind == EventType.GIT_CONFIG_NEUTRALIZED:
        klass, activity = FILE_SYSTEM_ACTIVITY, FILE_UPDATE
        body = {"file": {"path": str(data.get("repo", "")), "name": str(data.get("key") or data.get("what") or ""),
                         "type_id": 2, "type": "Folder"}}
    elif tool == NETWORK_TOOL and kind in (EventType.PERMISSION_DENIED, EventType.PERMISSION_GRANTED):
        klass = NETWORK_ACTIVITY
        activity = NETWORK_REFUSE if kind == EventType.PERMISSION_DENIED else NETWORK_OPEN
        body = {"dst_endpoint": _endpoint(str(data.get("destination") or data.get("summary") or "")),
                "src_endpoint": {"uid": event.session_id}}
    else:
        operation, activity = API_EVENTS.get(kind, (kind, API_OTHER))
        klass = API_ACTIVITY
        body = {"api": {"operation": operation, "service": {"name": "sandboxd"}},
                "src_endpoint": {"uid": event.session_id}}
        if event.call_id:
            body["api"]["request"] = {"uid": event.call_id}
    class_uid, class_name, category_uid, category_name = klass
    activity_id, activity_name = activity
    out: dict[str, Any] = {
        "class_uid": class_uid, "class_name": class_name, "category_uid": category_uid,
        "category_name": category_name, "activity_id": activity_id, "activity_name": activity_name,
        "type_uid": class_uid * 100 + activity_id, "type_name": f"{class_name}: {activity_name}",
        "time": int(event.time * 1000),
        "severity_id": severity[0], "severity": severity[1], "status_id": status[0], "status": status[1],
        "message": _message(event),
        "metadata": {"product": PRODUCT, "version": OCSF_VERSION, "uid": str(event.id), "sequence": event.id,
                     "log_name": "sandboxd audit", "original_time": repr(event.time),
                     "correlation_uid": event.call_id or event.session_id},
        "actor": _actor(event, owner),
        "device": {"hostname": _HOSTNAME, "type_id": 1, "type": "Server"},
        **body,
        "unmapped": {"event_type": kind, "session_id": event.session_id, "sequence": event.sequence,
                     "call_id": event.call_id, "tool": tool, "data": data},
    }
    if status == STATUS_FAILURE and data.get("reason"):
        out["status_detail"] = str(data["reason"])
    return out


def record_or_fallback(event: Event, owner: Owner | None) -> dict[str, Any]:
    """``record``, or if mapping this event fails (data of a shape no type writes: a row edited by
    hand), an API
    Activity record of class Other that keeps the event whole under ``unmapped`` and says why, so
    one event never holds the export back."""
    try:
        return record(event, owner)
    except Exception as exc:  # noqa: BLE001 - the event still leaves the node, marked
        fallback = record(Event(event.id, event.session_id, event.sequence, "", event.time, event.call_id, "", {}),
                          owner)
        fallback["unmapped"].update(event_type=event.type, tool=event.tool, data=event.data,
                                    mapping_error=f"{type(exc).__name__}: {exc}")
        return fallback


def encode(ocsf_record: dict[str, Any]) -> bytes:
    """A record as one JSON line (ASCII: every control and non-ASCII character escaped)."""
    return json.dumps(ocsf_record, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


def _actor(event: Event, owner: Owner | None) -> dict[str, Any]:
    """Who acted: the person who answered or closed (``by_uid``, and ``by_principal`` when that was
    a TLS caller or a pod) when the event names one, else the session's owner; the session is the
    actor's session. Only a local uid 0 (no principal) is the node's Admin: a pod's uid 0 is a
    User named by its pod (``name`` the principal, ``uid_alt`` the pod's UID)."""
    by = event.data.get("by_uid")
    if isinstance(by, int):
        uid: int | None = by
        by_principal = event.data.get("by_principal")
        principal = by_principal if isinstance(by_principal, str) else ""
    else:
        uid = owner.uid if owner is not None else None
        principal = owner.principal if owner is not None else ""
    user: dict[str, Any] = {}
    if uid is not None:
        admin = uid == 0 and not principal
        user = {"uid": str(uid), "type_id": 2 if admin else 1, "type": "Admin" if admin else "User"}
        if principal:
            user["name"] = principal
            if principal.startswith(POD_PREFIX):
                user["uid_alt"] = principal[len(POD_PREFIX):]
    actor: dict[str, Any] = {"user": user, "session": {"uid": event.session_id}}
    return actor


def _endpoint(destination: str) -> dict[str, Any]:
    """``host:port`` (the proxy's destination) as an OCSF endpoint; anything else as its hostname."""
    host, _, port = destination.rpartition(":")
    if host and port.isascii() and port.isdigit() and int(port) < 65536:
        return {"hostname": host.removeprefix("[").removesuffix("]"), "port": int(port)}
    return {"hostname": destination}


def _process(event: Event) -> dict[str, Any]:
    process: dict[str, Any] = {"uid": event.call_id}
    arguments = event.data.get("arguments")
    if isinstance(arguments, dict):
        argv = arguments.get("argv")
        if isinstance(argv, list):
            process["cmd_line"] = shlex.join(str(a) for a in argv)
            if argv:
                process["name"] = str(argv[0]).rsplit("/", 1)[-1]
        if isinstance(arguments.get("cwd"), str):
            process["working_directory"] = arguments["cwd"]
    return process


def _file(event: Event) -> dict[str, Any]:
    arguments = event.data.get("arguments")
    path = ""
    if isinstance(arguments, dict):
        paths = arguments.get("paths")
        path = str(arguments.get("path") or (", ".join(str(p) for p in paths) if isinstance(paths, list) else ""))
    name = path.rstrip("/").rsplit("/", 1)[-1] if path else ""
    return {"path": path, "name": name, "type_id": 0, "type": "Unknown", "uid": event.call_id}


def _status(event: Event) -> tuple[int, str]:
    kind, data = event.type, event.data
    if kind in (EventType.PERMISSION_DENIED, EventType.TOOL_FAILED):
        return STATUS_FAILURE
    if kind == EventType.TOOL_COMPLETED:
        failed = data.get("timed_out") or data.get("oom_killed") or data.get("signal") or \
            (isinstance(data.get("exit_code"), int) and data["exit_code"] != 0)
        return STATUS_FAILURE if failed else STATUS_SUCCESS
    if kind in (EventType.TOOL_STARTED, EventType.PERMISSION_REQUESTED):
        return STATUS_UNKNOWN                      # its outcome is a later event's
    return STATUS_SUCCESS


def _severity(event: Event) -> tuple[int, str]:
    if event.type == EventType.GIT_CONFIG_NEUTRALIZED:
        return SEVERITY_HIGH                       # a call planted code for git to run
    if event.type == EventType.PERMISSION_DENIED:
        return SEVERITY_MEDIUM
    if event.type == EventType.TOOL_FAILED:
        return SEVERITY_LOW
    return SEVERITY_INFO


def _message(event: Event) -> str:
    summary = event.data.get("message") or event.data.get("summary") or ""
    text = f"{event.type} {event.tool}".strip()
    return f"{text}: {summary}" if summary else text
