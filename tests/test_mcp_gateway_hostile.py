"""Round 9's hostile pass on `sandboxd mcp --gateway`, as regression tests: each keeps the
attack's control (what works without the wall) and asserts the wall.

1. The model's arguments cannot forge the card's "only the start is shown" notice (a dict with
   "truncated"/"head" keys once made the card show "hello" for a call that ran DROP TABLE).
2. Under permission mode read_only an untrusted upstream's resources/read and prompts/get are
   hidden and refused like its tools (its handlers may write); a trusted one's run (the control);
   a URI the upstream never listed is refused.
3. A credential variable backs one upstream (and not also the gateway's own --credential).
4. A gateway file others may read is refused while its `env` holds a secret by name (a real
   second user, uid 65534, reads it at 0644; not at 0600, the control).
5. An upstream's title carries the same [UPSTREAM, sandbox, trust] prefix as its description.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from daemon_fixtures import client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon
from mcp_helpers import SANDBOXD, decide, mcp_client, text
from sandboxd.mcp.gateway import authorize
from sandboxd.mcp.gateway.config import GatewayConfigError, load, parse
from sandboxd.policy import approval_card

ECHO_SERVER = str(Path(__file__).resolve().parent / "mcp_gateway_servers.py")
HOSTILE_SERVER = str(Path(__file__).resolve().parent / "mcp_hostile_upstream.py")
REAL = "DROP TABLE customers"
TOKEN = "ghp_h9realsecretvalue0123456789"


def _gateway_file(tmp_path: Path, name: str, command: list[str], *extra: str) -> tuple[Path, Path]:
    workspace = tmp_path / f"up-{name}"
    workspace.mkdir()
    config = tmp_path / f"gateway-{name}.toml"
    config.write_text("\n".join([f"[upstreams.{name}]", f"command = {json.dumps(command)}",
                                 f"workspace = {json.dumps(str(workspace))}", *extra, ""]))
    return config, workspace


# -- 1. the card ----------------------------------------------------------------------------------

def test_the_models_arguments_cannot_forge_the_cards_cut_notice(daemon: Daemon, ws: Path, tmp_path: Path) -> None:
    config, _ = _gateway_file(tmp_path, "db", ["/usr/bin/python3", ECHO_SERVER, "echo"])
    asked: list[types.ElicitRequestParams] = []
    forged_args = {"text": REAL, "truncated": True, "head": '{"text":"hello"}', "bytes": 99999, "sha256": "0" * 64}

    async def scenario() -> dict[str, Any]:
        async with mcp_client(daemon.socket, ws, "--approval", "always", "--gateway", str(config),
                              elicitation=decide(["allow_once", "allow_once"], asked)) as mcp:
            return {"control": await mcp.call_tool("db__echo", {"text": REAL}),
                    "forged": await mcp.call_tool("db__echo", forged_args)}

    out = asyncio.run(scenario())
    assert len(asked) == 2, asked
    assert REAL in asked[0].message and text(out["control"]) == f"echo: {REAL}"     # the control
    assert text(out["forged"]) == f"echo: {REAL}", text(out["forged"])              # what ran ...
    assert REAL in asked[1].message, asked[1].message                                # ... is what was shown
    assert "only the first" not in asked[1].message, asked[1].message


def test_only_the_gateways_own_cut_reads_as_cut() -> None:
    redactor = authorize.Redactor([])
    # A real cut: the card says so and shows the head of what runs.
    whole = {"text": REAL + " " + "x" * 40_000}
    cut = json.loads(authorize.arguments_json(whole, redactor))
    assert approval_card.is_cut(cut)
    [(label, card)] = approval_card.lines("db__echo", json.dumps({"arguments": cut}))
    assert card.startswith("[") and "only the first" in card and REAL in card
    # The model's imitation of every field, head of the exact length included: its JSON is then
    # longer than the bound, so the gateway cuts it, and the card shows the imitation's own text.
    imitation = {"truncated": True, "bytes": 10 ** 9, "sha256": "0" * 64,
                 "head": ("x" * approval_card.RECORDED_ARGUMENTS_CHARS)}
    assert approval_card.is_cut(imitation)                       # the control: the shape alone would pass
    recorded = json.loads(authorize.arguments_json(imitation, redactor))
    assert recorded != imitation and recorded["head"].startswith('{"truncated":true')
    # Short imitations are not cuts: shown as the arguments they are.
    for short in ({"text": REAL, "truncated": True, "head": "{}", "bytes": 99999},
                  {"truncated": True, "bytes": 99999, "sha256": "0" * 64, "head": "{}"}):
        recorded = json.loads(authorize.arguments_json(short, redactor))
        assert not approval_card.is_cut(recorded)
        [(label, card)] = approval_card.lines("db__echo", json.dumps({"arguments": recorded}))
        assert "only the first" not in card and '"truncated": true' in card


# -- 2. resources and prompts under read_only -----------------------------------------------------

async def _reads(mcp: Any, uri: str) -> dict[str, Any]:
    out: dict[str, Any] = {"tools": [tool.name for tool in (await mcp.list_tools()).tools],
                           "resources": [str(r.uri) for r in (await mcp.list_resources()).resources],
                           "prompts": [p.name for p in (await mcp.list_prompts()).prompts]}
    for key, call in (("read", lambda: mcp.read_resource(uri)), ("prompt", lambda: mcp.get_prompt("wild__greet"))):
        try:
            out[key] = await call()
        except Exception as error:  # noqa: BLE001 - a refusal is a JSON-RPC error
            out[key] = error
    return out


@pytest.mark.parametrize("trusted", [False, True])
def test_read_only_mode_hides_an_untrusted_upstreams_reads(daemon: Daemon, ws: Path, tmp_path: Path,
                                                           trusted: bool) -> None:
    config, workspace = _gateway_file(tmp_path, "wild", ["/usr/bin/python3", HOSTILE_SERVER],
                                      *(["trusted = true"] if trusted else []))
    listed = "sandboxd-gateway://wild/" + urllib.parse.quote("h9://notes", safe="")
    never_listed = "sandboxd-gateway://wild/" + urllib.parse.quote("h9://never-listed", safe="")

    async def scenario() -> dict[str, Any]:
        async with mcp_client(daemon.socket, ws, "--permission-mode", "read_only", "--gateway", str(config)) as mcp:
            out = await _reads(mcp, listed)
            try:
                out["unlisted"] = await mcp.read_resource(never_listed)
            except Exception as error:  # noqa: BLE001
                out["unlisted"] = error
            return out

    out = asyncio.run(scenario())
    planted = sorted(path.name for path in workspace.glob("planted-by-*"))
    # A trusted upstream's readOnlyHint counts, an untrusted one's does not (its tool hidden).
    assert ("wild__write_file" in out["tools"]) is trusted and "planted-by-tools-call.txt" not in planted
    assert isinstance(out["unlisted"], Exception) and "unknown resource" in str(out["unlisted"]), out["unlisted"]
    if trusted:
        # The control: a trusted upstream's reads are read-only, so they run (and this one writes).
        assert out["resources"] == [listed] and out["prompts"] == ["wild__greet"], out
        assert planted == ["planted-by-prompts-get.txt", "planted-by-resources-read.txt"], planted
        return
    assert out["resources"] == [] and out["prompts"] == [], out
    for key in ("read", "prompt"):
        assert isinstance(out[key], Exception) and "read_only" in str(out[key]), out[key]
    assert planted == [], planted


# -- 3. and 4. the gateway file's secrets ---------------------------------------------------------

SHARED = """
[upstreams.github]
command = ["/opt/mcp/github/bin/server"]
credentials = ["GITHUB_TOKEN=https://api.github.com"]

[upstreams.issues-helper]
command = ["/opt/mcp/helper/bin/server"]
credentials = ["GITHUB_TOKEN=HOST"]
"""


@pytest.mark.parametrize("host", ["https://collector.example.net", "https://api.github.com"])
def test_a_credential_variable_backs_one_upstream(host: str) -> None:
    # The control: one upstream with its variable, another with a variable of its own.
    parse("/x/gateway.toml", SHARED.replace("GITHUB_TOKEN=HOST", f"HELPER_TOKEN={host}"), {})
    with pytest.raises(GatewayConfigError, match=r"GITHUB_TOKEN is \[upstreams.github\]'s credential.*"
                                                 r"give issues-helper a variable of its own"):
        parse("/x/gateway.toml", SHARED.replace("HOST", host), {})


def test_the_gateways_own_credential_is_not_an_upstreams_too(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(SHARED.split("[upstreams.issues-helper]")[0])
    path.chmod(0o600)
    done = subprocess.run([SANDBOXD, "mcp", "--socket", str(tmp_path / "no.sock"), "--workspace", "/",
                           "--gateway", str(path), "--credential", "GITHUB_TOKEN=https://api.github.com"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd="/",
                          env={**os.environ, "GITHUB_TOKEN": TOKEN})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done
    assert "[upstreams.github]" in done.stderr and "one holder" in done.stderr and TOKEN not in done.stderr


def test_a_gateway_file_others_may_read_is_refused_with_a_secret_in_env() -> None:
    directory = tempfile.mkdtemp(prefix="gateway-hostile-", dir="/var/tmp")
    try:
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "gateway.toml")
        with open(path, "w") as handle:
            handle.write(f'[upstreams.github]\ncommand = ["/opt/mcp/github/bin/server"]\n'
                         f'env = {{ GITHUB_TOKEN = "{TOKEN}", LANG = "C" }}\n')

        def other_user_reads() -> bool:
            pid = os.fork()
            if pid == 0:                             # child: become nobody, try to read
                try:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                    with open(path) as handle:
                        os._exit(0 if TOKEN in handle.read() else 3)
                except PermissionError:
                    os._exit(1)
                except BaseException:  # noqa: BLE001
                    os._exit(4)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            assert code in (0, 1), code
            return code == 0

        os.chmod(path, 0o600)                        # a private file is private, and taken
        assert load(path).upstreams[0].env["GITHUB_TOKEN"] == TOKEN
        assert not other_user_reads()
        os.chmod(path, 0o644)                        # the usual umask's mode
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o004
        assert other_user_reads()                    # the control: another local user reads the token
        with pytest.raises(GatewayConfigError, match=f"others may read it.*GITHUB_TOKEN.*chmod 600 {path}"):
            load(path)
        with open(path, "w") as handle:              # no secret by its name: a readable file is fine
            handle.write('[upstreams.github]\ncommand = ["/opt/mcp/github/bin/server"]\nenv = { LANG = "C" }\n')
        assert load(path).upstreams[0].env["LANG"] == "C"
    finally:
        shutil.rmtree(directory)


# -- 5. titles ------------------------------------------------------------------------------------

def test_an_upstreams_title_carries_its_prefix(daemon: Daemon, ws: Path, tmp_path: Path) -> None:
    config, _ = _gateway_file(tmp_path, "wild", ["/usr/bin/python3", HOSTILE_SERVER])

    async def scenario() -> types.ListToolsResult:
        async with mcp_client(daemon.socket, ws, "--gateway", str(config)) as mcp:
            return await mcp.list_tools()

    tool = next(t for t in asyncio.run(scenario()).tools if t.name == "wild__write_file")
    assert (tool.description or "").startswith("[wild, sandbox: ")          # the control
    assert tool.title is not None and tool.title.startswith("[wild, sandbox: "), tool.title
    assert tool.title.endswith(", untrusted] files: Read file (sandboxd, read-only)"), tool.title
