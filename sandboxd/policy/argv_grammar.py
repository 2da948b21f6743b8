"""How a program reads its arguments, written down so that the command classifier knows exactly
which options it was given (sandboxd.policy.safe_commands holds the programs' grammars).

The rules are GNU getopt_long's, which coreutils, grep, file and the others follow:

* ``--`` ends the options; ``-`` alone is an operand; everything else starting with ``-`` is an
  option, wherever it stands (GNU programs permute: ``sed -n 1p file -i`` is in place).
* ``-abc`` is ``-a -b -c``; a letter that takes a value takes the rest of the word (``-n5``) or,
  when nothing is left, the next argument (``-n 5``).
* ``--name=value``, or ``--name value`` when the value is required. The name must be spelled
  out: a program accepts any unambiguous abbreviation (``--compress`` for
  ``--compress-program``), so only a name written here in full is known, and an abbreviation of
  a harmless option is refused with the rest.

What the grammar does not list is refused, never guessed. Declaring an option that takes a value
as one that does not is the safe mistake (the value is then checked as an option or an operand of
its own); the opposite would let a value hide an option, so an option is declared as taking a
required value (``valued``, ``long_valued``) only where the program's manual says so, and one
whose value is optional only in its attached form (``attached``, ``long_optional``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sandboxd._record import Record


class Grammar(Record):
    """The options one program accepts that neither run anything nor write anywhere."""

    flags: str = ""                           # short options without a value: "la" for -l, -a
    valued: str = ""                          # short options whose value is required: -n 5, -n5
    attached: str = ""                        # short options whose value is optional: only -w80
    long_flags: frozenset[str] = frozenset()  # --all (given with "=value": refused, as getopt does)
    long_valued: frozenset[str] = frozenset()  # --lines=5, --lines 5
    long_optional: frozenset[str] = frozenset()  # --color or --color=auto
    numbers: bool = False                     # -5 as a whole word (head -5, grep -3)
    # getopt gives a required value the next word, whatever it is (sort -k --x: the key "--x").
    # False for a program that parses its words in more than one pass (git log/show/diff: the
    # diff options' pass reads `git diff -pn --output=F`'s --output=F, and writes F, while the
    # revision pass took it as -n's value): such a value is then not vouched for.
    option_like_values: bool = True
    max_operands: int = -1                    # -1: any number


class Parsed(Record):
    options: tuple[tuple[str, str], ...]      # (name as written without dashes, value or "")
    operands: tuple[str, ...]


def _looks_like_an_option(word: str) -> bool:
    """A separate value that begins like an option ("-x", "--name"; not "-" nor a negative number)."""
    return word.startswith("-") and word != "-" and not word[1:].replace(".", "", 1).isdigit()


def words(*names: str) -> frozenset[str]:
    """A set of long option names from space-separated text."""
    return frozenset(name for text in names for name in text.split())


def parse(grammar: Grammar, args: Sequence[str]) -> Parsed | None:
    """The options and operands of ``args`` as the program reads them; None when an argument is
    not in the grammar (or too many operands are given)."""
    options: list[tuple[str, str]] = []
    operands: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "--":
            operands.extend(args[index:])
            break
        if arg == "-" or not arg.startswith("-"):
            operands.append(arg)
            continue
        if arg.startswith("--"):
            name, equals, value = arg[2:].partition("=")
            if name in grammar.long_flags and not equals:
                options.append((name, ""))
            elif name in grammar.long_optional and not equals and index < len(args) and args[index] == "--":
                # git's parse-options gives a required value the next word, "--" included, and
                # then reads the words after it as options: whichever way the program reads it,
                # what follows would not be checked as it runs.
                return None
            elif name in grammar.long_optional or (name in grammar.long_valued and equals):
                options.append((name, value))
            elif name in grammar.long_valued and index < len(args):
                if not grammar.option_like_values and _looks_like_an_option(args[index]):
                    return None
                options.append((name, args[index]))
                index += 1
            else:
                return None
            continue
        if grammar.numbers and arg[1:].isdigit():
            options.append((arg[1:], ""))
            continue
        position = 1
        while position < len(arg):
            letter = arg[position]
            position += 1
            if letter in grammar.flags:
                options.append((letter, ""))
            elif letter in grammar.attached:
                options.append((letter, arg[position:]))
                break
            elif letter in grammar.valued:
                if position < len(arg):
                    options.append((letter, arg[position:]))
                elif index < len(args):
                    if not grammar.option_like_values and _looks_like_an_option(args[index]):
                        return None
                    options.append((letter, args[index]))
                    index += 1
                else:
                    return None                               # the program would refuse it
                break
            else:
                return None
    if 0 <= grammar.max_operands < len(operands):
        return None
    return Parsed(tuple(options), tuple(operands))
