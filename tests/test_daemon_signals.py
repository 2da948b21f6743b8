"""The daemon stops on SIGTERM/SIGINT however the signals land: a handler that took a lock
(it used Event.set) could deadlock the main thread when a signal arrived while it held that lock."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from daemon_helpers import DaemonFactory


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_burst_of_stop_signals_stops_the_daemon(sandboxd_daemon: DaemonFactory, signum: int) -> None:
    daemon = sandboxd_daemon()
    assert daemon.proc is not None
    for _ in range(50):                               # many, fast: some land at the worst moment
        try:
            os.kill(daemon.pid, signum)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    assert daemon.proc.wait(timeout=30) == 0
    assert not Path(daemon.socket).exists()
