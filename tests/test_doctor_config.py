"""`sandboxd doctor --config FILE`: the configured address pool against the host's routes, the state
directory (there or makeable, root's, its mode, its disk's free space against audit.min_free), the
audit database (read-only: integrity, schema version), and whether `serve` would take the file.
A real `sandboxd doctor` on real files; the pool on the real kernel's routing table of a network
namespace of the test's own. Each problem has its control (the same check, the problem absent: ok)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from conftest import BASE_ENV, SANDBOXD
from sandboxd.audit.store import MIGRATIONS, EventType, open_in_state_dir
from sandboxd.cli import doctor_config

pytestmark = pytest.mark.timeout(240)


def doctor(config_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, "doctor", "--config", str(config_path)], capture_output=True, text=True,
                          timeout=180, env=BASE_ENV)


def line(out: str, name: str) -> str:
    found = [text for text in out.splitlines() if text[6:].startswith(name + ":")]
    assert len(found) == 1, out
    return found[0]


def made_store(state: Path, events: int = 50) -> Path:
    store = open_in_state_dir(str(state))
    for n in range(events):
        store.append("s1", EventType.TOOL_COMPLETED, data={"n": n, "pad": "x" * 200})
    store.close()
    return state / "events.db"


def test_a_good_configuration_checks_out(tmp_path: Path) -> None:
    state = tmp_path / "state"
    made_store(state)
    path = tmp_path / "sandboxd.toml"
    path.write_text(f'[state]\ndir = "{state}"\n[network]\npool = "10.236.0.0/20"\n')
    result = doctor(path)
    assert result.returncode == 0, result.stdout
    assert line(result.stdout, "configuration").startswith(f"ok    configuration: {path}: sandboxd serve would accept")
    assert line(result.stdout, "address pool").startswith("ok    address pool: 10.236.0.0/20 (network.pool): ")
    assert line(result.stdout, "state directory").startswith(f"ok    state directory: {state}: root's, mode 0700;")
    assert line(result.stdout, "audit database") == (f"ok    audit database: {state}/events.db: intact (quick_check), "
                                                     f"schema version {len(MIGRATIONS)}, 50 events")


def test_what_serve_would_refuse_and_a_foreign_state_directory_fail(tmp_path: Path) -> None:
    state = tmp_path / "state"
    made_store(state)
    os.chown(state, 65534, 65534)
    path = tmp_path / "sandboxd.toml"
    path.write_text(f'[state]\ndir = "{state}"\n[metrics]\nlisten = "127.0.0.1:70000"\n[audit]\nmin_free = "8000T"\n')
    result = doctor(path)
    assert result.returncode == 1, result.stdout
    assert "FAIL  configuration: sandboxd serve would refuse it: " in result.stdout
    assert "metrics.listen: '127.0.0.1:70000' must be HOST:PORT" in result.stdout
    assert line(result.stdout, "state directory").startswith(
        f"FAIL  state directory: {state} (state.dir) belongs to uid 65534, not to the daemon's uid 0")
    # Control: root's again, a floor above the disk: FAIL.
    os.chown(state, 0, 0)
    path.write_text(f'[state]\ndir = "{state}"\n[audit]\nmin_free = "8000T"\n')
    result = doctor(path)
    assert result.returncode == 1 and "ok    configuration" in result.stdout
    assert "below the floor, serve refuses every new call" in line(result.stdout, "state directory")
    path.write_text(f'[state]\ndir = "{state}"\n')
    assert line(doctor(path).stdout, "state directory").startswith("ok ")


def configured(state: Path, pool: str = "10.233.0.0/16") -> doctor_config.Configured:
    return doctor_config.Configured(path=None, pool=pool, state_dir=str(state), min_free="512M")


def test_a_damaged_or_newer_audit_database_fails(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = made_store(state, events=2000)
    assert doctor_config.check_audit_db(configured(state))[0] == "ok"          # the control
    size = db.stat().st_size
    with open(db, "r+b") as f:                                                # a page in the middle overwritten
        f.seek((size // 4096 // 2) * 4096)
        f.write(os.urandom(4096))
    status, text = doctor_config.check_audit_db(configured(state))
    assert status == "FAIL" and "events.db" in text, text
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "events.db").write_bytes(b"not a database at all" * 100)
    assert doctor_config.check_audit_db(configured(garbage))[0] == "FAIL"
    newer = tmp_path / "newer"
    newer_db = made_store(newer, events=1)
    import sqlite3
    with sqlite3.connect(newer_db) as handle:
        handle.execute("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS) + 5,))
    status, text = doctor_config.check_audit_db(configured(newer))
    assert status == "FAIL" and f"schema version {len(MIGRATIONS) + 5}, newer than this sandboxd's" in text, text
    # read-only: the check changed nothing
    with sqlite3.connect(newer_db) as handle:
        assert handle.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == len(MIGRATIONS) + 5


@pytest.fixture
def netns_pid() -> Iterator[int]:
    """A process in a network namespace of the test's own (gone with it): its routes are its own.
    Handed out only once it is in that namespace: ``unshare`` calls unshare(2) and then execs the
    shell that says so. Its pid right after the start names a process that may not have switched
    yet (under load it had not): ``nsenter`` then made the test's links in the host's namespace
    (lan0 and lan1 were left on the machine) while the routing table read was the new, empty one."""
    proc = subprocess.Popen(["unshare", "--net", "sh", "-c", "echo switched; exec sleep 600"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "switched\n"
        assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def in_netns(pid: int, *command: str) -> None:
    subprocess.run(["nsenter", "--net", f"--target={pid}", *command], check=True, capture_output=True)


def test_a_pool_the_host_routes_is_refused_and_sandbox_blocks_are_counted(netns_pid: int) -> None:
    table = f"/proc/{netns_pid}/net/route"
    pool = configured(Path("/nonexistent"), "10.237.0.0/16")
    for link, peer in (("lan0", "lan1"), ("sbx0123456789ab", "peer0")):
        in_netns(netns_pid, "ip", "link", "add", link, "type", "veth", "peer", "name", peer)
        in_netns(netns_pid, "ip", "link", "set", link, "up")
        in_netns(netns_pid, "ip", "link", "set", peer, "up")
    # Control: a sandbox link's block in the pool is a used block, not a clash.
    in_netns(netns_pid, "ip", "addr", "add", "10.237.0.1/30", "dev", "sbx0123456789ab")
    status, text = doctor_config.check_address_pool(pool, table)
    assert status == "ok" and "16383 of 16384 isolated networks free" in text, text
    # The host's own network inside the pool: refused, naming the route.
    in_netns(netns_pid, "ip", "addr", "add", "10.237.8.1/24", "dev", "lan0")
    status, text = doctor_config.check_address_pool(pool, table)
    assert status == "FAIL" and "the host routes 10.237.8.0/24 dev lan0 inside it" in text, text
    # ... and a pool around it (the pool inside the host's route) too.
    status, text = doctor_config.check_address_pool(configured(Path("/x"), "10.237.8.128/25"), table)
    assert status == "FAIL", text
