"""The gateway's documentation holds: docs/examples/gateway.toml, the file docs/mcp.md offers to
copy, is one the gateway loads (sandboxd.mcp.gateway.config.load, strict: an unknown key or a
wrong value is an error), and says what its comments say; and docs/mcp.md's reference tables name
exactly the keys the parser takes, so a key added to (or dropped from) the parser cannot go
undocumented. No daemon: the file is read as the gateway reads it at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO
from sandboxd.mcp.gateway import config
from sandboxd.policy.tools import Effect

EXAMPLE = REPO / "docs" / "examples" / "gateway.toml"
MCP_DOC = REPO / "docs" / "mcp.md"


@pytest.fixture()
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where an upstream without a workspace gets its private directory: a temporary one."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def test_the_example_loads_as_the_docs_describe_it(state_home: Path) -> None:
    loaded = config.load(str(EXAMPLE))
    upstreams = {upstream.name: upstream for upstream in loaded.upstreams}
    assert list(upstreams) == ["files", "git", "github"]
    files, git, github = upstreams["files"], upstreams["git"], upstreams["github"]
    # files: the project, trusted, no network; its reads and writes typed.
    assert files.workspace == "/home/me/src/project" and files.trusted and not files.network
    assert files.command[-1] == "/home/me/src/project" and files.sandbox == "workspace-write"
    assert files.tools["read_text_file"] == config.ToolOverride(effect=Effect.READ_ONLY, risk="low")
    assert files.tools["write_file"].effect == Effect.WORKSPACE_WRITE
    # git: started on first use, a longer timeout, plain settings only.
    assert (git.start, git.timeout_seconds, git.pass_env) == ("first_use", 300.0, ("LANG",))
    assert git.env["GIT_AUTHOR_NAME"] == "agent" and not git.trusted
    assert git.tools["git_reset"] == config.ToolOverride(effect=None, risk="high")
    # github: untrusted, the network, its token as a credential, its own private directory.
    assert not github.trusted and github.network and not github.env and not github.pass_env
    assert github.credentials == ("GITHUB_PERSONAL_ACCESS_TOKEN=https://api.github.com",)
    assert github.workspace == str(state_home / "sandboxd" / "gateway" / "github")
    assert github.start == "gateway" and github.timeout_seconds == config.DEFAULT_TIMEOUT_SECONDS
    assert github.tools["merge_pull_request"] == config.ToolOverride(effect=Effect.NETWORK, risk="high")
    assert github.tools["create_repository"].effect == Effect.DESTRUCTIVE
    assert github.tools["get_file_contents"].effect == Effect.READ_ONLY


def test_the_example_holds_no_secret() -> None:
    """The file is as readable as the home it sits in: a token belongs in `credentials`."""
    text = EXAMPLE.read_text()
    assert not re.search(r"gh[pousr]_[A-Za-z0-9]{20,}|github_pat_", text)
    env_lines = [line for line in text.splitlines() if line.startswith("env")]
    assert env_lines and not any(re.search(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", line, re.I) for line in env_lines)


def test_a_typo_in_the_example_is_refused_naming_it(tmp_path: Path, state_home: Path) -> None:
    """The control: the same load refuses the example with one key misspelt, naming file, table and key."""
    broken = tmp_path / "gateway.toml"
    broken.write_text(EXAMPLE.read_text().replace("trusted = true", "trustd = true", 1))
    with pytest.raises(config.GatewayConfigError) as refused:
        config.load(str(broken))
    message = str(refused.value)
    assert str(broken) in message and "[upstreams.files] trustd" in message, message


def _table_keys(doc: str, heading: str) -> set[str]:
    """The first column's `key`s of the first table after ``heading``."""
    after = doc.split(heading, 1)[1]
    table = re.search(r"^\| key \|.*?\n((?:\|.*\n)+)", after, re.M)
    assert table, f"no key table after {heading!r}"
    return set(re.findall(r"^\| `([a-z_]+)` \|", table.group(1), re.M))


def test_the_docs_tables_name_exactly_the_keys_the_parser_takes() -> None:
    doc = MCP_DOC.read_text()
    assert _table_keys(doc, "### The file") == set(config._KEYS) - {"tools"}
    assert _table_keys(doc, "And per tool, `[upstreams.NAME.tools.TOOL]`") == {"effect", "risk"}


def test_the_docs_state_the_parsers_bounds() -> None:
    doc = MCP_DOC.read_text().split("### The file", 1)[1]
    assert f"(at most {config.MAX_UPSTREAMS})" in doc
    assert f"(at most {config.MAX_TOOL_OVERRIDES} per upstream" in doc
    assert f"| `timeout_seconds` | `{config.DEFAULT_TIMEOUT_SECONDS:g}` |" in doc


def test_the_examples_commented_url_upstream_loads_too(tmp_path: Path, state_home: Path) -> None:
    """The alternative the example gives in comments (GitHub's remote server) is a file the gateway takes."""
    block = EXAMPLE.read_text().split("Use it in place of [upstreams.github] above:\n", 1)[1]
    text = "\n".join(line.removeprefix("#").strip() for line in block.splitlines() if line.startswith("#  "))
    remote = tmp_path / "remote.toml"
    remote.write_text(text + "\n")
    (github,) = config.load(str(remote)).upstreams
    assert (github.name, github.url, github.command) == ("github", "https://api.githubcopilot.com/mcp/", ())
    assert github.credentials == ("GITHUB_PERSONAL_ACCESS_TOKEN=https://api.githubcopilot.com",)
