"""systemd integration: the units verify, the daemon takes a socket handed over by socket
activation (LISTEN_FDS) and tells the service manager when it is ready (NOTIFY_SOCKET)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

from pathlib import Path

import pytest

from conftest import REPO, SANDBOXD
from daemon_helpers import DaemonFactory, socket_in
from sandboxd import config
from sandboxd.client import SandboxClient

pytestmark = pytest.mark.timeout(120)
UNITS = REPO / "packaging" / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_units_verify(tmp_path: Path) -> None:
    for name in ("sandboxd.socket", "sandboxd.service"):
        text = (UNITS / name).read_text()
        # The package installs /usr/bin/sandboxd; here the venv's stands in for it.
        (tmp_path / name).write_text(text.replace("/usr/bin/sandboxd", SANDBOXD))
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "sandboxd.socket"),
                             str(tmp_path / "sandboxd.service")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    service = (UNITS / "sandboxd.service").read_text()
    assert "Type=notify" in service and "Delegate=yes" in service and "KillSignal=SIGTERM" in service
    # SIGTERM drains: systemd must let the whole default drain run before it SIGKILLs.
    stop_timeout = float(next(line.split("=", 1)[1] for line in service.splitlines()
                              if line.startswith("TimeoutStopSec=")))
    assert stop_timeout > next(float(key.default) for key in config.KEYS  # type: ignore[arg-type]
                               if key.dotted == "drain.timeout_seconds")


def test_socket_activation_and_readiness(sandboxd_daemon: DaemonFactory) -> None:
    base = sandboxd_daemon.base                            # short: Unix socket paths are at most 107 bytes
    public = socket_in(base)
    public.parent.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(public))
    os.chmod(public, 0o666)
    listener.listen(16)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(base / "notify"))
    notify.settimeout(60)
    fd = listener.fileno()
    # What systemd does: the socket as descriptor 3, LISTEN_PID naming the daemon itself (the
    # wrapper execs it, so the pid stays), LISTEN_FDS=1.
    wrapper = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
               "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.argv[2], sys.argv[2:])")
    daemon = sandboxd_daemon.prepare(wrapper=[sys.executable, "-c", wrapper, str(fd)], pass_fds=(fd,),
                                     args=["--socket", "/nonexistent/ignored.sock"], socket=public,
                                     env={"NOTIFY_SOCKET": str(base / "notify")})
    try:
        daemon.start()
    finally:
        listener.close()                                   # the daemon holds it now, as from systemd
    try:
        try:
            ready = notify.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(daemon.log()) from None
        assert "READY=1" in ready and str(public) in ready, ready
        with SandboxClient(str(public)) as client:         # a call through the activated socket
            workspace = sandboxd_daemon.workspace()
            session = client.create_session(str(workspace), approval="never")
            assert client.exec(session.id, ["echo", "activated"]).stdout == b"activated\n"
            client.close_session(session.id)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in notify.recv(4096).decode()
        assert daemon.proc.wait(timeout=60) == 0, daemon.log()
        assert public.exists()                             # systemd's socket stays where systemd put it
    finally:
        notify.close()


def test_without_a_service_manager_nothing_is_sent(tmp_path: Path) -> None:
    from sandboxd.service import systemd

    saved = os.environ.pop("NOTIFY_SOCKET", None)
    try:
        assert systemd.notify("READY=1") is False
        assert systemd.activated_socket() is None
    finally:
        if saved is not None:
            os.environ["NOTIFY_SOCKET"] = saved

