"""The Debian package: built from this tree, installed (apt-get install ./deb, as docs/operations.md
says) in a throw-away root (tests/throwaway_root.py: this machine's root with an overlay that goes
away), the installed daemon started there (as the unit would, minus systemd: this machine's PID 1
is not systemd) and asked for its health from the host, exporting its audit trail to a collector
with the otlp sink (the package carries the `otlp` extra), then the package purged, leaving nothing
behind in that root; and the host's own root is untouched throughout."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BASE_ENV, REPO
from conftest import eventually
from daemon_helpers import DaemonFactory
from otlp_collector import Collector
from throwaway_root import ThrowawayRoot, throwaway_root

pytestmark = pytest.mark.timeout(900)
INSTALLED = ("/usr/bin/sandboxd", "/usr/bin/sandboxctl", "/usr/lib/sandboxd", "/etc/sandboxd/sandboxd.toml",
             "/usr/share/doc/sandboxd", "/usr/share/python3/runtime.d/sandboxd.rtupdate")
# The CPython versions the wheelhouse serves (build.sh's SANDBOXD_DEB_PYTHONS default, the Depends' range).
PYTHONS = ("3.11", "3.12", "3.13", "3.14")
# The otlp extra's projects: audit.export.sink = "otlp" (the OpenTelemetry SDK, its OTLP/HTTP exporter).
OTLP_PROJECTS = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http", "opentelemetry-api", "requests")


def resolves_for(python: str) -> list[str]:
    """pip's arguments that resolve sandboxd[otlp] from the installed wheelhouse alone for CPython
    ``python`` on any manylinux glibc up to Debian 12's (what make-venv's pip --no-index does there)."""
    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(5, 37)]
    platforms += [f"manylinux{legacy}_{machine}" for legacy in ("2014", "2010", "1")]    # as build.sh: not implied
    return ["install", "--dry-run", "--target", f"/tmp/resolve-{python}", "--no-index", "--find-links",
            "/usr/lib/sandboxd/wheels", "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
            *[arg for name in platforms for arg in ("--platform", name)], "sandboxd[otlp]"]


def host_has_the_package() -> list[str]:
    """What of the package the host's own root has (nothing, before and after)."""
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "sandboxd"], capture_output=True, text=True).stdout
    found = [path for path in INSTALLED if os.path.lexists(path)]
    return (["dpkg: " + status] if "installed" in status else []) + found


def check_the_otlp_extra(root: ThrowawayRoot, venv: str, dist: Path, collector: Collector) -> Path:
    """The installed package has the otlp extra: the sink's SDK imports in the venv, the wheelhouse
    resolves sandboxd[otlp] for every Python the package supports (not only this machine's), the
    copyright file names the new wheels' licences, and `config check` accepts the otlp sink. Returns
    that configuration (exporting to ``collector``), written under /var/tmp (seen inside)."""
    sink = root.run([f"{venv}/bin/python", "-c", "from sandboxd.audit.export.sinks import OtlpSink; "
                     f"print(OtlpSink({collector.endpoint!r}).name)"])
    assert sink.stdout == "otlp\n", sink.stderr
    for version in PYTHONS:
        resolved = root.run([f"{venv}/bin/pip", *resolves_for(version)], timeout=120)
        assert resolved.returncode == 0 and "opentelemetry-sdk" in resolved.stdout, (version, resolved.stderr)
    copyright_ = root.run(["cat", "/usr/share/doc/sandboxd/copyright"]).stdout
    for project in OTLP_PROJECTS:
        named = [line for line in copyright_.splitlines() if line.strip().lower().startswith(project + ":")]
        assert named and "dist-info" not in named[0], (project, named)
    otlp = dist / "otlp.toml"
    otlp.write_text(f'[audit.export]\nsink = "otlp"\nendpoint = "{collector.endpoint}"\n')
    check = root.run(["/usr/bin/sandboxd", "config", "check", str(otlp)])
    assert check.returncode == 0, check.stderr
    return otlp


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="not a Debian system: dpkg-deb is missing")
def test_the_package_builds_installs_starts_and_goes(sandboxd_daemon: DaemonFactory) -> None:
    on_the_host = host_has_the_package()
    assert not on_the_host, f"a sandboxd package is installed on this machine already: {on_the_host}"
    dist = sandboxd_daemon.base / "dist"          # under /var/tmp: the throw-away root sees it too
    built = subprocess.run([str(REPO / "packaging" / "debian" / "build.sh"), str(dist)], capture_output=True,
                           text=True, timeout=900, env=BASE_ENV)
    assert built.returncode == 0, built.stderr[-3000:]
    deb = Path(built.stdout.strip().splitlines()[-1])
    contents = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True).stdout
    for path in ("./lib/systemd/system/sandboxd.service", "./lib/systemd/system/sandboxd.socket",
                 "./etc/sandboxd/sandboxd.toml", "./usr/lib/sandboxd/wheels/sandboxd-",
                 "./usr/share/doc/sandboxd/copyright", "./usr/share/doc/sandboxd/changelog.gz",
                 "./usr/lib/sandboxd/wheels/opentelemetry_sdk-",
                 "./usr/lib/sandboxd/wheels/opentelemetry_exporter_otlp_proto_http-"):
        assert path in contents, path
    # The collector is on the host: the throw-away root shares its network.
    with contextlib.closing(Collector()) as collector, throwaway_root() as root:
        env = {**BASE_ENV, "DEBIAN_FRONTEND": "noninteractive"}
        daemon = None
        try:
            # As docs/operations.md says (apt resolves the dependencies; here they are installed already).
            install = root.run(["apt-get", "install", "-y", str(deb)], timeout=600, env=env)
            assert install.returncode == 0, install.stdout + install.stderr
            # The venv of this version and this Python, which /usr/lib/sandboxd/venv names.
            venv = root.run(["readlink", "-f", "/usr/lib/sandboxd/venv"]).stdout.strip()
            python = "%d.%d" % sys.version_info[:2]
            assert venv.startswith("/usr/lib/sandboxd/venvs/") and venv.endswith(f"-py{python}"), venv
            assert root.run(["readlink", "-f", "/usr/bin/sandboxd"]).stdout.strip() == f"{venv}/bin/sandboxd"
            assert root.run(["/usr/bin/sandboxd", "version"]).stdout.startswith("sandboxd ")
            check = root.run(["/usr/bin/sandboxd", "config", "check", "/etc/sandboxd/sandboxd.toml"])
            assert check.returncode == 0, check.stderr
            # `sandboxd mcp` has its dependency (the MCP SDK) among the package's wheels.
            mcp = root.run([f"{venv}/bin/python", "-c", "import sandboxd.cli.mcp_transports"])
            assert mcp.returncode == 0, mcp.stderr
            otlp = check_the_otlp_extra(root, venv, dist, collector)
            # The installed wheel carries the native call helper.
            helper = root.run([f"{venv}/bin/python", "-c",
                               "from sandboxd.launcher.native_call import helper_path; print(helper_path())"])
            assert helper.stdout.strip().startswith(f"{venv}/") and helper.stdout.strip().endswith(
                "sandboxd-call"), helper
            assert host_has_the_package() == []                      # installed there, not here
            daemon = sandboxd_daemon(executable="/usr/bin/sandboxd", wrapper=root.wrapper(), config=otlp.read_text())
            status = root.run(["/usr/bin/sandboxctl", "--socket", daemon.socket, "status"], timeout=60)
            assert status.returncode == 0 and "health: SERVING" in status.stdout, status.stdout + status.stderr
            workspace = sandboxd_daemon.workspace()
            session = root.run(["/usr/bin/sandboxctl", "--socket", daemon.socket, "session", "create",
                                str(workspace), "--approval", "never"], timeout=60)
            ran = root.run(["/usr/bin/sandboxctl", "--socket", daemon.socket, "exec", session.stdout.strip(),
                            "--", "echo", "from the package"], timeout=60)
            assert ran.stdout == "from the package\n", ran.stderr
            # The installed daemon's audit trail reached the collector with the otlp sink.
            assert eventually(lambda: any("from the package" in body for body in collector.bodies), within=60), \
                collector.bodies[-3:]
        finally:
            if daemon is not None:
                daemon.close()                             # before the purge takes its executable away
        # The control for `config check`: without the exporter in the venv it refuses the otlp sink.
        root.run(["sh", "-c", f"rm -r {venv}/lib/python3*/site-packages/opentelemetry/exporter"])
        check = root.run(["/usr/bin/sandboxd", "config", "check", str(otlp)])
        assert check.returncode == 2 and "otlp extra" in check.stderr, (check.returncode, check.stderr)
        purge = root.run(["dpkg", "--purge", "sandboxd"], timeout=300)
        assert purge.returncode == 0, purge.stdout + purge.stderr
        left = root.run(["sh", "-c", "for p in \"$@\"; do [ -e \"$p\" ] && echo \"$p\"; done; true", "sh", *INSTALLED])
        assert left.stdout == "", left.stdout
    assert host_has_the_package() == []
