"""The daemon stops on SIGTERM/SIGINT however the signals land: a handler that took a lock
(it used Event.set) could deadlock the main thread when a signal arrived while it held that lock.
Ctrl-C on the terminal `packaging/setup.sh serve` runs in stops it cleanly, as a person sees it."""

from __future__ import annotations

import os
import pty
import signal
import time
from pathlib import Path

import pytest

from conftest import PY, REPO, SLOW
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


# Runs the rest of its arguments with the terminal argv[1] as its controlling terminal and stdin,
# as a shell in a terminal window does (stdout and stderr stay where they were: the daemon's log).
ON_A_TERMINAL = ("import os, sys\n"
                 "os.setsid()\n"
                 "os.dup2(os.open(sys.argv[1], os.O_RDWR), 0)\n"   # a session leader's first terminal: its own
                 "os.execvp(sys.argv[2], sys.argv[2:])\n")


def test_ctrl_c_on_setup_sh_serve_stops_it_cleanly(sandboxd_daemon: DaemonFactory) -> None:
    """`packaging/setup.sh serve` in a terminal, then Ctrl-C: the terminal sends SIGINT to its whole
    foreground group. The daemon stops in order (sessions, then the fork server) and exits 0, and
    nothing prints a traceback: the fork server, which got the SIGINT too and died of it mid-loop
    with a KeyboardInterrupt traceback, runs in a session of its own."""
    master, slave = pty.openpty()
    try:
        daemon = sandboxd_daemon(executable=str(REPO / "packaging" / "setup.sh"), wrapper=[PY, "-c", ON_A_TERMINAL,
                                 os.ttyname(slave)], env={"SANDBOXD_BIN_DIR": str(sandboxd_daemon.base / "bin")},
                                 within=180 * SLOW)
        assert daemon.proc is not None
        assert os.tcgetpgrp(master) == os.getpgid(daemon.pid)         # the daemon is the terminal's foreground
        os.write(master, b"\x03")                                      # Ctrl-C
        assert daemon.proc.wait(timeout=60) == 0, daemon.log()
    finally:
        os.close(master)
        os.close(slave)
    log = daemon.log()
    assert "stopped" in log and "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert not Path(daemon.socket).exists()
