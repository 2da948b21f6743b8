"""`sandboxd run --credential` (cli/run_credentials.py), root and rootless, against a TLS upstream in
the stand-in internet of tests/test_isolated_network.py (api.internet.test on 198.51.100.10:443,
with a certificate of a test CA the run process trusts through its SSL_CERT_FILE).

What is checked, each with a control that shows the check can fail:
- the upstream gets the real secret, put in by the proxy; inside, the variable, the environment of
  every process and the files the command can write hold only the phantom (control: --pass-env
  VAR without --credential passes the secret, and the same dump shows it);
- --allow-endpoint lets GET through and refuses POST with 403 before the upstream sees it;
- a --credential-file variant;
- where the secret is in memory: not in the sandbox's init nor a rootless run's outer process
  (control: the run process, which holds it, is found holding it by the same scan); and a rootless
  run process and its outer process cannot be read by another process of the same user
  (control: a dumpable process of that user can be).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, SANDBOXD, SLOW, make_dir
from daemon_helpers import descendants
from interception_helpers import UpstreamCA
from test_isolated_network import DNS, World, world  # noqa: F401 - world: a fixture
from test_rootless_run import Setup, as_user, sandboxd_run, setup  # noqa: F401 - setup: a fixture

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="builds a network world and plain users as root")]

API = "api.internet.test"
SECRET = "ghs_REALsecretVALUE0123456789abcdefXYZ"
UPSTREAM_ADDRESS = "198.51.100.10"

# The upstream, in the world's gateway namespace: records each request (method, path, headers) as
# a JSON line, and answers whether the Authorization header carried the secret (never the secret).
UPSTREAM = textwrap.dedent('''
    import http.server, json, ssl, sys
    chain, log, secret = sys.argv[1:4]
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *args): pass
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with open(log, "a") as f:
                f.write(json.dumps([self.command, self.path, dict(self.headers)]) + "\\n")
            reply = b"has the secret" if self.headers.get("Authorization") == "Bearer " + secret else b"no secret"
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
        do_GET = do_POST = answer
    server = http.server.ThreadingHTTPServer(("198.51.100.10", 443), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()
''')

# The command: a GET and a POST with the variable, then everything it can see of its own: its
# environment, every process's, and the files it could have written (the test looks for the secret).
PROBE = textwrap.dedent('''
    echo "get=$(curl -sS -H "Authorization: Bearer $GH_TOKEN" https://api.internet.test/check)"
    echo "post=$(curl -sS -o /dev/null -w '%{http_code}' -X POST -d x -H "Authorization: Bearer $GH_TOKEN" \\
        https://api.internet.test/check)"
    echo "var=$GH_TOKEN"
    echo "--- env"; env
    echo "--- environ"; cat /proc/[0-9]*/environ | tr '\\0' '\\n'
    echo "--- files"; find /tmp "$HOME" "$PWD" -xdev -type f -size -1M -exec cat {} + 2>/dev/null
    echo "--- end"
''')


class UpstreamTrust:
    """The upstream's CA, in a file the run process trusts through SSL_CERT_FILE."""

    def __init__(self, base: Path) -> None:
        self.ca = UpstreamCA((API, "other.test"))
        self.ca_file = base / "test-ca.pem"
        self.ca_file.write_text(self.ca.pem)


class Upstream(UpstreamTrust):
    def __init__(self, world: World, base: Path) -> None:  # noqa: F811
        super().__init__(base)
        chain = base / "upstream-chain.pem"
        chain.write_bytes(self.ca.leaf_pem + self.ca.leaf_key_pem)
        self.log = base / "upstream.log"
        self.log.write_text("")
        self.process = subprocess.Popen(["ip", "netns", "exec", world.gw, PY, "-c", UPSTREAM, str(chain), str(self.log),
                                         SECRET], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def requests(self) -> "list[list[object]]":
        import json
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def upstream(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:  # noqa: F811
    base = make_dir(tmp_path_factory.mktemp("upstream"), 0o755)
    made = Upstream(world, base)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> UpstreamTrust:
    """For the runs that reach no upstream: no world to wait for."""
    return UpstreamTrust(make_dir(tmp_path_factory.mktemp("ca"), 0o755))


def nobody_workspace(tmp_path: Path) -> Path:
    """A workspace of nobody's: root's run then runs the command as nobody, who cannot read root's
    0700 directories (where a --credential-file test keeps its secret)."""
    workspace = make_dir(tmp_path / "ws", 0o755)
    os.chown(workspace, 65534, 65534)
    return workspace


def run_root(workspace: Path, upstream: UpstreamTrust, *args: str, env: "dict[str, str] | None" = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), *args, "--", "sh", "-c", PROBE],
                          capture_output=True, text=True, timeout=120 * SLOW, stdin=subprocess.DEVNULL,
                          env={**BASE_ENV, "SSL_CERT_FILE": str(upstream.ca_file), "GH_TOKEN": SECRET,
                               **(env or {})})


def check_phantom_only(result: subprocess.CompletedProcess[str], upstream: Upstream, since: int) -> None:
    """The run reached the upstream with the secret, GET only, and the command saw only the phantom."""
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "get=has the secret" in out, out[:2000] + result.stderr
    assert "post=403" in out, out[:2000] + result.stderr
    phantom = re.search(r"^var=(sbxp_[a-z2-7]{40})$", out, re.M)
    assert phantom is not None, out[:2000]
    assert f"GH_TOKEN={phantom.group(1)}" in out.split("--- env", 1)[1]
    assert SECRET not in out and SECRET not in result.stderr
    seen = upstream.requests()[since:]
    assert [(method, path) for method, path, _ in seen] == [("GET", "/check")], seen   # the POST never left
    assert seen[0][2]["Authorization"] == f"Bearer {SECRET}"


ROOT_ARGS = ("--network", "--dns", DNS, "--credential", f"GH_TOKEN=https://{API}",
             "--allow-endpoint", f"{API}=GET:/**")


def test_root_run_puts_the_secret_in_and_the_command_holds_only_the_phantom(tmp_path: Path,
                                                                              upstream: Upstream) -> None:
    since = len(upstream.requests())
    check_phantom_only(run_root(nobody_workspace(tmp_path), upstream, *ROOT_ARGS, "--pass-env", "GH_TOKEN",
                                "--env", "GH_TOKEN=also-not-passed"), upstream, since)


def test_an_upstream_the_run_does_not_trust_gets_nothing(tmp_path: Path, upstream: Upstream) -> None:
    """Without the test CA in the run's SSL_CERT_FILE the upstream's certificate fails: the command's
    CONNECT gets 502 and the upstream no request, so the secret never leaves."""
    since = len(upstream.requests())
    result = run_root(nobody_workspace(tmp_path), upstream, *ROOT_ARGS, env={"SSL_CERT_FILE": "/nonexistent"})
    assert "get=\n" in result.stdout and "CONNECT tunnel failed, response 502" in result.stderr, result.stderr
    assert upstream.requests()[since:] == []


def test_control_pass_env_without_a_credential_passes_the_secret(tmp_path: Path, test_ca: UpstreamTrust) -> None:
    """The dump above finds the secret where one is: --pass-env without --credential hands it over."""
    result = run_root(nobody_workspace(tmp_path), test_ca, "--pass-env", "GH_TOKEN")
    assert f"var={SECRET}" in result.stdout and f"GH_TOKEN={SECRET}" in result.stdout.split("--- environ", 1)[1]


def test_a_credential_file_gives_the_secret(tmp_path: Path, upstream: Upstream) -> None:
    keep = make_dir(tmp_path / "keep", 0o700)                      # root's: the command (nobody) cannot read it
    (keep / "token").write_text(SECRET + "\n")
    since = len(upstream.requests())
    result = run_root(nobody_workspace(tmp_path), upstream, *ROOT_ARGS, "--credential-file",
                      f"GH_TOKEN={keep / 'token'}", env={"GH_TOKEN": "not-this-one"})
    check_phantom_only(result, upstream, since)


def test_bad_credential_options_are_refused_saying_what_to_fix(tmp_path: Path, test_ca: UpstreamTrust) -> None:
    workspace = nobody_workspace(tmp_path)
    cases = {
        ("--credential", f"GH_TOKEN=https://{API}"): "only applies to the isolated network: add --network",
        ("--network", "--credential", f"GH_TOKEN=http://{API}"): "the upstream must be https://",
        ("--network", "--credential", f"GH_TOKEN=https://{API}", "--credential-file", "OTHER=/etc/hostname"):
            "no --credential names OTHER",
        ("--network", "--credential", f"UNSET_TOKEN=https://{API}"): "$UNSET_TOKEN is not set in your environment",
        ("--network", "--credential", f"GH_TOKEN=https://{API}", "--credential-file", "GH_TOKEN=/nonexistent"):
            "not a readable file",
    }
    for args, expected in cases.items():
        result = run_root(workspace, test_ca, *args)
        assert result.returncode == 125 and expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


# A corporate proxy on the host's loopback: answers each CONNECT, logs its authority, and pumps the
# tunnel to the world's address of the name (it resolves names itself, as such proxies do).
CORPORATE = textwrap.dedent('''
    import socket, sys, threading
    log, names = sys.argv[1], {"api.internet.test": "198.51.100.10"}
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    def pump(source, sink):
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    def one(client):
        head = b""
        while b"\\r\\n\\r\\n" not in head:
            head += client.recv(4096) or b"\\r\\n\\r\\n"
        authority = head.split(b" ")[1].decode()
        with open(log, "a") as f:
            f.write(authority + "\\n")
        host, _, port = authority.rpartition(":")
        upstream = socket.create_connection((names.get(host, host), int(port)))
        client.sendall(b"HTTP/1.1 200 Connection established\\r\\n\\r\\n")
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        pump(client, upstream)
    while True:
        threading.Thread(target=one, args=(listener.accept()[0],), daemon=True).start()
''')


@pytest.fixture
def corporate(tmp_path: Path) -> "Iterator[tuple[int, Path]]":
    """The corporate proxy's port and its log of CONNECT authorities."""
    log = tmp_path / "connects.log"
    process = subprocess.Popen([PY, "-c", CORPORATE, str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline()), log
    finally:
        process.kill()
        process.wait()


def test_an_upstream_proxy_carries_the_credentials_connection(tmp_path: Path, upstream: Upstream,
                                                              corporate: "tuple[int, Path]") -> None:
    """--upstream-proxy: the allowed connection goes out as a CONNECT through the corporate proxy,
    and the credential still reaches the upstream (its certificate verified end to end)."""
    port, log = corporate
    since = len(upstream.requests())
    result = run_root(nobody_workspace(tmp_path), upstream, *ROOT_ARGS, "--upstream-proxy", f"127.0.0.1:{port}")
    check_phantom_only(result, upstream, since)
    assert log.read_text().split() == [f"{API}:443", f"{API}:443"]      # the GET's and the refused POST's


def test_a_bad_upstream_proxy_is_refused(tmp_path: Path) -> None:
    for args, expected in ((("--upstream-proxy", "proxy:3128"), "add --network with --allow-domain or --credential"),
                           (("--network", "--allow-domain", API, "--upstream-proxy", "proxy"), "give HOST:PORT")):
        result = subprocess.run([SANDBOXD, "run", "--workspace", str(tmp_path), *args, "--", "true"],
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=BASE_ENV)
        assert result.returncode == 125 and expected in result.stderr, result.stderr


# -- where the secret is in memory ------------------------------------------------------------------

def memory_holds(pid: int, needle: bytes) -> bool:
    """Whether a readable mapping of ``pid`` holds ``needle`` (read as root through /proc/PID/mem)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            start, end = (int(part, 16) for part in span.split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, OverflowError, ValueError):
                continue                                           # [vvar] and the like
    return False


WAIT = ("curl -sS -o /dev/null -H \"Authorization: Bearer $GH_TOKEN\" https://api.internet.test/check; "
        "echo up; exec sleep 60")


def started(runner: "subprocess.Popen[str]") -> "dict[int, bytes]":
    """The run's descendants by pid (their command lines), once its command said it is up."""
    assert runner.stdout is not None and runner.stdout.readline().strip() == "up", runner.stderr and runner.stderr.read()
    return {pid: info.cmdline for pid, info in descendants(runner.pid).items()}


def stop(runner: "subprocess.Popen[str]") -> None:
    runner.kill()
    runner.communicate(timeout=60)


def test_the_sandboxs_init_never_holds_the_secret(tmp_path: Path, upstream: Upstream) -> None:
    runner = subprocess.Popen([SANDBOXD, "run", "--workspace", str(nobody_workspace(tmp_path)), *ROOT_ARGS, "--",
                               "sh", "-c", WAIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL,
                              env={**BASE_ENV, "SSL_CERT_FILE": str(upstream.ca_file), "GH_TOKEN": SECRET})
    try:
        tree = started(runner)
        init = next(pid for pid, cmdline in tree.items() if b"sleep" not in cmdline)
        assert memory_holds(runner.pid, SECRET.encode()), "the scan does not find what the run process holds"
        assert not memory_holds(init, SECRET.encode())
    finally:
        stop(runner)


def readable_by(user_uid: int, user_gid: int, pid: int) -> str:
    """What another process of that user gets reading ``pid``'s memory and environment."""
    probe = ("import sys\nfor name in ('mem', 'environ'):\n    try:\n"
             "        with open(f'/proc/{sys.argv[1]}/{name}', 'rb') as f:\n"
             "            f.read(1) if name == 'environ' else None\n        print(name, 'read')\n"
             "    except OSError as e:\n        print(name, type(e).__name__)\n")
    return subprocess.run([PY, "-c", probe, str(pid)], capture_output=True, text=True, user=user_uid, group=user_gid,
                          extra_groups=[], timeout=60).stdout


def test_rootless_the_secret_is_only_in_a_process_nobody_else_can_read(setup: Setup, upstream: Upstream,  # noqa: F811
                                                                       corporate: "tuple[int, Path]") -> None:
    ca_file = setup.base / "test-ca.pem"
    ca_file.write_text(upstream.ca.pem)
    os.chmod(ca_file, 0o644)
    options = as_user(setup, setup.user)
    options["env"] = {**options["env"], "SSL_CERT_FILE": str(ca_file), "GH_TOKEN": SECRET}
    for extra in ((), ("--upstream-proxy", f"127.0.0.1:{corporate[0]}")):     # directly, then through one
        since = len(upstream.requests())
        result = subprocess.run(sandboxd_run(setup, [*ROOT_ARGS, *extra, "--", "sh", "-c", PROBE]), capture_output=True,
                                text=True, timeout=120 * SLOW, stdin=subprocess.DEVNULL, **options)
        check_phantom_only(result, upstream, since)
    assert corporate[1].read_text().split() == [f"{API}:443", f"{API}:443"]

    runner = subprocess.Popen(sandboxd_run(setup, [*ROOT_ARGS, "--", "sh", "-c", WAIT]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, **options)
    control = subprocess.Popen(["sleep", "60"], user=setup.user.uid, group=setup.user.gid, extra_groups=[])
    try:
        tree = started(runner)
        outer = next(pid for pid, info in descendants(runner.pid).items() if info.ppid == runner.pid)
        init = next(pid for pid, info in descendants(runner.pid).items() if info.ppid == outer)
        assert set(tree) >= {outer, init}
        assert memory_holds(runner.pid, SECRET.encode())
        for pid in (outer, init):
            assert not memory_holds(pid, SECRET.encode()), tree[pid]
        for pid in (runner.pid, outer):
            assert readable_by(setup.user.uid, setup.user.gid, pid).split() == [
                "mem", "PermissionError", "environ", "PermissionError"], pid
        # Yama's ptrace_scope 1 or more refuses /proc/PID/mem of a non-descendant to everyone: then
        # only environ (a read, not an attach) shows the difference.
        yama = Path("/proc/sys/kernel/yama/ptrace_scope")
        mem = "read" if not yama.exists() or yama.read_text().strip() == "0" else "PermissionError"
        assert readable_by(setup.user.uid, setup.user.gid, control.pid).split() == ["mem", mem, "environ", "read"]
    finally:
        control.kill()
        control.wait()
        stop(runner)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
