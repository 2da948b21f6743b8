"""The Debian package: built from this tree, installed on this machine (apt-get install ./deb, as docs/operations.md says), the installed daemon
started (as the unit would, minus systemd: this machine's PID 1 is not systemd) and asked for
its health, then the package removed again, leaving nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess

from pathlib import Path

import pytest

from conftest import BASE_ENV, REPO
from daemon_helpers import DaemonFactory

pytestmark = pytest.mark.timeout(900)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="not a Debian system: dpkg-deb is missing")
def test_the_package_builds_installs_starts_and_goes(sandboxd_daemon: DaemonFactory, tmp_path: Path) -> None:
    already = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "sandboxd"], capture_output=True, text=True)
    assert "installed" not in already.stdout, "a sandboxd package is installed already: remove it first"
    built = subprocess.run([str(REPO / "packaging" / "debian" / "build.sh"), str(tmp_path)], capture_output=True,
                           text=True, timeout=900, env=BASE_ENV)
    assert built.returncode == 0, built.stderr[-3000:]
    deb = Path(built.stdout.strip().splitlines()[-1])
    contents = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True).stdout
    for path in ("./lib/systemd/system/sandboxd.service", "./lib/systemd/system/sandboxd.socket",
                 "./etc/sandboxd/sandboxd.toml", "./opt/sandboxd/wheels/sandboxd-"):
        assert path in contents, path
    daemon = None
    try:
        # As docs/operations.md says (apt resolves the dependencies; here they are installed already).
        install = subprocess.run(["apt-get", "install", "-y", str(deb)], capture_output=True,
                                 text=True, timeout=600, env={**BASE_ENV, "DEBIAN_FRONTEND": "noninteractive"})
        assert install.returncode == 0, install.stdout + install.stderr
        assert os.path.realpath("/usr/bin/sandboxd") == "/opt/sandboxd/venv/bin/sandboxd"
        assert subprocess.run(["/usr/bin/sandboxd", "version"], capture_output=True, text=True).stdout.startswith(
            "sandboxd ")
        check = subprocess.run(["/usr/bin/sandboxd", "config", "check", "/etc/sandboxd/sandboxd.toml"],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        # `sandboxd mcp` has its dependency (the MCP SDK) among the package's wheels.
        mcp = subprocess.run(["/opt/sandboxd/venv/bin/python", "-c", "import sandboxd.cli.mcp_transports"],
                             capture_output=True, text=True, cwd="/")
        assert mcp.returncode == 0, mcp.stderr
        # The installed wheel carries the native call helper.
        helper = subprocess.run(["/opt/sandboxd/venv/bin/python", "-c",
                                 "from sandboxd.launcher.native_call import helper_path; print(helper_path())"],
                                capture_output=True, text=True, cwd="/").stdout.strip()
        assert helper.startswith("/opt/sandboxd/venv/") and helper.endswith("sandboxd-call")
        daemon = sandboxd_daemon(executable="/usr/bin/sandboxd")
        socket_path = daemon.socket
        status = subprocess.run(["/usr/bin/sandboxctl", "--socket", socket_path, "status"], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "health: SERVING" in status.stdout, status.stdout + status.stderr
        workspace = sandboxd_daemon.workspace()
        session = subprocess.run(["/usr/bin/sandboxctl", "--socket", socket_path, "session", "create",
                                  str(workspace), "--approval", "never"], capture_output=True, text=True)
        ran = subprocess.run(["/usr/bin/sandboxctl", "--socket", socket_path, "exec", session.stdout.strip(),
                              "--", "echo", "from the package"], capture_output=True, text=True, timeout=60)
        assert ran.stdout == "from the package\n", ran.stderr
    finally:
        if daemon is not None:
            daemon.close()                                 # before the purge takes its executable away
        subprocess.run(["dpkg", "--purge", "sandboxd"], capture_output=True, timeout=300)
    assert not os.path.exists("/usr/bin/sandboxd") and not os.path.exists("/opt/sandboxd/venv")
    assert not os.path.exists("/etc/sandboxd/sandboxd.toml")

