"""`sandboxctl shell` and `sandboxctl exec -t`: a command on a terminal inside the session.

The local terminal goes into raw mode once the command has started (not before: a call held
for approval still prints its notice on a normal terminal) and is restored on every way out
(the command's end, an error, the daemon gone, SIGTERM or SIGHUP to this process). Every key,
Ctrl-C included, is sent as typed: the terminal inside the session turns ^C into SIGINT for its
foreground command, as a local one would. SIGWINCH here becomes a resize there.
"""

from __future__ import annotations

import os
import signal
import termios
import tty
from collections.abc import Callable

from sandboxd.cli.exec_requests import ExecRequests
from sandboxd.client import SandboxClient, write_through
from sandboxd.v1 import sandboxd_pb2 as pb

# Runs the session's bash when it has one, else sh; both interactive, in the workspace.
SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -i; fi; exec sh -i"]
_TERM_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.+")


def require_terminal(what: str) -> None:
    """ValueError (one line, exit 2) unless stdin and stdout are a terminal."""
    if not (os.isatty(0) and os.isatty(1)):
        raise ValueError(f"{what} needs a terminal (stdin and stdout are not one); "
                         "without one, use `sandboxctl exec SESSION -- PROGRAM`")


def local_terminal() -> pb.Terminal:
    """The local terminal's size and TERM (left to the daemon's default when it is not a plain name)."""
    size = os.get_terminal_size(1)
    term = os.environ.get("TERM", "")
    if not term or len(term) > 64 or not set(term) <= _TERM_CHARACTERS:
        term = ""
    return pb.Terminal(rows=size.lines, columns=size.columns, term=term)


def run(client: SandboxClient, start: pb.ExecStart, on_started: Callable[[], None] = lambda: None) -> int:
    """Run ``start`` on a terminal sized like ours; returns the command's shell status.
    ``on_started``: the call was granted and runs (see ctl._exec)."""
    require_terminal("a terminal session")
    start.terminal.CopyFrom(local_terminal())
    requests = ExecRequests(start)

    def resized(_signum: int, _frame: object) -> None:
        size = os.get_terminal_size(1)
        requests.put(pb.ExecRequest(resize=pb.TerminalSize(rows=size.lines, columns=size.columns)))

    def ended(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)                    # unwinds through the restore below

    saved = termios.tcgetattr(0)
    handlers = {signum: signal.signal(signum, handler) for signum, handler in
                ((signal.SIGWINCH, resized), (signal.SIGTERM, ended), (signal.SIGHUP, ended))}
    status = 1
    try:
        for response in client.stub.Exec(iter(requests)):
            kind = response.WhichOneof("kind")
            if kind == "started_pid":
                on_started()                              # before raw mode: a prompt may still be restoring
                tty.setraw(0, termios.TCSANOW)
                requests.pump_stdin(0, close_at_eof=False)
                resized(signal.SIGWINCH, None)            # a resize while the call waited to start
            elif kind in ("stdout", "stderr"):
                write_through(1, getattr(response, kind))
            elif kind == "result":
                status = response.result.shell_status
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        for signum, previous in handlers.items():
            signal.signal(signum, previous)
        requests.close()
    return status


