"""What of a git directory a sandbox may change, and which git config keys are harmless.

Pure: names and text only. The mounts that enforce the first list are in
sandboxd/launcher/rootfs.py, the inspection that applies the second in
sandboxd/gitguard/guard.py.

Git runs code named by its repository: hooks, and config keys such as
core.fsmonitor, core.hooksPath, core.sshCommand, filter.*.clean or alias.x=!cmd.
A host user's next `git status` in a workspace a sandbox could write would run
it. So a config a sandbox wrote keeps only keys known to name no program, no
other file and no other repository; everything else is dropped.
"""

from __future__ import annotations

# The protected subpath that turns the git guard on (it is a default; --no-default-protect drops it).
GIT_GUARD_SUBPATH = ".git/config"

# Entries of an existing git directory that stay writable: what `git add`, `commit`, `checkout`,
# `branch`, `tag`, `stash`, `merge`, `rebase`, `fetch` and `gc` write. Everything else that exists
# (config, hooks/, info/, description, branches/, commondir, config.worktree, anything unknown) is
# bound read-only; modules/ and worktrees/ are pinned and each repository in them is treated the same.
GIT_DIR_WRITABLE: frozenset[str] = frozenset({
    "objects", "refs", "logs", "index", "HEAD", "packed-refs", "ORIG_HEAD", "FETCH_HEAD", "COMMIT_EDITMSG",
    "MERGE_HEAD", "MERGE_MSG", "MERGE_MODE", "MERGE_RR", "AUTO_MERGE", "REBASE_HEAD", "CHERRY_PICK_HEAD",
    "REVERT_HEAD", "BISECT_LOG", "BISECT_START", "BISECT_TERMS", "BISECT_EXPECTED_REV", "BISECT_ANCESTORS_OK",
    "BISECT_NAMES", "BISECT_RUN", "BISECT_HEAD", "rebase-merge", "rebase-apply", "sequencer", "rr-cache",
    "gc.pid", "gc.log", "shallow", "lfs", "SQUASH_MSG", "TAG_EDITMSG", "NOTES_EDITMSG", "EDIT_DESCRIPTION",
})
# ... and by pattern: lock files (index.lock, HEAD.lock, packed-refs.lock, ...) and the split index.
GIT_DIR_WRITABLE_SUFFIXES = (".lock",)
GIT_DIR_WRITABLE_PREFIXES = ("sharedindex.",)
# Directories holding further git directories (submodules' and linked worktrees').
GIT_DIR_NESTED = ("modules", "worktrees")
# Empty directories `git init` makes; created when missing so that they can be bound read-only
# (a name that does not exist cannot be covered by a mount).
GIT_DIR_CREATE_EMPTY = ("hooks", "info")
# Files that point git at other configuration or another repository: removed when they appear.
GIT_DIR_REDIRECTS = ("commondir", "config.worktree")
# Where git keeps a stopped rebase, am, cherry-pick or revert. Their todo lists hold `exec` lines and
# their option files merge strategies: `git rebase --continue` on the host would run them.
GIT_SEQUENCER_DIRS = ("rebase-merge", "rebase-apply", "sequencer")

# How git reads a .git *file* (setup.c, read_gitfile_gently): at most 1 MiB, "gitdir: " then the
# path; only trailing LF and CR are stripped (blanks are part of the path); the path is a C string
# (it ends at a NUL); a relative one is relative to the directory holding the file.
GITFILE_MAX_BYTES = 1 << 20
GITFILE_PREFIX = b"gitdir: "
GITFILE_PATH_MAX = 4096        # PATH_MAX, with the NUL


def gitfile_target(data: bytes, gitfile: bytes) -> bytes | None:
    """The git directory a .git file whose content is ``data``, found at path ``gitfile``, names, by
    git's rules (not yet resolved: symlinks and ".." are the caller's); None where git refuses it."""
    if len(data) > GITFILE_MAX_BYTES or not data.startswith(GITFILE_PREFIX):
        return None
    path = data[len(GITFILE_PREFIX):].rstrip(b"\r\n").split(b"\0", 1)[0]
    if not path:
        return None
    if not path.startswith(b"/"):
        slash = gitfile.rfind(b"/")
        path = gitfile[:slash + 1] + path if slash >= 0 else path
    # The kernel refuses a longer path (ENAMETOOLONG) and so git's is_git_directory fails on it;
    # judged on the absolute path (at least as long as git's own), so never kept where git could follow.
    return path if len(path) < GITFILE_PATH_MAX else None


def git_dir_entry_writable(name: str) -> bool:
    return (name in GIT_DIR_WRITABLE or name.endswith(GIT_DIR_WRITABLE_SUFFIXES)
            or name.startswith(GIT_DIR_WRITABLE_PREFIXES))


# Keys (lower-case section and name; "*" stands for any subsection) that name no program, no
# file and no other repository.
SAFE_KEYS: frozenset[str] = frozenset({
    "core.repositoryformatversion", "core.filemode", "core.bare", "core.logallrefupdates", "core.ignorecase",
    "core.symlinks", "core.precomposeunicode", "core.protecthfs", "core.protectntfs", "core.autocrlf",
    "core.eol", "core.safecrlf", "core.checkstat", "core.trustctime", "core.abbrev",
    "remote.*.url", "remote.*.pushurl", "remote.*.fetch", "remote.*.push", "remote.*.tagopt", "remote.*.mirror",
    "remote.*.prune",
    "branch.*.remote", "branch.*.merge", "branch.*.rebase", "branch.*.pushremote",
    "user.name", "user.email",
    "submodule.*.url", "submodule.*.active", "submodule.*.branch",
    "extensions.objectformat", "extensions.refstorage", "extensions.preciousobjects",
    "init.defaultbranch", "gc.auto", "gc.autopacklimit", "pull.rebase", "pull.ff", "merge.ff", "fetch.prune",
    "index.version", "pack.threads",
})
_TRANSPORT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")


def _transport_url(url: str) -> bool:
    """A remote URL like "ext::sh -c ..." or "fd::3" runs a program through a transport helper."""
    scheme, sep, _ = url.partition("::")
    return bool(sep) and bool(scheme) and set(scheme) <= _TRANSPORT_CHARS
_URL_KEYS = ("remote.*.url", "remote.*.pushurl", "submodule.*.url")


class ConfigEntry:
    """One `key = value` of a git config file. ``value`` is None for a bare key (boolean true)."""

    __slots__ = ("section", "subsection", "name", "value")

    def __init__(self, section: str, subsection: str | None, name: str, value: str | None) -> None:
        self.section, self.subsection, self.name, self.value = section.lower(), subsection, name.lower(), value

    @property
    def key(self) -> str:
        """The full key as git prints it (section and name lower-case, subsection as is)."""
        middle = "" if self.subsection is None else f".{self.subsection}"
        return f"{self.section}{middle}.{self.name}"

    @property
    def pattern(self) -> str:
        middle = "" if self.subsection is None else ".*"
        return f"{self.section}{middle}.{self.name}"

    def ident(self) -> tuple[str, str | None]:
        return self.key, self.value


class ConfigSyntaxError(ValueError):
    pass


def is_safe(entry: ConfigEntry) -> bool:
    if entry.pattern not in SAFE_KEYS:
        return False
    if entry.pattern in _URL_KEYS and entry.value is not None and _transport_url(entry.value):
        return False
    return True


def parse(text: str) -> list[ConfigEntry]:
    """The entries of a git config file, parsed as git does (sections, quoted subsections, the
    legacy [section.sub] form, quoted values, escapes, continuation lines, comments).
    Raises ConfigSyntaxError where git itself would refuse the file."""
    entries: list[ConfigEntry] = []
    section: str | None = None
    subsection: str | None = None
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c in "#;":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "[":
            section, subsection, i = _parse_header(text, i + 1)
        elif c.isalpha():
            if section is None:
                raise ConfigSyntaxError("a key before any section")
            start = i
            while i < n and (text[i].isalnum() or text[i] == "-"):
                i += 1
            name = text[start:i]
            while i < n and text[i] in " \t":
                i += 1
            if i < n and text[i] == "=":
                value, i = _parse_value(text, i + 1)
                entries.append(ConfigEntry(section, subsection, name, value))
            elif i >= n or text[i] in "\r\n#;":
                entries.append(ConfigEntry(section, subsection, name, None))
            else:
                raise ConfigSyntaxError(f"bad character after key {name!r}")
        elif c == "\ufeff" and i == 0:
            i += 1
        else:
            raise ConfigSyntaxError(f"unexpected {c!r}")
    return entries


def _parse_header(text: str, i: int) -> tuple[str, str | None, int]:
    n = len(text)
    start = i
    while i < n and (text[i].isalnum() or text[i] in "-."):
        i += 1
    name = text[start:i]
    if not name:
        raise ConfigSyntaxError("empty section name")
    if i < n and text[i] == "]":
        if "." in name:                                   # legacy [section.subsection]
            section, _, legacy = name.partition(".")
            return section, legacy.lower(), i + 1
        return name, None, i + 1
    if i < n and text[i] in " \t" and "." not in name:
        while i < n and text[i] in " \t":
            i += 1
        if i >= n or text[i] != '"':
            raise ConfigSyntaxError("bad section header")
        i += 1
        sub = []
        while True:
            if i >= n or text[i] == "\n":
                raise ConfigSyntaxError("unterminated subsection")
            c = text[i]
            if c == '"':
                i += 1
                break
            if c == "\\":
                i += 1
                if i >= n or text[i] == "\n":
                    raise ConfigSyntaxError("bad escape in subsection")
                c = text[i]
            sub.append(c)
            i += 1
        if i >= n or text[i] != "]":
            raise ConfigSyntaxError("bad section header")
        return name, "".join(sub), i + 1
    raise ConfigSyntaxError("bad section header")


_ESCAPES = {"n": "\n", "t": "\t", "b": "\b", "\\": "\\", '"': '"'}


def _parse_value(text: str, i: int) -> tuple[str, int]:
    n = len(text)
    out: list[str] = []
    quoted = False
    pending_space = ""
    while i < n and text[i] in " \t":
        i += 1
    while i < n:
        c = text[i]
        if c == "\n":
            if quoted:
                raise ConfigSyntaxError("newline in a quoted value")
            break
        if not quoted and c in "#;":
            while i < n and text[i] != "\n":
                i += 1
            break
        if c == "\\":
            i += 1
            if i < n and text[i] == "\n":            # continuation line
                i += 1
                continue
            if i < n and text[i] == "\r" and i + 1 < n and text[i + 1] == "\n":
                i += 2
                continue
            if i >= n or text[i] not in _ESCAPES:
                raise ConfigSyntaxError("bad escape in value")
            out.append(pending_space + _ESCAPES[text[i]])
            pending_space = ""
            i += 1
            continue
        if c == '"':
            quoted = not quoted
            i += 1
            continue
        if not quoted and c in " \t\r":
            pending_space += c                       # trailing blanks are dropped, inner ones kept
            i += 1
            continue
        out.append(pending_space + c)
        pending_space = ""
        i += 1
    if quoted:
        raise ConfigSyntaxError("unterminated quote")
    return "".join(out), i


def render(entries: list[ConfigEntry]) -> str:
    """Entries as a config file git reads back to exactly these keys and values."""
    lines: list[str] = []
    current: tuple[str, str | None] | None = None
    for entry in entries:
        header = (entry.section, entry.subsection)
        if header != current:
            if entry.subsection is None:
                lines.append(f"[{entry.section}]")
            else:
                lines.append(f'[{entry.section} "{_quote_sub(entry.subsection)}"]')
            current = header
        if entry.value is None:
            lines.append(f"\t{entry.name}")
        else:
            lines.append(f'\t{entry.name} = "{_quote_value(entry.value)}"')
    return "".join(line + "\n" for line in lines)


def _quote_sub(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quote_value(text: str) -> str:
    return (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
            .replace("\b", "\\b"))


def filter_config(text: str, trusted: frozenset[tuple[str, str | None]] = frozenset()
                  ) -> tuple[str | None, list[str]]:
    """(the config to write instead, the keys dropped); (None, []) when nothing needs dropping.
    ``trusted`` entries (key, value) were there before the sandbox ran and are kept as they are.
    A file git could not parse is replaced by an empty one (git would refuse it anyway; our
    reading of it must never be the one that keeps a key git would see)."""
    try:
        entries = parse(text)
    except ConfigSyntaxError as exc:
        return "", [f"<unparsable config: {exc}>"]
    kept = [e for e in entries if is_safe(e) or e.ident() in trusted]
    dropped = [e.key for e in entries if not (is_safe(e) or e.ident() in trusted)]
    if not dropped:
        return None, []
    # Subsection names may not hold a newline or NUL; values may not hold NUL (git cannot write them).
    kept = [e for e in kept if "\n" not in (e.subsection or "") and "\0" not in (e.value or "")]
    return render(kept), dropped
