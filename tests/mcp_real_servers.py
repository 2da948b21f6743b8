"""Real third-party MCP servers from the registries, pinned, installed where every user and every
sandbox can read them: the reference filesystem server (npm, packaging/mcp-gateway-servers/
package-lock.json, `npm ci` into that directory of the repository) and the git server (PyPI,
packaging/mcp-gateway-servers/git-requirements.txt with hashes, in a venv of its own under
/var/cache/sandboxd-test-mcp/: it brings its own `mcp` SDK, apart from sandboxd's).

Each install is made once per pin (the venv's directory is named by the requirements' hash, the
npm one is checked against the pinned version) under a lock, so concurrent test runs share it.
Nothing is under /root: a server runs as a plain user, inside a sandbox that hides homes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVERS = REPO / "packaging" / "mcp-gateway-servers"
GIT_REQUIREMENTS = SERVERS / "git-requirements.txt"
CACHE = Path("/var/cache/sandboxd-test-mcp")
SYSTEM_PYTHON = "/usr/bin/python3"     # readable by every user (the test venv's interpreter may live under /root)
FILESYSTEM_PACKAGE = "@modelcontextprotocol/server-filesystem"
INSTALL_TIMEOUT = 600


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o755)                      # whatever the umask: plain users run what is in it
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _readable_by_all(path: Path) -> None:
    """Every directory from / to ``path`` searchable by others: a plain user runs what is in it."""
    for part in [path, *path.parents]:
        assert part.stat().st_mode & 0o005 == 0o005, f"{part} is not readable by other users: servers run as plain users"


def filesystem_server() -> list[str]:
    """The command of the reference filesystem server (its allowed directories follow it)."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are installed by packaging/setup.sh test"
    pinned = json.loads((SERVERS / "package.json").read_text())["dependencies"][FILESYSTEM_PACKAGE]
    installed = SERVERS / "node_modules" / FILESYSTEM_PACKAGE
    with _locked(CACHE / "npm.lock"):
        try:
            current = json.loads((installed / "package.json").read_text())["version"]
        except OSError:
            current = None
        if current != pinned:
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=SERVERS, check=True,
                           timeout=INSTALL_TIMEOUT, env={**os.environ, "npm_config_umask": "022"})
    entry = installed / json.loads((installed / "package.json").read_text())["bin"]["mcp-server-filesystem"]
    _readable_by_all(entry)
    return [shutil.which("node") or "node", str(entry)]


def git_server_venv() -> Path:
    """The git server's venv, made from the pinned requirements (hashes required) on first use."""
    pin = hashlib.sha256(GIT_REQUIREMENTS.read_bytes()).hexdigest()[:16]
    venv = CACHE / f"git-{pin}"
    done = venv / ".installed"
    with _locked(CACHE / "git.lock"):
        if not done.exists():
            if venv.exists():
                shutil.rmtree(venv)                   # a half-made one (a run stopped while installing)
            old_umask = os.umask(0o022)
            try:
                subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT)
                subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                                "--require-hashes", "--no-deps", "--only-binary", ":all:", "-r", str(GIT_REQUIREMENTS)],
                               check=True, timeout=INSTALL_TIMEOUT)
            finally:
                os.umask(old_umask)
            done.write_text(pin + "\n")
    _readable_by_all(venv / "bin" / "mcp-server-git")
    return venv


def git_server(repository: str | os.PathLike[str] | None = None) -> list[str]:
    """The command of the git server (``--repository`` restricts it to that repository)."""
    command = [str(git_server_venv() / "bin" / "mcp-server-git")]
    return command + (["--repository", str(repository)] if repository is not None else [])


def gateway_file(upstreams: dict[str, dict[str, object]]) -> str:
    """The text of a gateway file (TOML) with one ``[upstreams.NAME]`` table per entry; a value
    that is a dict of dicts under "tools" becomes ``[upstreams.NAME.tools.TOOL]`` tables, "env"
    an inline table. Strings and lists are written as JSON, which TOML reads the same."""
    lines: list[str] = []
    for name, table in upstreams.items():
        lines.append(f"[upstreams.{name}]")
        tools = table.get("tools", {})
        for key, value in table.items():
            if key == "tools":
                continue
            if isinstance(value, dict):
                inner = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{{inner}}}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        assert isinstance(tools, dict)
        for tool, override in tools.items():
            lines.append(f"[upstreams.{name}.tools.{json.dumps(tool)}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in override.items()]
        lines.append("")
    return "\n".join(lines)
