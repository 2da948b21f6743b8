"""The daemon stops on SIGTERM/SIGINT however the signals land: a handler that took a lock
(it used Event.set) could deadlock the main thread when a signal arrived while it held that lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_burst_of_stop_signals_stops_the_daemon(signum: int) -> None:
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="sandboxd-signals-"))
    socket_path = base / "sandboxd.sock"
    daemon = subprocess.Popen([SANDBOXD, "serve", "--socket", str(socket_path), "--state-dir", str(socket_path.parent / "state")], stderr=subprocess.PIPE, text=True)
    try:
        assert daemon.stderr is not None and '"serving"' in daemon.stderr.readline()
        for _ in range(50):                               # many, fast: some land at the worst moment
            try:
                os.kill(daemon.pid, signum)
            except ProcessLookupError:
                break
            time.sleep(0.002)
        assert daemon.wait(timeout=30) == 0
        assert not socket_path.exists()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(base, ignore_errors=True)
