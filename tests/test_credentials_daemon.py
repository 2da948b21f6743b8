"""Credentials held by the daemon, injected at its egress proxy, and live network changes, end to
end through a real daemon and `sandboxctl` (issue 26 items 1, 6, 7; service/credential_vault.py,
service/sessions/network_live.py, cli/network_args.py).

The world is tests/tls_world.py: HTTPS upstreams on the stand-in internet with their own test CA,
given to the daemon as network.upstream_ca_file. A session's `--credential TOKEN=https://api...`
gets the real secret injected by the proxy while its sandbox holds only the phantom; the phantom
sent to another allowed host arrives as is. A live UpdateSessionPolicy changes what the running
proxy allows with no rebuild (the sandbox's init is the same process). The hostile pass's H1 (a
kept secret follows the whole credential; an admin cannot put its secret into another owner's
session) and H2 (a daemon secret only goes to its configured upstreams) and a plain user's walls.
The secret never shows in events, `session list` or an error.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BASE_ENV
from daemon_helpers import PYTHON, Daemon, DaemonFactory, PlainUser, daemon_factory, plain_users
from tls_world import API_HOST, OTHER_HOST, SECRET, TlsWorld, tls_world  # noqa: F401 (the fixture)

REPO = Path(__file__).resolve().parent.parent
SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
DAEMON_SECRET = b"dsk_DAEMONsecret0123456789abcdefXYZ"
WAIT = 120

# A plain user cannot run the venv's interpreter: start as root, import what sandboxctl loads
# lazily, drop to the user, then run sandboxctl's main (as tests/test_cli_approvals.py does).
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


@dataclass
class Place:
    factory: DaemonFactory
    daemon: Daemon
    world: TlsWorld
    alice: PlainUser
    bob: PlainUser
    config: str
    said: list[str]                     # everything sandboxctl printed, stdout and stderr: searched for secrets

    def ctl(self, *args: str, user: PlainUser | None = None, env: dict[str, str] | None = None,
            ok: bool = True) -> subprocess.CompletedProcess[str]:
        words = ["--socket", str(self.daemon.socket), *args]
        argv = [SANDBOXCTL, *words] if user is None else [PYTHON, "-c", AS_USER, str(user.uid), str(user.gid), *words]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT, env={**BASE_ENV, **(env or {})},
                              stdin=subprocess.DEVNULL, cwd="/")
        self.said += [done.stdout, done.stderr]
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def workspace(self, owner: PlainUser | None = None) -> Path:
        path = self.factory.workspace()
        if owner is not None:
            os.chown(path, owner.uid, owner.gid)
        return path

    def session(self, *flags: str, user: PlainUser | None = None, env: dict[str, str] | None = None) -> str:
        made = self.ctl("session", "create", str(self.workspace(user)), "--approval", "never", *flags,
                        user=user, env=env)
        return made.stdout.strip()

    def sh(self, session_id: str, script: str, user: PlainUser | None = None) -> str:
        return self.ctl("exec", session_id, "--", "sh", "-c", script, user=user, ok=False).stdout

    def shown(self, session_id: str) -> dict[str, object]:
        return dict(json.loads(self.ctl("session", "show", session_id, "--json").stdout))


def curl(url: str, *options: str) -> str:
    """A curl line for a sandbox's shell: prints the body, or curl's error."""
    return f"curl -sS --max-time 20 {' '.join(options)} {url} 2>&1; echo"


@pytest.fixture(scope="module")
def place(tls_world: TlsWorld) -> Iterator[Place]:  # noqa: F811 (the fixture)
    with plain_users(2) as (alice, bob), daemon_factory("sbxd-cred-") as factory:
        secret = factory.base / "secret-api"
        secret.write_bytes(DAEMON_SECRET + b"\n")
        os.chmod(secret, 0o600)
        config = (tls_world.daemon_config() +
                  f'[network.secrets.apikey]\nfile = "{secret}"\nusers = ["{alice.name}"]\n'
                  f'upstreams = ["https://{API_HOST}"]\n')
        daemon = factory(config=config)
        yield Place(factory, daemon, tls_world, alice, bob, config, [])


def headers_of(upstream: object, path: str) -> list[dict[str, str]]:
    return [seen.headers for seen in upstream.seen if seen.path == path]  # type: ignore[attr-defined]


def test_the_proxy_puts_the_secret_in_and_the_sandbox_holds_only_the_phantom(place: Place) -> None:
    session = place.session("--credential", f"TOKEN=https://{API_HOST}", "--allow-domain", OTHER_HOST,
                            env={"TOKEN": SECRET.decode()})
    out = place.sh(session, curl(place.world.url("/check"), '-H "Authorization: Bearer $TOKEN"') +
                   "; env; cat /proc/self/environ | tr '\\0' '\\n'")
    assert out.startswith("ok"), out                                  # the upstream got the real secret
    phantom = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("TOKEN="))
    assert phantom.startswith("sbxp_") and SECRET.decode() not in out, out
    assert headers_of(place.world.api, "/check")[-1]["authorization"] == f"Bearer {SECRET.decode()}"
    # The phantom to another allowed host (a tunnel: its certificate is the world's, hence -k) is
    # sent as it is: worthless there.
    out = place.sh(session, curl(place.world.url("/echo-headers", OTHER_HOST), "-k",
                                 '-H "Authorization: Bearer $TOKEN"'))
    assert headers_of(place.world.other, "/echo-headers")[-1]["authorization"] == f"Bearer {phantom}", out
    # The control: without the credential, the secret passed into the sandbox is there for any command.
    control = place.session("--allow-domain", API_HOST, "--env", "TOKEN", env={"TOKEN": SECRET.decode()})
    assert SECRET.decode() in place.sh(control, "env"), "the control leaks nothing: the check above proves nothing"
    states = place.shown(session)["credential_states"]
    assert states == [{"name": "TOKEN", "upstream": f"https://{API_HOST}:443", "source": "caller", "usable": True}]


def test_a_live_policy_change_applies_to_the_next_connection_without_a_rebuild(place: Place) -> None:
    session = place.session("--credential", f"TOKEN=https://{API_HOST}", "--allow-domain", OTHER_HOST,
                            env={"TOKEN": SECRET.decode()})
    inits = set(place.daemon.session_inits())
    before = place.shown(session)
    post = curl(place.world.url("/check"), "-X POST -d x", '-H "Authorization: Bearer $TOKEN"')
    other = curl(place.world.url("/", OTHER_HOST), "-k")
    assert place.sh(session, post).startswith("got 1 bytes"), "POST passes before the change"
    assert place.sh(session, other).startswith("hello"), "the other host is reachable before the change"
    place.ctl("session", "policy", session, "--allow-endpoint", f"{API_HOST}=GET:/check",
              "--allow-domain", API_HOST)
    refused = place.sh(session, post)
    assert "GET:/check" in refused and "403" in refused or "not among the endpoint rules" in refused, refused
    assert place.sh(session, curl(place.world.url("/check"), '-H "Authorization: Bearer $TOKEN"')).startswith("ok")
    gone = place.sh(session, other)
    assert "403" in gone and not gone.startswith("hello"), gone
    after = place.shown(session)
    assert after["sandbox_generation"] == before["sandbox_generation"] and set(place.daemon.session_inits()) == inits
    events = place.ctl("events", "--session", session, "--json").stdout.splitlines()
    changed = [json.loads(line)["data"] for line in events if "PolicyChanged" in line]
    assert changed and changed[-1]["live"] is True and changed[-1]["by"] == "caller", changed


def test_a_kept_secret_follows_the_whole_credential(place: Place) -> None:
    """H1: re-pointing TOKEN to another upstream (or header) without its secret is refused; the
    same spec keeps its secret."""
    session = place.session("--credential", f"TOKEN=https://{API_HOST}", "--allow-domain", OTHER_HOST,
                            env={"TOKEN": SECRET.decode()})
    for spec in (f"TOKEN=https://{OTHER_HOST}", f"TOKEN=https://{API_HOST};x-api-key: {{}}"):
        refused = place.ctl("session", "policy", session, "--credential", spec, ok=False)
        assert refused.returncode != 0 and "TOKEN" in refused.stderr, refused.stderr
    kept = place.ctl("session", "policy", session, "--credential", f"TOKEN=https://{API_HOST}",
                     "--allow-domain", OTHER_HOST, API_HOST)
    assert kept.returncode == 0
    assert place.sh(session, curl(place.world.url("/check"), '-H "Authorization: Bearer $TOKEN"')).startswith("ok")


def test_an_admin_cannot_put_its_secret_into_another_owners_session(place: Place) -> None:
    """H1: root may change alice's session, not give its credentials a secret of its own."""
    session = place.session("--credential", f"TOKEN=https://{API_HOST}", user=place.alice,
                            env={"TOKEN": "alices-token-0123"})
    refused = place.ctl("session", "policy", session, "--credential", f"TOKEN=https://{API_HOST}", ok=False,
                        env={"TOKEN": "roots-own-token-0123"})
    assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
    daemon = place.ctl("session", "policy", session, "--credential", f"TOKEN=https://{API_HOST}",
                       "--daemon-credential", "TOKEN=apikey", ok=False)
    assert daemon.returncode != 0 and "PERMISSION_DENIED" in daemon.stderr, daemon.stderr


def test_a_daemon_secret_goes_only_to_its_upstreams_and_users(place: Place) -> None:
    """H2 and the grant: alice may use `apikey` for api only; bob may not use it at all."""
    refused = place.ctl("session", "create", str(place.workspace(place.alice)), "--credential",
                        f"KEY=https://{OTHER_HOST}", "--daemon-credential", "KEY=apikey", user=place.alice, ok=False)
    assert refused.returncode != 0 and f"only for https://{API_HOST}:443" in refused.stderr, refused.stderr
    denied = place.ctl("session", "create", str(place.workspace(place.bob)), "--credential",
                       f"KEY=https://{API_HOST}", "--daemon-credential", "KEY=apikey", user=place.bob, ok=False)
    assert denied.returncode != 0 and "PERMISSION_DENIED" in denied.stderr, denied.stderr
    session = place.session("--credential", f"KEY=https://{API_HOST}", "--daemon-credential", "KEY=apikey",
                            user=place.alice)
    out = place.sh(session, curl(place.world.url("/echo-headers"), '-H "Authorization: Bearer $KEY"'),
                   user=place.alice)
    assert headers_of(place.world.api, "/echo-headers")[-1]["authorization"] == f"Bearer {DAEMON_SECRET.decode()}"
    assert DAEMON_SECRET.decode() not in out                         # the echo is scrubbed
    # bob neither sees alice's session nor changes it.
    for args in (("session", "show", session), ("session", "policy", session, "--allow-domain", OTHER_HOST),
                 ("exec", session, "--", "true")):
        other = place.ctl(*args, user=place.bob, ok=False)
        assert other.returncode != 0 and "NOT_FOUND" in other.stderr, (args, other.stderr)


def test_no_secret_in_events_listings_or_errors(place: Place) -> None:
    """Runs last in the module: everything sandboxctl printed above, and the whole audit log."""
    place.said.append(place.ctl("events", "--json").stdout)
    place.said.append(place.ctl("session", "list").stdout)
    place.said.append(place.ctl("session", "list", "--json").stdout)
    listed = place.said[-2]
    assert "TOKEN->https://api.test.example:443 (caller)" in listed, listed
    everything = "\n".join(place.said)
    assert SECRET.decode() not in everything.replace(f"TOKEN={SECRET.decode()}", "")   # the control's env only
    assert DAEMON_SECRET.decode() not in everything
