"""A blocked request becomes a question (issue 26 item 3), end to end: a real daemon, real
sandboxes, `sandboxctl`, and the stand-in internet of tests/tls_world.py (HTTPS api.test.example,
other.test.example; the older world's plain http://internet.test:8080).

A session with ``--unlisted ask`` (approval on-request; a standing rule lets its shell commands
run unasked, so the only held calls are the network's) asks about a connection to an unlisted
host and about a request no endpoint rule allows: a held call of tool ``network``, reason
``network_request``, showing host, port, method, path and the proposal, escaped. Allow once lets
that connection through and the next asks again; deny refuses it; allow for the session adds the
rule (PolicyChanged, by approval) and the next passes unasked. Under approval ``never`` nothing is
asked and the connection is refused. The cap of waiting questions and their timeout hold, and
another plain user cannot answer.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BASE_ENV
from sandboxd.cli.held_output import SOFT_RESET
from daemon_helpers import PYTHON, Daemon, DaemonFactory, PlainUser, daemon_factory, plain_users
from tls_world import API_HOST, OTHER_HOST, TlsWorld, tls_world  # noqa: F401 (the fixture)

REPO = Path(__file__).resolve().parent.parent
SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
WAIT = 120
CAP = 2                                 # quotas.network_questions_per_session
PLAIN_HOST, PLAIN_PORT = "internet.test", 8080

AS_USER = r"""
import os, sys
import grpc, grpc._channel, grpc._common, grpc._utilities, grpc._interceptor, grpc._runtime_protos
import google.protobuf.json_format
from sandboxd.cli import ctl, approval_prompt, env_args, network_args
ctl.build_parser().format_help()
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
sys.exit(ctl.main(sys.argv[3:]))
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a daemon with isolated networks needs root")


@dataclass
class Place:
    factory: DaemonFactory
    daemon: Daemon
    world: TlsWorld
    bob: PlainUser

    def ctl(self, *args: str, user: PlainUser | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
        words = ["--socket", str(self.daemon.socket), *args]
        argv = [SANDBOXCTL, *words] if user is None else [PYTHON, "-c", AS_USER, str(user.uid), str(user.gid), *words]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT, env=BASE_ENV,
                              stdin=subprocess.DEVNULL, cwd="/")
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def session(self, *flags: str, approval: str = "on-request") -> str:
        workspace = self.factory.workspace()
        made = self.ctl("session", "create", str(workspace), "--approval", approval, *flags).stdout.strip()
        # Its commands run unasked: the network's are the only held calls.
        self.ctl("rules", "add", str(workspace), "shell.exec")
        return made

    def start(self, session_id: str, script: str) -> subprocess.Popen[str]:
        return subprocess.Popen([SANDBOXCTL, "--socket", str(self.daemon.socket), "exec", session_id, "--",
                                 "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=BASE_ENV, stdin=subprocess.DEVNULL, cwd="/")

    def held(self, session_id: str, count: int = 1) -> list[dict[str, str]]:
        """The network questions held in the session, once there are ``count``."""
        deadline = time.monotonic() + WAIT
        while True:
            lines = self.ctl("approvals", "--session", session_id, "--json").stdout.splitlines()
            held = [json.loads(line) for line in lines if line.strip()]
            held = [entry for entry in held if entry.get("tool") == "network"]
            if len(held) >= count:
                return held
            assert time.monotonic() < deadline, f"no {count} network questions held in {session_id}"
            time.sleep(0.1)

    def events(self, session_id: str, kind: str) -> list[dict[str, object]]:
        lines = self.ctl("events", "--session", session_id, "--json", "--type", kind).stdout.splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def finished(process: subprocess.Popen[str], before: str = "") -> str:
    out, _ = process.communicate(timeout=WAIT)
    return before + out


def read_until(process: subprocess.Popen[str], text: str) -> str:
    """What ``process`` printed up to and including the line holding ``text`` (its exec polls for
    held calls, so a line it prints in place comes some time after the question is held)."""
    assert process.stdout is not None
    seen = ""
    deadline = time.monotonic() + WAIT
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} never printed: {seen!r}"
        line = process.stdout.readline()
        assert line, f"{text!r} never printed before the end: {seen!r}"
        seen += line
    return seen


def curl(url: str, *options: str) -> str:
    return f"curl -sS -k --max-time 60 {' '.join(options)} {url} 2>&1; echo"


@pytest.fixture(scope="module")
def place(tls_world: TlsWorld) -> Iterator[Place]:  # noqa: F811 (the fixture)
    with plain_users(1) as (bob,), daemon_factory("sbxd-ask-") as factory:
        # approvals.timeout_seconds is daemon_helpers' --approval-timeout (20 s).
        config = tls_world.daemon_config() + f"[quotas]\nnetwork_questions_per_session = {CAP}\n"
        yield Place(factory, factory(config=config), tls_world, bob)


def test_an_unlisted_host_is_asked_allowed_once_then_asked_again_and_refused(place: Place) -> None:
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask")
    run = place.start(session, curl(place.world.url("/once")) + "; " + curl(place.world.url("/twice")))
    first = place.held(session)[0]
    assert (first["reason"], first["proposal"]) == ("network_request", API_HOST), first
    assert f"CONNECT https://{API_HOST}:443" in first["summary"], first
    arguments = json.loads(first["arguments_json"])
    assert (arguments["host"], arguments["port"], arguments["method"], arguments["path"]) == (
        API_HOST, 443, "CONNECT", ""), arguments
    # The question carried the exec's context: sandboxctl exec says, in place, how to answer it.
    shown = read_until(run, f"waiting for approval (network_request): network: CONNECT https://{API_HOST}:443")
    place.ctl("approve", session, first["call_id"])
    second = place.held(session)[0]                                   # the next connection asks again
    assert second["call_id"] != first["call_id"]
    place.ctl("deny", session, second["call_id"])
    out = finished(run, shown)
    assert "hello /once" in out and "403" in out, out
    assert [seen.path for seen in place.world.api.seen if seen.path in ("/once", "/twice")] == ["/once"]
    denied = [event for event in place.events(session, "PermissionDenied") if event.get("tool") == "network"]
    assert any(event["data"]["by"] == "user" for event in denied), denied     # type: ignore[index]
    # Control: the listed host is never asked.
    out = place.ctl("exec", session, "--", "sh", "-c", curl(place.world.url("/listed", OTHER_HOST))).stdout
    assert "hello /listed" in out, out


def test_allow_for_the_session_adds_the_rule_and_the_next_connection_passes_unasked(place: Place) -> None:
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask")
    run = place.start(session, curl(place.world.url("/first")))
    held = place.held(session)[0]
    place.ctl("approve", session, held["call_id"], "--session-wide")
    assert "hello /first" in finished(run)
    shown = place.ctl("session", "show", session, "--json").stdout
    assert API_HOST in json.loads(shown)["sandbox_policy"]["allowed_domains"], shown
    changed = [event["data"] for event in place.events(session, "PolicyChanged")]
    assert any(data.get("by") == "approval" and data.get("live") for data in changed), changed  # type: ignore[union-attr]
    out = place.ctl("exec", session, "--", "sh", "-c", curl(place.world.url("/next"))).stdout
    assert "hello /next" in out, out                                  # no question: it would hold this exec


def test_a_path_with_escapes_is_shown_escaped_and_a_person_may_give_the_rule(place: Place) -> None:
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask")
    raw = (f"import os, socket; s = socket.create_connection(('127.0.0.1', 3128)); "
           f"s.sendall(b'GET http://{PLAIN_HOST}:{PLAIN_PORT}/a\\x1b[31mred HTTP/1.1\\r\\nHost: {PLAIN_HOST}\\r\\n\\r\\n'); "
           f"print(s.recv(4096).decode('latin-1').splitlines()[0])")
    run = place.start(session, f"python3 -c \"{raw}\"")
    held = place.held(session)[0]
    assert "\x1b" not in json.dumps(held, ensure_ascii=False) and "\x1b" not in held["arguments_json"]
    assert f"GET http://{PLAIN_HOST}:{PLAIN_PORT}/a" in held["summary"] and "[31mred" in held["summary"], held
    # A rule that does not cover the held request is refused, and the question stays.
    refused = place.ctl("approve", session, held["call_id"], "--session-wide", "--rule", "elsewhere.test", ok=False)
    assert refused.returncode != 0 and "does not cover" in refused.stderr, refused.stderr
    place.ctl("deny", session, held["call_id"])
    assert "403" in finished(run)                                     # python printed the status line


def test_an_endpoint_miss_on_an_allowed_host_is_an_endpoint_question(place: Place) -> None:
    session = place.session("--allow-domain", PLAIN_HOST, "--allow-endpoint", f"{PLAIN_HOST}=GET:/allowed/**",
                            "--unlisted", "ask")
    url = f"http://{PLAIN_HOST}:{PLAIN_PORT}"
    run = place.start(session, curl(f"{url}/other/12") + "; " + curl(f"{url}/other/13"))
    held = place.held(session)[0]
    assert held["proposal"] == f"{PLAIN_HOST}=GET:/other/*", held
    arguments = json.loads(held["arguments_json"])
    assert (arguments["proposal_kind"], arguments["method"], arguments["path"]) == ("endpoint", "GET", "/other/12")
    place.ctl("approve", session, held["call_id"])
    again = place.held(session)[0]
    assert json.loads(again["arguments_json"])["path"] == "/other/13"
    place.ctl("deny", session, again["call_id"])
    out = finished(run)
    assert "hello from internet" in out and "GET /other/13 is not among the endpoint rules" in out, out
    assert "sandboxd: refused when asked" in out, out


def test_under_approval_never_nothing_is_asked_and_it_is_refused(place: Place) -> None:
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask", approval="never")
    out = place.ctl("exec", session, "--", "sh", "-c", curl(place.world.url("/never"))).stdout
    assert "403" in out, out
    assert place.ctl("approvals", "--session", session, "--json").stdout.strip() == ""
    denied = [event["data"] for event in place.events(session, "PermissionDenied") if event.get("tool") == "network"]
    assert any("approval policy never" in str(data) for data in denied), denied


def test_the_cap_and_the_timeout_hold_and_another_user_cannot_answer(place: Place) -> None:
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask")
    url = f"http://{PLAIN_HOST}:{PLAIN_PORT}"
    runs = [place.start(session, curl(f"{url}/q{n}")) for n in range(CAP)]
    held = place.held(session, CAP)
    over = place.ctl("exec", session, "--", "sh", "-c", curl(f"{url}/q-over", "-i")).stdout
    assert "403" in over and "quotas.network_questions_per_session" in over, over
    # Bob may not answer a question of root's session.
    stolen = place.ctl("approve", session, held[0]["call_id"], user=place.bob, ok=False)
    assert stolen.returncode != 0, stolen.stdout
    assert len(place.held(session, CAP)) == CAP
    # Nobody answers: each is denied after approvals.timeout_seconds.
    for run in runs:
        out = finished(run)
        assert "refused: no answer within" in out and "approvals.timeout_seconds" in out, out
    timeouts = [event["data"] for event in place.events(session, "PermissionDenied")
                if event.get("tool") == "network" and event["data"].get("by") == "timeout"]  # type: ignore[union-attr]
    assert len(timeouts) == CAP, timeouts


# A client that opens one tunnel to HOST through the proxy, GETs /m5-first on it, waits for the
# file "go", then POSTs /m5-after-rule on the same tunnel: "closed" when the proxy has cut it.
ONE_TUNNEL = r'''
import os, socket, ssl, time
HOST = "%(host)s"
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(("CONNECT %%s:443 HTTP/1.1\r\nHost: %%s:443\r\n\r\n" %% (HOST, HOST)).encode())
r = b""
while b"\r\n\r\n" not in r:
    c = s.recv(1)
    if not c: break
    r += c
print("CONNECT", r.split(b"\r\n")[0].decode(), flush=True)
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
t = ctx.wrap_socket(s, server_hostname=HOST)
def req(method, path):
    t.sendall(("%%s %%s HTTP/1.1\r\nHost: %%s\r\nContent-Length: 0\r\n\r\n" %% (method, path, HOST)).encode())
    data = b""
    while b"\r\n\r\n" not in data:
        c = t.recv(4096)
        if not c: return "closed"
        data += c
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length": length = int(v)
    while len(body) < length:
        c = t.recv(4096)
        if not c: break
        body += c
    return head.split(b"\r\n")[0].decode()
print("FIRST", req("GET", "/m5-first"), flush=True)
while not os.path.exists("go"): time.sleep(0.2)
try:
    print("SECOND", req("POST", "/m5-after-rule"), flush=True)
except Exception as exc:
    print("SECOND failed", type(exc).__name__, flush=True)
'''


def test_a_tunnel_allowed_once_is_cut_when_its_host_gains_endpoint_rules(place: Place) -> None:
    """Hostile r7b M5: the person's allow-once spares the tunnel only the allowlist cut; once the
    owner gives the host endpoint rules its requests must be read, so the unread tunnel is cut."""
    import base64

    workspace = place.factory.workspace()
    session = place.ctl("session", "create", str(workspace), "--approval", "on-request", "--allow-domain", OTHER_HOST,
                        "--unlisted", "ask").stdout.strip()
    place.ctl("rules", "add", str(workspace), "shell.exec")
    code = base64.b64encode((ONE_TUNNEL % {"host": API_HOST}).encode()).decode()
    run = place.start(session, f"cd {workspace}; python3 -c \"import base64; exec(base64.b64decode('{code}'))\"")
    place.ctl("approve", session, place.held(session)[0]["call_id"])         # allow once: this connection
    assert run.stdout is not None
    lines: list[str] = []
    while not any(line.startswith("FIRST") for line in lines):
        line = run.stdout.readline()
        assert line, lines
        lines.append(line)
    assert "FIRST HTTP/1.1 200" in "".join(lines), lines
    place.ctl("session", "policy", session, "--allow-domain", OTHER_HOST, "--allow-domain", API_HOST,
              "--allow-endpoint", f"{API_HOST}=GET:/m5-first", "--unlisted", "refuse")
    (workspace / "go").write_text("")
    out = "".join(lines) + finished(run)
    assert "SECOND closed" in out or "SECOND failed" in out, out
    assert ("POST", "/m5-after-rule") not in [(s.method, s.path) for s in place.world.api.seen], out
    # Control: the rule is in force for a new connection (403).
    control = place.ctl("exec", session, "--", "sh", "-c",
                        curl(f"https://{API_HOST}/m5-control", "-X POST -o /dev/null -w '%{http_code}'")).stdout
    assert "403" in control, control


def _read_until(master: int, screen: bytearray, needle: bytes) -> None:
    """Add the pty's output to ``screen`` until ``needle`` is in it (or the pty ends)."""
    deadline = time.monotonic() + WAIT
    with selectors.DefaultSelector() as selector:
        selector.register(master, selectors.EVENT_READ)
        while needle not in screen:
            assert time.monotonic() < deadline, (needle, bytes(screen))
            if not selector.select(0.2):
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:                               # EIO: every writer closed the pty
                chunk = b""
            assert chunk, (needle, bytes(screen))
            screen += chunk


def test_in_place_the_command_cannot_draw_over_the_card(place: Place) -> None:
    """Hostile review r7b H1: `sandboxctl exec` (no -t) asks a network question on the terminal the
    running command writes to. The command erases the card and draws one naming another host; before,
    the person read the forgery and `s` allowed the hidden host. Now nothing of the command's reaches
    the terminal from the card until the answer, and the card comes after a soft reset."""
    session = place.session("--allow-domain", OTHER_HOST, "--unlisted", "ask")
    workspace = Path(json.loads(place.ctl("session", "show", session, "--json").stdout)["workspace"])
    forged = "FORGED-CARD network: CONNECT https://other.test.example:443"
    # The card is up once the test creates `go`; then the command prints (up 8 lines, erase to the end,
    # a forged card) and says so by a request to the allowed host.
    script = (f"cd {workspace}; curl -sS -k --max-time 60 {place.world.url('/h1')} >/dev/null 2>&1 & "
              "while [ ! -e go ]; do sleep 0.1; done; "
              f"printf '\\033[31mred \\033]0;\\033[8A\\033[J\\nsandboxctl: approval needed\\n  command: {forged}\\n"
              "  [y] once  [s] session  [n] deny ? '; "
              f"curl -sS -k --max-time 60 {place.world.url('/h1-printed', OTHER_HOST)} >/dev/null 2>&1; wait; "
              "echo; echo h1-done")
    master, slave = os.openpty()
    run = subprocess.Popen([SANDBOXCTL, "--socket", str(place.daemon.socket), "exec", session, "--", "sh", "-c",
                            script], stdin=slave, stdout=slave, stderr=slave, env={**BASE_ENV, "TERM": "xterm"},
                           cwd="/", start_new_session=True)
    os.close(slave)
    screen = bytearray()
    try:
        _read_until(master, screen, b"[n] deny ? ")
        (workspace / "go").touch()
        deadline = time.monotonic() + WAIT
        while not any(seen.path == "/h1-printed" for seen in place.world.other.seen):
            assert time.monotonic() < deadline, "the command never printed its forgery"
            time.sleep(0.1)
        # What the person reads when pressing the key: the real card, last; the forgery has not come.
        card = screen.rfind(b"sandboxctl: approval needed")
        assert screen.endswith(b"  [y] once  [s] session  [n] deny ? "), bytes(screen)
        assert f"CONNECT https://{API_HOST}:443".encode() in screen[card:], bytes(screen)
        assert forged.encode() not in screen, bytes(screen)
        assert screen[:card].endswith((SOFT_RESET + "\r\n").encode()), bytes(screen[-200:])   # the pty's ONLCR
        os.write(master, b"s")
        _read_until(master, screen, b"h1-done")
        run.wait(timeout=WAIT)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=WAIT)
        os.close(master)
    # The command's output came after the answer, whole and in order.
    answered = screen.find(b"allowed for this session\r\n", card)
    assert 0 < answered < screen.find(b"\x1b[31mred \x1b]0;\x1b[8A\x1b[J"), bytes(screen[card:])
    assert screen.find(forged.encode()) < screen.find(b"h1-done"), bytes(screen[card:])
    assert run.returncode == 0, bytes(screen)
    # What `s` allowed is the host the card showed.
    assert API_HOST in json.loads(place.ctl("session", "show", session, "--json").stdout)["sandbox_policy"][
        "allowed_domains"]
