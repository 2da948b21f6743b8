"""The soak benchmark (``tests/benchmark.py --soak SECONDS``): does the daemon hold steady under
hours of ordinary use? Not a test: it prints numbers and the reader judges the trend.

For ``SECONDS`` (600 by default on the command line) ``--soak-clients`` (20) client threads, each
with its own ``SandboxClient`` (its own channel and connection), drive one ``sandboxd serve``:

* ``long`` clients (a quarter): one session for the whole run, Exec after Exec in it;
* ``churn`` clients: CreateSession, a few Exec of short commands, CloseSession, again;
* one ``bare`` client: CreateSession + CloseSession only (session churn without calls).

The commands rotate through ``true``, ``echo``, a shell writing to both streams and ``cat`` of a
file the session wrote; each result is checked (exit status, stdout), a wrong one is an error.
Every call carries a gRPC deadline (``CALL_DEADLINE_S``), so a hung call is an error, not a hang.

Every ``--soak-interval`` seconds (5) a sampler records, for the daemon and its fork server: open
fds, threads and VmRSS; and the live sessions (ListSessions), the sandbox processes (descendants of
the fork server), the calls done and the errors so far. At the end it prints the samples as a table,
min / median / max / last of each metric, the Exec latency median / p95 (whole run, first and last
fifth), the errors by kind with the first message of each, and what the stop left behind.
A flat fd, thread and session line and an RSS that levels off are the healthy picture.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CALL_DEADLINE_S = 60.0          # a safety deadline: only a hung call reaches it
LONG_SHARE = 4                  # one client in LONG_SHARE keeps a long-lived session
EXECS_PER_CHURN = 3             # Execs in each short-lived session


@dataclass
class Tally:
    """What the clients did, shared by all of them (under ``lock``)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    execs: int = 0
    sessions_created: int = 0
    sessions_closed: int = 0
    latencies: list[tuple[float, float]] = field(default_factory=list)   # (monotonic end, ms)
    errors: Counter[str] = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)

    def exec_done(self, ended: float, ms: float) -> None:
        with self.lock:
            self.execs += 1
            self.latencies.append((ended, ms))

    def error(self, what: str, exc: BaseException) -> None:
        kind = f"{what}: {_error_kind(exc)}"
        with self.lock:
            self.errors[kind] += 1
            self.first_error.setdefault(kind, str(exc).splitlines()[0][:300] if str(exc) else repr(exc))


def _error_kind(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return str(code().name)
        except Exception:  # noqa: BLE001 - not a gRPC error after all
            pass
    return type(exc).__name__


# --------------------------------------------------------------------------- the clients


class SoakClient:
    """One client thread: its own channel, its role, its share of the tally."""

    COMMANDS: list[tuple[list[str], bytes | None]] = [
        (["true"], b""),
        (["echo", "soak"], b"soak\n"),
        (["sh", "-c", "echo out; echo err >&2"], b"out\n"),
        (["cat", "soak.txt"], b"written by the session\n"),
    ]

    def __init__(self, index: int, role: str, socket_path: str, workspace: str, tally: Tally,
                 stop: threading.Event) -> None:
        from sandboxd.client import SandboxClient

        self.index, self.role, self.workspace, self.tally, self.stop = index, role, workspace, tally, stop
        self.client = SandboxClient(socket_path)
        self.open: set[str] = set()
        self.turn = index                       # clients start at different commands
        self.thread = threading.Thread(target=self.run, name=f"soak-{role}-{index}", daemon=True)

    def run(self) -> None:
        try:
            if self.role == "long":
                self.long_lived()
            else:
                while not self.stop.is_set():
                    self.short_lived(EXECS_PER_CHURN if self.role == "churn" else 0)
        finally:
            for session_id in list(self.open):
                self.close(session_id)
            self.client.close()

    def long_lived(self) -> None:
        session_id = self.create()
        while session_id is None and not self.stop.is_set():
            time.sleep(1)                       # the failure is counted; try again, slowly
            session_id = self.create()
        while not self.stop.is_set() and session_id is not None:
            self.exec_one(session_id)

    def short_lived(self, execs: int) -> None:
        session_id = self.create()
        if session_id is None:
            time.sleep(0.5)
            return
        for _ in range(execs):
            if self.stop.is_set():
                break
            self.exec_one(session_id)
        self.close(session_id)

    def create(self) -> str | None:
        from sandboxd.v1 import sandboxd_pb2 as pb

        try:
            session = self.client.stub.CreateSession(pb.CreateSessionRequest(
                workspace=self.workspace, approval_policy=pb.NEVER,
                sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE),
                labels={"soak": self.role}), timeout=CALL_DEADLINE_S)
            self.client.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="soak.txt",
                                                           data=b"written by the session\n"),
                                       timeout=CALL_DEADLINE_S)
        except Exception as exc:  # noqa: BLE001 - counted
            self.tally.error("CreateSession", exc)
            return None
        self.open.add(session.id)
        with self.tally.lock:
            self.tally.sessions_created += 1
        return session.id

    def close(self, session_id: str) -> None:
        from sandboxd.v1 import sandboxd_pb2 as pb

        try:
            self.client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=CALL_DEADLINE_S)
        except Exception as exc:  # noqa: BLE001 - counted
            self.tally.error("CloseSession", exc)
            return
        self.open.discard(session_id)
        with self.tally.lock:
            self.tally.sessions_closed += 1

    def exec_one(self, session_id: str) -> None:
        from sandboxd.v1 import sandboxd_pb2 as pb

        argv, expected = self.COMMANDS[self.turn % len(self.COMMANDS)]
        self.turn += 1
        start = pb.ExecStart(session_id=session_id, argv=argv, close_stdin=True)
        began = time.monotonic()
        stdout, result = b"", None
        try:
            for response in self.client.stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=CALL_DEADLINE_S):
                kind = response.WhichOneof("kind")
                if kind == "stdout":
                    stdout += response.stdout
                elif kind == "result":
                    result = response.result
            if result is None or result.shell_status != 0 or (expected is not None and stdout != expected):
                raise RuntimeError(f"{argv}: result={str(result).strip()!r} stdout={stdout[-200:]!r}")
        except Exception as exc:  # noqa: BLE001 - counted
            self.tally.error("Exec", exc)
            return
        ended = time.monotonic()
        self.tally.exec_done(ended, (ended - began) * 1e3)


def roles(clients: int) -> list[str]:
    """A quarter long-lived (at least one), one bare session churner (from 3 clients), the rest churn."""
    long = max(1, clients // LONG_SHARE)
    bare = 1 if clients >= 3 else 0
    return ["long"] * long + ["bare"] * bare + ["churn"] * (clients - long - bare)


# --------------------------------------------------------------------------- sampling


def fd_count(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


METRICS: list[tuple[str, str]] = [          # (key, column title)
    ("sessions", "sessions"), ("sandboxes", "sbx procs"),
    ("serve_fds", "serve fds"), ("serve_threads", "serve thr"), ("serve_rss_mib", "serve MiB"),
    ("fork_fds", "fork fds"), ("fork_threads", "fork thr"), ("fork_rss_mib", "fork MiB"),
]


def sample(daemon: Any, lister: Any, tally: Tally, started: float) -> dict[str, Any]:
    """One row: the daemon's and the fork server's fds, threads and RSS, the live sessions."""
    from benchmark import descendants, memory_kib
    from sandboxd.v1 import sandboxd_pb2 as pb

    fork = daemon.fork_server_pid()
    serve_mem = memory_kib(daemon.pid)
    fork_mem = memory_kib(fork) if fork else {}
    try:
        sessions: int | None = len(lister.stub.ListSessions(pb.ListSessionsRequest(), timeout=CALL_DEADLINE_S).sessions)
    except Exception as exc:  # noqa: BLE001 - counted
        tally.error("ListSessions (sampler)", exc)
        sessions = None

    def mib(kib: int | None) -> float | None:
        return None if kib is None else kib / 1024

    with tally.lock:
        execs, errors = tally.execs, sum(tally.errors.values())
        created = tally.sessions_created
    return {
        "t": time.monotonic() - started, "sessions": sessions,
        "sandboxes": len(descendants(fork)) if fork else None,
        "serve_fds": fd_count(daemon.pid), "serve_threads": serve_mem.get("threads"),
        "serve_rss_mib": mib(serve_mem.get("rss_kib")),
        "fork_fds": fd_count(fork), "fork_threads": fork_mem.get("threads"),
        "fork_rss_mib": mib(fork_mem.get("rss_kib")),
        "execs": execs, "created": created, "errors": errors,
    }


def _cell(value: Any, width: int) -> str:
    if value is None:
        return "-".rjust(width)
    if isinstance(value, float):
        return f"{value:.1f}".rjust(width)
    return str(value).rjust(width)


def print_samples(rows: list[dict[str, Any]]) -> None:
    columns = [("t", "t s")] + METRICS + [("execs", "execs"), ("created", "sessions+"), ("errors", "errors")]
    print("  ".join(title.rjust(9) for _, title in columns))
    for row in rows:
        print("  ".join(_cell(row.get(key), 9) for key, _ in columns))


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """min / median / max / last of every metric over the samples."""
    out: dict[str, dict[str, float | None]] = {}
    for key, _ in METRICS:
        values = [row[key] for row in rows if row.get(key) is not None]
        out[key] = {"min": min(values) if values else None, "median": statistics.median(values) if values else None,
                    "max": max(values) if values else None, "last": rows[-1].get(key) if rows else None}
    return out


def latency(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"n": 0, "median": None, "p95": None}
    ordered = sorted(samples)
    return {"n": len(ordered), "median": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


# --------------------------------------------------------------------------- the run


def run_soak(seconds: float, clients: int = 20, interval: float = 5.0) -> dict[str, Any]:
    """Start a daemon, soak it, stop it; print the report; return it (JSON-ready)."""
    from benchmark import DaemonProcess, Watchdog, error_text, still_alive
    from sandboxd.client import SandboxClient

    base = tempfile.mkdtemp(prefix="sandboxd-soak-", dir="/var/tmp")
    os.chmod(base, 0o755)
    daemon = DaemonProcess(base)
    tally, stop = Tally(), threading.Event()
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"seconds": seconds, "clients": clients, "interval_s": interval,
                              "roles": dict(Counter(roles(clients))), "errors": []}
    workers: list[SoakClient] = []
    lister = None
    started = time.monotonic()
    print(f"soak: {seconds:.0f} s, {clients} clients {report['roles']}, a sample every {interval:.0f} s; "
          f"daemon base {base}", flush=True)
    try:
        report["ready_s"] = daemon.start()
        lister = SandboxClient(daemon.socket)
        started = time.monotonic()
        rows.append(sample(daemon, lister, tally, started))    # idle, before any client
        for i, role in enumerate(roles(clients)):
            workspace = os.path.join(base, f"ws-{i}")   # beside the socket's directory, never in it
            os.mkdir(workspace)
            workers.append(SoakClient(i, role, daemon.socket, workspace, tally, stop))
        with Watchdog(daemon, "soak", seconds + 300):
            for worker in workers:
                worker.thread.start()
            deadline = started + seconds
            while time.monotonic() < deadline and daemon.running():
                stop.wait(min(interval, max(0.0, deadline - time.monotonic())))
                rows.append(sample(daemon, lister, tally, started))
                print_progress(rows[-1])
            stop.set()
            report["load_s"] = time.monotonic() - started
            for worker in workers:
                worker.thread.join(CALL_DEADLINE_S * 3)
        report["hung_clients"] = sum(1 for worker in workers if worker.thread.is_alive())
        time.sleep(1.0)
        rows.append(sample(daemon, lister, tally, started))    # settled, every client gone
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up
        report["errors"].append(f"soak: {error_text(exc)}")
    finally:
        stop.set()
        if lister is not None:
            lister.close()
        daemon.stop()
        report["log_problems"] = daemon.log_problems()
        report["socket_left_behind"] = os.path.exists(daemon.socket)
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - started
    fifth = seconds / 5
    report.update({
        "samples": rows, "summary": summary(rows), "elapsed_s": elapsed,
        "execs": tally.execs,
        "execs_per_s": tally.execs / report["load_s"] if report.get("load_s") else None,
        "sessions_created": tally.sessions_created, "sessions_closed": tally.sessions_closed,
        "exec_latency_ms": latency([ms for _, ms in tally.latencies]),
        "exec_latency_first_fifth_ms": latency([ms for end, ms in tally.latencies if end - started <= fifth]),
        "exec_latency_last_fifth_ms": latency([ms for end, ms in tally.latencies
                                               if end - started >= seconds - fifth]),
        "call_errors": dict(tally.errors), "first_errors": dict(tally.first_error),
        "exit_code": daemon.exit_code, "killed": daemon.killed, "watchdog_fired": daemon.watchdog_fired,
        "survivors": still_alive(daemon.seen),
    })
    print_report(report)
    report["failures"] = (sum(tally.errors.values()) + len(report["errors"]) + len(report["survivors"])
                          + (report.get("hung_clients") or 0) + (0 if report["exit_code"] == 0 else 1))
    return report


def print_progress(row: dict[str, Any]) -> None:
    print(f"  t={row['t']:6.0f} s  sessions={row['sessions']}  serve fds={row['serve_fds']} "
          f"threads={row['serve_threads']}  fork fds={row['fork_fds']}  execs={row['execs']}  "
          f"errors={row['errors']}", flush=True)


def print_report(report: dict[str, Any]) -> None:
    rows = report["samples"]
    print()
    print("samples (the first before any client, the last after every client left):")
    print_samples(rows)
    print()
    print(f"{'metric':>14}  {'min':>8}  {'median':>8}  {'max':>8}  {'last':>8}")
    for key, title in METRICS:
        s = report["summary"][key]
        print(f"{title:>14}  " + "  ".join(_cell(s[k], 8) for k in ("min", "median", "max", "last")))
    print()
    for label, key in (("whole run", "exec_latency_ms"), ("first fifth", "exec_latency_first_fifth_ms"),
                       ("last fifth", "exec_latency_last_fifth_ms")):
        lat = report[key]
        median = "-" if lat["median"] is None else f"{lat['median']:.1f}"
        p95 = "-" if lat["p95"] is None else f"{lat['p95']:.1f}"
        print(f"Exec latency, {label}: median {median} ms, p95 {p95} ms (n={lat['n']})")
    rate = report["execs_per_s"]
    print(f"calls: {report['execs']} Execs ({'-' if rate is None else f'{rate:.1f}'}/s), "
          f"{report['sessions_created']} sessions created, {report['sessions_closed']} closed")
    errors = report["call_errors"]
    print(f"errors: {sum(errors.values())}" + ("" if errors else " (none)"))
    for kind, count in sorted(errors.items(), key=lambda item: -item[1]):
        print(f"  {count:6d}  {kind}: {report['first_errors'].get(kind, '')}")
    for problem in report["errors"]:
        print(f"  ERROR {problem}")
    print(f"daemon: exit {report['exit_code']}, killed={report['killed']}, watchdog={report['watchdog_fired'] or 'no'}, "
          f"survivors={report['survivors'] or 'none'}, socket left behind={report['socket_left_behind']}, "
          f"hung clients={report.get('hung_clients')}")
    if report["log_problems"]:
        print(f"daemon log: {len(report['log_problems'])} warning/error lines, first: {report['log_problems'][0][:300]}")
