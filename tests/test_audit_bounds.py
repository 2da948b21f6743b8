"""The audit log's bounds, in the store itself: the bounded form of an event (audit/bounded.py),
the per-owner budget (audit/budget.py), the disk floor (audit/disk_floor.py) and what the store
does with them (``admit``, ``note``, the charge of every write). The attacks against a real daemon
are in tests/test_audit_growth.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from sandboxd import config
from sandboxd.audit.bounded import bounded, text_of
from sandboxd.audit.budget import SWEEP_AT, OwnerBudgets
from sandboxd.audit.disk_floor import DiskFloor
from sandboxd.audit.store import EventStore, EventType, SessionRow
from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.policy.audit_limits import AuditLimits, parse_min_free


def sha(value: object) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- the bounded form


def test_an_ordinary_event_is_kept_whole() -> None:
    data = {"arguments": {"argv": ["pytest", "-q"], "cwd": "/ws"}}
    kept, text = bounded(data, 16384)
    assert kept is data and json.loads(text) == data


def test_a_long_command_keeps_its_start_length_and_digest() -> None:
    argv = ["python3", "-c", "import os"] + ["A" * 131071] * 14
    kept, text = bounded({"arguments": {"argv": argv, "cwd": "/ws"}}, 16384)
    assert len(text) <= 16384 and json.loads(text) == kept
    assert kept["arguments"]["cwd"] == "/ws"                       # the rest of the object stays
    assert kept["arguments"]["argv"].startswith('["python3","-c","import os","AAAA')
    assert kept["clipped"] == [{"path": ["arguments", "argv"], "bytes": len(text_of(argv)), "sha256": sha(argv)}]
    assert len(text_of(kept["arguments"]["argv"])) <= 16384 // 4 + 2


def test_a_long_string_stays_a_string_and_escapes_count() -> None:
    kept, text = bounded({"error": "é" * 50000, "kind": "reported"}, 4096)
    assert len(text) <= 4096 and kept["kind"] == "reported"
    assert set(kept["error"]) == {"é"} and len(text_of(kept["error"])) <= 1024 + 2     # 6 bytes a character
    assert kept["clipped"][0]["sha256"] == sha("é" * 50000)


def test_an_object_of_many_middling_values_goes_as_one() -> None:
    labels = {f"k{i}": "v" * 1024 for i in range(64)}
    kept, text = bounded({"labels": labels, "workspace": "/ws"}, 16384)
    assert len(text) <= 16384 and kept["workspace"] == "/ws"
    assert [c["path"] for c in kept["clipped"]] == [["labels"]] and kept["clipped"][0]["sha256"] == sha(labels)


def test_two_big_values_both_go_biggest_first() -> None:
    kept, text = bounded({"detail": "d" * 30000, "message": "m" * 40000, "by": "sandbox"}, 16384)
    assert len(text) <= 16384 and kept["by"] == "sandbox"
    assert [c["path"] for c in kept["clipped"]] == [["message"], ["detail"]]


def test_what_does_not_fit_any_other_way_is_replaced_whole() -> None:
    data = {f"k{i}": "v" * 900 for i in range(64)}                 # no value worth clipping alone
    kept, text = bounded(data, 16384)
    assert len(text) <= 16384 and set(kept) == {"head", "clipped"}
    assert kept["clipped"] == [{"path": [], "bytes": len(text_of(data)), "sha256": sha(data)}]


def test_no_input_breaks_the_limit() -> None:
    """Random shapes a caller could send (Authorize's arguments, a tool's result): every one fits."""
    rng = random.Random(24)

    def value(depth: int) -> object:
        kind = rng.choice("sliod" if depth < 3 else "sid")
        if kind == "s":
            return "".join(rng.choices("a\"\\\n\x1bé€😀", k=rng.choice((1, 50, 3000, 20000))))
        if kind == "l":
            return [value(depth + 1) for _ in range(rng.choice((0, 3, 20)))]
        if kind == "i":
            return rng.randrange(-10**18, 10**18)
        if kind == "o":
            return {f"{rng.random()}": value(depth + 1) for _ in range(rng.choice((1, 5, 12)))}
        return None

    for limit in (1024, 4096, 16384):
        for _ in range(30):
            data = {"arguments": value(0), "summary": "x", "result": value(1)}
            kept, text = bounded(data, limit)
            assert len(text.encode()) <= limit and json.loads(text) == kept


# --------------------------------------------------------------------------- the budget


def test_a_budget_refuses_when_spent_and_refills_evenly() -> None:
    now = [1000.0]
    budgets = OwnerBudgets(1000, 100.0, clock=lambda: now[0])          # 10 bytes a second
    assert budgets.refusal("uid 1") is None
    budgets.spend("uid 1", 1500)                                         # an overdraft of 500
    assert budgets.left("uid 1") == -500 and budgets.refusal("uid 1") == pytest.approx(50.1)
    assert budgets.refusal("uid 2") is None                               # another owner's is its own
    now[0] += 50
    assert budgets.refusal("uid 1") is not None                           # at zero: still nothing
    now[0] += 1
    assert budgets.refusal("uid 1") is None and budgets.left("uid 1") == pytest.approx(10)
    now[0] += 10_000
    assert budgets.left("uid 1") == 1000                                  # never more than one budget


def test_full_buckets_are_forgotten() -> None:
    now = [0.0]
    budgets = OwnerBudgets(1000, 10.0, clock=lambda: now[0])
    for uid in range(SWEEP_AT):
        budgets.spend(f"uid {uid}", 10)
    now[0] += 10
    budgets.spend("uid last", 10)
    assert len(budgets._levels) == 1


def test_the_audit_settings_are_checked() -> None:
    assert parse_min_free("512M") == (512 << 20, 0.0) and parse_min_free("5%") == (0, 5.0)
    assert parse_min_free("0") == (0, 0.0)
    for bad in ("100%", "-1%", "nan%", "%", "lots", ""):
        with pytest.raises(InvalidPolicy):
            parse_min_free(bad)
    with pytest.raises(InvalidPolicy, match="audit.owner_budget"):
        AuditLimits(event_bytes=16384, owner_budget_bytes=16384)
    settings = config.load(None, environ={})
    assert settings.audit == AuditLimits()
    for key, value in (("SANDBOXD_AUDIT_MIN_FREE", "7 percent"), ("SANDBOXD_AUDIT_OWNER_BUDGET", ""),
                       ("SANDBOXD_AUDIT_EVENT_BYTES", "10"), ("SANDBOXD_AUDIT_BUDGET_PERIOD_SECONDS", "0")):
        with pytest.raises(config.ConfigError, match=key.removeprefix("SANDBOXD_AUDIT_").lower()):
            config.load(None, environ={key: value})
    small = config.load(None, environ={"SANDBOXD_AUDIT_OWNER_BUDGET": "64K", "SANDBOXD_AUDIT_EVENT_BYTES": "4096",
                                       "SANDBOXD_AUDIT_MIN_FREE": "2%"})
    assert small.audit == AuditLimits(event_bytes=4096, owner_budget_bytes=64 << 10, min_free_bytes=0,
                                      min_free_percent=2.0)


# --------------------------------------------------------------------------- the store


def owned_store(tmp_path: Path, **limits: object) -> EventStore:
    store = EventStore(str(tmp_path / "events.db"), limits=AuditLimits(**limits))   # type: ignore[arg-type]
    for sid, uid in (("s1", 1001), ("s2", 1002), ("root", 0)):
        store.save_session(SessionRow(sid, uid, uid, "", "/ws", {}, "never", {}, {}, {}, 0.0, None))
    return store


def test_every_write_is_spent_from_its_owner_and_admit_refuses_past_it(tmp_path: Path) -> None:
    store = owned_store(tmp_path, event_bytes=1024, owner_budget_bytes=16 << 10, min_free_bytes=0)
    try:
        store.admit(1001)
        written = 0
        while store.budget_left(1001) > 0:
            store.append("s1", EventType.TOOL_STARTED, call_id="c", tool="shell.exec",
                         data={"arguments": {"argv": ["x" * 5000]}})
            written += 1
        # Each event was bounded to 1 KiB (5 KiB sent), and each cost at least its row's overhead.
        assert (16 << 10) // (1024 + 300) <= written <= (16 << 10) // 300
        with pytest.raises(Exhausted, match=r"uid 1001 .*audit.owner_budget: 16K per audit.budget_period_seconds"):
            store.admit(1001)
        store.admit(1002)                              # another owner is not affected
        store.admit(0)                                 # local root is never refused by its budget
        # What records something already done is never refused: written, and spent.
        before = store.budget_left(1001)
        store.append("s1", EventType.TOOL_COMPLETED, call_id="c", tool="shell.exec", data={"exit_code": 0})
        assert store.budget_left(1001) < before
        events = store.session_events("s1")
        assert len(events) == written + 1 and all(len(text_of(e.data)) <= 1024 for e in events)
    finally:
        store.close()


def test_noted_events_past_the_budget_are_counted_and_recorded_at_close(tmp_path: Path) -> None:
    store = owned_store(tmp_path, event_bytes=1024, owner_budget_bytes=16 << 10, min_free_bytes=0)
    try:
        denial = (EventType.PERMISSION_DENIED, "", "network", {"reason": "network_request", "destination": "x:1"})
        written = counted = 0
        for _ in range(500):
            if store.note("s1", [denial]):
                written += 1
            else:
                counted += 1
        assert written < 100 and counted == 500 - written
        assert store.note("s2", [denial])              # another owner's session still records its own
        store.append("s1", EventType.SESSION_CLOSED, data={"by_uid": 1001})
        last = store.session_events("s1")[-2:]
        assert [e.type for e in last] == [EventType.PERMISSION_DENIED, EventType.SESSION_CLOSED]
        assert last[0].tool == "network" and last[0].data["unrecorded"] == counted
        assert "audit.owner_budget" in last[0].data["message"]
    finally:
        store.close()


def test_a_noted_event_carries_the_count_when_the_budget_is_back(tmp_path: Path) -> None:
    store = owned_store(tmp_path, event_bytes=1024, owner_budget_bytes=16 << 10, min_free_bytes=0)
    try:
        git = (EventType.GIT_CONFIG_NEUTRALIZED, "", "", {"repo": "/ws", "what": "hook", "key": "pre-commit"})
        while store.note("s1", [git]):
            pass
        assert store.note("s1", [git, git]) == []      # two more counted
        store._budgets.spend("uid 1001", -(64 << 10))  # as if a day had passed
        first = store.note("s1", [git])
        assert first[0].data["unrecorded"] == 3 and "unrecorded" not in store.note("s1", [git])[0].data
    finally:
        store.close()


def test_the_disk_floor_refuses_everyone_and_says_where(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    floor = DiskFloor(str(tmp_path), free + (1 << 40), 0.0, "huge")
    problem = floor.shortfall()
    assert problem is not None and str(tmp_path) in problem and "audit.min_free (huge" in problem
    assert DiskFloor(str(tmp_path), 1 << 20, 0.0, "1M").shortfall() is None
    assert DiskFloor(str(tmp_path), 0, 100.0 - 1e-9, "99.99%").shortfall() is not None
    store = owned_store(tmp_path, min_free_bytes=free + (1 << 40))
    try:
        for uid in (1001, 0):                          # root's calls would write too
            with pytest.raises(Exhausted, match="below audit.min_free"):
                store.admit(uid)
        assert store.note("s1", [(EventType.GIT_CONFIG_NEUTRALIZED, "", "", {})]) == []
        assert store.query() == []                     # reads work
    finally:
        store.close()
