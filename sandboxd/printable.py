"""A string someone else chose, as a person may be shown it: on a terminal, in a log, in an MCP
client's dialog.

Every string a caller chooses (a command, a path, a job's name, a reason, an error that quotes
them) passes through ``printable`` wherever a person reads it. Nothing in the result is acted on
by a terminal or a log reader, or hides from the eye: control characters (C0, DEL, C1: escape
sequences, carriage returns, newlines), bidirectional overrides and isolates, other format
characters, separators other than the plain space, and the code points Unicode says to draw as
nothing (Default_Ignorable_Code_Point: zero-width characters, variation selectors, fillers) are
written as escapes, Python's: ``\\n``, ``\\r``, ``\\t``, ``\\xNN``, ``\\uNNNN``, ``\\UNNNNNNNN``.
A backslash is written ``\\\\``, so no escape can be mistaken for the characters it is made of,
and two different strings never look the same (each character maps to one token, and no token
is a prefix of another: the rendering decodes back to the string).

Light enough for `sandboxd run` (no ``re``, no ``unicodedata``): the common string, printable
ASCII without a backslash, comes back as it is after one C-level check."""

from __future__ import annotations

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): drawn as nothing. Most are
# format characters (Cf) that str.isprintable already refuses; the rest are marks and letters
# (the combining grapheme joiner, Hangul fillers, variation selectors) that it lets through.
_IGNORABLE_RANGES = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
                     (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
                     (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
                     (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF))
_SHORT = {ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def _token(code: int) -> str:
    """One character as shown: itself, or its escape."""
    short = _SHORT.get(code)
    if short is not None:
        return short
    char = chr(code)
    # isprintable is false for every control (Cc), format (Cf), surrogate (Cs), private-use (Co),
    # unassigned (Cn) and separator (Zl, Zp, Zs but the ASCII space) character.
    if char.isprintable() and not any(first <= code <= last for first, last in _IGNORABLE_RANGES):
        return char
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


class _Tokens(dict[int, str]):
    """str.translate's table for one string: Latin-1 filled in, any other character worked out
    when first met and kept for the rest of that string (at C speed then), not beyond it: a
    caller's strings must not grow a table in a long-lived daemon."""

    def __missing__(self, code: int) -> str:
        self[code] = token = _token(code)
        return token


_LATIN1: dict[int, str] = {}                 # filled on first use: importing this costs next to nothing


def printable(text: str) -> str:
    """``text`` with every character a terminal or log reader would act on, or that would not be
    seen, written as a visible escape (the module's doc says which); one to one."""
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text
    if not _LATIN1:
        _LATIN1.update((code, _token(code)) for code in range(0x100))
    return text.translate(_Tokens(_LATIN1))
