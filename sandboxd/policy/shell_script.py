"""A ``sh -c`` script read as a list of plain commands, or not at all.

The classifier looks into a script only when it is plain commands of plain words joined by
``&&``, ``||``, ``;`` or ``|`` (then each command is classified, and the script is as safe as
its least safe part). A word is letters, digits and ``_-./,:=+@%``, single-quoted text, or
double-quoted text without ``$``, a backquote, a backslash or ``!``. Anything else the shell would
read as more than words (``$`` and backquotes, redirections, globs, ``~``, braces, ``#``, ``&``,
newlines, escapes) makes the script unknown: it could run or write what no word shows.
A command whose first word holds ``=`` (an assignment such as ``LD_PRELOAD=x ls``, quoted or
not) is refused too.
"""

from __future__ import annotations

from sandboxd._record import Record

WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./,:=+@%")
OPERATORS = ("&&", "||", ";", "|")
BLANKS = " \t"
DOUBLE_QUOTED_SPECIAL = frozenset("$`\\!")


class Command(Record):
    argv: tuple[str, ...]
    joined_by: str            # the operator before it ("" for the first)


def split(script: str) -> list[Command] | None:
    """The script's commands, in order; None when it is more than plain commands."""
    commands: list[Command] = []
    argv: list[str] = []
    word: list[str] | None = None          # None: between words
    joined_by = ""
    index = 0
    while index < len(script):
        char = script[index]
        if char in BLANKS:
            if word is not None:
                argv.append("".join(word))
                word = None
            index += 1
        elif char == "'" or char == '"':
            end = script.find(char, index + 1)
            if end < 0:
                return None
            inner = script[index + 1:end]
            if char == '"' and any(special in DOUBLE_QUOTED_SPECIAL for special in inner):
                return None
            word = (word or []) + [inner]
            index = end + 1
        elif char in WORD_CHARS:
            word = (word or []) + [char]
            index += 1
        else:
            operator = next((op for op in OPERATORS if script.startswith(op, index)), None)
            if operator is None or script.startswith(("|&", ";;"), index):
                return None
            if word is not None:
                argv.append("".join(word))
                word = None
            if not argv:
                return None                          # an operator with no command before it
            commands.append(Command(tuple(argv), joined_by))
            argv, joined_by = [], operator
            index += len(operator)
    if word is not None:
        argv.append("".join(word))
    if not argv:
        return None                                  # empty, or ends with an operator
    commands.append(Command(tuple(argv), joined_by))
    if any("=" in command.argv[0] for command in commands):
        return None
    return commands
