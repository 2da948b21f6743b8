"""Everything a patch makes `git apply` do, read the way git reads it, before anyone is asked.

`git apply` applies more than the ``---``/``+++`` parts of a unified diff: a git-format part
(``diff --git a/X b/Y``) may carry no hunks at all and still create a file (``new file mode``,
an executable one), delete one, rename one away (``rename from``/``rename to``), copy one,
change a mode (``old mode``/``new mode``), or write a binary file (``GIT binary patch``). An
approval card, the policy's judgement of each target and the RPC's result that list only the
headed parts show a person an innocent edit while the patch does the rest (round 10's hostile pass).

So this follows git's own parser (apply.c: find_header, parse_git_diff_header, parse_fragment)
part by part and returns every path a part writes, with what it does there. It is strict where
git is lenient: a part it cannot account for exactly (a binary part, whose content no card can
show; an epoch timestamp that git reads as a creation or deletion; a name it would have to guess;
a hunk git would call corrupt) is refused with a message saying what to change, never applied unseen.
Names end where git ends them (find_name_traditional, diff_timestamp_len): a traditional name
ends before a timestamp after a tab or after spaces, else at a tab; a carriage return ends any
name; \v and \f never do (round 10's second hostile pass: `a/X 2020-01-01` is X).
tests/test_patch_parts.py checks it against git itself on generated patches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandboxd.errors import InvalidPolicy
from sandboxd.printable import printable

# git's extended header lines, in the order apply.c tries them (a longer prefix first where it matters).
_HEADER_LINES = ("@@ -", "--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ",
                 "copy from ", "copy to ", "rename old ", "rename new ", "rename from ", "rename to ",
                 "similarity index ", "dissimilarity index ", "index ")
_FRAGMENT = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_EPOCH = re.compile(r"\t(1970-01-01|1969-12-31) ")
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


@dataclass
class _Part:
    """One part as git's struct patch holds it."""
    def_name: str | None = None
    old_name: str | None = None
    new_name: str | None = None
    old_mode: int = 0
    new_mode: int = 0
    is_new: bool = False
    is_delete: bool = False
    is_rename: bool = False
    is_copy: bool = False
    hunks: int = 0


@dataclass(frozen=True)
class Change:
    """One path the patch writes, and what it does there (``modified``, ``created``, ``created
    executable``, ``created symlink``, ``deleted``, ``renamed to X``, ``renamed from X``, ``copied from
    X``; a mode change is added: ``made executable``, ``changed from regular to symlink``)."""
    path: str
    action: str


def refuse(line: int, what: str) -> InvalidPolicy:
    return InvalidPolicy(f"patch line {line}: {what}")


def changes(patch: str, strip: int) -> tuple[list[Change], int]:
    """Every path the patch makes git write, in patch order, and the -p level (0: auto, 1 when every
    name starts a/ or b/)."""
    lines = patch.split("\n")
    if strip == 0:
        strip = _auto_strip(lines)
    found: list[Change] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("@@ -") and _FRAGMENT.match(line):
            raise refuse(index + 1, "a hunk (@@) without a file header before it: give ---/+++ or diff --git headers")
        if line.startswith("diff --git "):
            part, index = _git_part(lines, index, strip)
        elif (line.startswith("--- ") and index + 2 < len(lines) and lines[index + 1].startswith("+++ ")
              and lines[index + 2].startswith("@@ -")):
            part, index = _traditional_part(lines, index, strip)
        else:
            index += 1                      # text between parts (a commit message): git skips it too
            continue
        found.extend(_described(part))
    if not found:
        raise InvalidPolicy("no file in the patch: give a unified diff (---/+++ headers and @@ hunks, "
                            "or git's diff --git parts)")
    return found, strip


def _auto_strip(lines: list[str]) -> int:
    named = []
    for line in lines:
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            if name != "/dev/null":
                named.append(name.lstrip('"'))
        elif line.startswith("diff --git "):
            # its names may hold spaces: what counts is that the first starts a/ and the second b/
            sides = line[11:]
            named.append(sides.lstrip('"'))
            named.append("b/" if (' b/' in sides or ' "b/' in sides) else sides)
    return 1 if named and all(name.startswith(("a/", "b/")) for name in named) else 0


def _git_part(lines: list[str], start: int, strip: int) -> tuple[_Part, int]:
    part = _Part(def_name=_header_name(lines[start][11:], strip, start + 1))
    index = start + 1
    while index < len(lines):
        line = lines[index]
        if index == len(lines) - 1:
            break                           # git: a header line must end with a newline
        prefix = next((p for p in _HEADER_LINES if line.startswith(p)), None)
        if prefix is None or prefix == "@@ -":
            break
        _header_line(part, prefix, line[len(prefix):], strip, index + 1)
        index += 1
    if index == start + 1:
        # git ignores a lone diff --git line; a hunk right after it would be a fragment without a header
        raise refuse(start + 1, "a diff --git line without the header lines git needs (---/+++, new file mode, ...)")
    line = lines[index] if index < len(lines) else ""
    if line == "GIT binary patch" or (line.endswith(" differ") and line.startswith(("Binary files ", "Files "))):
        raise refuse(index + 1, "a binary part: the daemon cannot show what it writes; write that file with "
                                "WriteFile, or send a text patch")
    if not part.old_name and not part.new_name:
        if part.def_name is None:
            raise refuse(start + 1, "cannot tell which file this diff --git part is about (quote names with "
                                    "spaces, or give ---/+++ lines)")
        part.old_name = part.new_name = part.def_name
    if (not part.new_name and not part.is_delete) or (not part.old_name and not part.is_new):
        raise refuse(start + 1, "the diff --git header lacks a file name")
    index = _hunks(lines, index, part)
    metadata = (part.is_new or part.is_delete or part.is_rename or part.is_copy
                or (part.old_mode and part.new_mode and part.old_mode != part.new_mode))
    if not part.hunks and not metadata:
        raise refuse(start + 1, "a diff --git part that changes nothing git can apply (no hunk, no mode or name change)")
    return part, index


def _header_line(part: _Part, prefix: str, rest: str, strip: int, number: int) -> None:
    if prefix in ("--- ", "+++ "):
        null = _dev_null(rest)
        known = part.old_name if prefix == "--- " else part.new_name
        name = None if null else _name(rest, strip, number, ends="tab")
        if known is None and name is not None:
            if prefix == "--- ":
                part.old_name = name
            else:
                part.new_name = name
        elif known is not None and name != known:
            raise refuse(number, "the ---/+++ name does not match the diff --git line's")
    elif prefix in ("old mode ", "new mode ", "deleted file mode ", "new file mode "):
        mode = _mode(rest, number)
        if prefix == "deleted file mode ":
            part.is_delete, part.old_name, part.old_mode = True, part.def_name, mode
        elif prefix == "new file mode ":
            part.is_new, part.new_name, part.new_mode = True, part.def_name, mode
        elif prefix == "old mode ":
            part.old_mode = mode
        else:
            part.new_mode = mode
    elif prefix in ("copy from ", "rename old ", "rename from "):
        part.is_copy, part.is_rename = (True, part.is_rename) if prefix == "copy from " else (part.is_copy, True)
        part.old_name = _name(rest, max(strip - 1, 0), number, ends="line")
    elif prefix in ("copy to ", "rename new ", "rename to "):
        part.is_copy, part.is_rename = (True, part.is_rename) if prefix == "copy to " else (part.is_copy, True)
        part.new_name = _name(rest, max(strip - 1, 0), number, ends="line")
    elif prefix == "index " and " " in rest and ".." in rest.split(" ")[0]:
        part.old_mode = _mode(rest.split(" ", 1)[1], number)
    if sum((part.is_new, part.is_delete, part.is_rename, part.is_copy)) > 1:
        raise refuse(number, "inconsistent header lines (a part is one of: new, deleted, renamed, copied)")


def _traditional_part(lines: list[str], start: int, strip: int) -> tuple[_Part, int]:
    first, second = lines[start][4:], lines[start + 1][4:]
    part = _Part()
    for text, number in ((first, start + 1), (second, start + 2)):
        if _EPOCH.search(text):
            raise refuse(number, "an epoch timestamp (git reads it as a creation or deletion): use /dev/null")
    old_null, new_null = _dev_null(first), _dev_null(second)
    if old_null and new_null:
        raise refuse(start + 1, "both sides are /dev/null")
    if old_null:
        part.is_new, part.new_name = True, _name(second, strip, start + 2, ends="traditional")
    elif new_null:
        part.is_delete, part.old_name = True, _name(first, strip, start + 1, ends="traditional")
    else:
        old = _name(first, strip, start + 1, ends="traditional")
        new = _name(second, strip, start + 2, ends="traditional")
        # git prefers the shorter name when the other only adds to its end (x and x.orig: x), unless
        # the other is quoted (find_name_gnu takes it as it is)
        shorter = not second.startswith('"') and len(old) < len(new) and new.startswith(old)
        name = old if shorter else new
        part.old_name = part.new_name = name
    return part, _hunks(lines, start + 2, part)


def _dev_null(text: str) -> bool:
    # git's is_dev_null: /dev/null then space, tab, CR or the line's end (not \v or \f: "/dev/null\v" is a name)
    return text.startswith("/dev/null") and (len(text) == 9 or text[9] in " \t\r")


def _hunks(lines: list[str], index: int, part: _Part) -> int:
    """Past the part's hunks, checked as git checks them (line counts, line kinds)."""
    while index < len(lines) and lines[index].startswith("@@ -"):
        match = _FRAGMENT.match(lines[index])
        if not match:
            raise refuse(index + 1, "a hunk header git cannot read: @@ -a,b +c,d @@")
        old = int(match.group(2)) if match.group(2) is not None else 1
        new = int(match.group(4)) if match.group(4) is not None else 1
        header_line, index, changed = index + 1, index + 1, False
        while old or new:
            if index >= len(lines) - 1:
                raise refuse(header_line, "the hunk ends before its line counts say (corrupt hunk; a patch "
                                          "ends with a newline)")
            line = lines[index]
            kind = line[:1]
            if kind in ("", " "):
                old, new = old - 1, new - 1
            elif kind == "-":
                old, changed = old - 1, True
            elif kind == "+":
                new, changed = new - 1, True
            elif not (line.startswith("\\ ") and len(line) >= 11):
                raise refuse(index + 1, "a hunk line that is not context, +, - or '\\ No newline' (corrupt hunk)")
            if old < 0 or new < 0:
                raise refuse(header_line, "the hunk has more lines than its header counts (corrupt hunk)")
            index += 1
        if index < len(lines) - 1 and lines[index].startswith("\\ ") and len(lines[index]) >= 12:
            index += 1
        if not changed:
            raise refuse(header_line, "a hunk that changes no line")
        part.hunks += 1
    return index


def _described(part: _Part) -> list[Change]:
    change = ""
    if part.old_mode and part.new_mode and _kind(part.old_mode) != _kind(part.new_mode):
        change = {("regular", "executable"): "made executable", ("executable", "regular"): "made not executable"}.get(
            (_kind(part.old_mode), _kind(part.new_mode)), f"changed from {_kind(part.old_mode)} to {_kind(part.new_mode)}")
    edited = "modified" if part.hunks else ""
    if part.is_new:
        assert part.new_name is not None
        kind = _kind(part.new_mode)
        return [Change(part.new_name, "created" if kind == "regular" else f"created {kind}")]
    if part.is_delete:
        assert part.old_name is not None
        return [Change(part.old_name, "deleted")]
    assert part.old_name is not None and part.new_name is not None
    if part.is_copy:
        return [Change(part.new_name, ", ".join(x for x in (f"copied from {part.old_name}", change, edited) if x))]
    if part.old_name != part.new_name:
        # git writes a part whose ---/+++ names differ as a rename, with or without "rename from":
        # it removes the old file and writes the new one
        return [Change(part.old_name, f"renamed to {part.new_name}"),
                Change(part.new_name, ", ".join(x for x in (f"renamed from {part.old_name}", change, edited) if x))]
    # git rewrites the file even when its mode changes only in bits it does not keep (04755: 0755)
    return [Change(part.new_name, ", ".join(x for x in (edited, change) if x) or "rewritten as it is")]


def _kind(mode: int) -> str:
    """What git makes of a mode (it keeps a file's executable bit only: 0104755 makes a 0755 file)."""
    kind = mode & 0o170000
    if kind == 0o120000:
        return "symlink"
    if kind == 0o160000:
        return "submodule"
    if kind in (0, 0o100000):
        return "executable" if mode & 0o100 else "regular"
    return f"of mode {mode:o}"


def _mode(text: str, number: int) -> int:
    match = re.match(r"[0-7]+(?=\s|$)", text)
    if not match:
        raise refuse(number, f"not an octal mode: {printable(text[:40])}")
    return int(match.group(), 8)


def _name(text: str, strip: int, number: int, *, ends: str) -> str:
    """A file name as git reads it after a header's prefix, ``strip`` components removed. ``ends``
    says where git ends it: "traditional" (a ---/+++ line of a traditional part: before a trailing
    timestamp, else at a tab), "tab" (a git part's ---/+++ line: at a tab) or "line" (a rename's or
    copy's: at the end of the line). A carriage return ends it always; \v and \f never (git's isspace
    knows only space, tab, LF and CR: a name ending in \v names a file whose name ends in \v)."""
    if text.startswith('"'):
        name, rest = _unquote(text, number)
        if rest.strip() and not (ends != "line" and rest.startswith("\t")):
            raise refuse(number, "text after a quoted name")
        return _stripped(name, strip, number)
    stamp = _timestamp_len(text) if ends == "traditional" else 0
    if stamp:
        # find_name_traditional: the name is all before the timestamp, tabs, spaces and CRs included
        name = text[:len(text) - stamp]
    else:
        name = text.split("\r")[0]
        name = name.split("\t")[0] if ends != "line" else name
    if ends != "line" and re.search(r" \d{4}-\d\d-\d\d ", name):
        raise refuse(number, "a timestamp after the name without a tab before it: separate it with a tab")
    if name != name.rstrip() and ends == "line":
        raise refuse(number, "a name that ends in white space")
    return _stripped(name, strip, number)


_DIGITS = frozenset("0123456789")       # git's isdigit: ASCII only


def _timestamp_len(line: str) -> int:
    """How much of a traditional ---/+++ line's end is a timestamp git drops from the name
    (apply.c diff_timestamp_len, exactly): [ws]YYYY-MM-DD[ HH:MM:SS[.frac]][ +ZZZZ| +ZZ:ZZ], after a
    tab, or after spaces (which git takes as whitespace damage and drops too). 0: no timestamp."""
    end = len(line)
    if not end or line[end - 1] not in _DIGITS:
        return 0
    end -= _fixed_len(line, end, " +0000", {0: " ", 1: "+-"}) or _fixed_len(line, end, " +00:00", {0: " ", 1: "+-", 4: ":"})
    time = _fixed_len(line, end, " 00:00:00", {0: " ", 3: ":", 6: ":"})
    if not time and end and line[end - 1] in _DIGITS:          # fractional seconds: 00:00:00.123
        dot = end - 1
        while dot > 0 and line[dot] in _DIGITS:
            dot -= 1
        if line[dot] == ".":
            whole = _fixed_len(line, dot, " 00:00:00", {0: " ", 3: ":", 6: ":"})
            time = end - dot + whole if whole else 0
    end -= time
    date = _fixed_len(line, end, "00-00-00", {2: "-", 5: "-"})
    if not date:
        return 0
    if end - date >= 2 and line[end - date - 1] in _DIGITS and line[end - date - 2] in _DIGITS:
        date += 2                                                  # a 4-digit year
    end -= date
    if end == 0:
        return 0
    if line[end - 1] == "\t":
        return len(line) - end + 1
    if line[end - 1] != " ":
        return 0
    while end > 0 and line[end - 1] == " ":
        end -= 1
    return len(line) - end


def _fixed_len(line: str, end: int, shape: str, fixed: dict[int, str]) -> int:
    """len(shape) when line[:end] ends in text of that shape (digits, except at ``fixed``
    positions, which hold one of the given characters), else 0."""
    start = end - len(shape)
    if start < 0:
        return 0
    for at, char in enumerate(line[start:end]):
        if char not in fixed.get(at, _DIGITS):
            return 0
    return len(shape)


def _stripped(name: str, strip: int, number: int) -> str:
    if not name or name.startswith("/") or "//" in name or "\0" in name:
        raise refuse(number, f"a file name git would read differently: {printable(name[:80])} (give a relative path)")
    parts = name.split("/")
    if len(parts) <= strip:
        raise refuse(number, f"cannot strip {strip} components from {printable(name[:80])}")
    return "/".join(parts[strip:])


def _header_name(text: str, strip: int, number: int) -> str | None:
    """The name a diff --git line gives when both sides are the same file (git_header_name);
    None when they differ (a rename: its names come from the lines below)."""
    if text.startswith('"'):
        first, rest = _unquote(text, number)
        rest = rest.lstrip(" \t")
        second = _unquote(rest, number)[0] if rest.startswith('"') else rest
        try:
            one, two = _stripped(first, strip, number), _stripped(second, strip, number)
        except InvalidPolicy:
            return None
        return one if one == two else None
    if '"' in text:
        head, _, quoted = text.partition(' "')
        try:
            one = _stripped(head, strip, number)
            two = _stripped(_unquote('"' + quoted, number)[0], strip, number)
        except InvalidPolicy:
            return None
        return one if one == two else None
    names = set()
    for at, char in enumerate(text):
        if char in " \t":
            try:
                one, two = _stripped(text[:at], strip, number), _stripped(text[at + 1:], strip, number)
            except InvalidPolicy:
                continue
            if one == two:
                names.add(one)
    if len(names) > 1:
        raise refuse(number, "a diff --git line that names its file ambiguously (quote names with spaces)")
    return names.pop() if names else None


def _unquote(text: str, number: int) -> tuple[str, str]:
    """git's C-style quoted name (unquote_c_style): the name and the text after its closing quote."""
    out = bytearray()
    at = 1
    while at < len(text):
        char = text[at]
        if char == '"':
            try:
                return out.decode(), text[at + 1:]
            except UnicodeDecodeError:
                raise refuse(number, "a quoted name that is not UTF-8") from None
        if char != "\\":
            out += char.encode("utf-8", errors="surrogateescape")
            at += 1
            continue
        escape = text[at + 1:at + 2]
        if escape in _C_ESCAPES:
            out.append(_C_ESCAPES[escape])
            at += 2
        elif re.fullmatch(r"[0-3][0-7][0-7]", text[at + 1:at + 4]):
            out.append(int(text[at + 1:at + 4], 8))
            at += 4
        else:
            raise refuse(number, "a quoted name with an escape git does not know")
    raise refuse(number, "a quoted name without its closing quote")
