"""The configuration file (sandboxd.config, `sandboxd config`, `sandboxd serve --config`) and
`sandboxd doctor`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BASE_ENV, REPO, SANDBOXD
from daemon_helpers import DaemonFactory
from sandboxd import config
from sandboxd.kernel import host_limits

pytestmark = pytest.mark.timeout(120)


def sandboxd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**BASE_ENV, **(env or {})})


def test_the_defaults_file_is_the_defaults(tmp_path: Path) -> None:
    text = sandboxd("config", "defaults").stdout
    (tmp_path / "defaults.toml").write_text(text)
    assert config.read_file(str(tmp_path / "defaults.toml")).values == config.read_file(None).values
    for key in config.KEYS:
        assert f"# {key.doc}" in text


@pytest.mark.parametrize("content, message", [
    ("[listen]\nsockett = \"/x\"\n",
     "listen.sockett: unknown key (known keys of [listen]: socket, socket_mode, admin_group, workers)"),
    ("[listen]\nsocket_mode = \"0999\"\n", "listen.socket_mode: must be an octal permission string"),
    ("[lisen]\nsocket = \"/x\"\n", "lisen.socket: unknown key (known sections:"),
    ("[listen]\nworkers = \"many\"\n", "listen.workers: must be a whole number from 1 to 1024, not 'many'"),
    ("[listen]\nsocket = \"relative.sock\"\n", "listen.socket: must be an absolute path"),
    ("[approvals]\ntimeout_seconds = 0\n", "approvals.timeout_seconds: must be a positive number of seconds"),
    ("[network]\ndns = [\"8.8.8\"]\n", "network.dns: '8.8.8' is not an IPv4 address"),
    ("[log]\nformat = \"xml\"\n", "log.format: must be one of json, text"),
    ("[tls]\naddress = \"127.0.0.1:9\"\n", "tls: a TCP listener needs all of address, cert, key and client_ca"),
    ("listen = 3\n", "listen: must be a [section] table"),
    ("[listen\n", "not valid TOML"),
])
def test_bad_files_are_refused_with_the_key_and_the_problem(sandboxd_daemon: DaemonFactory, tmp_path: Path,
                                                           content: str, message: str) -> None:
    path = tmp_path / "sandboxd.toml"
    path.write_text(content)
    result = sandboxd("config", "check", str(path))
    assert result.returncode == 2 and f"{path}: " in result.stderr and message in result.stderr, result.stderr
    serve = sandboxd_daemon.start_failure(args=["--config", str(path)], default_flags=False)
    assert serve.returncode == 2 and message in serve.log, serve.log        # the daemon stops at start-up


def test_a_good_file_checks_out(tmp_path: Path) -> None:
    path = tmp_path / "sandboxd.toml"
    path.write_text("[listen]\nworkers = 256\n[network]\ndns = [\"192.0.2.53\"]\n")
    result = sandboxd("config", "check", str(path))
    assert result.returncode == 0 and "listen.workers = 256" in result.stdout and "192.0.2.53" in result.stdout
    # What serve refuses, config check refuses: 8 workers leave no room for the quotas (checked at start).
    path.write_text("[listen]\nworkers = 8\n")
    result = sandboxd("config", "check", str(path))
    assert result.returncode == 2 and "raise listen.workers" in result.stderr, result.stderr


def test_serve_reads_the_file_and_flags_win(sandboxd_daemon: DaemonFactory) -> None:
    base = sandboxd_daemon.base
    run = base / "run"
    path = base / "sandboxd.toml"
    path.write_text(f'[listen]\nsocket = "{run}/from-config.sock"\nsocket_mode = "0660"\n'
                    f'[state]\ndir = "{base}/state"\n[log]\nformat = "text"\n')
    for args, env, expected in ((["--config", str(path)], {}, run / "from-config.sock"),
                                ([], {"SANDBOXD_CONFIG": str(path)}, run / "from-config.sock"),
                                (["--config", str(path), "--socket", str(run / "flag.sock")], {},
                                 run / "flag.sock")):
        daemon = sandboxd_daemon(args=args, env=env, socket=expected, default_flags=False)
        line = daemon.log().splitlines()[0]
        assert line.startswith("sandboxd info: serving") and f"socket={expected}" in line, line
        assert f"config={path}" in line and expected.exists()
        assert (base / "state" / "events.db").exists()
        assert os.stat(expected).st_mode & 0o777 == 0o660
        assert daemon.stop() == 0
        time.sleep(0.1)


def test_the_operations_page_documents_every_key() -> None:
    page = (REPO / "docs" / "operations.md").read_text()
    missing = [key.dotted for key in config.KEYS if f"`{key.dotted}`" not in page]
    assert not missing, f"keys missing from the configuration table of docs/operations.md: {missing}"


def test_doctor_on_this_machine() -> None:
    result = sandboxd("doctor", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line and not line.startswith(" ")]
    names = {line.split(":")[0].split(None, 1)[1] for line in lines[:-1]}
    assert names >= {"privileges", "sandbox", "seccomp", "landlock", "cgroups", "ceiling", "nftables", "address pool",
                     "call helper"}, lines
    assert all(line.startswith(("ok", "warn")) for line in lines[:-1]), result.stdout
    # the ceiling line says the defaults and the caps of all sandboxes together (kernel.host_limits)
    ceiling = next(line for line in lines if line.split(":")[0].endswith("ceiling"))
    assert f"pids {host_limits.DEFAULT_PIDS}," in ceiling, ceiling
    assert f"all together: pids {host_limits.default_ceiling().pids}," in ceiling, ceiling


def test_doctor_says_what_is_missing_and_how_to_fix_it() -> None:
    result = sandboxd("doctor", env={"PATH": "/usr/bin:/bin"}, timeout=120)   # no /usr/sbin: no nft
    assert result.returncode == 1, result.stdout
    assert "FAIL  nftables: the nft command is missing" in result.stdout
    assert "fix: apt-get install nftables" in result.stdout


def test_the_packaged_default_config_is_valid() -> None:
    packaged = REPO / "packaging" / "sandboxd.toml"
    assert config.read_file(str(packaged)).values == config.read_file(None).values
    assert os.path.getsize(packaged) > 0


def test_metrics_report_real_counts(sandboxd_daemon: DaemonFactory) -> None:
    import urllib.request

    from daemon_helpers import create_session, rpc_error, run_exec
    from sandboxd.v1 import sandboxd_pb2 as pb

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = sandboxd_daemon(args=["--metrics", f"127.0.0.1:{port}", "--log-level", "debug"])
    workspace = sandboxd_daemon.workspace()
    session = create_session(d.stub, workspace, pb.SandboxPolicy(mode=pb.SandboxPolicy.READ_ONLY))
    for _ in range(3):
        assert run_exec(d.stub, session.id, ["echo", "twelve bytes"]).stdout == b"twelve bytes\n"
    rpc_error(lambda: d.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="x", data=b"x")))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['sandboxd_tool_calls_total{outcome="completed",tool="shell.exec"}'] == 3
    assert values['sandboxd_tool_calls_total{outcome="denied_by_sandbox",tool="fs.write"}'] == 1
    assert values['sandboxd_decisions_total{reason="sandbox_rejected",verdict="denied_by_sandbox"}'] == 1
    assert values['sandboxd_decisions_total{reason="",verdict="allowed"}'] == 3
    assert values["sandboxd_exec_duration_seconds_count"] == 3 and values["sandboxd_exec_queue_seconds_count"] == 3
    assert values["sandboxd_output_bytes_total"] == 3 * len(b"twelve bytes\n")
    assert values["sandboxd_sessions"] == 1 and values["sandboxd_running_calls"] == 0
    assert values["sandboxd_event_store_events"] >= 1 + 3 * 3 + 1       # created, 3 x (granted, started, done), denied
    lines = [line for line in d.log_lines() if line.get("msg") in ("decision", "tool call ended")]
    assert lines and all(line.get("session_id") == session.id and line.get("call_id") for line in lines), lines


def test_session_defaults_come_from_the_file(sandboxd_daemon: DaemonFactory) -> None:
    from sandboxd.v1 import sandboxd_pb2 as pb

    d = sandboxd_daemon(config='[defaults]\nsandbox_policy = "read-only"\napproval_policy = "never"\n'
                               'timeout_seconds = 7\npids = 64\n[network]\npool = "10.234.0.0/24"\n')
    workspace = sandboxd_daemon.workspace()
    bare = d.stub.CreateSession(pb.CreateSessionRequest(workspace=str(workspace)))
    assert bare.sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY and bare.approval_policy == pb.NEVER
    assert bare.limits.timeout_seconds == 7 and bare.limits.pids == 64
    asked = d.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(workspace), approval_policy=pb.ALWAYS, limits=pb.Limits(timeout_seconds=3),
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True)))
    assert asked.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE and asked.approval_policy == pb.ALWAYS
    assert asked.limits.timeout_seconds == 3
    # The isolated network takes its address from the configured pool.
    from daemon_helpers import run_exec
    d.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=asked.id, approval_policy=pb.NEVER))
    routes = run_exec(d.stub, asked.id, ["cat", "/proc/net/fib_trie"]).stdout.decode()
    assert "10.234.0.2" in routes, routes[:500]


def test_an_owners_share_defaults_to_a_fifth_of_the_total_and_must_nest(tmp_path: Path) -> None:
    """limits.owner_pids: 0 is a fifth of limits.total_pids, and the built-in session default shrinks
    to fit it; a share above the total, or a default above the share, stops with both keys. The memory
    share is none unless set, and then nests the same way."""
    def resolved(text: str) -> config.ResourceLimits:
        path = tmp_path / "sandboxd.toml"
        path.write_text(text)
        return config.resource_limits(config.read_file(str(path)))

    built_in = resolved("")
    assert built_in.owner_pids == built_in.total_pids // 5 and built_in.owner_memory == 0
    small = resolved("[limits]\ntotal_pids = 300\n")
    assert (small.owner_pids, small.pids) == (60, 60)
    shared = resolved("[limits]\ntotal_memory = \"512M\"\nowner_memory = \"256M\"\n")
    assert (shared.owner_memory, shared.memory) == (256 << 20, 256 << 20)
    for text, low, high in (
            ("[limits]\ntotal_pids = 300\nowner_pids = 301\n", "limits.owner_pids", "limits.total_pids"),
            ("[defaults]\npids = 100\n[limits]\ntotal_pids = 300\n", "defaults.pids", "limits.owner_pids"),
            ("[limits]\ntotal_memory = \"512M\"\nowner_memory = \"1G\"\n", "limits.owner_memory", "limits.total_memory"),
            ("[defaults]\nmemory = \"300M\"\n[limits]\nowner_memory = \"256M\"\n", "defaults.memory",
             "limits.owner_memory")):
        with pytest.raises(config.ConfigError) as refused:
            resolved(text)
        assert refused.value.key == low and high in str(refused.value), str(refused.value)
