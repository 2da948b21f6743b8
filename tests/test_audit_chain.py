"""The audit log's hash chain and signed checkpoints (sandboxd.audit.integrity), checked the way an
attacker without the key would tamper: rows edited, deleted, inserted and reordered with the
sqlite3 module, a checkpoint edited and one forged with another key. Each is caught, with its
kind and the first event it concerns; the untouched log (the control) is whole."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sandboxd.audit.integrity import checkpoints, keys
from sandboxd.audit.integrity.encoding import ZERO_HASH, checkpoint_message, digest, event_hash
from sandboxd.audit.integrity.verify import Kind, Verifier, open_read_only
from sandboxd.audit.store import EventStore, EventType, open_in_state_dir
from sandboxd.cli.audit import main as audit_main
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.audit_limits import AuditLimits

EVENTS = 40            # 20 in each of two sessions, interleaved
EVERY = 10             # a checkpoint every 10 events


def _filled(state: Path, events: int = EVENTS) -> Path:
    store = open_in_state_dir(str(state), limits=AuditLimits(checkpoint_events=EVERY))
    for index in range(events):
        store.append("sess-a" if index % 2 == 0 else "sess-b", EventType.TOOL_STARTED, call_id=f"c{index}",
                     tool="shell.exec", data={"argv": ["echo", str(index)]})
    store.close()
    return state / "events.db"


def _verify(path: Path, *, public: bool = True) -> tuple[int, str]:
    db = open_read_only(str(path))
    try:
        key = keys.read_public_of_state(str(path.parent)) if public else None
        report = Verifier(db, key, pinned=public).verify()
    finally:
        db.close()
    return (report.problem.event_id or report.problem.checkpoint_id, report.problem.kind) if report.problem \
        else (0, report.text())


def _tamper(path: Path, *statements: tuple[str, tuple[object, ...]]) -> None:
    db = sqlite3.connect(path)
    for sql, args in statements:
        db.execute(sql, args)
    db.commit()
    db.close()


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return _filled(tmp_path / "state")


def test_an_untouched_log_is_whole_with_its_count_head_and_checkpoint(log: Path) -> None:
    where, text = _verify(log)
    assert where == 0, text
    signer = keys.read_public_of_state(str(log.parent))
    assert text.startswith(f"whole: {EVENTS} events, head {EVENTS} ")
    assert f"last checkpoint 5 at event {EVENTS} signed by {keys.key_id(signer)}" in text
    assert "not yet signed" not in text                          # the shutdown signed the head


def test_an_edited_event_is_caught(log: Path) -> None:
    _tamper(log, ("UPDATE events SET data = ? WHERE id = 17", ('{"argv":["rm","-rf","/"]}',)))
    assert _verify(log) == (17, Kind.EDITED)


def test_an_edit_with_its_hash_recomputed_is_caught_at_the_next_link(log: Path) -> None:
    db = sqlite3.connect(log)
    row = db.execute("SELECT id, time, session_id, seq, type, call_id, tool, prev_hash, session_prev_hash "
                     "FROM events WHERE id = 13").fetchone()
    forged = event_hash(row[0], row[1], row[2], row[3], row[4], row[5], row[6], "{}", row[7], row[8])
    db.close()
    _tamper(log, ("UPDATE events SET data = '{}', hash = ? WHERE id = 13", (forged,)))
    assert _verify(log) == (13, Kind.EDITED)


def test_a_rewrite_of_every_hash_after_an_edit_is_caught_by_the_signed_checkpoint(log: Path) -> None:
    """Whoever has no key may recompute the whole chain from an edit on: the checkpoint that
    signed the old head still names the edit's range."""
    db = sqlite3.connect(log)
    db.execute("UPDATE events SET data = '{}' WHERE id = 12")
    rows = db.execute("SELECT id, time, session_id, seq, type, call_id, tool, data FROM events ORDER BY id").fetchall()
    prev, heads = ZERO_HASH, {}
    for event_id, stamp, session_id, seq, kind, call_id, tool, data in rows:
        session_prev = heads.get(session_id, ZERO_HASH)
        digest_ = event_hash(event_id, stamp, session_id, seq, kind, call_id, tool, data, prev, session_prev)
        db.execute("UPDATE events SET prev_hash = ?, hash = ?, session_prev_hash = ? WHERE id = ?",
                   (prev, digest_, session_prev, event_id))
        prev, heads[session_id] = digest_, digest_
    db.commit()
    db.close()
    where, kind = _verify(log)
    assert (where, kind) == (20, Kind.EDITED)                   # the first checkpoint after the edit signed 20


def test_a_deleted_event_is_caught(log: Path) -> None:
    _tamper(log, ("DELETE FROM events WHERE id = 25", ()))
    assert _verify(log) == (26, Kind.DELETED)


def test_deleted_newest_events_are_caught_by_the_checkpoint(log: Path) -> None:
    _tamper(log, ("DELETE FROM events WHERE id > 35", ()))
    assert _verify(log)[1] == Kind.DELETED


def test_deleted_oldest_events_are_caught(log: Path) -> None:
    _tamper(log, ("DELETE FROM events WHERE id <= 3", ()))
    assert _verify(log) == (4, Kind.DELETED)


def test_an_inserted_event_is_caught(log: Path) -> None:
    _tamper(log, ("INSERT INTO events (session_id, seq, type, time, data) VALUES ('sess-a', 99, 'SessionClosed', "
                  "1.0, '{}')", ()))
    assert _verify(log) == (EVENTS + 1, Kind.INSERTED)


def test_an_event_inserted_in_the_middle_with_the_rest_renumbered_is_caught(log: Path) -> None:
    db = sqlite3.connect(log)
    for event_id in range(EVENTS, 9, -1):
        db.execute("UPDATE events SET id = id + 1 WHERE id = ?", (event_id,))
    before = db.execute("SELECT hash FROM events WHERE id = 9").fetchone()[0]
    forged = event_hash(10, 1.0, "sess-c", 1, "SessionCreated", "", "", "{}", before, ZERO_HASH)
    db.execute("INSERT INTO events (id, session_id, seq, type, time, data, prev_hash, hash, session_prev_hash) "
               "VALUES (10, 'sess-c', 1, 'SessionCreated', 1.0, '{}', ?, ?, ?)", (before, forged, ZERO_HASH))
    db.commit()
    db.close()
    assert _verify(log) == (10, Kind.INSERTED)


def test_reordered_events_are_caught(log: Path) -> None:
    _tamper(log, ("UPDATE events SET id = -1 WHERE id = 21", ()), ("UPDATE events SET id = 21 WHERE id = 22", ()),
            ("UPDATE events SET id = 22 WHERE id = -1", ()))
    assert _verify(log) == (21, Kind.REORDERED)


def test_an_edited_checkpoint_is_caught(log: Path) -> None:
    _tamper(log, ("UPDATE audit_checkpoints SET last_event_id = 19 WHERE id = 2", ()))
    assert _verify(log) == (2, Kind.CHECKPOINT)


def test_a_checkpoint_forged_without_the_key_is_caught(log: Path) -> None:
    """A rewritten log signed with a key of the forger's own: the pinned key refuses it."""
    db = sqlite3.connect(log)
    last = checkpoints.latest(db)
    assert last is not None
    other = keys.Signer(Ed25519PrivateKey.generate())
    forged = last._replace(id=last.id + 1, kind="periodic", prev_digest=digest(last.message()), key_id=other.key_id)
    forged = forged._replace(signature=other.sign(forged.message()))
    db.execute("INSERT INTO audit_checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", forged)
    # and one claiming the right key id, with a signature that is not the key's
    claimed = forged._replace(id=last.id + 2, key_id=last.key_id, prev_digest=digest(forged.message()))
    db.commit()
    db.close()
    assert _verify(log) == (last.id + 1, Kind.CHECKPOINT)
    _tamper(log, ("DELETE FROM audit_checkpoints WHERE id = ?", (last.id + 1,)),
            ("INSERT INTO audit_checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
             tuple(claimed._replace(id=last.id + 1, prev_digest=digest(last.message())))))
    assert _verify(log) == (last.id + 1, Kind.CHECKPOINT)


def test_a_deleted_checkpoint_is_caught(log: Path) -> None:
    _tamper(log, ("DELETE FROM audit_checkpoints WHERE id = 2", ()))
    assert _verify(log) == (3, Kind.CHECKPOINT)


def test_a_moved_genesis_is_caught(log: Path) -> None:
    _tamper(log, ("DELETE FROM events WHERE id <= 5", ()), ("UPDATE audit_genesis SET first_event_id = 6", ()))
    assert _verify(log)[1] == Kind.EDITED


def test_the_session_stream_catches_an_edit_of_its_own_events(log: Path) -> None:
    db = open_read_only(str(log))
    assert Verifier(db, None).verify_session("sess-b").text().startswith("session sess-b: whole: 20 events")
    db.close()
    _tamper(log, ("UPDATE events SET tool = 'fs.read' WHERE id = 8", ()))
    db = open_read_only(str(log))
    report = Verifier(db, None).verify_session("sess-b")
    db.close()
    assert report.problem is not None and (report.problem.event_id, report.problem.kind) == (8, Kind.EDITED)


def test_a_store_from_before_the_chain_starts_it_at_an_explicit_genesis(tmp_path: Path) -> None:
    """Migration: the old events stay unchained, the chain starts at the next id, and verify says so."""
    from sandboxd.audit.store import MIGRATIONS

    path = tmp_path / "state" / "events.db"
    path.parent.mkdir(mode=0o700)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, migration in enumerate(MIGRATIONS[:5], 1):
        for statement in migration.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    for seq in range(1, 4):
        db.execute("INSERT INTO events (session_id, seq, type, time, data) VALUES ('old', ?, 'ToolInvocationStarted', "
                   "1.0, '{}')", (seq,))
    db.commit()
    db.close()
    store = open_in_state_dir(str(path.parent), limits=AuditLimits(checkpoint_events=EVERY))
    assert store.append("old", EventType.TOOL_COMPLETED).id == 4
    store.append("new", EventType.SESSION_CREATED)
    store.close()
    where, text = _verify(path)
    assert where == 0, text
    assert "whole: 2 events, head 5" in text and "3 older events from before the chain began" in text
    _tamper(path, ("UPDATE events SET hash = NULL, prev_hash = NULL, session_prev_hash = NULL WHERE id = 5", ()))
    assert _verify(path) == (5, Kind.INSERTED)                  # unchaining a new event is no way out


def test_offline_verify_writes_nothing_beside_the_database(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Offline and read-only, with the daemon's store closed (immutable) and open (a WAL beside
    it: refused, exit 2, saying what to do, since SQLite would make and write a -shm there): the
    directory's files are the same before and after, none modified or made."""
    def listing() -> dict[str, tuple[int, int]]:
        return {name: (os.stat(log.parent / name).st_mtime_ns, os.stat(log.parent / name).st_size)
                for name in os.listdir(log.parent)}

    before = listing()
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent)]) == 0
    assert listing() == before
    live = EventStore(str(log))                                   # a daemon's store, with its WAL
    live.append("sess-c", EventType.SESSION_CREATED)
    before = listing()
    assert any(name.endswith("-wal") for name in before)
    capsys.readouterr()
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent)]) == 2
    assert "write-ahead log" in capsys.readouterr().err
    assert listing() == before
    live.close()
    assert not os.path.exists(f"{log}-wal")                       # closed: folded in, verifiable again
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent)]) == 0


def test_the_command_prints_whole_or_the_first_problem_and_exits_accordingly(log: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pub = tmp_path / "pinned.pub"
    pub.write_text(subprocess.run([sys.executable, "-m", "sandboxd.cli.main", "audit", "pubkey", "--state-dir",
                                   str(log.parent)], capture_output=True, text=True, check=True).stdout)
    assert pub.read_text().startswith("ed25519 ")
    whole = subprocess.run([sys.executable, "-m", "sandboxd.cli.main", "audit", "verify", "--db", str(log),
                            "--pubkey", str(pub)], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.startswith(f"whole: {EVENTS} events") and "(not pinned" not in whole.stdout
    _tamper(log, ("DELETE FROM events WHERE id = 7", ()))
    broken = subprocess.run([sys.executable, "-m", "sandboxd.cli.main", "audit", "verify", "--db", str(log),
                             "--pubkey", str(pub)], capture_output=True, text=True)
    assert broken.returncode == 1
    assert broken.stdout.startswith("NOT WHOLE: event 8 deleted: events 7 to 7 are missing")
    other = tmp_path / "other.pub"
    other.write_text(keys.public_line(Ed25519PrivateKey.generate().public_key()))
    assert audit_main(["verify", "--db", str(log), "--pubkey", str(other)]) == 1    # pinned to another key
    assert audit_main(["verify", "--db", str(tmp_path / "missing.db")]) == 2
    (tmp_path / "not-a.db").write_bytes(b"not sqlite at all" * 100)
    assert audit_main(["verify", "--db", str(tmp_path / "not-a.db")]) == 2
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent), "--session", "no-such-session"]) == 2
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent), "--session", "sess-b"]) == 0        # untouched
    assert audit_main(["verify", "--db", str(log), "--state-dir", str(log.parent), "--session", "sess-a"]) == 1        # event 7 was sess-a's
    assert capsys.readouterr().out.splitlines()[-1] == \
        "NOT WHOLE: event 9 deleted: its session's events with sequence 4 to 4 are missing"


def test_the_signing_key_is_private_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _filled(state, 1)
    key = state / keys.KEY_FILE
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    signer = keys.load_or_create(str(state))                      # the same key again
    assert keys.public_line(signer.public) == (state / keys.PUBLIC_FILE).read_text().strip()
    os.chmod(key, 0o640)
    with pytest.raises(InvalidPolicy, match="mode 0640.*0600"):
        keys.load_or_create(str(state))
    os.chmod(key, 0o600)
    os.rename(key, state / "elsewhere.key")
    os.symlink(state / "elsewhere.key", key)
    with pytest.raises(InvalidPolicy, match="symlink"):
        keys.load_or_create(str(state))
    os.unlink(key)
    os.rename(state / "elsewhere.key", key)
    os.chown(key, 65534, 65534)
    with pytest.raises(InvalidPolicy, match="belongs to uid 65534"):
        open_in_state_dir(str(state))


def test_checkpoint_messages_are_unambiguous() -> None:
    """Length-prefixed fields: moving bytes from one field to the next changes the message."""
    a = checkpoint_message(1, "periodic", 1, 10, ZERO_HASH, 10, 0, ZERO_HASH, 0, ZERO_HASH, 1.0, "ab")
    b = checkpoint_message(1, "periodica", 1, 10, ZERO_HASH, 10, 0, ZERO_HASH, 0, ZERO_HASH, 1.0, "b")
    assert a != b
    assert event_hash(1, 1.0, "s", 1, "T", "ab", "", "{}", ZERO_HASH, ZERO_HASH) != \
        event_hash(1, 1.0, "s", 1, "T", "a", "b", "{}", ZERO_HASH, ZERO_HASH)


def test_an_exporter_reads_events_with_their_hashes_and_the_checkpoints(log: Path) -> None:
    """events_after / checkpoints_after (track export's reader): the hashes link, and each
    checkpoint's head is the hash of the event it names."""
    store = EventStore(str(log))
    try:
        events = store.events_after(0, 1000)
        assert [event.id for event in events] == list(range(1, EVENTS + 1))
        assert events[0].prev_hash == ZERO_HASH
        assert all(later.prev_hash == earlier.hash for earlier, later in zip(events, events[1:]))
        assert [event.id for event in store.events_after(38, 1000)] == [39, 40]
        signed = store.checkpoints_after(0)
        assert [c.last_event_id for c in signed] == [0, 10, 20, 30, 40]      # 0: the store's start
        assert all(c.head_hash == events[c.last_event_id - 1].hash for c in signed[1:])
        assert [c.id for c in store.checkpoints_after(3)] == [4, 5]
        assert [(e.hash, e.prev_hash) for e in store.query(after_id=0, limit=1000)] == \
            [(e.hash, e.prev_hash) for e in events]                # QueryEvents and WatchEvents carry them too
    finally:
        store.close()
