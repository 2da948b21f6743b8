"""The audit export (sandboxd/audit/export, issue 27 item 4): every event as an OCSF record, to a
rotated file or an OTLP collector, at least once from a persisted cursor; and WatchEvents' resume
cursor (``after_id``).

The records are checked against SCHEMA, a small table of the OCSF 1.3 classes the export uses: the
class's category, its allowed activity ids and its required attributes (https://schema.ocsf.io).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from conftest import eventually
from daemon_helpers import BASE_ENV, Daemon, DaemonFactory, create_session, rpc_error, run_exec
from otlp_collector import Collector
from sandboxd.audit.export import ocsf
from sandboxd.audit.export.cursor import Cursor
from sandboxd.audit.export.exporter import Exporter, cursor_path
from sandboxd.audit.export.sinks import FileSink
from sandboxd.audit.store import Event, EventStore, EventType
from sandboxd.policy.audit_export import AuditExport
from sandboxd.v1 import sandboxd_pb2 as pb

SANDBOXCTL = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sandboxctl"
# OCSF 1.3: class_uid -> (category_uid, activity ids, attributes the class requires beyond the base).
SCHEMA: dict[int, tuple[int, set[int], tuple[str, ...]]] = {
    1001: (1, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 99}, ("actor", "device", "file")),
    1007: (1, {0, 1, 2, 3, 4, 99}, ("actor", "device", "process")),
    4001: (4, {0, 1, 2, 3, 4, 5, 6, 7, 99}, ("dst_endpoint", "src_endpoint")),
    6003: (6, {0, 1, 2, 3, 4, 99}, ("actor", "api", "src_endpoint")),
}
BASE_REQUIRED = ("activity_id", "category_uid", "class_uid", "metadata", "severity_id", "time", "type_uid")
SEVERITIES, STATUSES = {0, 1, 2, 3, 4, 5, 6, 99}, {0, 1, 2, 99}


def ocsf_problems(record: dict[str, Any]) -> list[str]:
    """What makes ``record`` not a valid record of its class (empty: valid)."""
    problems = [f"no {name}" for name in BASE_REQUIRED if name not in record]
    if problems:
        return problems
    klass = SCHEMA.get(record["class_uid"])
    if klass is None:
        return [f"class {record['class_uid']} is not one the export uses"]
    category, activities, required = klass
    problems += [f"no {name}" for name in required if not record.get(name)]
    if record["category_uid"] != category:
        problems.append(f"category {record['category_uid']} is not class {record['class_uid']}'s ({category})")
    if record["activity_id"] not in activities:
        problems.append(f"activity {record['activity_id']} is not one of class {record['class_uid']}'s")
    if record["type_uid"] != record["class_uid"] * 100 + record["activity_id"]:
        problems.append("type_uid is not class_uid * 100 + activity_id")
    if record["severity_id"] not in SEVERITIES or record.get("status_id", 0) not in STATUSES:
        problems.append("severity_id or status_id out of range")
    if not isinstance(record["time"], int) or record["time"] < 0:
        problems.append("time is not milliseconds since the epoch")
    metadata = record["metadata"]
    if metadata.get("product", {}).get("name") != "sandboxd" or not metadata.get("version", "").startswith("1."):
        problems.append("metadata.product.name or metadata.version is wrong")
    return problems


def event(kind: str, tool: str = "", data: dict[str, Any] | None = None, event_id: int = 7) -> Event:
    return Event(event_id, "sess_1", 3, kind, 1700000000.25, "call_1" if tool else "", tool, data or {})


# Every event type the store writes, with the tools that change its class: (event, class_uid, activity_id).
EVERY_KIND = [
    (event(EventType.SESSION_CREATED, data={"workspace": "/w", "owner_uid": 1000}), 6003, 1),
    (event(EventType.SESSION_CLOSED, data={"by_uid": 0}), 6003, 4),
    (event(EventType.POLICY_CHANGED, data={"by_uid": 1000}), 6003, 3),
    (event(EventType.PERMISSION_REQUESTED, "shell.exec", {"summary": "Execute: rm -rf x"}), 6003, 99),
    (event(EventType.PERMISSION_GRANTED, "shell.exec", {"by": "policy"}), 6003, 99),
    (event(EventType.PERMISSION_DENIED, "fs.write", {"by": "sandbox", "reason": "destructive"}), 6003, 99),
    (event(EventType.TOOL_STARTED, "shell.exec", {"arguments": {"argv": ["ls", "-l"], "cwd": "/w"}}), 1007, 1),
    (event(EventType.TOOL_COMPLETED, "shell.exec", {"exit_code": 0, "signal": 0}), 1007, 2),
    (event(EventType.TOOL_FAILED, "monitor.start", {"error": "no such file"}), 1007, 2),
    (event(EventType.TOOL_STARTED, "fs.read", {"arguments": {"path": "/w/a"}}), 1001, 2),
    (event(EventType.TOOL_STARTED, "fs.write", {"arguments": {"paths": ["/w/a"]}}), 1001, 1),
    (event(EventType.TOOL_COMPLETED, "patch.apply", {}), 1001, 3),
    (event(EventType.TOOL_COMPLETED, "fs.list", {}), 1001, 2),
    (event(EventType.TOOL_COMPLETED, "search", {}), 1001, 2),
    (event(EventType.TOOL_STARTED, "browser.action", {"arguments": {"url": "x"}}), 6003, 99),
    (event(EventType.TOOL_COMPLETED, "monitor.list", {}), 6003, 99),
    (event(EventType.PERMISSION_DENIED, "network", {"destination": "evil.example:443", "by": "sandbox"}), 4001, 5),
    (event(EventType.PERMISSION_GRANTED, "network", {"summary": "api.example:443", "by": "user"}), 4001, 1),
    (event(EventType.GIT_CONFIG_NEUTRALIZED, data={"repo": "/w", "what": "hook", "key": "pre-commit"}), 1001, 3),
    (event(EventType.CHANGES_APPLIED, data={"paths": ["a"]}), 6003, 3),
    (event(EventType.CHANGES_DISCARDED, data={"by": "review.keep_days"}), 6003, 4),
    (event(EventType.CHECKPOINT_CREATED, data={"label": "x"}), 6003, 1),
    (event(EventType.CHANGES_ROLLED_BACK, data={}), 6003, 3),
    (event(EventType.CALL_STOPPED, data={"reason": "drain_timeout"}), 6003, 99),
]


def test_every_event_type_maps_to_a_valid_ocsf_record() -> None:
    assert {e.type for e, *_ in EVERY_KIND} == set(EventType.ALL)        # none forgotten
    for source, class_uid, activity_id in EVERY_KIND:
        record = ocsf.record(source, ocsf.Owner(1000, ""))
        assert ocsf_problems(record) == [], (source, record)
        assert (record["class_uid"], record["activity_id"]) == (class_uid, activity_id), source
        assert record["metadata"]["uid"] == "7" and record["time"] == 1700000000250
        assert record["unmapped"]["data"] == source.data and record["unmapped"]["event_type"] == source.type
    launch = ocsf.record(EVERY_KIND[6][0], ocsf.Owner(1000, ""))
    assert launch["process"]["cmd_line"] == "ls -l" and launch["actor"]["user"]["uid"] == "1000"
    closed = ocsf.record(EVERY_KIND[1][0], ocsf.Owner(1000, ""))
    assert closed["actor"]["user"]["uid"] == "0"              # who closed it, not whose it was
    network = ocsf.record(EVERY_KIND[16][0], None)
    assert network["dst_endpoint"] == {"hostname": "evil.example", "port": 443}
    odd = ocsf.record(event(EventType.PERMISSION_DENIED, "network", {"destination": "x:99999"}), None)
    assert odd["dst_endpoint"] == {"hostname": "x:99999"}
    denied = ocsf.record(EVERY_KIND[5][0], None)
    assert (denied["status_id"], denied["severity_id"]) == (2, 3) and denied["status_detail"] == "destructive"


def test_an_event_that_cannot_be_mapped_still_leaves_whole() -> None:
    """A row someone edited by hand: its data a JSON list, which no event type writes."""
    odd = Event(7, "sess_1", 3, EventType.TOOL_STARTED, 1700000000.25, "call_1", "shell.exec", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        ocsf.record(odd, None)
    kept = ocsf.record_or_fallback(odd, None)
    assert ocsf_problems(kept) == [] and (kept["class_uid"], kept["activity_id"]) == (6003, 99)
    assert kept["unmapped"]["event_type"] == EventType.TOOL_STARTED and "mapping_error" in kept["unmapped"]


def test_the_schema_check_sees_a_bad_record() -> None:
    """The control: the table refuses a record that lacks a required attribute, one with another
    class's activity, and one whose type_uid does not follow."""
    good = ocsf.record(EVERY_KIND[6][0], ocsf.Owner(0, ""))
    assert ocsf_problems(good) == []
    assert ocsf_problems({k: v for k, v in good.items() if k != "process"}) == ["no process"]
    assert ocsf_problems({**good, "activity_id": 5}) != []
    assert ocsf_problems({**good, "type_uid": 100799}) == ["type_uid is not class_uid * 100 + activity_id"]


def test_a_callers_string_stays_data_on_one_line() -> None:
    hostile = "x\n{\"class_uid\":6003}\r\x1b[2K\u202eevil\"},\"actor\":{}"
    source = event(EventType.TOOL_STARTED, "shell.exec", {"arguments": {"argv": [hostile], "cwd": "/w"}})
    line = ocsf.encode(ocsf.record(source, ocsf.Owner(1000, hostile)))
    assert line.count(b"\n") == 1 and line.endswith(b"\n") and line.isascii()
    assert b"\x1b" not in line and b"\r" not in line
    decoded = json.loads(line)
    assert decoded["unmapped"]["data"]["arguments"]["argv"] == [hostile]
    assert decoded["actor"]["user"]["name"] == hostile and decoded["class_uid"] == 1007


def test_a_root_pod_tenant_is_exported_as_its_pod_not_the_nodes_admin() -> None:
    """Hostile pass A, F7: a pod's uid 0 is never the node's Admin: its records are a User named by its
    pod (uid_alt: the pod's UID), whether the owner acted or the event names who acted (by_uid with
    by_principal). The control: the node's root (no principal) is the Admin, on the same events."""
    pod_uid = "0b7c6f5e-4e0d-4f59-9d62-8c8a4f0f6a11"
    pod = f"pod:{pod_uid}"
    run = event(EventType.TOOL_STARTED, "shell.exec", {"arguments": {"argv": ["id"]}})
    changed = event(EventType.POLICY_CHANGED, data={"before": {}, "after": {}, "by_uid": 0, "by_principal": pod})
    as_pod = {"uid": "0", "type_id": 1, "type": "User", "name": pod, "uid_alt": pod_uid}
    for source in (run, changed):
        record = ocsf.record(source, ocsf.Owner(0, pod))
        assert record["actor"]["user"] == as_pod and ocsf_problems(record) == [], record
    by_root = event(EventType.POLICY_CHANGED, data={"before": {}, "after": {}, "by_uid": 0})
    assert ocsf.record(by_root, ocsf.Owner(0, pod))["actor"]["user"] == {"uid": "0", "type_id": 2, "type": "Admin"}
    assert ocsf.record(run, ocsf.Owner(0, ""))["actor"]["user"] == {"uid": "0", "type_id": 2, "type": "Admin"}
    tls = ocsf.record(changed, ocsf.Owner(0, "tls:agent"))["actor"]["user"]          # by_principal wins
    assert tls["name"] == pod and tls["type"] == "User"


def test_the_file_sink_rotates_at_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "export" / "audit.jsonl"
    sink = FileSink(str(path), max_bytes=64 << 10, keep=3)
    lines = [(f'{{"n":{n},"pad":"{"p" * 1000}"}}\n').encode() for n in range(300)]     # ~300 KiB: 4 rotations
    for start in range(0, 300, 50):
        sink.send([({}, line) for line in lines[start:start + 50]])
    sink.close()
    files = sorted(tmp_path.joinpath("export").iterdir())
    assert [f.name for f in files] == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl.3"]
    assert all(f.stat().st_size <= 64 << 10 for f in files) and oct(path.stat().st_mode & 0o777) == "0o600"
    kept = [json.loads(line)["n"] for f in (files[3], files[2], files[1], files[0]) for line in f.read_text().splitlines()]
    assert kept == list(range(300 - len(kept), 300))          # in order, the oldest dropped whole
    assert len(kept) < 300


def test_the_file_sink_follows_an_outside_rotation(tmp_path: Path) -> None:
    """logrotate moved the file away: the next batch goes to a new file at the path, not the old one."""
    path = tmp_path / "audit.jsonl"
    sink = FileSink(str(path), max_bytes=1 << 20, keep=2)
    sink.send([({}, b'{"n":1}\n')])
    path.rename(tmp_path / "audit.jsonl.old")
    sink.send([({}, b'{"n":2}\n')])
    sink.close()
    assert path.read_text() == '{"n":2}\n' and (tmp_path / "audit.jsonl.old").read_text() == '{"n":1}\n'


def test_the_file_sink_writes_only_into_a_file_of_its_own(tmp_path: Path) -> None:
    """A file another user made first at the path (theirs to read: the node's whole trail), a
    FIFO (an open that would block the export for good), or one others may read: refused, naming
    the file, at once. The control: the sink's own file, made 0600, takes the records."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)
    theirs = shared / "audit.jsonl"
    theirs.touch(mode=0o666)
    os.chown(theirs, 65534, 65534)
    fifo = shared / "fifo.jsonl"
    os.mkfifo(fifo)
    loose = tmp_path / "loose.jsonl"
    loose.touch()
    os.chmod(loose, 0o644)
    for path, why in ((theirs, "belongs to uid 65534"), (fifo, "is not a regular file|No such device"), (loose, "has mode 644")):
        sink = FileSink(str(path), max_bytes=1 << 20, keep=2)
        with pytest.raises(OSError, match=why):
            sink.send([({}, b'{"n":1}\n')])
        sink.close()
    assert theirs.read_bytes() == b"" and loose.read_bytes() == b""
    own = tmp_path / "own" / "audit.jsonl"
    sink = FileSink(str(own), max_bytes=1 << 20, keep=2)
    sink.send([({}, b'{"n":1}\n')])
    sink.close()
    assert own.read_text() == '{"n":1}\n' and own.stat().st_mode & 0o777 == 0o600


def test_the_cursor_is_replaced_whole(tmp_path: Path) -> None:
    cursor = Cursor(str(tmp_path / "c.cursor"))
    assert cursor.last_id == 0
    cursor.store(41)
    assert Cursor(str(tmp_path / "c.cursor")).last_id == 41 and not (tmp_path / "c.cursor.tmp").exists()
    (tmp_path / "c.cursor").write_text("{torn")
    assert Cursor(str(tmp_path / "c.cursor")).last_id == 0    # repeats, never a gap


class FlakySink:
    """Fails its first ``failures`` sends, then keeps what it is sent."""
    name = "file"

    def __init__(self, failures: int) -> None:
        self.failures, self.sends, self.ids = failures, 0, []      # type: list[int]

    def send(self, records: list[tuple[dict[str, Any], bytes]]) -> None:
        self.sends += 1
        if self.sends <= self.failures:
            raise OSError("collector down")
        self.ids += [int(record["metadata"]["uid"]) for record, _line in records]

    def close(self) -> None:
        pass


def test_a_failing_sink_is_retried_from_the_cursor(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "events.db"))
    try:
        for n in range(25):
            store.append("s", EventType.TOOL_STARTED, call_id=f"c{n}", tool="shell.exec", data={"n": n})
        sink = FlakySink(failures=2)
        exporter = Exporter(store.path, str(tmp_path), AuditExport(sink="file", path="/x", batch=10), sink=sink)
        exporter.start()
        assert eventually(lambda: len(sink.ids) == 25, within=30), (sink.sends, sink.ids)
        exporter.stop()
        assert sink.ids == list(range(1, 26)) and exporter.failures == 2
        assert Cursor(cursor_path(str(tmp_path), "file")).last_id == 25
    finally:
        store.close()


class HangingSink(FlakySink):
    """Holds every send until released: a collector that does not answer."""

    def __init__(self) -> None:
        super().__init__(failures=0)
        self.entered, self.release = threading.Event(), threading.Event()

    def send(self, records: list[tuple[dict[str, Any], bytes]]) -> None:
        self.entered.set()
        self.release.wait(60)
        super().send(records)


def test_a_hanging_sink_holds_back_neither_appends_nor_the_wal(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "events.db"))
    sink = HangingSink()
    exporter = Exporter(store.path, str(tmp_path), AuditExport(sink="file", path="/x", batch=5), sink=sink)
    try:
        store.append("s", EventType.TOOL_STARTED, call_id="c", tool="shell.exec", data={})
        exporter.start()
        assert sink.entered.wait(30)                       # the exporter is stuck in its sink
        for n in range(200):                               # appends go on
            store.append("s", EventType.TOOL_STARTED, call_id=f"c{n}", tool="shell.exec", data={"n": n})
        with sqlite3.connect(store.path) as other:
            busy, _log, _done = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0 and os.path.getsize(store.path + "-wal") == 0     # no reader pins the WAL
        pinning = sqlite3.connect(store.path, isolation_level=None)    # the control: a reader mid-transaction
        pinning.execute("BEGIN")
        pinning.execute("SELECT COUNT(*) FROM events").fetchone()
        store.append("s", EventType.TOOL_STARTED, call_id="pinned", tool="shell.exec", data={})
        with sqlite3.connect(store.path) as other:
            assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 1
        pinning.close()
        sink.release.set()
        assert eventually(lambda: len(sink.ids) == 202, within=30)
        assert sink.ids == list(range(1, 203))
    finally:
        sink.release.set()
        exporter.stop()
        store.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the simulated kill
def test_a_crash_between_delivery_and_cursor_repeats_exactly_that_batch(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The window at-least-once leaves: a batch written to the file, the process gone before its
    cursor is stored. The next exporter sends that batch again, and nothing else twice."""
    store = EventStore(str(tmp_path / "events.db"))
    out = tmp_path / "out.jsonl"
    settings = AuditExport(sink="file", path=str(out), batch=10)
    try:
        for n in range(35):
            store.append("s", EventType.TOOL_STARTED, call_id=f"c{n}", tool="shell.exec", data={"n": n})
        real_store = Cursor.store

        def dies_on_the_third(self: Cursor, last_id: int) -> None:
            if last_id > 20:
                raise SystemExit("killed")         # ends the exporter's thread where a kill -9 would
            real_store(self, last_id)
        monkeypatch.setattr(Cursor, "store", dies_on_the_third)
        first = Exporter(store.path, str(tmp_path), settings)
        first.start()
        assert eventually(lambda: not first._thread.is_alive(), within=30)
        first._sink.close()
        assert len(exported(out)) == 30 and Cursor(cursor_path(str(tmp_path), "file")).last_id == 20
        monkeypatch.setattr(Cursor, "store", real_store)
        second = Exporter(store.path, str(tmp_path), settings)
        second.start()
        assert eventually(lambda: len(exported(out)) >= 45, within=30)
        second.stop()
        ids = [int(r["metadata"]["uid"]) for r in exported(out)]
        assert sorted(set(ids)) == list(range(1, 36))
        assert [i for i in set(ids) if ids.count(i) > 1] == list(range(21, 31))     # that batch, once more
    finally:
        store.close()


def test_the_export_keys_are_a_table_of_their_own(tmp_path: Path) -> None:
    from sandboxd import config

    path = tmp_path / "sandboxd.toml"
    path.write_text('[audit]\nevent_bytes = 4096\n[audit.export]\nsink = "file"\nmax_bytes = "1M"\nkeep = 3\n')
    settings = config.load(str(path), environ={"SANDBOXD_AUDIT_EXPORT_BATCH": "50"}, flags={})
    assert settings.audit_export == AuditExport(sink="file", path="/var/lib/sandboxd/audit-export.ocsf.jsonl",
                                                max_bytes=1 << 20, keep=3, batch=50)
    assert settings.audit.event_bytes == 4096
    for text, key, problem in (
            ('[audit.export]\nsnk = "file"\n', "audit.export.snk", "known keys of [audit.export]: sink"),
            ('[audit.export]\nsink = "otlp"\n', "audit.export.endpoint", "OTLP/HTTP logs URL"),
            ('[audit.export]\nsink = "kafka"\n', "audit.export.sink", "must be one of"),
            ('[audit.export]\nsink = "file"\npath = "relative"\n', "audit.export.path", "absolute"),
            ('[audit.export]\nmax_bytes = "1K"\n', "audit.export.max_bytes", "at least")):
        path.write_text(text)
        with pytest.raises(config.ConfigError) as refused:
            config.load(str(path), environ={}, flags={})
        assert refused.value.key == key and problem in refused.value.problem, refused.value


def test_the_otlp_sink_without_its_exporter_is_refused_with_a_message(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """opentelemetry-api without the exporter (what a plain install has: the MCP SDK brings the api)
    is a missing extra, said as such, not a traceback. The installed package's venv with the exporter's
    files removed is the same case on disk (tests/test_debian_package.py)."""
    from sandboxd import config

    path = tmp_path / "sandboxd.toml"
    path.write_text('[audit.export]\nsink = "otlp"\nendpoint = "http://127.0.0.1:4318/v1/logs"\n')
    assert config.load(str(path), environ={}, flags={}).audit_export.sink == "otlp"     # the control: installed
    for name in [name for name in sys.modules if name.startswith("opentelemetry.exporter")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter", None)   # as if not installed: importing it fails
    with pytest.raises(config.ConfigError) as refused:
        config.load(str(path), environ={}, flags={})
    assert refused.value.key == "audit.export.sink" and "otlp extra" in refused.value.problem, refused.value


# --------------------------------------------------------------------------- a real daemon


def exported(path: Path) -> list[dict[str, Any]]:
    """Every record in the export file and its rotated files, oldest first."""
    files = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:])) + [path]
    return [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines()]


def all_events(daemon: Daemon) -> list[pb.Event]:
    events, token = [], ""
    while True:
        page = daemon.stub.QueryEvents(pb.QueryEventsRequest(page_size=1000, page_token=token))
        events += page.events
        token = page.next_page_token
        if not token:
            return events


def file_config(path: Path, **extra: object) -> str:
    lines = ["[audit.export]", 'sink = "file"', f'path = "{path}"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


def test_a_daemon_exports_every_event_of_a_scenario(sandboxd_daemon: DaemonFactory) -> None:
    out = sandboxd_daemon.base / "export" / "audit.jsonl"
    daemon = sandboxd_daemon(config=file_config(out, max_bytes="64K", keep=50, batch=20))
    ws = sandboxd_daemon.workspace()
    session = create_session(daemon.stub, ws).id
    assert run_exec(daemon.stub, session, ["sh", "-c", "echo hi > a.txt"]).result.exit_code == 0
    daemon.stub.WriteFile(pb.WriteFileRequest(session_id=session, path=str(ws / "b.txt"), data=b"b\n"))
    daemon.stub.ReadFile(pb.ReadFileRequest(session_id=session, path=str(ws / "b.txt")))
    daemon.stub.ListDir(pb.ListDirRequest(session_id=session))
    daemon.stub.Search(pb.SearchRequest(session_id=session, pattern="hi"))
    denied = rpc_error(lambda: daemon.stub.WriteFile(pb.WriteFileRequest(session_id=session, path="/etc/sbxd-x",
                                                                         data=b"x")))
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED, denied
    daemon.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session, approval_policy=pb.ON_REQUEST))
    for n in range(25):                                       # enough records for a rotation at 64K
        run_exec(daemon.stub, session, ["true", "x" * 1500, str(n)])
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    review_ws = sandboxd_daemon.workspace()                   # review mode: a checkpoint, an apply
    review = create_session(daemon.stub, review_ws, review=True).id
    assert run_exec(daemon.stub, review, ["sh", "-c", "echo r > r.txt"]).result.exit_code == 0
    daemon.stub.CreateCheckpoint(pb.CreateCheckpointRequest(session_id=review, label="first\x1b[2K"))
    daemon.stub.ApplyChanges(pb.ApplyChangesRequest(session_id=review))
    assert (review_ws / "r.txt").read_text() == "r\n"
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=review))
    events = all_events(daemon)
    assert eventually(lambda: len(exported(out)) >= len(events), within=60), (len(events), len(exported(out)))
    records = exported(out)
    assert [int(r["metadata"]["uid"]) for r in records] == [e.id for e in events]      # each once, in order
    assert out.with_name("audit.jsonl.1").exists()                                     # rotated
    assert all(f.stat().st_size <= 64 << 10 for f in out.parent.iterdir())
    for record in records:
        assert ocsf_problems(record) == [], record
    kinds = {(r["unmapped"]["event_type"], r["unmapped"]["tool"]): r["class_uid"] for r in records}
    assert {e.type for e in events} >= {EventType.SESSION_CREATED, EventType.PERMISSION_GRANTED, EventType.TOOL_STARTED,
                                         EventType.TOOL_COMPLETED, EventType.PERMISSION_DENIED,
                                         EventType.POLICY_CHANGED, EventType.SESSION_CLOSED,
                                         EventType.CHECKPOINT_CREATED, EventType.CHANGES_APPLIED}
    assert kinds[(EventType.CHECKPOINT_CREATED, "")] == 6003 and kinds[(EventType.CHANGES_APPLIED, "")] == 6003
    assert kinds[(EventType.TOOL_STARTED, "shell.exec")] == 1007 and kinds[(EventType.TOOL_STARTED, "fs.write")] == 1001
    assert kinds[(EventType.SESSION_CREATED, "")] == 6003 and kinds[(EventType.PERMISSION_DENIED, "fs.write")] == 6003
    assert records[0]["actor"]["user"]["uid"] == "0"
    ended = [r for r in records if r["class_uid"] == 1007 and r["activity_id"] == 2]
    assert ended and all(r["exit_code"] == 0 and r["status_id"] == 1 for r in ended)
    launched = [r for r in records if r["class_uid"] == 1007 and r["activity_id"] == 1]
    assert launched[0]["process"]["cmd_line"] == "sh -c 'echo hi > a.txt'"


CONNECT_PROBE = """
import socket
with socket.create_connection(("127.0.0.1", 3128), timeout=30) as proxy:
    proxy.sendall(b"CONNECT other.invalid:443 HTTP/1.1\\r\\nHost: other.invalid:443\\r\\n\\r\\n")
    print(proxy.recv(200).split(b"\\r\\n")[0].decode())
"""


def test_a_refused_connection_is_network_activity(sandboxd_daemon: DaemonFactory) -> None:
    out = sandboxd_daemon.base / "export" / "audit.jsonl"
    daemon = sandboxd_daemon(config=file_config(out))
    session = create_session(daemon.stub, sandboxd_daemon.workspace(), pb.SandboxPolicy(
        mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=["allowed.invalid"])).id
    try:
        answer = run_exec(daemon.stub, session, ["python3", "-c", CONNECT_PROBE])
        assert "403" in answer.stdout.decode(), answer.describe()
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    wanted = {e.id for e in all_events(daemon)}
    assert eventually(lambda: {int(r["metadata"]["uid"]) for r in exported(out)} >= wanted, within=60)
    [refused] = [r for r in exported(out) if r["unmapped"]["tool"] == "network"]
    assert (refused["class_uid"], refused["activity_id"], refused["status_id"]) == (4001, 5, 2)
    assert refused["dst_endpoint"] == {"hostname": "other.invalid", "port": 443} and ocsf_problems(refused) == []


def test_a_stopping_daemon_exports_its_last_events(sandboxd_daemon: DaemonFactory) -> None:
    out = sandboxd_daemon.base / "export" / "audit.jsonl"
    daemon = sandboxd_daemon(config=file_config(out))
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    run_exec(daemon.stub, session, ["true"])
    assert daemon.stop() == 0
    with sqlite3.connect(sandboxd_daemon.base / "state" / "events.db") as db:
        stored = [row[0] for row in db.execute("SELECT id FROM events ORDER BY id")]
    assert [int(r["metadata"]["uid"]) for r in exported(out)] == stored and len(stored) >= 4


def test_kill_9_mid_export_loses_nothing_and_repeats_at_most_a_batch(sandboxd_daemon: DaemonFactory) -> None:
    out = sandboxd_daemon.base / "export" / "audit.jsonl"
    batch = 20
    config = file_config(out, batch=batch)
    daemon = sandboxd_daemon(config=config)
    ws = sandboxd_daemon.workspace()
    session = create_session(daemon.stub, ws).id
    for n in range(60):
        run_exec(daemon.stub, session, ["true", str(n)])

    def more_calls() -> None:                       # still appending when the kill comes
        try:
            for n in range(1000):
                run_exec(daemon.stub, session, ["true", "more", str(n)])
        except grpc.RpcError:
            pass
    caller = threading.Thread(target=more_calls)
    caller.start()
    assert eventually(lambda: len(exported(out)) > 200, within=120)
    assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
    caller.join(60)
    before_kill = len(exported(out))
    cursor = Cursor(str(sandboxd_daemon.base / "state" / "audit-export-file.cursor")).last_id
    with sqlite3.connect(sandboxd_daemon.base / "state" / "events.db") as db:
        stored_at_kill = int(db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
    ids_before = [int(r["metadata"]["uid"]) for r in exported(out)]
    assert cursor <= (max(ids_before) if ids_before else 0)        # never ahead of what was delivered
    again = sandboxd_daemon(config=config)
    again.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    events = all_events(again)
    assert eventually(lambda: {int(r["metadata"]["uid"]) for r in exported(out)} >= {e.id for e in events},
                      within=60)
    ids = [int(r["metadata"]["uid"]) for r in exported(out)]
    repeated = len(ids) - len(set(ids))
    assert set(ids) == {e.id for e in events}                       # nothing lost
    assert repeated <= batch, (repeated, before_kill, cursor)
    print(json.dumps({"events": len(events), "stored_at_kill": stored_at_kill, "exported_before_kill": before_kill,
                      "cursor_at_kill": cursor,
                      "repeated_after_restart": repeated}))


# --------------------------------------------------------------------------- OTLP


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    try:
        yield found
    finally:
        found.close()


def test_otlp_reaches_a_collector_and_a_hanging_one_stalls_no_call(sandboxd_daemon: DaemonFactory,
                                                                   collector: Collector) -> None:
    collector.hang.set()
    daemon = sandboxd_daemon(config=f'[audit.export]\nsink = "otlp"\nendpoint = "{collector.endpoint}"\n')
    ws = sandboxd_daemon.workspace()
    session = create_session(daemon.stub, ws).id
    assert eventually(lambda: collector.hung >= 1, within=30)       # the exporter's request is held
    for n in range(10):                                            # calls go on meanwhile
        assert run_exec(daemon.stub, session, ["echo", str(n)]).stdout == f"{n}\n".encode()
    assert collector.bodies == []
    collector.hang.clear()
    collector.release.set()                                        # it answers again: the backlog arrives
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    wanted = {e.id for e in all_events(daemon)}
    assert eventually(lambda: collector.ids() >= wanted, within=120), (sorted(wanted - collector.ids()))
    for body in collector.bodies:
        assert ocsf_problems(json.loads(body)) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_otlp_without_a_collector_is_retried_not_fatal(sandboxd_daemon: DaemonFactory) -> None:
    """The control for the hang: a port nobody listens on refuses at once; calls are served, the
    daemon keeps running, and the failures are counted."""
    metrics_port = free_port()
    daemon = sandboxd_daemon(config=f'[audit.export]\nsink = "otlp"\nendpoint = "http://127.0.0.1:{free_port()}/v1/logs"\n',
                             args=["--metrics", f"127.0.0.1:{metrics_port}"])
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    assert run_exec(daemon.stub, session, ["echo", "ok"]).stdout == b"ok\n"
    assert eventually(lambda: "audit export failed" in daemon.log(), within=60), daemon.log()
    assert metric(metrics_port, "sandboxd_audit_export_failures_total") >= 1
    assert metric(metrics_port, "sandboxd_audit_exported_events_total") == 0
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    assert daemon.proc is not None and daemon.proc.poll() is None


# A sitecustomize.py for a daemon's PYTHONPATH: an import finder that notes, in MARK, each module of
# the WATCHED top-level packages a process of the daemon imports (find_spec is asked once per
# module, before the ordinary finders, which then import it as usual).
NOTE_IMPORTS = '''\
import os, sys

class _NoteImports:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in WATCHED:
            try:
                with open(MARK, "a") as notes:
                    notes.write(f"{os.getpid()} {name}\\n")
            except OSError:
                pass
        return None

sys.meta_path.insert(0, _NoteImports())
'''


def imports_noted(directory: Path) -> set[str]:
    """The watched top-level packages a daemon that ran with ``directory`` on its PYTHONPATH imported."""
    mark = directory / "imported"
    return {line.split()[1].partition(".")[0] for line in mark.read_text().splitlines()} if mark.exists() else set()


def watching_imports(directory: Path, *packages: str) -> dict[str, str]:
    """The environment that makes a daemon note its imports of ``packages`` (see NOTE_IMPORTS)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(
        f"WATCHED = {set(packages)!r}\nMARK = {str(directory / 'imported')!r}\n" + NOTE_IMPORTS)
    return {"PYTHONPATH": str(directory)}


def test_only_the_otlp_sink_loads_the_sdk(sandboxd_daemon: DaemonFactory, collector: Collector) -> None:
    """The OpenTelemetry SDK, and requests which it brings, are the otlp sink's alone: the package and
    the image carry them (the otlp extra), this venv has them, yet a daemon that does not export to
    a collector never imports them. The control: one exporting with the otlp sink does."""
    for name, config in (("default", None), ("file", '[audit.export]\nsink = "file"\npath = "{base}/audit.jsonl"\n'),
                         ("otlp", f'[audit.export]\nsink = "otlp"\nendpoint = "{collector.endpoint}"\n')):
        notes = sandboxd_daemon.base / f"imports-{name}"
        daemon = sandboxd_daemon(config=config.format(base=sandboxd_daemon.base) if config else None,
                                 env=watching_imports(notes, "opentelemetry", "requests"))
        session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
        assert run_exec(daemon.stub, session, ["echo", name]).stdout == f"{name}\n".encode()
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
        if name == "file":
            assert eventually(lambda: (sandboxd_daemon.base / "audit.jsonl").exists(), within=60)
        if name == "otlp":
            assert eventually(lambda: collector.bodies != [], within=60)
        daemon.close()
        if name == "otlp":
            assert imports_noted(notes) == {"opentelemetry", "requests"}
        else:
            assert imports_noted(notes) == set(), name


# --------------------------------------------------------------------------- WatchEvents after_id


def test_watch_events_resumes_after_an_id(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    for n in range(3):
        run_exec(daemon.stub, session, ["true", str(n)])
    past = all_events(daemon)
    cut = past[len(past) // 2].id
    for request in (pb.WatchEventsRequest(after_id=cut), pb.WatchEventsRequest(session_id=session, after_id=cut)):
        stream = daemon.stub.WatchEvents(request, timeout=60)
        seen = [next(stream).id for _ in range(len([e for e in past if e.id > cut]))]
        assert seen == [e.id for e in past if e.id > cut]           # exactly the events after N, in order
        run_exec(daemon.stub, session, ["true", "live"])            # then live ones
        assert next(stream).id > past[-1].id
        stream.cancel()
        past = all_events(daemon)
    everything = daemon.stub.WatchEvents(pb.WatchEventsRequest(), timeout=60)   # the control: no cursor
    assert next(everything).id == past[0].id
    everything.cancel()
    shown = subprocess.run([str(SANDBOXCTL), "--socket", daemon.socket, "events", "--after", str(cut)],
                           capture_output=True, text=True, timeout=60, env=BASE_ENV)
    assert shown.returncode == 0, shown.stderr
    assert [int(line.split()[1]) for line in shown.stdout.splitlines()] == [e.id for e in past if e.id > cut]
    follower = subprocess.Popen([str(SANDBOXCTL), "--socket", daemon.socket, "events", "--follow", "--after",
                                 str(cut)], stdout=subprocess.PIPE, text=True, env=BASE_ENV)
    try:
        assert follower.stdout is not None
        followed = [int(follower.stdout.readline().split()[1]) for e in past if e.id > cut]
        assert followed == [e.id for e in past if e.id > cut]
    finally:
        follower.kill()
        follower.wait()
    refused = subprocess.run([str(SANDBOXCTL), "--socket", daemon.socket, "events", "--after", "-1"],
                             capture_output=True, text=True, timeout=60, env=BASE_ENV)
    assert refused.returncode == 2 and "not an event id" in refused.stderr, refused
    too_far = rpc_error(lambda: daemon.stub.WatchEvents(pb.WatchEventsRequest(after_id=1 << 63), timeout=60))
    assert too_far.code() == grpc.StatusCode.INVALID_ARGUMENT and "after_id" in (too_far.details() or "")
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
