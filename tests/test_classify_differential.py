"""The classifier against the programs themselves (issue 24, round 4's second hostile pass,
finding 1): every command it calls read-only, run on the real kernel, runs no other program and
writes nothing; every one it calls workspace-write writes nowhere but the workspace.

Commands are generated (hypothesis) from each vouched-for program's own grammar
(sandboxd.policy.safe_commands) mixed with hostile words: the options that run or write
(``--pre=canary``, ``-exec canary ;``, ``e canary``, ``-o out``, ``--compress-program=canary``,
``--output=out`` ...), abbreviations of them, values placed where a value would hide an option,
``sh -c`` scripts of several commands, and environments with ``LD_PRELOAD``, ``BASH_ENV``,
``GIT_CONFIG_*``, ``PAGER``, ``RIPGREP_CONFIG_PATH`` .... Each command the classifier calls
read-only runs under bubblewrap where the whole file system is read-only but a scratch
directory (the command's workspace, its HOME and its /tmp, holding a git repository and the
files the words name) and a log directory; PATH starts with a directory of canary programs
(``canary``, and the decompressors, pagers and ``pr`` that options start) and a canary
library is named wherever a preload could be. The scratch tree is compared before and after (type,
mode, size, mtime, content), and the log must stay empty.

The control: the same runner catches the finding's commands (``sed -n 'e canary'``, ``sort -o``,
``sort --compress-program``, ``rg --pre``, ``git grep -O``, ``find -exec``, ``uniq IN OUT``,
``LD_PRELOAD``): each of them runs the canary or writes.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from sandboxd.policy.argv_grammar import Grammar
from sandboxd.policy.command_env import SAFE_VARIABLES, CommandEnv
from sandboxd.policy.safe_commands import (ANY_ARGUMENTS, FIND_ALONE, FIND_VALUED, GIT_GLOBAL, GIT_SUBCOMMANDS,
                                           READ_ONLY_PROGRAMS, WRITERS)
from sandboxd.policy.tools import Effect, WriteScope, classify_command

pytestmark = pytest.mark.timeout(600)

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
CANARY_PROGRAMS = ("canary", "gzip", "gunzip", "xz", "bzip2", "lzma", "lz4", "zstd", "brotli", "uncompress", "lzip",
                   "pr", "less", "more", "pager", "gpg", "vi", "nano")


class Lab:
    """The scratch tree, the canaries and the runner."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.scratch = root / "scratch"
        self.ws = self.scratch / "ws"
        self.home = self.scratch / "home"
        self.tmp = self.scratch / "tmp"
        self.canaries = root / "canary"
        self.log = root / "log"
        self.preload = root / "canary.so"
        self.rg_config = root / "rgconfig"
        self.script = self.canaries / "canary"
        self.last: subprocess.CompletedProcess[bytes] | None = None

    def build(self) -> None:
        for path in (self.ws / "sub", self.home, self.tmp, self.canaries, self.log):
            path.mkdir(parents=True)
        os.chmod(self.log, 0o777)
        for name in CANARY_PROGRAMS:
            path = self.canaries / name
            path.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {self.log}/ran\n")
            path.chmod(0o755)
        source = self.root / "canary.c"
        source.write_text('#include <fcntl.h>\n#include <unistd.h>\n'
                          '__attribute__((constructor)) static void ran(void) {\n'
                          f'  int fd = open("{self.log}/ran", O_WRONLY | O_CREAT | O_APPEND, 0644);\n'
                          '  if (fd >= 0) { write(fd, "preload\\n", 8); close(fd); }\n}\n')
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(self.preload), str(source)], check=True)
        self.rg_config.write_text(f"--pre={self.script}\n")
        (self.ws / "a.txt").write_text("".join(f"line {i} alpha\n" for i in range(1, 30)))
        (self.ws / "b.txt").write_text("beta\nalpha\nbeta\n")
        (self.ws / "big.txt").write_text("".join(f"{i * 7919 % 10007} gamma\n" for i in range(6000)))
        (self.ws / "sub" / "c.py").write_text("print('c')\n")
        (self.ws / "-n").write_text("a file named like an option\n")
        (self.ws / "z.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 20)
        git = ["git", "-C", str(self.ws), "-c", "user.name=t", "-c", "user.email=t@t"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "GIT_CONFIG_NOSYSTEM": "1"}
        subprocess.run([*git, "init", "-q", "-b", "main"], check=True, env=env)
        subprocess.run([*git, "add", "a.txt", "b.txt", "sub"], check=True, env=env)
        subprocess.run([*git, "commit", "-q", "-m", "one"], check=True, env=env)
        (self.ws / "a.txt").write_text((self.ws / "a.txt").read_text() + "changed\n")
        old = os.stat(self.ws / "b.txt").st_mtime - 3600
        for path in self.ws.rglob("*"):                  # nothing racily clean: git status rewrites no index
            if ".git" not in path.parts:
                os.utime(path, (old, old), follow_symlinks=False)
        subprocess.run([*git, "update-index", "--refresh"], env=env, capture_output=True)
        subprocess.run([*git, "status"], check=True, env=env, capture_output=True)

    def snapshot(self) -> dict[str, tuple[object, ...]]:
        tree: dict[str, tuple[object, ...]] = {}
        for directory, dirs, files in os.walk(self.scratch):
            for name in dirs + files:
                path = os.path.join(directory, name)
                info = os.lstat(path)
                digest = ""
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as handle:
                        digest = hashlib.sha256(handle.read()).hexdigest()
                tree[os.path.relpath(path, self.scratch)] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
        return tree

    def ran(self) -> str:
        path = self.log / "ran"
        return path.read_text() if path.exists() else ""

    def run(self, argv: list[str], env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
        setenv = [arg for name, value in {"PATH": f"{self.canaries}:/usr/bin:/bin", "HOME": str(self.home),
                                          "LANG": "C.UTF-8", **(env or {})}.items()
                  for arg in ("--setenv", name, value)]
        command = [BWRAP, "--die-with-parent", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                   "--cap-drop", "ALL", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                   "--bind", str(self.tmp), "/tmp", "--bind", str(self.scratch), str(self.scratch),
                   "--bind", str(self.log), str(self.log), "--chdir", str(cwd or self.ws), "--clearenv", *setenv,
                   "--", *argv]
        try:
            return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, -9, b"", b"timed out")

    def effects(self, argv: list[str], env: dict[str, str] | None = None,
                inside: Path | None = None) -> tuple[str, list[str]]:
        """What running ``argv`` did: what it ran (the canaries' log) and which scratch paths it
        created, removed or changed (outside ``inside``, when given)."""
        before = self.snapshot()
        done = self.run(argv, env)
        after = self.snapshot()
        changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
        if inside is not None:
            prefix = os.path.relpath(inside, self.scratch)
            changed = [path for path in changed if path != prefix and not path.startswith(prefix + "/")]
        self.last = done
        return self.ran(), changed


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    root = Path(tempfile.mkdtemp(prefix="sbx-classify-", dir="/var/tmp"))   # /tmp is replaced inside
    made = Lab(root)
    try:
        made.build()
        yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)


def scope_of(lab: Lab) -> WriteScope:
    return WriteScope(roots=(str(lab.ws),), protected=(".git/hooks", ".git/config"), scratch=("/dev/shm",))


# -- what words are drawn from ---------------------------------------------------------------------


def values(lab: Lab) -> list[str]:
    return ["1", "3", "0", "2,5", "a", "x", ",", ":", "%p", "+%s", "a.txt", "out", "canary", str(lab.script),
            "e canary", "w out", "auto", "never", "utf8", "*.txt", "HEAD", "main", "-exec", "--pre=canary",
            f"--output={lab.ws}/out", "-o"]


def operands(lab: Lab) -> list[str]:
    return ["a.txt", "b.txt", "sub", "sub/c.py", ".", "-", "--", "-n", "z.gz", "out", str(lab.ws / "a.txt"),
            str(lab.ws / "out"), "/etc/hostname", "/tmp/out", "canary", str(lab.script), "HEAD", "main", "1p",
            "alpha", "{}", ";", "+%s"]


HOSTILE = ["-o", "out", "--output=out", "--output", "-i", "-i.bak", "--in-place", "--pre=canary", "--pre", "canary",
           "--compress-program=canary", "--compress=canary", "-T", "/tmp", "-S", "1K", "--batch-size=2", "-z",
           "--search-zip", "--hostname-bin=canary", "-O", "-Ocanary", "--open-files-in-pager=canary", "--ext-diff",
           "--textconv", "--exec=canary", "-exec", "-execdir", "-ok", "-delete", "-fprint", "-fls", "-fprintf",
           "-C", "-c", "core.pager=canary", "--git-dir=/tmp", "--work-tree=/tmp", "--exec-path=/tmp", "-p",
           "--paginate", "--config-env=core.fsmonitor=HOME", "-l", "--paginate", "-r", "-R", "--set=2020-01-01",
           "-s", "01010101", "-F", "--file=/etc/hostname", "-b", "-m", "--magic-file=/etc/hostname", "--compile",
           "--show-signature", "--no-index", "--sync", "-D", "-Z", "e canary", "1e canary", "w out", "1w out",
           "s/a/b/w out", "s/a/b/e", "$!N", "--help", "--version", "-X", "--files0-from=out"]


def hostile_env(lab: Lab) -> dict[str, list[str]]:
    return {"LD_PRELOAD": [str(lab.preload)], "LD_AUDIT": [str(lab.preload)], "BASH_ENV": [str(lab.script)],
            "ENV": [str(lab.script)], "PAGER": [str(lab.script)], "GIT_PAGER": [str(lab.script)],
            "GIT_EXTERNAL_DIFF": [str(lab.script)], "GIT_CONFIG_COUNT": ["1"], "GIT_CONFIG_KEY_0": ["core.fsmonitor"],
            "GIT_CONFIG_VALUE_0": [str(lab.script)], "RIPGREP_CONFIG_PATH": [str(lab.rg_config)],
            "TMPDIR": [str(lab.ws)], "SHELLOPTS": ["xtrace"], "PS4": [f"$({lab.script})"],
            "BASH_FUNC_ls%%": [f"() {{ {lab.script}; }}"], "PATH": [f"{lab.ws}:/usr/bin"], "HOME": [str(lab.ws)],
            "GCONV_PATH": [str(lab.canaries)], "LANG": ["C.UTF-8", f"{lab.ws}/x", "../x"],
            "TERM": ["xterm-256color", "/tmp/x"], "TZ": ["UTC", "Europe/Paris", f":{lab.ws}/a.txt"],
            "COLUMNS": ["80", "x"], "NO_COLOR": ["1"], "LC_ALL": ["C", "C.UTF-8"]}


def grammar_words(grammar: Grammar, lab: Lab) -> st.SearchStrategy[list[str]]:
    """One option of the grammar as it may be written (a list: a value may be its own word)."""
    value = st.sampled_from(values(lab))
    choices: list[st.SearchStrategy[list[str]]] = []
    if grammar.flags:
        choices.append(st.lists(st.sampled_from(grammar.flags), min_size=1, max_size=3).map(lambda f: ["-" + "".join(f)]))
    if grammar.valued:
        letter = st.sampled_from(grammar.valued)
        choices.append(st.tuples(letter, value).map(lambda lv: ["-" + lv[0], lv[1]]))
        choices.append(st.tuples(letter, value).map(lambda lv: ["-" + lv[0] + lv[1]]))
        if grammar.flags:                     # a flag cluster ending in a valued letter
            choices.append(st.tuples(st.sampled_from(grammar.flags), letter, value).map(
                lambda flv: ["-" + flv[0] + flv[1], flv[2]]))
    if grammar.attached:
        choices.append(st.tuples(st.sampled_from(grammar.attached), value).map(lambda lv: ["-" + lv[0] + lv[1]]))
    for names, form in ((grammar.long_flags, "flag"), (grammar.long_valued, "valued"),
                        (grammar.long_optional, "optional")):
        if not names:
            continue
        name = st.sampled_from(sorted(names))
        if form == "flag":
            choices.append(name.map(lambda n: ["--" + n]))
        else:
            choices.append(st.tuples(name, value).map(lambda nv: [f"--{nv[0]}={nv[1]}"]))
            choices.append(st.tuples(name, value).map(lambda nv: ["--" + nv[0], nv[1]]))
    if grammar.numbers:
        choices.append(st.integers(0, 9).map(lambda n: [f"-{n}"]))
    return st.one_of(choices) if choices else st.just([])


def args_for(grammar: Grammar | str, lab: Lab) -> st.SearchStrategy[list[str]]:
    """Words mostly of the grammar (so that most commands are vouched for and run), then operands,
    then hostile words."""
    own = grammar_words(grammar, lab) if isinstance(grammar, Grammar) else st.sampled_from([["-n"], ["-e"], ["x"]])
    operand = st.sampled_from(operands(lab)).map(lambda w: [w])
    word = st.one_of(own, own, own, operand, operand, st.sampled_from(HOSTILE).map(lambda w: [w]))
    return st.lists(word, max_size=5).map(lambda parts: [w for part in parts for w in part])


def installed(name: str) -> bool:
    return name in ("[", "test", "echo", "printf", "true", "false", "pwd") or shutil.which(name) is not None


@st.composite
def commands(draw: st.DrawFn, lab: Lab) -> list[str]:
    """A command line for one vouched-for program (or a near miss)."""
    kind = draw(st.sampled_from(["plain", "plain", "plain", "git", "git", "find", "sed", "date"]))
    if kind == "git":
        globals_ = draw(st.lists(st.sampled_from([f"--{n}" for n in sorted(GIT_GLOBAL)] + ["-P", "-c", "core.pager=canary",
                                                                                       "--git-dir=/tmp", "-C", "/tmp",
                                                                                       "--paginate", "-p"]),
                                 max_size=2))
        sub = draw(st.sampled_from(sorted(GIT_SUBCOMMANDS) + ["config", "commit", "difftool", "help"]))
        rest = draw(args_for(GIT_SUBCOMMANDS.get(sub, Grammar()), lab))
        return ["git", *globals_, sub, *rest]
    if kind == "find":
        word = st.one_of(st.sampled_from(sorted(FIND_ALONE)).map(lambda w: [w]),
                         st.tuples(st.sampled_from(sorted(FIND_VALUED) + ["-newermt"]),
                                   st.sampled_from(values(lab) + ["*.txt", "f", "d", "1", "%p\\n"])).map(list),
                         st.sampled_from(["-exec", "-execdir", "-ok", "-delete", "-fprint", "-fls", "-fprintf",
                                          "-fprint0", str(lab.script), "{}", ";", "+", "out", "%p"]).map(lambda w: [w]))
        starts = draw(st.lists(st.sampled_from([".", "sub", "a.txt", "-L", "-H"]), max_size=2))
        expression = draw(st.lists(word, max_size=5))
        return ["find", *starts, *[w for part in expression for w in part]]
    if kind == "sed":
        script = draw(st.sampled_from(["1p", "2,5p", "$p", "1,$p", "e canary", "1e canary", "w out", "1w out",
                                       "s/a/b/w out", "s/a/b/e", "1!p", "1p;e canary", "1p\ne canary", "3p"]))
        head = draw(st.sampled_from([["-n"], ["-n", "-i"], [], ["-ni"], ["--quiet"], ["-n", "-s"]]))
        files = draw(st.lists(st.sampled_from(["a.txt", "b.txt", "-i", "--in-place", "-", "out"]), max_size=2))
        return ["sed", *head, script, *files]
    if kind == "date":
        return ["date", *draw(st.lists(st.sampled_from(["+%s", "-u", "-d", "yesterday", "-s", "2020-01-01", "010101",
                                                         "--set=2020-01-01", "-r", "a.txt", "-Iseconds", "-R"]),
                                       max_size=3))]
    programs = [name for name in sorted(READ_ONLY_PROGRAMS) if installed(name)]
    program = draw(st.sampled_from(programs))
    return [program, *draw(args_for(GENERATED.get(program, READ_ONLY_PROGRAMS[program]), lab))]


# tail's following options wait for more input forever: generated without them (they read, and
# each would only cost the run's timeout).
_TAIL = READ_ONLY_PROGRAMS["tail"]
assert isinstance(_TAIL, Grammar)
GENERATED: dict[str, Grammar | str] = {"tail": _TAIL.replace(
    flags=_TAIL.flags.replace("f", "").replace("F", ""), long_flags=_TAIL.long_flags - {"retry"},
    long_valued=_TAIL.long_valued - {"pid", "sleep-interval", "max-unchanged-stats"}, long_optional=frozenset())}


@st.composite
def environments(draw: st.DrawFn, lab: Lab) -> dict[str, str]:
    pool = hostile_env(lab)
    safe = {name: ["C.UTF-8", "1", "80", "xterm", "UTC"] for name in SAFE_VARIABLES}
    if draw(st.integers(0, 3)) < 2:
        return {}
    names = draw(st.lists(st.sampled_from(sorted(pool) + sorted(safe) * 2), min_size=1, max_size=2, unique=True))
    return {name: draw(st.sampled_from(pool.get(name) or safe[name])) for name in names}


# git's optional index refresh (status, diff, describe): it takes .git/index.lock and may rewrite
# .git/index, the cache of the worktree's file times (GIT_OPTIONAL_LOCKS=0 and --no-optional-locks
# skip it). The one write a command vouched for as read-only makes; nothing else in .git may change.
GIT_CACHE = ("ws/.git", "ws/.git/index")

# -- the differential ---------------------------------------------------------------------------------

DIFFERENTIAL = settings(max_examples=int(os.environ.get("SANDBOXD_CLASSIFY_EXAMPLES", "1500")), deadline=None,
                        database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                              HealthCheck.data_too_large])


@DIFFERENTIAL
@given(data=st.data())
def test_what_the_classifier_calls_read_only_runs_nothing_and_writes_nothing(lab: Lab, data: st.DataObject) -> None:
    argv = data.draw(commands(lab), label="argv")
    shell = data.draw(st.booleans(), label="through sh -c")
    if shell:
        more = data.draw(st.lists(st.tuples(st.sampled_from(["&&", "||", ";", "|"]), commands(lab)), max_size=2))
        script = shlex.join(argv) + "".join(f" {op} {shlex.join(other)}" for op, other in more)
        if data.draw(st.booleans()):
            script = "cd sub && " + script
        argv = ["/bin/sh", "-c", script]
    env = data.draw(environments(lab), label="env")
    found = classify_command(argv, cwd=str(lab.ws), scope=scope_of(lab), env=CommandEnv(overlay=env))
    if found.effect != Effect.READ_ONLY:
        return
    event(f"ran: {argv[0] if argv[0] != '/bin/sh' else 'sh -c'}")
    ran, changed = lab.effects(argv, env)
    changed = [path for path in changed if path not in GIT_CACHE]
    assert lab.last is not None
    note(f"exit {lab.last.returncode}; stderr {lab.last.stderr[-300:]!r}")
    assert ran == "" and changed == [], (argv, env, ran, changed)


@st.composite
def writes(draw: st.DrawFn, lab: Lab) -> list[str]:
    program = draw(st.sampled_from(sorted(WRITERS)))
    paths = ["new", "newdir/x", "a.txt", "sub", "sub/c.py", "..", "../home/x", "/tmp/out", str(lab.home / "x"),
             f"--target-directory={lab.home}", f"--target-directory={lab.ws}/sub", "-t", str(lab.home), "-S",
             "/../../home/x", "--backup", "--suffix=/../../home/x", "--parents", "-l", "-s", "-b", "-p",
             "--no-preserve-root", "u+s", "4755", "755", "u+x", "-m", "2777", "0644", "--reference=a.txt", "-r",
             "a.txt", "-d", "yesterday", "-s", "10"]
    rest = draw(st.lists(st.one_of(grammar_words(WRITERS[program], lab), st.sampled_from(paths).map(lambda p: [p])),
                         max_size=4))
    return [program, *[w for part in rest for w in part]]


@DIFFERENTIAL
@given(data=st.data())
def test_what_the_classifier_calls_workspace_write_writes_only_the_workspace(lab: Lab, data: st.DataObject) -> None:
    argv = data.draw(writes(lab), label="argv")
    found = classify_command(argv, cwd=str(lab.ws / "sub"), scope=scope_of(lab))
    if found.effect not in (Effect.READ_ONLY, Effect.WORKSPACE_WRITE):
        return
    event(f"ran: {argv[0]}")
    saved = lab.root / "saved-ws"
    shutil.copytree(lab.ws, saved, symlinks=True)
    try:
        before = lab.snapshot()
        done = lab.run(argv, cwd=lab.ws / "sub")
        note(f"exit {done.returncode}; stderr {done.stderr[-300:]!r}")
        after = lab.snapshot()
        outside = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
                         and not path.startswith("ws/") and path != "ws")
        assert lab.ran() == "" and outside == [], (argv, lab.ran(), outside)
        assert not any(after[path][0] & 0o6000 for path in after if path.startswith("ws/") and
                       after[path] != before.get(path)), argv                      # nothing made set-id
    finally:
        shutil.rmtree(lab.ws)
        shutil.move(saved, lab.ws)


# -- every option the tables admit, each once with hostile values -------------------------------------

OPTION_VALUES = ("out", "canary", "e canary", "-o")     # a value where a file or a program could go


def each_option(program: str, grammar: Grammar) -> Iterator[list[str]]:
    """One command per option of ``grammar`` (with each of OPTION_VALUES where it takes a value),
    reading a.txt: every entry of the table is run at least once, whatever hypothesis draws."""
    for letter in grammar.flags:
        yield [program, "-" + letter, "a.txt"]
    for letter in grammar.valued:
        for value in OPTION_VALUES:
            yield [program, "-" + letter, value, "a.txt"]
            yield [program, "-" + letter + value, "a.txt"]
    for letter in grammar.attached:
        for value in OPTION_VALUES:
            yield [program, "-" + letter + value, "a.txt"]
    for name in sorted(grammar.long_flags):
        yield [program, "--" + name, "a.txt"]
    for name in sorted(grammar.long_valued | grammar.long_optional):
        for value in OPTION_VALUES:
            yield [program, f"--{name}={value}", "a.txt"]
            yield [program, "--" + name, value, "a.txt"]
    if grammar.numbers:
        yield [program, "-3", "a.txt"]


def every_option_command() -> Iterator[list[str]]:
    for program, grammar in sorted({**READ_ONLY_PROGRAMS, **GENERATED}.items()):
        if isinstance(grammar, Grammar) and installed(program):
            yield from each_option(program, grammar)
    for subcommand, grammar in sorted(GIT_SUBCOMMANDS.items()):
        yield from (["git", *argv] for argv in each_option(subcommand, grammar))
    for word in sorted(FIND_ALONE):
        yield ["find", ".", word] if word not in ("(", ")") else ["find", ".", "(", "-print", ")"]
    for word in sorted(FIND_VALUED):
        for value in OPTION_VALUES:
            yield ["find", ".", word, value]


def test_every_option_the_tables_admit_runs_nothing_and_writes_nothing(lab: Lab) -> None:
    """Each program's commands run in one sandbox, one after another; should anything run or be
    written, they are run again one by one to name the command."""
    batches: dict[str, list[list[str]]] = {}
    for argv in every_option_command():
        found = classify_command(argv, cwd=str(lab.ws), scope=scope_of(lab))
        if found.effect == Effect.READ_ONLY:
            batches.setdefault(argv[0] if argv[0] != "git" else f"git {argv[1]}", []).append(argv)
    assert len(batches) > 40 and sum(map(len, batches.values())) > 1500, {k: len(v) for k, v in batches.items()}
    failures = []
    for name, batch in batches.items():
        script = "; ".join(shlex.join(argv) + " >/dev/null 2>&1 </dev/null" for argv in batch)
        ran, changed = lab.effects(["/bin/sh", "-c", script])
        assert lab.last is not None and lab.last.returncode != -9, f"{name}: timed out"
        if ran or [path for path in changed if path not in GIT_CACHE]:
            culprits = []
            for argv in batch:
                (lab.log / "ran").unlink(missing_ok=True)
                one_ran, one_changed = lab.effects(argv)
                if one_ran or [path for path in one_changed if path not in GIT_CACHE]:
                    culprits.append((argv, one_ran[:200], one_changed))
                for path in one_changed:                   # what it wrote goes: the next one starts clean
                    if (lab.scratch / path).is_file() and path not in GIT_CACHE and path.startswith("ws/out"):
                        (lab.scratch / path).unlink()
            (lab.log / "ran").unlink(missing_ok=True)
            failures.append((name, culprits[:3]))
    assert failures == []


# -- the controls: the runner sees what the finding's commands do ------------------------------------------


def finding_commands(lab: Lab) -> list[tuple[list[str], dict[str, str]]]:
    return [
        (["sed", "-n", "e canary", "a.txt"], {}),
        (["sed", "1w out", "a.txt"], {}),
        (["sort", f"--compress-program={lab.script}", "-S", "1K", "-T", str(lab.tmp), "big.txt"], {}),
        (["sort", "-o", "out", "a.txt"], {}),
        (["rg", "--pre", str(lab.script), "alpha"], {}),
        (["git", "grep", f"-O{lab.script}", "alpha"], {}),
        (["git", "-c", f"core.fsmonitor={lab.script}", "status"], {}),
        (["git", "--no-pager", "diff", "--no-index", "--output=out", "a.txt", "b.txt"], {}),
        (["find", ".", "-name", "a.txt", "-exec", str(lab.script), "{}", ";"], {}),
        (["find", ".", "-fprint", "out"], {}),
        (["uniq", "b.txt", "out"], {}),
        (["ls"], {"LD_PRELOAD": str(lab.preload)}),
        (["bash", "-c", "ls"], {"BASH_ENV": str(lab.script)}),
        (["git", "status"], {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.fsmonitor",
                             "GIT_CONFIG_VALUE_0": str(lab.script)}),
    ]


def test_the_runner_sees_each_finding_run_or_write(lab: Lab) -> None:
    """The control of the differential: each attack of the finding, run the same way, does run the
    canary or write the scratch tree; and the classifier calls none of them read-only."""
    for argv, env in finding_commands(lab):
        if not installed(argv[0]):
            continue
        (lab.log / "ran").unlink(missing_ok=True)
        ran, changed = lab.effects(argv, env)
        for path in changed:                                  # put the tree back for the next one
            if path.endswith("out") and (lab.scratch / path).is_file():
                (lab.scratch / path).unlink()
        (lab.log / "ran").unlink(missing_ok=True)
        assert ran or changed, (argv, env)
        found = classify_command(argv, cwd=str(lab.ws), scope=scope_of(lab), env=CommandEnv(overlay=env))
        assert found.effect == Effect.UNKNOWN_COMMAND, (argv, env, found)


READ_ONLY_EXAMPLES = [
    ["ls", "-la", "--color=never"], ["cat", "-n", "a.txt"], ["head", "-5", "a.txt"], ["tail", "-n", "3", "a.txt"],
    ["wc", "-l", "a.txt", "b.txt"], ["grep", "-rn", "alpha", "."], ["sort", "-u", "-k1,1", "b.txt"],
    ["uniq", "-c", "b.txt"], ["sed", "-n", "2,4p", "a.txt"], ["find", ".", "-name", "*.py", "-print"],
    ["git", "status", "--short"], ["git", "--no-pager", "log", "--oneline", "-n", "1"], ["git", "diff", "--stat"],
    ["git", "grep", "-n", "alpha"], ["git", "show", "HEAD", "--stat"], ["git", "branch", "--show-current"],
    ["rg", "-n", "alpha"], ["file", "-b", "a.txt"], ["diff", "-u", "a.txt", "b.txt"], ["date", "-u", "+%s"],
    ["/bin/sh", "-c", "cd sub && ls | wc -l && git log --oneline -n 1 ; cat ../b.txt"],
]


@pytest.mark.parametrize("argv", READ_ONLY_EXAMPLES, ids=lambda argv: shlex.join(argv)[:40])
def test_a_truly_read_only_command_is_vouched_for_and_runs_clean(lab: Lab, argv: list[str]) -> None:
    # Every program here is one `packaging/setup.sh test` installs (ripgrep among them): a missing one
    # is a broken set-up, not a kernel without a feature.
    assert installed(argv[0]), f"{argv[0]} is not installed: packaging/setup.sh test installs it"
    found = classify_command(argv, cwd=str(lab.ws), scope=scope_of(lab))
    assert found.effect == Effect.READ_ONLY, found
    done = lab.run(argv)
    assert done.returncode in (0, 1), done.stderr                     # it ran (diff says 1: the files differ)
    ran, changed = lab.effects(argv)
    assert (lab.ran(), ran, [path for path in changed if path not in GIT_CACHE]) == ("", "", [])
