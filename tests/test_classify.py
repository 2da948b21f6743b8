"""The command classifier's rules, one by one (pure: no daemon, no kernel; the programs themselves
are in tests/test_classify_differential.py, the daemon in tests/test_classify_daemon.py).

Round 4's second hostile pass, finding 1: commands were called read-only by their program's name
and ran other programs or wrote anywhere (`sed e`, `sort --compress-program`, `rg --pre`,
`git grep -O`, `git --git-dir`, `git diff --output`, `uniq IN OUT`, `LD_PRELOAD` ...). Each is
here with its control: the harmless form of the same program, still vouched for.
"""

from __future__ import annotations

import pytest

from sandboxd.policy.argv_grammar import Grammar, parse
from sandboxd.policy.command_env import CommandEnv
from sandboxd.policy.shell_script import split
from sandboxd.policy.tools import Effect, WriteScope, classify_command

SCOPE = WriteScope(roots=("/ws", "/cache"), protected=(".git/hooks", ".git/config"), scratch=("/tmp", "/dev/shm"))
RO, WW, UNKNOWN, NET, DESTRUCTIVE = (Effect.READ_ONLY, Effect.WORKSPACE_WRITE, Effect.UNKNOWN_COMMAND,
                                     Effect.NETWORK, Effect.DESTRUCTIVE)


def effect(argv: list[str], env: CommandEnv | None = None, scope: WriteScope = SCOPE) -> str:
    return classify_command(argv, cwd="/ws", scope=scope, env=env).effect


# The finding's commands (each was read-only), then the control beside each: the same program in
# a form that runs nothing and writes nowhere.
@pytest.mark.parametrize("attack, control", [
    (["sed", "-n", "e touch /home/u/PWNED", "/etc/hostname"], ["sed", "-n", "1p", "/etc/hostname"]),
    (["sed", "w /home/u/.bashrc", "f"], ["sed", "-n", "2,5p", "f"]),
    (["sed", "-n", "1e python3 -c x", "/etc/hostname"], ["sed", "-n", "$p", "f"]),
    (["sed", "-n", "1p", "f", "-i"], ["sed", "-n", "1,$p", "f", "g"]),           # GNU sed permutes: -i in place
    (["sed", "-n", "s/a/b/w out", "f"], ["sed", "-n", "3p"]),
    (["sort", "--compress-program=/ws/x.sh", "-S", "1K", "-T", "/tmp", "/etc/services"], ["sort", "/etc/services"]),
    (["sort", "--compress=/ws/x.sh", "f"], ["sort", "-k2,2", "-t,", "f"]),                 # an abbreviation
    (["sort", "-o", "/home/u/x", "f"], ["sort", "-ru", "f"]),
    (["sort", "--batch-size=2", "-T", "/home/u", "f"], ["sort", "-k", "--compress-program=x"]),   # a key
    (["rg", "--pre", "/ws/x.sh", "pat"], ["rg", "-n", "--hidden", "pat"]),
    (["rg", "--pre=/ws/x.sh", "pat"], ["rg", "-e", "--pre=/ws/x.sh"]),                    # a value, not an option
    (["rg", "-z", "pat"], ["rg", "-uu", "pat"]),
    (["git", "grep", "-O/ws/x.sh", "pat"], ["git", "grep", "-n", "pat"]),
    (["git", "grep", "--open-files-in-pager=x", "pat"], ["git", "grep", "-e", "-O"]),
    (["git", "--git-dir=/tmp/g", "status"], ["git", "status"]),
    (["git", "--config-env=core.fsmonitor=VAR", "status"], ["git", "--no-pager", "status", "-s"]),
    (["git", "-c", "core.pager=x", "log"], ["git", "-P", "log", "--oneline", "-n", "5"]),
    (["git", "-C", "/tmp/g", "log"], ["git", "log", "-3"]),
    (["git", "--no-pager", "diff", "--no-index", "--output=/home/u/x", "a", "b"], ["git", "diff", "--no-index", "a", "b"]),
    (["git", "log", "--output=/home/u/x"], ["git", "log", "--format=%H"]),
    # The differential test's finds (2026-12-03): git's diff pass reads a word its revision pass took
    # as -n's value (`-pn --output=F` wrote F); --remerge-diff writes objects into .git/objects.
    (["git", "diff", "-pn", "--output=/home/u/x"], ["git", "log", "-pn", "5"]),
    (["git", "log", "--remerge-diff"], ["git", "log", "--diff-merges=on"]),
    (["git", "diff", "--ext-diff"], ["git", "diff", "--no-ext-diff", "--stat"]),
    (["git", "log", "--show-signature"], ["git", "log", "--stat"]),
    (["git", "branch", "new-branch"], ["git", "branch", "--list", "feat*"]),
    (["git", "branch", "-v", "new"], ["git", "branch", "-vv"]),
    (["tree", "-o", "/home/u/x"], ["ls", "-R"]),
    (["uniq", "in", "/home/u/out"], ["uniq", "-c", "in"]),
    (["find", ".", "-exec", "sh", "-c", "x", ";"], ["find", ".", "-name", "*.py", "-print"]),
    (["find", ".", "-delete"], ["find", ".", "-type", "f", "-newermt", "2020-01-01"]),
    (["find", ".", "-fprint", "/home/u/x"], ["find", "-L", ".", "-maxdepth", "2", "-printf", "%p\n"]),
    (["date", "-s", "2020-01-01"], ["date", "-u", "+%s"]),
    (["date", "010203042030"], ["date", "-d", "yesterday", "+%F"]),
    (["hostname", "evil"], ["hostname", "-s"]),
    (["file", "-C", "-m", "x"], ["file", "-b", "f"]),
    (["file", "-z", "f.gz"], ["file", "--mime-type", "f.gz"]),
    (["diff", "-l", "a", "b"], ["diff", "-u", "a", "b"]),
    (["df", "--sync"], ["df", "-h"]),
    (["xxd", "in", "out"], ["od", "-c", "in"]),
    (["ls", "--colour=never"], ["ls", "--color=never"]),                                  # an abbreviation
])
def test_the_finding_and_its_controls(attack: list[str], control: list[str]) -> None:
    assert effect(attack) == UNKNOWN, attack
    assert effect(control) == RO, control


@pytest.mark.parametrize("overlay", [
    {"LD_PRELOAD": "/ws/x.so"}, {"LD_LIBRARY_PATH": "/ws"}, {"LD_AUDIT": "x"}, {"BASH_ENV": "/ws/x.sh"},
    {"ENV": "/ws/x.sh"}, {"SHELLOPTS": "xtrace", "PS4": "$(x)"}, {"BASH_FUNC_ls%%": "() { x; }"},
    {"GIT_CONFIG_COUNT": "1"}, {"GIT_DIR": "/tmp/g"}, {"GIT_PAGER": "x"}, {"PAGER": "x"}, {"EDITOR": "x"},
    {"PYTHONPATH": "/ws"}, {"TMPDIR": "/home/u"}, {"RIPGREP_CONFIG_PATH": "/ws/rc"}, {"GCONV_PATH": "/ws"},
    {"GLIBC_TUNABLES": "x"}, {"PATH": "/usr/bin:/bin"}, {"HOME": "/root"}, {"XDG_CONFIG_HOME": "/ws"},
    {"LANG": "/ws/locale"}, {"LC_ALL": "../../ws/x"}, {"TERM": "/ws/terminfo"}, {"TZ": "/ws/zone"},
    {"TZ": ":/ws/zone"}, {"COLUMNS": "80x"}, {"OPENAI_API_KEY": "sk-..."},
])
def test_a_variable_outside_the_safe_set_makes_any_command_unknown(overlay: dict[str, str]) -> None:
    found = classify_command(["ls"], cwd="/ws", scope=SCOPE, env=CommandEnv(overlay=overlay))
    assert found.effect == UNKNOWN and "the environment sets" in found.note, found
    assert effect(["mkdir", "x"], CommandEnv(overlay=overlay)) == UNKNOWN
    # The session's own env counts too (its PATH and HOME are judged as directories, below).
    if set(overlay) - {"PATH", "HOME"}:
        assert effect(["ls"], CommandEnv(configured=overlay)) == UNKNOWN


def test_the_safe_set_keeps_commands_vouched_for() -> None:
    """The control: locale, terminal and colour variables with plain values."""
    safe = {"LANG": "en_US.UTF-8", "LC_ALL": "C", "LANGUAGE": "fr:en", "TERM": "xterm-256color", "COLUMNS": "120",
            "NO_COLOR": "1", "COLORTERM": "truecolor", "TZ": "Europe/Paris", "CLICOLOR_FORCE": "1"}
    assert effect(["ls"], CommandEnv(overlay=safe)) == RO
    assert effect(["mkdir", "x"], CommandEnv(configured=safe)) == WW
    # A network or destructive command keeps its effect: it is asked about (or refused) anyway.
    assert effect(["curl", "x"], CommandEnv(overlay={"LD_PRELOAD": "x"})) == NET
    assert effect(["rm", "-rf", "/etc"], CommandEnv(overlay={"LD_PRELOAD": "x"})) == DESTRUCTIVE


def test_a_bare_name_is_vouched_for_only_with_a_path_the_agent_cannot_write() -> None:
    venv = CommandEnv(path="/ws/.venv/bin:/usr/local/bin:/usr/bin:/bin")
    found = classify_command(["ls"], cwd="/ws", scope=SCOPE, env=venv)
    assert found.effect == UNKNOWN and "/ws/.venv/bin" in found.note, found
    assert effect(["sh", "-c", "/usr/bin/ls"], venv) == UNKNOWN                 # `sh` itself is looked up
    assert effect(["/bin/sh", "-c", "ls"], venv) == UNKNOWN                      # so is the script's `ls`
    assert effect(["/usr/bin/ls", "-la"], venv) == RO                           # the control: a system path
    assert effect(["/bin/sh", "-c", "/usr/bin/ls && /bin/cat f"], venv) == RO
    for path in ("/tmp/bin:/usr/bin", "/dev/shm/x:/usr/bin", "/cache/bin:/bin", "relative:/usr/bin",
                 "/proc/self/cwd/bin:/usr/bin", "/usr/bin::/bin"):
        assert effect(["ls"], CommandEnv(path=path)) == UNKNOWN, path
        assert effect(["ls"], CommandEnv(configured={"PATH": path})) == UNKNOWN, path
    for path in ("/usr/local/bin:/usr/bin:/bin", "/opt/tool/bin:/usr/bin", "/tmp/sandboxd-home/bin:/usr/bin"):
        assert effect(["ls"], CommandEnv(path=path)) == RO, path
        assert effect(["ls"], CommandEnv(configured={"PATH": path})) == RO, path
    # A read-only sandbox: nothing is written without asking, so its workspace may be on PATH.
    read_only = SCOPE.replace(writes_allowed=False)
    assert effect(["ls"], venv, read_only) == RO


def test_git_needs_a_home_and_repositories_the_agent_cannot_write() -> None:
    assert effect(["git", "status"], CommandEnv(home="/tmp/sandboxd-home")) == RO
    found = classify_command(["git", "status"], cwd="/ws", scope=SCOPE, env=CommandEnv(home="/ws"))
    assert found.effect == UNKNOWN and "HOME" in found.note, found                # a workspace that is HOME
    assert effect(["git", "log"], CommandEnv(configured={"HOME": "/cache/home"})) == UNKNOWN
    assert effect(["git", "log"], CommandEnv(configured={"HOME": "/home/u"})) == RO
    assert effect(["ls"], CommandEnv(home="/ws")) == RO                         # only git reads it
    unguarded = SCOPE.replace(git_guarded=False, scratch=())                     # danger-full-access
    found = classify_command(["git", "status"], cwd="/ws", scope=unguarded, env=CommandEnv(home="/home/u"))
    assert found.effect == UNKNOWN and "git guard" in found.note, found
    assert effect(["/bin/sh", "-c", "ls && git log"], CommandEnv(home="/home/u"), unguarded) == UNKNOWN
    assert effect(["ls"], CommandEnv(home="/home/u"), unguarded) == RO


def test_the_session_home_is_not_a_scratch_area() -> None:
    """Writing the commands' HOME would plant .gitconfig for the next `git status`: destructive,
    like .git/config; the rest of /tmp stays the sandbox's scratch."""
    assert SCOPE.effect_of(["/tmp/sandboxd-home/.gitconfig"])[0] == DESTRUCTIVE
    assert effect(["touch", "/tmp/sandboxd-home/.gitconfig"]) == DESTRUCTIVE
    assert effect(["cp", "x", "/ws/.git/hooks/pre-commit"]) == DESTRUCTIVE
    assert effect(["touch", "/tmp/scratch"]) == WW
    assert SCOPE.replace(scratch=()).effect_of(["/tmp/sandboxd-home/x"])[0] == DESTRUCTIVE


@pytest.mark.parametrize("argv, expected", [
    (["mkdir", "-p", "build/out"], WW), (["mkdir", "-m", "755", "d"], WW), (["mkdir", "-m", "4755", "d"], UNKNOWN),
    (["mkdir", "--mode=2775", "d"], UNKNOWN), (["chmod", "u+s", "x"], UNKNOWN), (["chmod", "g+s,u+x", "x"], UNKNOWN),
    (["chmod", "4755", "x"], UNKNOWN), (["chmod", "0755", "x"], WW), (["chmod", "-R", "go-w,u+x", "d"], WW),
    (["chmod", "-x", "f"], UNKNOWN), (["cp", "--target-directory=/etc", "x"], DESTRUCTIVE),
    (["cp", "-t", "/etc", "x"], DESTRUCTIVE), (["cp", "-t/etc", "x"], DESTRUCTIVE), (["cp", "-r", "a", "b"], WW),
    (["cp", "--parents", "../../x", "d"], UNKNOWN), (["cp", "-s", "/etc/passwd", "l"], UNKNOWN),
    (["cp", "-l", "a", "b"], UNKNOWN), (["cp", "--backup", "--suffix=/../../x", "a", "b"], UNKNOWN),
    (["mv", "-S", "/x", "a", "b"], UNKNOWN), (["ln", "-s", "..", "up"], UNKNOWN), (["rmdir", "-p", "a/b"], UNKNOWN),
    (["rm", "--no-preserve-root", "-rf", "x"], UNKNOWN), (["rm", "-rf", "/cache/old"], WW),
    (["rm", "-rf", "/etc"], DESTRUCTIVE), (["touch", "-r", "/etc/hosts", "f"], WW), (["truncate", "-s", "0", "f"], WW),
    (["mkdir"], UNKNOWN), (["mv", "a", "../elsewhere"], DESTRUCTIVE),
])
def test_writers_in_their_known_forms(argv: list[str], expected: str) -> None:
    assert effect(argv) == expected


@pytest.mark.parametrize("script, expected", [
    ("ls -la", RO), ("ls && git status | head -5", RO), ("cat a || cat b ; wc -l c", RO),
    ("cd sub && ls", RO), ("cd sub && mkdir x", WW), ("mkdir a && cd a && touch b", WW),
    ("ls 'my dir' \"other dir\" plain-word_1.2,x:y=z+@%", RO),
    ("ls; rm -rf /", UNKNOWN), ("ls && sed -n 'e x' f", UNKNOWN), ("cat a > /etc/passwd", UNKNOWN),
    ("echo $(id)", UNKNOWN), ("echo `id`", UNKNOWN), ("echo \"$HOME\"", UNKNOWN), ("echo 'unterminated", UNKNOWN),
    ("ls *.py", UNKNOWN), ("ls ~", UNKNOWN), ("ls {a,b}", UNKNOWN), ("ls &", UNKNOWN), ("ls |& cat", UNKNOWN),
    ("ls\nid", UNKNOWN), ("ls # x", UNKNOWN), ("LD_PRELOAD=/ws/x.so ls", UNKNOWN), ("'A=1' ls", UNKNOWN),
    ("ls &&", UNKNOWN), ("&& ls", UNKNOWN), ("", UNKNOWN), ("ls \\; x", UNKNOWN), ("cd /tmp && git log", UNKNOWN),
    ("cd .. && mkdir x", UNKNOWN), ("cd sub | ls", UNKNOWN), ("cd - && ls", UNKNOWN), ("cd && ls", UNKNOWN),
    ("ls ;; ls", UNKNOWN), ("curl x && ls", UNKNOWN), ("mkdir /etc/x && ls", UNKNOWN), ("pytest -q", UNKNOWN),
])
def test_shell_scripts(script: str, expected: str) -> None:
    assert effect(["/bin/sh", "-c", script]) == expected, script
    assert effect(["bash", "-c", script]) == expected, script


def test_cd_then_a_relative_write_is_judged_from_both_directories() -> None:
    """`cd a || mkdir ../x`: mkdir runs where the shell was when cd failed, and there ../x is outside
    the roots; after `cd a && ...` too, since `a && b || c` runs c after a failed."""
    assert effect(["/bin/sh", "-c", "cd a || mkdir ../x"]) == UNKNOWN
    assert effect(["/bin/sh", "-c", "cd a && mkdir ../x"]) == UNKNOWN
    assert effect(["/bin/sh", "-c", "cd a && mkdir x ../y"]) == UNKNOWN
    assert effect(["/bin/sh", "-c", "cd a/b && mkdir x y/z"]) == WW            # inside from both


def test_the_split_of_a_script() -> None:
    commands = split("ls -l 'a b' && cat \"c\"d | wc")
    assert commands is not None
    assert [(c.joined_by, c.argv) for c in commands] == [("", ("ls", "-l", "a b")), ("&&", ("cat", "cd")),
                                                        ("|", ("wc",))]
    assert split("echo ''")[0].argv == ("echo", "")  # type: ignore[index]


def test_the_argument_grammar_reads_as_getopt_does() -> None:
    grammar = Grammar(flags="ab", valued="n", attached="w", long_flags=frozenset({"all"}),
                      long_valued=frozenset({"lines"}), long_optional=frozenset({"color"}), numbers=True)
    assert parse(grammar, ["-ab", "-n5", "x"]) is not None
    parsed = parse(grammar, ["-an", "-o", "f"])                     # -n takes "-o": a value, not an option
    assert parsed is not None and ("n", "-o") in parsed.options and parsed.operands == ("f",)
    assert parse(grammar, ["-w"]) is not None and parse(grammar, ["-w", "-o"]) is None   # optional: attached only
    assert parse(grammar, ["--lines", "3"]) is not None and parse(grammar, ["--lines=3"]) is not None
    assert parse(grammar, ["--lines"]) is None                      # a required value missing
    assert parse(grammar, ["--color"]) is not None and parse(grammar, ["--color", "-o"]) is None
    assert parse(grammar, ["--all=x"]) is None and parse(grammar, ["--al"]) is None
    assert parse(grammar, ["-5"]) is not None and parse(grammar, ["-5x"]) is None
    assert parse(grammar, ["x", "-o"]) is None                      # permutation: an option after an operand
    parsed = parse(grammar, ["--", "-o", "--pre=x"])
    assert parsed is not None and parsed.operands == ("-o", "--pre=x")
    assert parse(grammar.replace(max_operands=1), ["a", "b"]) is None


# Round 4's third hostile pass (against the rewritten classifier): each ran an agent's program
# through a real daemon without asking. Each with its control, still vouched for.
@pytest.mark.parametrize("attack, control", [
    # bash's builtins evaluate an array subscript in a variable's name, quotes and all, and
    # printf -v assigns any variable (/usr/bin/test and /usr/bin/printf do neither: not scripts).
    (["bash", "-c", "test -v 'a[$(id > /ws/P)]'"], ["bash", "-c", "test -f a.txt"]),
    (["bash", "-c", "[ -v 'a[$(id)]' ]"], ["bash", "-c", "test -d src && ls src"]),
    (["bash", "-c", "printf -v 'a[$(uname)]' x"], ["bash", "-c", "printf '%s\\n' done"]),
    (["bash", "-c", "printf -v PATH %s /ws/bin && ls"], ["bash", "-c", "printf x && ls"]),
    (["sh", "-c", "test -R 'a[$(id)]'"], ["sh", "-c", "echo 'a b'"]),
    (["sh", "-c", "echo '$(id)'"], ["sh", "-c", "echo ok; pwd"]),
    # A nested repository's config planted and run in one script (the guard cleans after the call).
    (["sh", "-c", "cp cfg sub/.git/config && cd sub && git status"], ["sh", "-c", "cd sub && git status"]),
    (["sh", "-c", "cp -r planted sub && cd sub/planted && git status"], ["sh", "-c", "git status && git log -3"]),
    # Debian's egrep and fgrep are scripts that run `grep` from PATH.
    (["/usr/bin/egrep", "x", "f"], ["/usr/bin/grep", "-E", "x", "f"]),
    (["fgrep", "x", "f"], ["grep", "-F", "x", "f"]),
    # git gives a required value the next word, "--" too, and reads the rest as options.
    (["git", "describe", "--match", "--", "--always"], ["git", "describe", "--match=v*", "--always"]),
])
def test_the_third_pass_and_its_controls(attack: list[str], control: list[str]) -> None:
    assert effect(attack) == UNKNOWN, attack
    assert effect(control) == RO, control


@pytest.mark.parametrize("argv", [
    ["cp", "-r", "h/sandboxd-home", "/tmp"],                    # lands as /tmp/sandboxd-home: the commands' HOME
    ["cp", "-r", "-t", "/tmp", "h/sandboxd-home"],
    ["mv", "h/sandboxd-home/", "/tmp"],
])
def test_writes_that_land_in_home_are_refused(argv: list[str]) -> None:
    assert effect(argv) == DESTRUCTIVE, argv


@pytest.mark.parametrize("argv", [
    ["cp", "-rT", "h", "/tmp"],                                 # h's contents, its sandboxd-home too, into /tmp
    ["cp", "-r", "h/.", "/tmp"],
    ["cp", "cfg", "sub/.git/config"],                          # a nested repository's configuration
    ["cp", "-r", "planted/.git", "sub"],                       # a .git moved into place
    ["mv", "x", "deep/er/.git"],
    ["touch", "sub/.git/hooks/pre-commit"],
    ["mkdir", "-p", "a/.git/hooks"],
])
def test_writes_that_may_fill_home_or_a_repository_are_asked(argv: list[str]) -> None:
    assert effect(argv) == UNKNOWN, argv


@pytest.mark.parametrize("argv", [
    ["cp", "-r", "src", "/tmp/src"], ["cp", "a", "b"], ["mv", "build", "/tmp/old-build"], ["mkdir", "-p", "a/b"],
    ["cp", "-t", "out", "a", "b"], ["touch", "a.git", ".gitignore"],
])
def test_the_same_writes_elsewhere_are_workspace_writes(argv: list[str]) -> None:
    assert effect(argv) == WW, argv
