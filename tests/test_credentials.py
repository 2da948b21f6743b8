"""Issue 26 end to end: credentials the sandbox never holds, endpoint rules, metadata, on the real
kernel against the TLS world of tests/tls_world.py (HTTPS upstreams of a test CA the daemon and
`sandboxd run` are told to trust; nothing leaves the machine).

Through `sandboxd run --credential GITHUB_TOKEN=https://api.test.example` and through a daemon
session (`sandboxctl session create --network --allow-domain ... --credential ...`):

- curl, git over HTTPS, Python requests and httpx, Node's fetch (node 20 ignores HTTPS_PROXY: it
  gets through by transparent capture only) and gh when it is installed reach the upstream, which
  records the real secret; none of them was told anything but the phantom;
- inside the sandbox the variable, `env`, every readable `/proc/*/environ`, every readable file
  (`grep -r /`, less /proc, /sys and /dev) and a live client's memory (read through
  `/proc/PID/mem` by its parent: RLIMIT_CORE is 0 inside, so no core dump) hold no piece of the
  secret, although the client asked an endpoint that echoes its headers; the control passes the
  same secret with `--pass-env` and the same scan finds it in each place (and a file planted with
  it is found by the same grep);
- the phantom sent to the second allowed host, or in another header, arrives as the phantom;
- an endpoint rule lets GET through and refuses POST with the 403 naming the rules (the
  upstream never sees the POST; control: a rule with POST passes it), and an ambiguous path is 400;
- a name resolving to 169.254.169.254 is refused (control: the world's metadata service answers
  the host);
- SSE passes without buffering: each event after the first is sent only once the client, having
  read the one before, fetched /sse-ack (no timing: a buffered stream would hold event 0 back and
  the server would count a gate timeout);
- a plain user cannot use another user's session, phantom, session CA or daemon-side secret.

The secret is made per test with a random middle (``Secret.fragment``, 16 hex digits): the scans
look for the fragment, so no scanning process ever holds the whole secret, and the fragment alone
is in no file of the machine (the tests' own source holds no secret).

INTEGRATION: this module needs every track of issue 26 merged (daemon, run, proxy, capture);
``tls_world.ISSUE_26_MERGED`` switches it (and test_mcp_recipe.py's credential test) on.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import BASE_ENV, PY, SANDBOXD, describe
from daemon_helpers import PYTHON, Daemon, DaemonFactory, PlainUser, owned_dir
from test_cli_approvals import AS_USER, SANDBOXCTL
from tls_world import (API_HOST, META_HOST, NAMES, OTHER_HOST, TlsWorld, needs_issue_26,
                       tls_world)  # noqa: F401 - the fixture

pytestmark = [pytest.mark.timeout(900), needs_issue_26]

VAR = "GITHUB_TOKEN"
CREDENTIAL = f"{VAR}=https://{API_HOST}"
PHANTOM_PREFIX = "sbxp_"


@dataclass(frozen=True)
class Secret:
    value: str
    fragment: str                      # the random middle the scans look for


@pytest.fixture
def secret() -> Secret:
    fragment = secrets.token_hex(8)
    return Secret(f"ghs_{fragment}{secrets.token_hex(12)}", fragment)


def bearer_seen(world: TlsWorld, path: str, host: str = API_HOST) -> list[str]:
    """The Authorization headers the upstream ``host`` received on requests to ``path``."""
    upstream = world.api if host == API_HOST else world.other
    return [s.headers.get("authorization", "") for s in upstream.seen if s.path == path]


# --------------------------------------------------------------------------- the clients

# The venv's packages for the system Python inside (requests, httpx: test dependencies, same Python
# version), as test_mcp_recipe.py gives the SDK to its server.
SITE_PACKAGES = str(next((Path(__file__).resolve().parents[1] / ".venv" / "lib").glob("python3*/site-packages")))
# Each prints what the upstream answered for /client/NAME, sending "Authorization: Bearer $GITHUB_TOKEN"
# as a program given that variable would, and nothing else: the sandbox's proxy variables and trust
# bundle are sandboxd's.
CLIENTS: dict[str, str] = {
    "curl": f'curl -sS --fail -H "Authorization: Bearer ${VAR}" https://{API_HOST}/client/curl',
    "requests": f"PYTHONPATH={SITE_PACKAGES} {PY} -c \"import os, requests; print(requests.get('https://{API_HOST}/client/requests', "
                f"headers={{'Authorization': 'Bearer ' + os.environ['{VAR}']}}, timeout=30).text)\"",
    "httpx": f"PYTHONPATH={SITE_PACKAGES} {PY} -c \"import os, httpx; print(httpx.get('https://{API_HOST}/client/httpx', "
             f"headers={{'Authorization': 'Bearer ' + os.environ['{VAR}']}}, timeout=30).text)\"",
    # Node 20's fetch ignores HTTPS_PROXY: only transparent capture takes it to the proxy.
    "node": "node -e \"fetch('https://" + API_HOST + "/client/node', {headers: {authorization: 'Bearer ' + "
            "process.env." + VAR + "}}).then(r => r.text()).then(t => console.log(t), e => { console.error(e); "
            "process.exit(1) })\"",
}
if shutil.which("gh"):
    # A GitHub Enterprise host: gh asks https://HOST/api/v3/... with GH_ENTERPRISE_TOKEN.
    CLIENTS["gh"] = (f'GH_HOST={API_HOST} GH_ENTERPRISE_TOKEN="${VAR}" gh api --hostname {API_HOST} '
                     "/client/gh")
GH_PATH = "/api/v3/client/gh"
GIT_CLONE = (f'git -c http.extraHeader="Authorization: Bearer ${VAR}" clone -q https://{API_HOST}/git/repo.git '
             "/tmp/clone && git -C /tmp/clone log --format=%s")


def run_sandboxed(world: TlsWorld, workspace: Path, secret: Secret, script: str, *options: str,
                  credential: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` in `sandboxd run --network` with the world's resolvers, GITHUB_TOKEN in the
    client's environment and, with ``credential``, named with --credential (else passed in clear
    with --pass-env: the control); other.test.example allowed (tunnelled)."""
    naming = ["--credential", CREDENTIAL] if credential else ["--pass-env", VAR, "--allow-domain", API_HOST]
    argv = [SANDBOXD, "run", "--workspace", str(workspace), "--network", "--dns", NAMES, *naming,
            "--allow-domain", OTHER_HOST, *options, "--", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input="",
                          env={**world.run_env(), VAR: secret.value})


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_client_reaches_the_upstream_with_the_secret_it_never_held(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                                     secret: Secret, client: str) -> None:
    done = run_sandboxed(tls_world, workspace, secret, CLIENTS[client] + f"; echo; echo ${VAR}")
    assert done.returncode == 0, describe(done)
    answer, phantom = done.stdout.strip().splitlines()[0], done.stdout.split()[-1]
    path = GH_PATH if client == "gh" else f"/client/{client}"
    assert answer == f"hello {path}", describe(done)
    assert phantom.startswith(PHANTOM_PREFIX) and secret.fragment not in done.stdout + done.stderr
    assert bearer_seen(tls_world, path) == [f"Bearer {secret.value}"]         # swapped at the proxy


def test_git_clones_over_https_with_the_secret_it_never_held(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                            secret: Secret) -> None:
    done = run_sandboxed(tls_world, workspace, secret, GIT_CLONE)
    assert done.returncode == 0, describe(done)
    assert done.stdout.split() == ["first"], describe(done)
    asked = [s for s in tls_world.api.seen if s.path.startswith("/git/repo.git/")]
    assert asked and {s.headers.get("authorization") for s in asked} == {f"Bearer {secret.value}"}, asked


# --------------------------------------------------------------------------- what the sandbox holds

# argv: the variable, the fragment, the echo URL, a CA file for the client ("" : the sandbox's own
# trust). Plants $VAR in /tmp/planted (the grep's control), starts a client that asks the echo URL
# with the variable as a bearer token and waits, then reads the client's memory and scans.
SCAN = textwrap.dedent(r'''
    import glob, json, os, re, ssl, subprocess, sys
    var, fragment, url, cafile = sys.argv[1:5]
    fragment_b = fragment.encode()
    out = {"var": os.environ.get(var, "")}
    with open("/tmp/planted", "w") as f:
        f.write(os.environ.get(var, "") + "\n")
    out["env"] = fragment in subprocess.run(["env"], capture_output=True, text=True).stdout
    environ = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if fragment_b in f.read():
                    environ.append(path)
        except OSError:
            pass
    out["environ"] = environ
    client = subprocess.Popen([sys.executable, "-c", """
    import os, ssl, sys, urllib.request
    context = ssl.create_default_context(cafile=sys.argv[3] or None)
    request = urllib.request.Request(sys.argv[2], headers={"Authorization": "Bearer " + os.environ[sys.argv[1]]})
    answer = urllib.request.urlopen(request, timeout=60, context=context).read()
    print(answer.decode(errors="replace").replace(chr(10), " | "), flush=True)
    sys.stdin.read()
    """, var, url, cafile], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out["echo"] = client.stdout.readline().strip()
    found = {"fragment": 0, "phantom": 0}
    phantom_b = os.environ.get(var, "").encode() or b"\0no-variable\0"
    with open(f"/proc/{client.pid}/maps") as maps, open(f"/proc/{client.pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]", "[vvar_vclock]")):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            found["fragment"] += data.count(fragment_b)
            found["phantom"] += data.count(phantom_b)
    out["memory"] = found
    client.stdin.close()
    client.wait(30)
    grep = subprocess.run(["timeout", "600", "grep", "-rlsF", "-D", "skip", "--exclude-dir=proc",
                           "--exclude-dir=sys", "--exclude-dir=dev", fragment, "/"],
                          capture_output=True, text=True)
    out["grep_status"] = grep.returncode
    out["files"] = grep.stdout.split()
    print(json.dumps(out))
''')


def scan(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, describe(done)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def scan_command(secret: Secret, url: str, cafile: str = "") -> str:
    return shlex.join([PY, "-c", SCAN, VAR, secret.fragment, url, cafile])


def test_the_sandbox_holds_only_the_phantom(tls_world: TlsWorld, workspace: Path, secret: Secret) -> None:  # noqa: F811
    seen = scan(run_sandboxed(tls_world, workspace, secret, scan_command(secret, tls_world.url("/echo-headers")),
                              timeout=900))
    assert str(seen["var"]).startswith(PHANTOM_PREFIX), seen
    assert seen["env"] is False and seen["environ"] == [], seen
    memory = seen["memory"]
    assert isinstance(memory, dict)
    assert memory["phantom"] > 0, seen                  # the scan reads the client's memory at all
    assert memory["fragment"] == 0, seen
    assert seen["grep_status"] != 124 and seen["files"] == [], seen   # the planted phantom holds no piece of it
    # The upstream echoed the secret it received; what reached the sandbox was scrubbed.
    assert bearer_seen(tls_world, "/echo-headers") == [f"Bearer {secret.value}"]
    assert "Authorization: " in str(seen["echo"]) and secret.fragment not in str(seen["echo"]), seen


def test_control_with_pass_env_the_same_scan_finds_the_secret(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                              secret: Secret) -> None:
    seen = scan(run_sandboxed(tls_world, workspace, secret,
                              scan_command(secret, tls_world.url("/echo-headers"), str(tls_world.ca_file)),
                              credential=False, timeout=900))
    assert seen["var"] == secret.value, seen
    assert seen["env"] is True and seen["environ"], seen
    memory = seen["memory"]
    assert isinstance(memory, dict) and memory["fragment"] > 0, seen
    assert seen["grep_status"] != 124 and seen["files"] == ["/tmp/planted"], seen      # grep: 2 for unreadable files
    assert secret.fragment in str(seen["echo"]), seen   # a tunnel: nothing scrubs what the upstream echoes


def test_the_phantom_sent_elsewhere_arrives_as_the_phantom(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                          secret: Secret) -> None:
    script = (f'curl -sS --fail --cacert {tls_world.ca_file} -H "Authorization: Bearer ${VAR}" '
              f"https://{OTHER_HOST}/elsewhere && echo && "
              f'curl -sS --fail -H "X-Other: ${VAR}" https://{API_HOST}/other-header && echo && echo ${VAR}')
    done = run_sandboxed(tls_world, workspace, secret, script)
    assert done.returncode == 0, describe(done)
    phantom = done.stdout.split()[-1]
    assert phantom.startswith(PHANTOM_PREFIX), describe(done)
    assert bearer_seen(tls_world, "/elsewhere", OTHER_HOST) == [f"Bearer {phantom}"]
    other_header = [s.headers.get("x-other") for s in tls_world.api.seen if s.path == "/other-header"]
    assert other_header == [phantom]


# --------------------------------------------------------------------------- endpoint rules, metadata


def test_an_endpoint_rule_allows_get_and_refuses_post(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                      secret: Secret) -> None:
    script = (f"for m in GET POST; do curl -sS -o /dev/null -w '%{{http_code}} ' -X $m "
              f"https://{API_HOST}/repos/a/issues/1; done; "
              f"curl -sS -X POST https://{API_HOST}/repos/a/issues/2; echo; "
              f"curl -sS -o /dev/null -w '%{{http_code}}' --path-as-is https://{API_HOST}/repos/%2e%2e/admin")
    done = run_sandboxed(tls_world, workspace, secret, script, "--allow-endpoint", f"{API_HOST}=GET:/repos/**")
    assert done.returncode == 0, describe(done)
    codes, ambiguous = done.stdout.split()[:2], done.stdout.split()[-1]
    assert codes == ["200", "403"], describe(done)
    assert f"is not among the endpoint rules for {API_HOST}" in done.stdout and "GET:/repos/**" in done.stdout, \
        describe(done)                                  # the 403's body names the host's rules
    assert ambiguous == "400", describe(done)
    methods = [(s.method, s.path) for s in tls_world.api.seen if s.path.startswith("/repos/")]
    assert methods == [("GET", "/repos/a/issues/1")], methods
    # Control: with POST in the rule the same request reaches the upstream.
    allowed = run_sandboxed(tls_world, workspace, secret, f"curl -sS --fail -X POST https://{API_HOST}/repos/a/b",
                            "--allow-endpoint", f"{API_HOST}=GET,POST:/repos/**")
    assert allowed.returncode == 0 and allowed.stdout.startswith("got 0 bytes"), describe(allowed)


def test_a_name_resolving_to_the_metadata_service_is_refused(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                             secret: Secret) -> None:
    import urllib.request

    # Control: the world's metadata service answers whoever reaches it.
    assert urllib.request.urlopen("http://169.254.169.254/", timeout=10).read() == b"hello from metadata"
    script = (f"curl -sS -o /dev/null -w '%{{http_code}}' http://{META_HOST}/latest/meta-data/; echo; "
              f"{PY} -c \"import socket; socket.create_connection(('169.254.169.254', 80), timeout=5)\" "
              "&& echo direct-open || echo direct-refused")
    done = run_sandboxed(tls_world, workspace, secret, script, "--allow-domain", META_HOST)
    lines = done.stdout.split()
    assert lines[0] != "200" and lines[-1] == "direct-refused", describe(done)
    assert "cloud metadata" in done.stderr, describe(done)
    # Intercepted (an endpoint rule for it) it is refused too, whatever the rules say.
    ruled = run_sandboxed(tls_world, workspace, secret, f"curl -sS https://{META_HOST}/", "--allow-domain", META_HOST,
                          "--allow-endpoint", f"{META_HOST}=GET:/**")
    assert ruled.returncode != 0 and "cloud metadata" in ruled.stderr, describe(ruled)


# --------------------------------------------------------------------------- streams

GATED_SSE = textwrap.dedent('''
    import json, os, sys, urllib.request
    base, var = sys.argv[1], sys.argv[2]
    headers = {"Authorization": "Bearer " + os.environ[var]}
    answer = urllib.request.urlopen(urllib.request.Request(base + "/sse-gated?count=4", headers=headers),
                                    timeout=120)
    events = []
    while len(events) < 4:
        line = answer.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line.decode().strip())
            if len(events) < 4:               # the next event is sent only after this ack
                urllib.request.urlopen(base + "/sse-ack", timeout=60).read()
    print(json.dumps(events))
''')
EVENTS = [f"data: event {n}" for n in range(4)]


def test_sse_passes_event_by_event_through_sandboxd_run(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                        secret: Secret) -> None:
    before = tls_world.api.gate_timeouts
    done = run_sandboxed(tls_world, workspace, secret,
                         shlex.join([PY, "-c", GATED_SSE, f"https://{API_HOST}", VAR]))
    assert done.returncode == 0, describe(done)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == EVENTS
    assert tls_world.api.gate_timeouts == before          # every event went out on an ack, none on a timeout
    assert bearer_seen(tls_world, "/sse-gated?count=4")[-1] == f"Bearer {secret.value}"


# --------------------------------------------------------------------------- daemon sessions


def sandboxctl(daemon: Daemon, *args: str, user: PlainUser | None = None, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`sandboxctl --socket ... ARGS` as root or as ``user`` (test_cli_approvals.AS_USER), with ``env``."""
    words = ["--socket", daemon.socket, *args]
    argv = [SANDBOXCTL, *words] if user is None else [PYTHON, "-c", AS_USER, str(user.uid), str(user.gid), *words]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input="",
                          env={**BASE_ENV, **(env or {})}, cwd="/")


@pytest.fixture
def daemon(sandboxd_daemon: DaemonFactory, tls_world: TlsWorld) -> Iterator[Daemon]:  # noqa: F811
    yield sandboxd_daemon(config=tls_world.daemon_config())


def create(daemon: Daemon, workspace: Path, secret: Secret | None, *options: str, user: PlainUser | None = None,
           credential: tuple[str, ...] = ("--credential", CREDENTIAL)) -> str:
    created = sandboxctl(daemon, "session", "create", str(workspace), "--approval", "never", "--network",
                         "--allow-domain", OTHER_HOST, *credential, *options, user=user,
                         env={VAR: secret.value} if secret else {})
    assert created.returncode == 0, describe(created)
    return created.stdout.strip()


def test_a_daemon_session_injects_the_credential_and_holds_only_the_phantom(
        tls_world: TlsWorld, sandboxd_daemon: DaemonFactory, daemon: Daemon, secret: Secret) -> None:  # noqa: F811
    session = create(daemon, sandboxd_daemon.workspace(), secret)
    for client, script in sorted(CLIENTS.items()):
        done = sandboxctl(daemon, "exec", session, "--", "sh", "-c", script)
        assert done.returncode == 0, f"{client}: {describe(done)}"
        path = GH_PATH if client == "gh" else f"/client/{client}"
        assert bearer_seen(tls_world, path)[-1] == f"Bearer {secret.value}", client
    cloned = sandboxctl(daemon, "exec", session, "--", "sh", "-c", GIT_CLONE)
    assert cloned.returncode == 0 and cloned.stdout.split() == ["first"], describe(cloned)
    seen = scan(sandboxctl(daemon, "exec", session, "--", "sh", "-c",
                           scan_command(secret, tls_world.url("/echo-headers")), timeout=900))
    assert str(seen["var"]).startswith(PHANTOM_PREFIX) and not seen["env"] and not seen["environ"], seen
    memory = seen["memory"]
    assert isinstance(memory, dict) and memory["phantom"] > 0 and memory["fragment"] == 0, seen
    assert seen["files"] == [] and seen["grep_status"] != 124, seen
    # SSE through the session's proxy, event by event.
    before = tls_world.api.gate_timeouts
    streamed = sandboxctl(daemon, "exec", session, "--", "sh", "-c",
                          shlex.join([PY, "-c", GATED_SSE, f"https://{API_HOST}", VAR]))
    assert streamed.returncode == 0, describe(streamed)
    assert json.loads(streamed.stdout.strip().splitlines()[-1]) == EVENTS
    assert tls_world.api.gate_timeouts == before
    # The audit log and the daemon's own log never hold the secret.
    events = sandboxctl(daemon, "events", "--session", session, "--json")
    assert events.returncode == 0 and secret.fragment not in events.stdout, describe(events)
    assert secret.fragment not in daemon.log_path.read_text(errors="replace")


def ca_of(bundle: str, host_bundle: str) -> str:
    """The certificates of ``bundle`` that ``host_bundle`` lacks (the session's CA), as PEM."""
    def certificates(text: str) -> list[str]:
        end = "-----END CERTIFICATE-----"
        begin = "-----BEGIN CERTIFICATE-----"
        return [part[part.index(begin):].strip() + "\n" + end + "\n" for part in text.split(end) if begin in part]
    host = set(certificates(host_bundle))
    return "".join(c for c in certificates(bundle) if c not in host)


def test_a_plain_user_cannot_use_another_users_credential_or_ca(tls_world: TlsWorld, sandboxd_daemon: DaemonFactory,  # noqa: F811
                                                                 daemon: Daemon, plain_users: Any, secret: Secret) -> None:
    from sandboxd.launcher.trust_bundle import host_bundle_path

    alice, mallory = plain_users(2)
    base = sandboxd_daemon.base
    alice_ws, mallory_ws = owned_dir(base / "ws-alice", alice), owned_dir(base / "ws-mallory", mallory)
    theirs = create(daemon, alice_ws, secret, user=alice)
    phantom = sandboxctl(daemon, "exec", theirs, "--", "printenv", VAR, user=alice).stdout.strip()
    assert phantom.startswith(PHANTOM_PREFIX)
    # Another user's session is not there for mallory.
    refused = sandboxctl(daemon, "exec", theirs, "--", "true", user=mallory)
    assert refused.returncode != 0 and ("NOT_FOUND" in refused.stderr or "PERMISSION_DENIED" in refused.stderr)
    # Alice's phantom sent from mallory's own intercepted session is only a phantom there.
    own = create(daemon, mallory_ws, None, "--allow-domain", API_HOST, "--allow-endpoint", f"{API_HOST}=GET:/**",
                 user=mallory, credential=())
    sent = sandboxctl(daemon, "exec", own, "--", "curl", "-sS", "--fail", "-H", f"Authorization: Bearer {phantom}",
                      f"https://{API_HOST}/stolen-phantom", user=mallory)
    assert sent.returncode == 0, describe(sent)
    assert bearer_seen(tls_world, "/stolen-phantom") == [f"Bearer {phantom}"]
    # Alice's session CA does not vouch for mallory's proxy (control: mallory's own bundle does).
    host_bundle = Path(host_bundle_path() or "/etc/ssl/certs/ca-certificates.crt").read_text()
    alice_bundle = sandboxctl(daemon, "exec", theirs, "--", "sh", "-c", 'cat "$SSL_CERT_FILE"', user=alice).stdout
    alice_ca = ca_of(alice_bundle, host_bundle + tls_world.ca.pem)      # network.upstream_ca_file's is in it too
    assert alice_ca.count("BEGIN CERTIFICATE") == 1, "alice's bundle adds exactly her session's CA"
    (mallory_ws / "alice-ca.pem").write_text(alice_ca)
    with_alice_ca = sandboxctl(daemon, "exec", own, "--", "curl", "-sS", "--cacert", str(mallory_ws / "alice-ca.pem"),
                               f"https://{API_HOST}/with-alice-ca", user=mallory)
    assert with_alice_ca.returncode == 60, describe(with_alice_ca)         # the peer's certificate does not verify
    with_own = sandboxctl(daemon, "exec", own, "--", "sh", "-c",
                          f'curl -sS --fail --cacert "$SSL_CERT_FILE" https://{API_HOST}/with-own-ca', user=mallory)
    assert with_own.returncode == 0, describe(with_own)


def test_a_daemon_secret_is_only_for_the_users_it_names(tls_world: TlsWorld, sandboxd_daemon: DaemonFactory,  # noqa: F811
                                                       plain_users: Any, secret: Secret) -> None:
    alice, mallory = plain_users(2)
    base = sandboxd_daemon.base
    secret_file = base / "github-token"
    secret_file.write_text(secret.value + "\n")
    secret_file.chmod(0o600)
    config = tls_world.daemon_config() + (f'\n[network.secrets.github]\nfile = "{secret_file}"\n'
                                          f'users = ["{alice.name}"]\nupstreams = ["https://{API_HOST}"]\n')
    daemon = sandboxd_daemon(config=config)
    alice_ws, mallory_ws = owned_dir(base / "ws-alice", alice), owned_dir(base / "ws-mallory", mallory)
    refused = sandboxctl(daemon, "session", "create", str(mallory_ws), "--network", "--credential", CREDENTIAL,
                         "--daemon-credential", f"{VAR}=github", user=mallory)
    assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, describe(refused)
    session = create(daemon, alice_ws, None, user=alice,
                     credential=("--credential", CREDENTIAL, "--daemon-credential", f"{VAR}=github"))
    used = sandboxctl(daemon, "exec", session, "--", "sh", "-c",
                      f'curl -sS --fail -H "Authorization: Bearer ${VAR}" https://{API_HOST}/daemon-secret', user=alice)
    assert used.returncode == 0, describe(used)
    assert bearer_seen(tls_world, "/daemon-secret") == [f"Bearer {secret.value}"]
