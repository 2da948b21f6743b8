"""Rootless `sandboxd run` (issue 17, item 6): a plain user created here runs `sandboxd run`, whose
sandbox is built in a user namespace mapping that user to themselves (launcher/rootless.py).

Every test runs real programs inside real sandboxes as that user, and each wall has a control:
the same thing done legitimately (or outside the sandbox) works. The plain user runs a copy of the
sandboxd package with the system python3 (the checkout and its venv may be root's only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, PY, REPO, SANDBOXD, SLOW, describe, make_dir
from daemon_helpers import PlainUser, plain_users
from test_conformance import CONFORMANCE
from test_isolated_network import (  # noqa: F401 - world: a fixture
    BLOCKED, DNS, HOST_ONLY, HOST_REACH_PROBE, PROXY_PROBE, UPLINK, World, world)

pytestmark = pytest.mark.timeout(300)


class Setup(NamedTuple):
    user: PlainUser          # runs sandboxd run
    other: PlainUser         # owns the secret
    base: Path               # 0755, root's
    code: Path               # the sandboxd package, readable by every user
    workspace: Path          # the user's, 0700
    outside: Path            # 0777: only the sandbox can stop a write there
    secret: Path             # the other user's, 0600


# The plain user runs the system's python3, which has no pyseccomp to compile the seccomp filters:
# root fills its cache first (/var/cache/sandboxd/seccomp, trusted only when root's), as on any
# machine where root has run sandboxd; a user's own install of sandboxd compiles them itself.
WARM_FILTERS = ("from sandboxd.kernel import seccomp\n"
                "for confined in (True, False):\n"
                "    seccomp.program_for(seccomp.FilterSpec(confined=confined))\n")


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    subprocess.run([sys.executable, "-c", WARM_FILTERS], check=True, timeout=120, cwd=REPO)
    with plain_users(2) as (user, other):
        base = Path(tempfile.mkdtemp(prefix="sbxrootless-", dir="/var/tmp"))
        try:
            os.chmod(base, 0o755)
            code = make_dir(base / "code")
            shutil.copytree(REPO / "sandboxd", code / "sandboxd", ignore=shutil.ignore_patterns("__pycache__"))
            # Its pure-Python dependencies on this path (the rootless proxy's DNS client, network/dns.py;
            # h11, with which it reads every plain http:// request, network/interception/plain.py), as an
            # installed sandboxd has them in its venv.
            import dns
            import h11
            for package in (dns, h11):
                shutil.copytree(Path(package.__file__).parent, code / package.__name__,
                                ignore=shutil.ignore_patterns("__pycache__"))
            subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
            workspace = make_dir(base / "ws", 0o700)
            os.chown(workspace, user.uid, user.gid)
            outside = make_dir(base / "outside", 0o777)
            secret = base / "secret"
            secret.write_text("the other user's secret\n")
            os.chown(secret, other.uid, other.gid)
            os.chmod(secret, 0o600)
            yield Setup(user, other, base, code, workspace, outside, secret)
            _wait_for_no_processes(user, other)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def run_as(s: Setup, user: PlainUser, *args: str, timeout: float = 60,
           workspace: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``sandboxd run ARGS`` as ``user`` (no supplementary groups), started in the workspace."""
    return subprocess.run(sandboxd_run(s, args), capture_output=True, text=True, timeout=timeout * SLOW,
                          stdin=subprocess.DEVNULL, **as_user(s, user, workspace))


def start_as(s: Setup, user: PlainUser, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(sandboxd_run(s, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, **as_user(s, user))


def sandboxd_run(s: Setup, args: Sequence[str]) -> list[str]:
    return [PY, "-m", "sandboxd.cli.main", "run", *args]


def as_user(s: Setup, user: PlainUser, workspace: Path | None = None) -> dict[str, Any]:
    """subprocess options that run a program as ``user`` in its workspace, with the copy of sandboxd."""
    where = workspace or s.workspace
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": str(where),
            "env": {**BASE_ENV, "HOME": str(where), "PYTHONPATH": str(s.code)}}


def _processes_of(*users: PlainUser) -> list[str]:
    found = subprocess.run(["ps", "-o", "pid=,args=", "-u", ",".join(str(u.uid) for u in users)],
                           capture_output=True, text=True)
    return found.stdout.splitlines()


def _wait_for_no_processes(*users: PlainUser, within: float = 10.0) -> list[str]:
    """The users' processes, once none are left or ``within`` seconds (scaled) have passed."""
    deadline = time.monotonic() + within * SLOW
    while (left := _processes_of(*users)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


WALLS_PROBE = textwrap.dedent('''
    import ctypes, json, os, resource, socket, sys
    outside, secret, port, host_tmp = sys.argv[1:5]
    seen = {"uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "pid": os.getpid()}
    seen["uid_map"] = open("/proc/self/uid_map").read().split()
    seen["userns"] = os.readlink("/proc/self/ns/user")
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    for key in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh", "NoNewPrivs", "Seccomp"):
        seen[key] = status[key].strip()
    def attempt(name, action):
        try:
            action()
            seen[name] = "ok"
        except OSError as e:
            seen[name] = type(e).__name__ + ":" + os.strerror(e.errno or 0)
    def write(path):
        with open(path, "w") as f:
            f.write("x")
    attempt("write workspace", lambda: write("made-inside"))
    attempt("write outside", lambda: write(os.path.join(outside, "escaped")))
    attempt("write /etc", lambda: write("/etc/sbx-rootless-escaped"))
    attempt("read secret", lambda: open(secret).read())
    seen["host tmp visible"] = os.path.exists(host_tmp)
    attempt("write /tmp", lambda: write("/tmp/private"))
    attempt("connect host loopback", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2).close())
    libc = ctypes.CDLL(None, use_errno=True)
    def unshare_user():
        if libc.unshare(0x10000000) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
    attempt("unshare user", unshare_user)
    seen["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    seen["open files"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(json.dumps(seen))
''')


@pytest.fixture
def host_listener() -> Iterator[socket.socket]:
    """A listener on the host's 127.0.0.1 that answers every connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield listener
    finally:
        listener.close()


def _walls(s: Setup, listener: socket.socket, host_tmp: Path, *options: str) -> dict[str, object]:
    result = run_as(s, s.user, *options, "--", PY, "-c", WALLS_PROBE, str(s.outside), str(s.secret),
                    str(listener.getsockname()[1]), str(host_tmp))
    assert result.returncode == 0, describe(result)
    seen: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return seen


def test_a_plain_user_gets_the_walls_rootless(setup: Setup, host_listener: socket.socket) -> None:
    s = setup
    host_tmp = Path(tempfile.mkdtemp(prefix="sbxrootless-", dir="/tmp"))
    os.chmod(host_tmp, 0o755)
    try:
        seen = _walls(s, host_listener, host_tmp, "--open-files", "64")
        # Control: the very same probe on the host, as the same user, outside any sandbox.
        on_host = subprocess.run([PY, "-c", WALLS_PROBE, str(s.outside), str(s.secret),
                                  str(host_listener.getsockname()[1]), str(host_tmp)], capture_output=True,
                                 text=True, timeout=60, **as_user(s, s.user))
    finally:
        shutil.rmtree(host_tmp)
    host = json.loads(on_host.stdout)
    # The user's own uid and gid inside, mapped to themselves (never uid 0), in a user namespace.
    assert (seen["uid"], seen["euid"], seen["gid"]) == (s.user.uid, s.user.uid, s.user.gid), seen
    assert seen["uid_map"] == [str(s.user.uid), str(s.user.uid), "1"], seen
    assert seen["userns"] != host["userns"], (seen, host)
    # No capability anywhere (the bounding set too), no_new_privs, seccomp filter mode.
    assert {seen[k] for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh")} == {"0000000000000000"}, seen
    assert (seen["NoNewPrivs"], seen["Seccomp"]) == ("1", "2"), seen
    # The workspace is writable; everything else read-only, even a 0777 directory.
    assert seen["write workspace"] == "ok" and (s.workspace / "made-inside").exists(), seen
    assert str(seen["write outside"]).startswith("OSError:Read-only file system"), seen
    assert str(seen["write /etc"]).startswith("OSError:Read-only file system"), seen
    assert host["write outside"] == "ok" and (s.outside / "escaped").exists(), host
    (s.outside / "escaped").unlink()
    # Another user's 0600 file stays unreadable (the control: its owner reads it, below).
    assert seen["read secret"] == "PermissionError:Permission denied", seen
    # A private /tmp: the host's is not seen, and writes to it land nowhere on the host.
    assert (seen["host tmp visible"], host["host tmp visible"]) == (False, True), (seen, host)
    assert seen["write /tmp"] == "ok", seen
    # No network: the host's loopback is another namespace's.
    assert seen["connect host loopback"].startswith("ConnectionRefusedError"), seen  # type: ignore[union-attr]
    assert host["connect host loopback"] == "ok", host
    # User namespaces inside stay refused (seccomp), while the host lets this user make them.
    assert seen["unshare user"].startswith("PermissionError"), seen  # type: ignore[union-attr]
    assert host["unshare user"] == "ok", host
    # Its own PID namespace: init and the command only. Rlimits apply.
    assert seen["processes"] == [1, seen["pid"]] and seen["pid"] == 2, seen
    assert (seen["open files"], host["open files"] != 64) == (64, True), (seen, host)


def test_the_secret_owner_reads_it_through_its_own_rootless_run(setup: Setup) -> None:
    """The control of the secret: the sandbox takes nothing away from a legitimate read."""
    s = setup
    own = make_dir(s.base / "other-ws", 0o700)
    os.chown(own, s.other.uid, s.other.gid)
    result = run_as(s, s.other, "--", "cat", str(s.secret), workspace=own)
    assert (result.returncode, result.stdout) == (0, "the other user's secret\n"), describe(result)


def test_the_host_network_only_when_asked(setup: Setup, host_listener: socket.socket) -> None:
    port = str(host_listener.getsockname()[1])
    connect = ["--", PY, "-c", "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), "
               "timeout=5).close(); print('reached')", port]
    refused = run_as(setup, setup.user, *connect)
    assert refused.returncode == 1 and "ConnectionRefusedError" in refused.stderr, describe(refused)
    reached = run_as(setup, setup.user, "--network=host", *connect)
    assert (reached.returncode, reached.stdout) == (0, "reached\n"), describe(reached)


def test_read_only_and_git_protection_rootless(setup: Setup) -> None:
    s = setup
    repo = s.workspace / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, user=s.user.uid, group=s.user.gid,
                   extra_groups=[], env={**BASE_ENV, "HOME": str(s.workspace)})
    script = ("for f in repo/.git/config repo/.git/hooks/pre-commit repo/file; do "
              "(echo x > $f) 2>/dev/null && echo \"$f ok\" || echo \"$f refused\"; done")
    written = run_as(s, s.user, "--", "sh", "-c", script)
    assert written.stdout.splitlines() == ["repo/.git/config refused", "repo/.git/hooks/pre-commit refused",
                                           "repo/file ok"], describe(written)
    read_only = run_as(s, s.user, "--sandbox", "read-only", "--", "sh", "-c", script)
    assert read_only.stdout.splitlines() == ["repo/.git/config refused", "repo/.git/hooks/pre-commit refused",
                                             "repo/file refused"], describe(read_only)
    assert (repo / "file").read_text() == "x\n"


def test_danger_full_access_runs_as_the_user_without_new_privileges(setup: Setup) -> None:
    s = setup
    result = run_as(s, s.user, "--sandbox", "danger-full-access", "--", "sh", "-c",
                    f"id -u; grep NoNewPrivs /proc/self/status; echo x > {s.outside}/full-access && echo wrote")
    assert result.stdout.split() == [str(s.user.uid), "NoNewPrivs:", "1", "wrote"], describe(result)
    (s.outside / "full-access").unlink()


REFUSED = {
    "isolated network": ["--network"],
    "memory limit": ["--memory", "512M"],
    "pids limit": ["--pids", "64"],
    "another user": ["--user", "0"],
    "published port": ["--publish", "8123"],
    "host allowlist": ["--network", "--allow-host", "198.51.100.10"],
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_needs_root_is_refused_in_one_line(setup: Setup, case: str) -> None:
    s = setup
    marker = s.workspace / f"ran-{case.replace(' ', '-')}"
    result = run_as(s, s.user, *REFUSED[case], "--", "touch", str(marker))
    assert result.returncode == 125, describe(result)
    assert result.stderr.count("\n") == 1 and "needs root" in result.stderr, describe(result)
    assert "run sandboxd run as root" in result.stderr, describe(result)
    assert not marker.exists()


def test_the_default_limits_fall_back_to_nothing_without_a_word(setup: Setup) -> None:
    """The control of the refusals: no flag, a run with every default (whose memory and pids
    limits need cgroups) runs, and says nothing."""
    result = run_as(setup, setup.user, "--", "touch", "default-run")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), describe(result)
    assert (setup.workspace / "default-run").exists()


def test_the_whole_tree_goes_with_the_run(setup: Setup) -> None:
    s = setup
    timed_out = run_as(s, s.user, "--timeout", str(1 * SLOW), "--", "sh", "-c", "sleep 300 & sleep 300")
    assert timed_out.returncode == 124 and "timed out" in timed_out.stderr, describe(timed_out)
    assert _wait_for_no_processes(s.user) == []
    # Ctrl-C reaches the command through the user namespace's outer process and init.
    running = start_as(s, s.user, *["--", "sh", "-c", "trap 'echo got-int; exit 9' INT; echo ready; "
                                    "while :; do sleep 0.1; done"])
    assert running.stdout is not None and running.stdout.readline() == "ready\n"
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=30 * SLOW)
    assert (running.returncode, out) == (9, "got-int\n"), err
    # SIGKILL of `sandboxd run` itself: nothing of the sandbox outlives it.
    killed = start_as(s, s.user, *["--", "sh", "-c", "echo ready; sleep 300 & sleep 300"])
    assert killed.stdout is not None and killed.stdout.readline() == "ready\n"
    killed.kill()
    killed.communicate(timeout=30 * SLOW)
    assert _wait_for_no_processes(s.user) == []


def test_allowed_domains_through_the_loopback_proxy(setup: Setup, world: World) -> None:  # noqa: F811
    """--network --allow-domain as a plain user: a loopback-only namespace whose init hands its
    listener to `sandboxd run`, which runs the egress proxy from the host's namespace."""
    result = run_as(setup, setup.user, "--network", "--dns", DNS, "--allow-domain", "internet.test",
                    "--allow-domain", "*.internet.test", "--allow-domain", "private.test", "--", PY, "-c",
                    PROXY_PROBE, timeout=120)
    assert result.returncode == 0, describe(result)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for allowed in ("http internet", "http subdomain", "connect internet", "socks internet"):
        assert seen[allowed] == "open: hello from internet", seen
    for refused in ("http other", "connect other"):
        assert "403" in seen[refused], seen
    assert seen["socks other"] == "socks refused 2", seen
    assert seen["http private"] == "http 403", seen                 # allowed by name, but a private address
    # Nothing but the proxy: a program that ignores the proxy variables reaches nothing.
    assert seen["direct 198.51.100.10"] in BLOCKED and seen["direct 198.51.100.11"] in BLOCKED, seen
    assert "blocked a connection to other.test:8080: not in the allowed domains" in result.stderr
    assert "private.test:8080: it resolves to 10.77.0.10, in 10.0.0.0/8, a blocked range" in result.stderr
    # The control of "direct": the same address is reachable from the host, as this user.
    direct = subprocess.run([PY, "-c", "import socket; socket.create_connection(('198.51.100.10', 8080), "
                             "timeout=5).close(); print('open')"], capture_output=True, text=True, timeout=60,
                            **as_user(setup, setup.user))
    assert direct.stdout == "open\n", direct.stderr


@pytest.mark.timeout(int(300 * SLOW))
def test_the_rootless_proxy_refuses_the_host_through_an_allowed_name(setup: Setup, world: World) -> None:  # noqa: F811
    """host.test is allowed and resolves to an address of the host (not in a blocked range). Rootless,
    no kernel filter stands behind the proxy, which connects from the host's namespace: it refuses
    the host's own addresses itself, through plain HTTP, CONNECT and SOCKS5 alike, and the host's
    service sees no connection."""
    s = setup
    service = socket.socket()
    service.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    service.bind(("0.0.0.0", 0))
    service.listen(16)
    port = service.getsockname()[1]
    try:
        # The control: the service is there, for this very user on the host.
        reached = subprocess.run([PY, "-c", "import socket, sys; socket.create_connection((sys.argv[1], "
                                  "int(sys.argv[2])), timeout=5).close(); print('open')", HOST_ONLY, str(port)],
                                 capture_output=True, text=True, timeout=60, **as_user(s, s.user))
        assert reached.stdout == "open\n", reached.stderr
        service.accept()[0].close()
        result = run_as(s, s.user, "--network", "--dns", DNS, "--allow-domain", "host.test", "--allow-domain",
                        "uplink.test", "--allow-domain", "internet.test", "--", PY, "-c", HOST_REACH_PROBE,
                        str(port), "1", timeout=120)
        assert result.returncode == 0, describe(result)
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        assert seen["http internet"] == "hello from internet", seen                 # the control, in the sandbox
        assert seen["socks internet"] == "socks reply 0", seen
        assert seen["http host"] == "HTTP/1.1 403 Forbidden", seen
        assert seen["connect host"] == "HTTP/1.1 403 Forbidden", seen
        assert seen["socks host"] == "socks reply 2", seen
        assert seen["http uplink"] == "HTTP/1.1 403 Forbidden", seen
        assert f"host.test:{port}: it resolves to {HOST_ONLY}, an address of this host" in result.stderr
        assert f"uplink.test:{port}: it resolves to {UPLINK}, in 203.0.113.0/24, a blocked range" in result.stderr
        service.setblocking(False)
        with pytest.raises(BlockingIOError):
            service.accept()                                                        # nothing came through
    finally:
        service.close()


PORT_PROBE = textwrap.dedent('''
    import json, os, socket, struct
    proxy = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    proxy, seen = (proxy[0], int(proxy[1])), {}
    for port in (8080, 22, 25, 5432):
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(f"CONNECT internet.test:{port} HTTP/1.1\\r\\nHost: internet.test\\r\\n\\r\\n".encode())
            seen[f"connect {port}"] = s.recv(4096).split(b"\\r\\n", 1)[0].decode()
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(b"\\x05\\x01\\x00"); s.recv(2)
            s.sendall(b"\\x05\\x01\\x00\\x03" + bytes([13]) + b"internet.test" + struct.pack(">H", port))
            seen[f"socks {port}"] = s.recv(10)[1]
    print(json.dumps(seen))
''')


def test_the_rootless_proxy_relays_an_allowed_name_to_web_ports_only(setup: Setup, world: World) -> None:  # noqa: F811
    """An allowed name is not an allowed host: rootless, with no kernel filter behind the proxy, it
    relays to the ports docs/rootless.md names (80, 443, 8080, 8443), and CONNECT or SOCKS to the
    name's ssh, mail or database port is 403 / SOCKS reply 2, saying why. Control: port 8080 of
    the same name goes through."""
    result = run_as(setup, setup.user, "--network", "--dns", DNS, "--allow-domain", "internet.test", "--", PY, "-c",
                    PORT_PROBE, timeout=120)
    assert result.returncode == 0, describe(result)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["connect 8080"].endswith(" 200 Connection established") and seen["socks 8080"] == 0, seen
    for port in (22, 25, 5432):
        assert seen[f"connect {port}"] == "HTTP/1.1 403 Forbidden" and seen[f"socks {port}"] == 2, seen
        assert (f"blocked a connection to internet.test:{port}: port {port} is not one this proxy relays to "
                "(only 80, 443, 8080, 8443)") in result.stderr


def test_conformance_probes_hold_as_a_plain_user(setup: Setup) -> None:
    """`../shared/conformance/run` as the plain user (its fixtures, workspace and decoys are the
    user's): all 80 verdicts hold rootless. Two things are translated by a wrapper, for reasons
    that are the rootless design, not weaker walls: --memory and --pids are dropped (cgroup limits
    need root; asked for rootless they are refused: test_what_needs_root_is_refused_in_one_line),
    and --network becomes --network=host (the isolated network needs root; the probes'
    workspace_write_net verdicts are written for a network the command can use, and NET-02
    expects routes out, which --allow-domain's loopback-only namespace has none of)."""
    runner = CONFORMANCE / "run"
    if not runner.exists():
        pytest.skip(f"conformance probes not present at {CONFORMANCE} (set SANDBOXD_CONFORMANCE)")
    s = setup
    wrapper = s.base / "sandboxd-rootless"
    # Under emulation the probes' CPU and wall budgets are scaled, as packaging/vm/slow-sandboxd does.
    wrapper.write_text("#!/bin/sh\nskip=\nscale=\ncommand=\nfor arg do shift\n"
                       "  if [ -n \"$command\" ]; then set -- \"$@\" \"$arg\"; continue; fi\n"
                       "  if [ -n \"$skip\" ]; then skip=; continue; fi\n"
                       f"  if [ -n \"$scale\" ]; then scale=; arg=$(( ${{arg%.*}} * {max(1, int(SLOW))} )); fi\n"
                       "  case \"$arg\" in --memory|--pids) skip=1; continue;; --network) arg=--network=host;;\n"
                       "    --cpu-seconds|--timeout) scale=1;; --) command=1;; esac\n"
                       "  set -- \"$@\" \"$arg\"\ndone\n"
                       f"PYTHONPATH={s.code} exec {PY} -m sandboxd.cli.main \"$@\"\n")
    wrapper.chmod(0o755)
    before = set(Path("/var/tmp").glob("sbx-conformance.*"))
    try:
        result = subprocess.run([str(runner), str(wrapper)], capture_output=True, text=True, timeout=280 * SLOW,
                                user=s.user.uid, group=s.user.gid, extra_groups=[], cwd="/",
                                env={**BASE_ENV, "HOME": str(s.workspace)})
    finally:
        for left in set(Path("/var/tmp").glob("sbx-conformance.*")) - before:
            if left.stat().st_uid == s.user.uid:       # its copies of the probes are read-only to it
                shutil.rmtree(left, ignore_errors=True)
    failed = [line for line in result.stdout.splitlines() if line and not line.startswith(("ok", "held"))]
    assert not failed, "\n".join(failed) + result.stderr[-2000:]
    assert "held 80/80" in result.stdout, result.stdout[-2000:]


def test_as_root_a_failing_command_says_which_uid_it_ran_as(setup: Setup) -> None:
    """Root's run starts the command as the workspace's owner: when it fails, one line says so."""
    s = setup
    root_only = s.base / "root-only"
    root_only.write_text("root's\n")
    os.chmod(root_only, 0o600)
    line = f"sandboxd run: the command ran as uid {s.user.uid} (gid {s.user.gid}), the owner of the workspace"

    def as_root(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SANDBOXD, "run", "--workspace", str(s.workspace), *args], capture_output=True,
                              text=True, timeout=60 * SLOW, env=BASE_ENV, stdin=subprocess.DEVNULL)

    failed = as_root("--", "cat", str(root_only))
    assert failed.returncode == 1 and "Permission denied" in failed.stderr, describe(failed)
    assert [x for x in failed.stderr.splitlines() if x.startswith(line)] != [], describe(failed)
    assert failed.stderr.count("the command ran as uid") == 1, describe(failed)
    # Controls: a command that succeeds, and one run as the uid --user names, say nothing of it.
    ok = as_root("--", "true")
    assert (ok.returncode, ok.stderr) == (0, ""), describe(ok)
    chosen = as_root("--user", "0", "--", "cat", str(root_only))
    assert (chosen.returncode, chosen.stdout, chosen.stderr) == (0, "root's\n", ""), describe(chosen)
    asked = as_root("--user", str(s.user.uid), "--", "cat", str(root_only))
    assert asked.returncode == 1 and "the command ran as uid" not in asked.stderr, describe(asked)


def test_host_unix_sockets_only_by_name_rootless(setup: Setup) -> None:
    """The connect broker works in the user namespace: a host socket of the user's own is
    refused unless --allow-unix-socket names it (the control)."""
    s = setup
    where = make_dir(s.base / "sockets", 0o700)
    os.chown(where, s.user.uid, s.user.gid)
    path = where / "service.sock"
    server = subprocess.Popen([PY, "-c", "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                               "s.bind(sys.argv[1]); s.listen(4); print('ready', flush=True)\n"
                               "while True:\n    c, _ = s.accept(); c.sendall(b'hello'); c.close()", str(path)],
                              stdout=subprocess.PIPE, text=True, **as_user(s, s.user))
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        probe = ["--", PY, "-c", "import socket, sys; c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); "
                 "print(c.recv(5).decode())", str(path)]
        refused = run_as(s, s.user, *probe)
        assert refused.returncode == 1 and "PermissionError" in refused.stderr, describe(refused)
        allowed = run_as(s, s.user, "--allow-unix-socket", str(path), *probe)
        assert (allowed.returncode, allowed.stdout) == (0, "hello\n"), describe(allowed)
    finally:
        server.kill()
        server.wait()
        path.unlink()


SWAP_CHECK = textwrap.dedent('''
    import os, sys
    from sandboxd.errors import SetupError
    from sandboxd.kernel import mounts, namespaces
    from sandboxd.launcher import rootless
    path, swap = sys.argv[1], sys.argv[2] == "swap"
    checked = os.open(path, os.O_PATH | os.O_CLOEXEC)       # what plan.prepare opened and checked
    if swap:                                                # the name now leads somewhere else
        os.rename(path, path + "-aside")
        os.mkdir(path)
    namespaces.unshare(namespaces.CLONE_NEWNS)              # the sandbox's new mount namespace
    mounts.make_private("/")
    trees = {path: checked}
    try:
        rootless.clone_roots(trees)
    except SetupError as exc:
        print("refused", exc.step, exc.errno == 116)        # ESTALE
    else:
        print("cloned", os.fstat(trees[path]).st_ino == os.stat(path).st_ino)
''')


def test_a_root_swapped_after_its_check_is_not_mounted(tmp_path: Path) -> None:
    """Rootless, the roots are cloned in the sandbox's mount namespace from their paths: a path
    that leads to another directory than the one checked (renamed and replaced since) is refused;
    the control, the same path left alone, is cloned."""
    for mode, expected in (("swap", "refused reopen workspace or writable root True\n"), ("keep", "cloned True\n")):
        path = make_dir(tmp_path / mode)
        done = subprocess.run([sys.executable, "-c", SWAP_CHECK, str(path), mode], capture_output=True, text=True,
                              timeout=60, cwd=REPO)
        assert done.stdout == expected, done.stderr


@pytest.mark.parametrize("who", ["root", "plain"])
def test_a_ctrl_c_at_any_moment_is_the_commands_or_ends_the_run_quietly(setup: Setup, who: str) -> None:
    """SIGINT sent to `sandboxd run` at staggered moments (its start-up, the sandbox's build, the
    command's fork, the command running): it reaches the command (its trap exits 9, or it dies of it:
    130), or ends a run that had no sandbox yet (130, or killed by it before Python ran, or while it
    imported sandboxd's modules, before any handler can be in place); never a traceback from main() or below, nor a setup failure
    (init or the CLI taking it as KeyboardInterrupt, as under load before signals were held across
    each fork), and nothing is left running."""
    script = "trap 'echo got-int; exit 9' INT; echo ready; while :; do sleep 0.1; done"
    if who == "plain":
        options = as_user(setup, setup.user)
    else:
        options = {"cwd": str(make_dir(setup.base / "root-ws")),
                   "env": {**BASE_ENV, "PYTHONPATH": str(setup.code)}}
    entry = "import sys; from sandboxd.cli.main import main; sys.exit(main())"   # as the `sandboxd` script
    for step in range(16):
        started = subprocess.Popen([PY, "-c", entry, "run", "--", "sh", "-c", script], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, **options)
        time.sleep(step * 0.025 * SLOW)
        started.send_signal(signal.SIGINT)
        try:
            out, err = started.communicate(timeout=30 * SLOW)
        except subprocess.TimeoutExpired:
            started.kill()                             # its sandbox goes with it (die-with-parent)
            out, err = started.communicate(timeout=60)
            raise AssertionError(f"step {step}: SIGINT ended nothing in {30 * SLOW:g} s: {out!r} {err!r}") from None
        outcome = (step, started.returncode, out, err)
        assert "setup failed" not in err and started.returncode != 125, outcome
        if "ready" in out:                             # its trap was set: the command must have got it
            assert (started.returncode, out) == (9, "ready\ngot-int\n"), outcome
        elif "Traceback" in err:
            # Only Python's own start-up may be interrupted so: the interpreter, or its import of
            # sandboxd's modules before main() runs (a frame of sandboxd's files only "in <module>":
            # no handler can be in place before the first of them runs). Never main() or below.
            ours = re.findall(r'File "[^"]*/sandboxd/[^"]*", line \d+, in (\S+)', err)
            assert err.rstrip().endswith("KeyboardInterrupt") and set(ours) <= {"<module>"}, outcome
        else:
            assert started.returncode in (130, -signal.SIGINT), outcome
    if who == "plain":
        assert _wait_for_no_processes(setup.user) == []
