"""cli.held_output: the command's output held back while `sandboxctl exec` shows a card in place
(hostile review r7b H1): passed through otherwise; kept in order across stdout and stderr while
held; written whole after; past the bound its writer waits (backpressure), nothing is dropped."""

from __future__ import annotations

import threading

from sandboxd.cli.held_output import HeldOutput


class Terminal:
    def __init__(self) -> None:
        self.written: list[tuple[int, bytes]] = []

    def __call__(self, stream: int, data: bytes) -> None:
        self.written.append((stream, data))


def test_output_passes_through_unless_a_card_is_up_then_comes_after_in_order() -> None:
    terminal = Terminal()
    output = HeldOutput(terminal)
    output.write(1, b"before")
    with output.holding():
        output.write(1, b"a")
        output.write(2, b"\x1b[8A\x1b[J")
        output.write(1, b"b")
        terminal(2, b"CARD")                              # the card, while held: nothing of the command's after it
        assert terminal.written == [(1, b"before"), (2, b"CARD")]
    output.write(1, b"after")
    assert terminal.written == [(1, b"before"), (2, b"CARD"), (1, b"a"), (2, b"\x1b[8A\x1b[J"), (1, b"b"),
                                (1, b"after")]


def test_past_the_bound_the_writer_waits_for_the_answer_and_nothing_is_dropped() -> None:
    terminal = Terminal()
    output = HeldOutput(terminal, limit=10)
    returned = threading.Event()

    def command() -> None:
        output.write(1, b"12345")
        output.write(1, b"6789012345")                      # over the bound: waits here
        returned.set()
        output.write(1, b"tail")

    with output.holding():
        writer = threading.Thread(target=command)
        writer.start()
        # It never returns while the card is up (the stream is not read: the daemon and the command wait).
        assert not returned.wait(1.0)
        assert terminal.written == []
    writer.join()
    assert b"".join(data for _, data in terminal.written) == b"123456789012345tail"


def test_a_release_without_a_hold_changes_nothing() -> None:
    terminal = Terminal()
    output = HeldOutput(terminal)
    output.release()
    output.write(2, b"x")
    assert terminal.written == [(2, b"x")]
