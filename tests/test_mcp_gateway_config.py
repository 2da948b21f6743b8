"""The gateway file (sandboxd/mcp/gateway/config.py): a good file becomes the GatewayConfig the
upstreams are built from; every bad one is a GatewayConfigError naming the file, the table and the
key, and saying what to fix (never another exception, never a default silently kept), also for
generated inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.errors import InvalidPolicy
from sandboxd.mcp.gateway.config import (MAX_ENV_TOTAL_BYTES, MAX_TOOL_OVERRIDES, MAX_UPSTREAMS, GatewayConfigError,
                                         ToolOverride, default_workspace, load, parse)
from sandboxd.policy.limits import MAX_ENV_NAME
from sandboxd.policy.spec import check_command

GOOD = """
[upstreams.files]
command = ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/srv/data"]
sandbox = "read-only"
workspace = "~/mcp/files"
network = false
trusted = true
timeout_seconds = 30
start = "first_use"

[upstreams.files.tools.write_file]
effect = "workspace-write"
risk = "medium"

[upstreams.github]
command = ["github-mcp-server", "stdio"]
writable_roots = ["~/out", "/var/tmp/./out/"]
allow_domains = ["api.github.com"]
credentials = ["GITHUB_TOKEN=https://api.github.com"]
env = { LOG_LEVEL = "debug" }
pass_env = ["LANG"]

[upstreams.github.tools.delete_repository]
effect = "destructive"

[upstreams.remote]
url = "https://mcp.example.com/mcp"
credentials = ["MCP_KEY=https://mcp.example.com;x-api-key: {}"]
"""


def test_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD)
    config = load(str(path))
    assert config.path == str(path)
    files, github, remote = config.upstreams
    assert remote.url == "https://mcp.example.com/mcp" and remote.command == ()
    assert files.name == "files" and files.command[0] == "npx" and files.url == ""
    assert files.sandbox == "read-only" and files.trusted and files.start == "first_use"
    assert files.workspace == os.path.expanduser("~/mcp/files") and files.writable_roots == ()
    assert files.timeout_seconds == 30.0 and isinstance(files.timeout_seconds, float)
    assert files.tools == {"write_file": ToolOverride(effect="workspace-write", risk="medium")}
    # What is not given takes the documented defaults.
    assert github.sandbox == "workspace-write" and not github.trusted and not github.network
    assert github.start == "gateway" and github.timeout_seconds == 120.0
    assert github.workspace == default_workspace("github")
    assert github.credentials == ("GITHUB_TOKEN=https://api.github.com",)
    assert github.writable_roots == (os.path.expanduser("~/out"), "/var/tmp/out")
    assert dict(github.env) == {"LOG_LEVEL": "debug"} and github.pass_env == ("LANG",)
    assert github.tools["delete_repository"] == ToolOverride(effect="destructive", risk=None)


def test_the_default_workspace_follows_xdg_state_home() -> None:
    assert default_workspace("fs", {"XDG_STATE_HOME": "/state"}) == "/state/sandboxd/gateway/fs"
    assert default_workspace("fs", {"XDG_STATE_HOME": "relative"}) == os.path.expanduser(
        "~/.local/state/sandboxd/gateway/fs")
    assert default_workspace("fs", {}) == os.path.expanduser("~/.local/state/sandboxd/gateway/fs")


BASE = '[upstreams.up]\ncommand = ["server"]\n'
BAD = [
    # (the file's text, what the message must hold: the table and key, and the fix)
    (BASE + "netwrok = true\n", "[upstreams.up] netwrok: is not a key of an upstream"),
    (BASE + "trusted = \"yes\"\n", "[upstreams.up] trusted: is a string: give true or false"),
    (BASE + "network = 1\n", "[upstreams.up] network: is an integer: give true or false"),
    (BASE + "sandbox = \"root\"\n", "[upstreams.up] sandbox: is 'root': give one of"),
    (BASE + "workspace = \"relative/dir\"\n", "[upstreams.up] workspace: 'relative/dir' is relative"),
    (BASE + "writable_roots = [\"out\"]\n", "[upstreams.up] writable_roots[0]: 'out' is relative"),
    (BASE + "writable_roots = \"/out\"\n", "[upstreams.up] writable_roots: is a string: give a list"),
    (BASE + "credentials = [\"TOKEN\"]\n", "[upstreams.up] credentials[0]: credential 'TOKEN': give VAR=https://"),
    (BASE + "credentials = [\"T=https://a.example\", \"T=https://b.example\"]\n", "T is named twice"),
    (BASE + "credentials = [\"T=https://a.example\"]\nenv = { T = \"x\" }\n", "[upstreams.up] env: T is a credential"),
    (BASE + "pass_env = [\"T\"]\n[upstreams.other]\ncommand = [\"b\"]\ncredentials = [\"T=https://a.example\"]\n",
     "[upstreams.up] pass_env: T is a credential's variable of [upstreams.other]"),
    (BASE + "env = { \"A=B\" = \"x\" }\n", "[upstreams.up] env: the variable name 'A=B' is not usable"),
    (BASE + "env = { A = \"x\\u0000y\" }\n", "[upstreams.up] env.A: holds a NUL character"),
    (BASE + "env = { A = 1 }\n", "[upstreams.up] env.A: is an integer: give a string"),
    (BASE + "pass_env = [\"\"]\n", "[upstreams.up] pass_env[0]: is empty"),
    (BASE + "sandbox = \"read-only\"\nnetwork = true\n", "[upstreams.up] network: a read-only sandbox has no network"),
    (BASE + "sandbox = \"read-only\"\nwritable_roots = [\"/var/tmp\"]\n", "[upstreams.up] writable_roots: a read-only"),
    (BASE + "sandbox = \"danger-full-access\"\nallow_domains = [\"example.org\"]\n",
     "[upstreams.up] allow_domains: is an option of sandbox = \"workspace-write\""),
    (BASE + "workspace = \"~\"\n", "[upstreams.up] workspace: " + os.path.expanduser("~") + " holds your home"),
    (BASE + "writable_roots = [\"/\"]\n", "[upstreams.up] writable_roots[0]: / holds your home"),
    (BASE + "timeout_seconds = 0\n", "[upstreams.up] timeout_seconds: is 0: give seconds above 0"),
    (BASE + "timeout_seconds = true\n", "[upstreams.up] timeout_seconds: is a boolean"),
    (BASE + "start = \"later\"\n", "[upstreams.up] start: is 'later': give one of 'gateway', 'first_use'"),
    (BASE + "[upstreams.up.tools.rm]\neffect = \"harmless\"\n", "[upstreams.up.tools.rm] effect: is 'harmless'"),
    (BASE + "[upstreams.up.tools.rm]\nrisk = \"none\"\n", "[upstreams.up.tools.rm] risk: is 'none': give one of"),
    (BASE + "[upstreams.up.tools.rm]\neffects = \"destructive\"\n", "[upstreams.up.tools.rm] effects: is not a key"),
    ('[upstreams.up]\nsandbox = "read-only"\n', "[upstreams.up]: give exactly one of command"),
    ('[upstreams.up]\ncommand = ["a"]\nurl = "https://mcp.example.com/mcp"\n', "give exactly one of command"),
    ('[upstreams.up]\ncommand = []\n', "[upstreams.up] command: is empty"),
    ('[upstreams.up]\ncommand = "server --stdio"\n', "[upstreams.up] command: is a string: give a list"),
    ('[upstreams.up]\nurl = "ftp://x"\n', "[upstreams.up] url: 'ftp://x' is not an http(s) URL"),
    ('[upstreams.up]\nurl = "https://me:pw@mcp.example.com/mcp"\n', "url: holds a user or password: give the "
                                                                    "secret as a credential"),
    ('[upstreams.Up]\ncommand = ["a"]\n', "[upstreams.Up]: the upstream's name must be"),
    ('[upstreams.my_server]\ncommand = ["a"]\n', "[upstreams.my_server]: the upstream's name must be"),
    ('[upstreams.' + "a" * 25 + ']\ncommand = ["a"]\n', "the upstream's name must be 1 to 24"),
    ("[server]\ncommand = [\"a\"]\n", "server: not a key of a gateway file"),
    ("", "no upstream: give at least one [upstreams.NAME] table"),
    ("[upstreams\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_a_bad_file_says_where_and_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(GatewayConfigError) as error:
        parse("/etc/gw.toml", text)
    assert str(error.value).startswith("/etc/gw.toml: ")
    assert message in str(error.value)


def test_the_limits() -> None:
    many = "".join(f'[upstreams.u{index}]\ncommand = ["a"]\n' for index in range(MAX_UPSTREAMS + 1))
    with pytest.raises(GatewayConfigError, match=f"{MAX_UPSTREAMS + 1} upstreams: at most {MAX_UPSTREAMS}"):
        parse("/gw.toml", many)
    parse("/gw.toml", "".join(f'[upstreams.u{index}]\ncommand = ["a"]\n' for index in range(MAX_UPSTREAMS)))
    overrides = "".join(f'[upstreams.up.tools.t{index}]\nrisk = "low"\n' for index in range(MAX_TOOL_OVERRIDES + 1))
    with pytest.raises(GatewayConfigError, match=f"at most {MAX_TOOL_OVERRIDES}"):
        parse("/gw.toml", BASE + overrides)


def test_the_servers_environment_fits_what_the_daemon_takes() -> None:
    """env (and the pass_env values set at start) past the daemon's bounds is a load error naming
    the upstream, not an Exec the daemon refuses at every restart (the control: it would)."""
    def with_env(count: int) -> str:
        variables = ", ".join(f'V{index} = "{"x" * 4000}"' for index in range(count))
        return f'[upstreams.big]\ncommand = ["server"]\nenv = {{ {variables} }}\n'

    fits = MAX_ENV_TOTAL_BYTES // 4010
    assert parse("/gw.toml", with_env(fits)).upstreams[0].env["V0"] == "x" * 4000
    with pytest.raises(GatewayConfigError, match=r"^/gw.toml: \[upstreams.big\] env: the server's variables .* take "
                                                 rf"\d+ bytes as NAME=value: at most {MAX_ENV_TOTAL_BYTES}"):
        parse("/gw.toml", with_env(fits + 1))
    # The control: past the daemon's own total, the daemon refuses the server's Exec (each restart).
    too_many = {f"V{index}": "x" * 4000 for index in range(40)}
    with pytest.raises(InvalidPolicy, match="env takes"):
        check_command(["server"], too_many)
    with pytest.raises(GatewayConfigError, match=r"\[upstreams.big\] env: "):
        parse("/gw.toml", with_env(40))
    # A pass_env value is read at start: a huge one is the same error, naming pass_env.
    passed = '[upstreams.big]\ncommand = ["server"]\npass_env = ["HUGE"]\n'
    assert parse("/gw.toml", passed, {"HUGE": "small"}).upstreams[0].pass_env == ("HUGE",)
    with pytest.raises(GatewayConfigError, match=r"\[upstreams.big\] pass_env: HUGE is 40000 bytes: the daemon takes"):
        parse("/gw.toml", passed, {"HUGE": "y" * 40000})
    long_name = "N" * (MAX_ENV_NAME + 1)
    with pytest.raises(GatewayConfigError, match=rf"env: the variable name .* is over {MAX_ENV_NAME} bytes"):
        parse("/gw.toml", f'[upstreams.big]\ncommand = ["server"]\nenv = {{ {long_name} = "v" }}\n')


def test_a_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(GatewayConfigError, match=r"missing\.toml: cannot read the gateway file \(No such file"):
        load(str(tmp_path / "missing.toml"))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[upstreams]")
    with pytest.raises(GatewayConfigError, match="not UTF-8"):
        load(str(binary))


def test_only_a_regular_file_of_yours_that_nobody_else_writes(tmp_path: Path) -> None:
    """As ssh takes its configuration: the file decides every upstream's walls."""
    path = tmp_path / "gateway.toml"
    path.write_text(BASE)
    path.chmod(0o644)
    assert load(str(path)).upstreams[0].name == "up"                      # the control
    path.chmod(0o664)
    with pytest.raises(GatewayConfigError, match=r"others may write it \(mode 664\): chmod go-w"):
        load(str(path))
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    with pytest.raises(GatewayConfigError, match="owned by uid 65534, not by you or root"):
        load(str(path))
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)                                   # nobody writes it: an open without O_NONBLOCK would hang
    with pytest.raises(GatewayConfigError, match="not a regular file"):
        load(str(fifo))
    with pytest.raises(GatewayConfigError, match="not a regular file"):
        load(str(tmp_path))


def test_a_name_in_a_message_is_printable() -> None:
    with pytest.raises(GatewayConfigError) as error:
        parse("/gw.toml", '[upstreams."evil\\u001b[2J"]\ncommand = ["a"]\n')
    assert "\x1b" not in str(error.value) and "[upstreams.evil" in str(error.value)


# Generated files: each key of an upstream with a value of any TOML type, and unknown keys. Whatever
# comes, the answer is a config or a GatewayConfigError naming the file; a key that is not one of
# the table's is always refused.
KEYS = ["command", "url", "sandbox", "workspace", "writable_roots", "network", "allow_domains", "credentials", "env",
        "pass_env", "trusted", "timeout_seconds", "start", "tools", "trustd", "networks", ""]
SCALARS = st.one_of(st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=20), st.sampled_from(["read-only", "gateway", "/abs", "~/x", "A=https://h.example",
                                                           "destructive", "low"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3),
                   st.dictionaries(st.text(max_size=5), st.one_of(SCALARS, st.dictionaries(
                       st.sampled_from(["effect", "risk", "x"]), SCALARS, max_size=2)), max_size=3))


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, int) or value == value else "0"
    if isinstance(value, str):
        return json.dumps(value)          # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{json.dumps(key)} = {toml_value(item)}" for key, item in value.items()) + "}"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
def test_generated_files_are_read_or_refused_with_a_message(name: str, fields: dict[str, object]) -> None:
    text = f"[upstreams.{json.dumps(name)}]\n" + "".join(f"{json.dumps(key)} = {toml_value(value)}\n"
                                                          for key, value in fields.items())
    try:
        config = parse("/gen.toml", text)
    except GatewayConfigError as error:
        assert str(error).startswith("/gen.toml: ")
        return
    [upstream] = config.upstreams
    assert not set(fields) - {"command", "url", "sandbox", "workspace", "writable_roots", "network", "allow_domains",
                              "credentials", "env", "pass_env", "trusted", "timeout_seconds", "start", "tools"}
    assert upstream.name == name and bool(upstream.command) != bool(upstream.url) and all(os.path.isabs(root) for root in upstream.writable_roots)
    assert os.path.isabs(upstream.workspace) and 0 < upstream.timeout_seconds
