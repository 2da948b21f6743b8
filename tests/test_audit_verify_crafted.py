"""Offline `sandboxd audit verify` on a database someone else prepared (hostile pass A, F1-F6,
F10): every answer is one line and an exit status, nothing is written beside the file, nothing
blocks, and a log rewritten after its checkpoints were deleted is NOT WHOLE. Each attack has its
control (the untouched copy verifies whole). The attacker's directory is owned by uid 65534, as
root would meet it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd.audit.integrity import keys, verify as verify_module
from sandboxd.audit.integrity.encoding import ZERO_HASH, event_hash
from sandboxd.audit.store import EventType, open_in_state_dir
from sandboxd.policy.audit_limits import AuditLimits
from test_audit_chain import _filled, _tamper     # a store (a checkpoint every 10 events); sqlite3 edits

NOBODY = 65534
SAFETY_DEADLINE = 60        # only so a regression fails instead of hanging the suite; never a measure


def _attacker_copy(tmp_path: Path, db: Path) -> Path:
    home = tmp_path / "attacker"
    home.mkdir(mode=0o755)
    target = home / "events.db"
    target.write_bytes(db.read_bytes())
    for path in (home, target):
        os.chown(path, NOBODY, NOBODY)
    return target


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from sandboxd.cli.audit import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "verify", *args], capture_output=True, text=True,
                          timeout=SAFETY_DEADLINE)


def _rewrite(db: Path, new_data: str, after_id: int = 0) -> None:
    """Every event after ``after_id`` given new data, every hash from there recomputed: what
    someone without the key can do."""
    con = sqlite3.connect(db)
    row = con.execute("SELECT hash FROM events WHERE id = ?", (after_id,)).fetchone()
    prev = bytes(row[0]) if row else ZERO_HASH
    session_prev: dict[str, bytes] = {}
    for session_id, in con.execute("SELECT DISTINCT session_id FROM events WHERE id <= ?", (after_id,)).fetchall():
        last = con.execute("SELECT hash FROM events WHERE session_id = ? AND id <= ? ORDER BY id DESC LIMIT 1",
                           (session_id, after_id)).fetchone()
        session_prev[session_id] = bytes(last[0])
    rows = con.execute("SELECT id, time, session_id, seq, type, call_id, tool FROM events WHERE id > ? ORDER BY id",
                       (after_id,)).fetchall()
    for event_id, stamp, session_id, seq, kind, call_id, tool in rows:
        linked = session_prev.get(session_id, ZERO_HASH)
        digest = event_hash(event_id, stamp, session_id, seq, kind, call_id, tool, new_data, prev, linked)
        con.execute("UPDATE events SET data = ?, prev_hash = ?, hash = ?, session_prev_hash = ? WHERE id = ?",
                    (new_data, prev, digest, linked, event_id))
        prev, session_prev[session_id] = digest, digest
    con.commit()
    con.close()


# -- F1: deleted checkpoints -----------------------------------------------------------------------

def test_deleting_every_checkpoint_and_rewriting_the_log_is_not_whole_with_a_pinned_key(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = _filled(state)
    pub = str(state / keys.PUBLIC_FILE)
    control = _verify("--db", str(db), "--pubkey", pub)
    assert control.returncode == 0 and control.stdout.startswith("whole: 40 events"), control
    _tamper(db, ("DELETE FROM audit_checkpoints", ()))
    _rewrite(db, '{"argv":["echo","nothing to see"]}')
    result = _verify("--db", str(db), "--pubkey", pub)
    assert result.returncode == 1, result
    assert result.stdout.startswith("NOT WHOLE: event 40 checkpoint: no signed checkpoint over 40 chained events")
    assert "Traceback" not in result.stderr


def test_deleting_every_checkpoint_is_not_whole_without_any_key_either(tmp_path: Path) -> None:
    """No key at all: the genesis row's interval (10) bounds the unsigned tail (40)."""
    db = _attacker_copy(tmp_path, _filled(tmp_path / "state"))
    empty = tmp_path / "no-key"
    empty.mkdir()
    assert _verify("--db", str(db), "--state-dir", str(empty)).returncode == 0         # the control
    _tamper(db, ("DELETE FROM audit_checkpoints", ()))
    _rewrite(db, "{}")
    result = _verify("--db", str(db), "--state-dir", str(empty))
    assert result.returncode == 1, result
    assert "40 events after the genesis, but a checkpoint is signed every 10 events" in result.stdout


def test_deleting_the_newest_checkpoints_and_rewriting_after_them_is_not_whole(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = _filled(state, events=60)
    # checkpoints: 1 the store's start (event 0), then at 10, 20, ... 60: keep those through 20
    _tamper(db, ("DELETE FROM audit_checkpoints WHERE last_event_id > 20", ()))
    _rewrite(db, "{}", after_id=20)
    result = _verify("--db", str(db), "--state-dir", str(state))          # the state's key, not pinned
    assert result.returncode == 1, result
    assert "40 events after checkpoint 3, but a checkpoint is signed every 10 events" in result.stdout


def test_a_tail_within_the_interval_is_whole_and_says_it_is_unsigned(tmp_path: Path) -> None:
    """The control for the bound: a daemon that stopped without its shutdown checkpoint (a crash)
    leaves fewer than the interval's events unsigned: whole, with the count."""
    state = tmp_path / "state"
    db = _filled(state, events=40)
    _tamper(db, ("DELETE FROM audit_checkpoints WHERE id = (SELECT MAX(id) FROM audit_checkpoints) "
                  "AND kind = 'shutdown'", ()))
    store = open_in_state_dir(str(state), limits=AuditLimits(checkpoint_events=10))
    for index in range(7):
        store.append("sess-c", EventType.TOOL_STARTED, call_id=f"d{index}", tool="shell.exec", data={})
    store._db.execute("DELETE FROM audit_checkpoints WHERE kind = 'shutdown'")   # noqa: SLF001 (a crash)
    store._chain.signer = None                                                    # noqa: SLF001
    store.close()
    result = _verify("--db", str(db), "--pubkey", str(state / keys.PUBLIC_FILE))
    assert result.returncode == 0, result
    assert "7 events after it not yet signed" in result.stdout


# -- F2, F3: the key ----------------------------------------------------------------------------------

def test_a_fifo_public_key_is_refused_not_waited_on(tmp_path: Path) -> None:
    db = _attacker_copy(tmp_path, _filled(tmp_path / "state"))
    os.mkfifo(db.parent / keys.PUBLIC_FILE)
    result = _verify("--db", str(db), "--state-dir", str(db.parent))
    assert result.returncode == 2 and "not a regular file" in result.stderr, result
    result = _verify("--db", str(db), "--pubkey", str(db.parent / keys.PUBLIC_FILE))
    assert result.returncode == 2 and "not a regular file" in result.stderr, result
    os.symlink(tmp_path / "state" / keys.PUBLIC_FILE, tmp_path / "linked.pub")
    result = _verify("--db", str(db), "--pubkey", str(tmp_path / "linked.pub"))
    assert result.returncode == 2 and "symlink" in result.stderr, result
    control = _verify("--db", str(db), "--pubkey", str(tmp_path / "state" / keys.PUBLIC_FILE))
    assert control.returncode == 0, control


def test_the_key_is_the_state_dirs_not_the_db_directorys_and_the_answer_says_which(tmp_path: Path) -> None:
    real = _filled(tmp_path / "state")
    db = _attacker_copy(tmp_path, real)
    (db.parent / keys.PUBLIC_FILE).write_text((real.parent / keys.PUBLIC_FILE).read_text())
    other = tmp_path / "other-state"
    _filled(other)                                       # another key in the state dir root names
    result = _verify("--db", str(db), "--state-dir", str(other))
    assert result.returncode == 1, result                # checked with --state-dir's key: not the signer
    assert "checkpoint" in result.stdout and "signed by key" in result.stdout
    assert f"key of {other} (--state-dir; not pinned" in result.stderr
    control = _verify("--db", str(db), "--state-dir", str(real.parent))
    assert control.returncode == 0 and f"key of {real.parent}" in control.stderr, control


# -- F4: nothing written -------------------------------------------------------------------------------

def test_a_db_with_a_wal_is_refused_and_nothing_is_made_beside_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = _attacker_copy(tmp_path, _filled(state))
    before = sorted(os.listdir(db.parent))
    assert _verify("--db", str(db), "--state-dir", str(state)).returncode == 0        # immutable: the control
    assert sorted(os.listdir(db.parent)) == before
    wal = Path(f"{db}-wal")
    wal.write_bytes(b"")
    os.chown(wal, NOBODY, NOBODY)
    result = _verify("--db", str(db), "--state-dir", str(state))
    assert result.returncode == 2 and "write-ahead log" in result.stderr, result
    assert not Path(f"{db}-shm").exists()
    assert sorted(os.listdir(db.parent)) == sorted(before + [wal.name])


# -- F5, F6: crafted types and tables -----------------------------------------------------------------

@pytest.mark.parametrize("value", [2 ** 62, 3_000_000_000, "not-bytes", b"short"])
def test_a_hash_of_the_wrong_type_is_not_whole_in_one_line(tmp_path: Path, value: object) -> None:
    state = tmp_path / "state"
    db = _attacker_copy(tmp_path, _filled(state))
    _tamper(db, ("UPDATE events SET prev_hash = ? WHERE id = 5", (value,)))
    result = _verify("--db", str(db), "--state-dir", str(state))
    assert result.returncode == 1, result
    assert result.stdout.startswith("NOT WHOLE: event 5 edited: its columns do not hold what an event holds")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("column,value", [("signature", 3_000_000_000), ("head_hash", "x"), ("time", "now"),
                                          ("interval", b"10")])
def test_a_checkpoint_column_of_the_wrong_type_is_not_whole_in_one_line(tmp_path: Path, column: str,
                                                                         value: object) -> None:
    state = tmp_path / "state"
    db = _attacker_copy(tmp_path, _filled(state))
    _tamper(db, (f"UPDATE audit_checkpoints SET {column} = ? WHERE id = 2", (value,)))
    result = _verify("--db", str(db), "--state-dir", str(state))
    assert result.returncode == 1, result
    assert result.stdout.startswith("NOT WHOLE: checkpoint 2 checkpoint: its columns do not hold")
    assert "Traceback" not in result.stderr


def test_an_events_view_is_refused_as_not_a_store(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = _attacker_copy(tmp_path, _filled(state))
    con = sqlite3.connect(db)
    con.executescript("""
        ALTER TABLE events RENAME TO events_real;
        CREATE VIEW events AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)
          SELECT i AS id, 0.0 AS time, 's' AS session_id, i AS seq, 't' AS type, '' AS call_id, '' AS tool,
                 '{}' AS data, NULL AS prev_hash, NULL AS hash, NULL AS session_prev_hash FROM n;
    """)
    con.close()
    result = _verify("--db", str(db), "--state-dir", str(state))
    assert result.returncode == 2, result
    assert "events is not a table" in result.stdout and "Traceback" not in result.stderr


# -- F10: a tenant's session verify ----------------------------------------------------------------------

def test_a_session_verify_checks_the_newest_checkpoint_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_in_state_dir(str(tmp_path / "s"), limits=AuditLimits(checkpoint_events=1))
    for index in range(300):
        store.append(f"other-{index % 7}", EventType.TOOL_STARTED, call_id=f"c{index}", tool="shell.exec", data={})
    store.append("mine", EventType.TOOL_STARTED, call_id="m", tool="shell.exec", data={})
    store.close()
    checks: list[int] = []
    real = verify_module.verifies
    monkeypatch.setattr(verify_module, "verifies", lambda *a: checks.append(1) or real(*a))
    public = keys.read_public_of_state(str(tmp_path / "s"))
    db = verify_module.open_read_only(str(tmp_path / "s" / "events.db"))
    try:
        report = verify_module.Verifier(db, public, pinned=True).verify_session("mine")
        assert report.whole and report.events == 1 and len(checks) == 1
        checks.clear()
        yields: list[int] = []
        whole = verify_module.Verifier(db, public, pinned=True, chunk=50,
                                       between_chunks=lambda: yields.append(1)).verify()
        assert whole.whole and len(checks) >= 300      # the control: the node's verify checks them all,
        assert len(yields) >= 300 // 50                # and yields between chunks of checkpoints too
    finally:
        db.close()
