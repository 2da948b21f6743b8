"""The commands the classifier vouches for, each with the exact options and operands known to run
no other program and to write nowhere (read-only), or to write only the paths they name
(workspace-write, judged by those paths). Anything else a program accepts is not listed, so it
is an unknown command: the options that run a program or write a file (``sed e``/``w``/``-i``,
``sort --compress-program``/``-o``, ``rg --pre``, ``git grep -O``, ``git -c``, ``find -exec``,
``tree -o``, ``uniq IN OUT`` ...) are refused because nothing admits them, not because a list
names them.

The technique is openai/codex's ``is_safe_command`` (codex-rs/core/src/command_safety), made
stricter: codex lists the dangerous options of a few programs; here each program's harmless
options are listed and the rest refused, the arguments are read as the program reads them
(sandboxd.policy.argv_grammar: clusters, values, permutation, ``--``), and
``tests/test_classify_differential.py`` runs what this module calls read-only on the real kernel
with a canary program on PATH and a write-watched scratch directory, so the tables and the
programs themselves must agree.

What each table relies on, beyond the options (sandboxd.policy.command_env): the environment
holds only variables known not to change what a program runs; a bare program name is looked up
in a PATH whose directories the agent cannot write; git reads a HOME the agent cannot write, and
the repository configuration the git guard (sandboxd/gitguard) leaves in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from sandboxd.policy.argv_grammar import Grammar, Parsed, parse, words

# -- read-only programs: their options (GNU coreutils 9, grep 3, ripgrep 13, file 5) --------------

ANY_ARGUMENTS = "any"          # the program reads or prints its arguments and nothing else

_GREP = Grammar(flags="EFGPiyvwxcLloqsbHhnTZzarRUI", valued="efmABCDd", numbers=True, long_flags=words(
    "extended-regexp fixed-strings basic-regexp perl-regexp ignore-case no-ignore-case invert-match word-regexp "
    "line-regexp count files-without-match files-with-matches only-matching quiet silent no-messages byte-offset "
    "with-filename no-filename line-number initial-tab null null-data text recursive dereference-recursive "
    "line-buffered binary"),
    long_valued=words("regexp file max-count label after-context before-context context binary-files devices "
                      "directories exclude exclude-from exclude-dir include"),
    long_optional=words("color colour"))
_SUMS = Grammar(flags="bctwz", long_flags=words("binary check tag text zero ignore-missing quiet status strict warn"))

READ_ONLY_PROGRAMS: dict[str, Grammar | str] = {
    "echo": ANY_ARGUMENTS, "printf": ANY_ARGUMENTS, "true": ANY_ARGUMENTS, "false": ANY_ARGUMENTS,
    "test": ANY_ARGUMENTS, "[": ANY_ARGUMENTS,
    "pwd": Grammar(flags="LP", long_flags=words("logical physical"), max_operands=0),
    "whoami": Grammar(max_operands=0),
    "id": Grammar(flags="aZgGnruz", long_flags=words("context group groups name real user zero")),
    "uname": Grammar(flags="asnrvmpio", long_flags=words(
        "all kernel-name nodename kernel-release kernel-version machine processor hardware-platform "
        "operating-system"), max_operands=0),
    # An operand of hostname, -F and -b set the host's name: none of them.
    "hostname": Grammar(flags="aAdfiIs", long_flags=words(
        "alias all-fqdns domain fqdn long ip-address all-ip-addresses short"), max_operands=0),
    "which": Grammar(flags="a"),
    "cat": Grammar(flags="AbeEnstTuv", long_flags=words(
        "show-all number-nonblank show-ends number squeeze-blank show-tabs show-nonprinting")),
    # Not tac: reading a pipe, it copies it to a file in TMPDIR first (the differential test saw /tmp change).
    "rev": Grammar(flags="0", long_flags=words("zero")),
    "nl": Grammar(flags="p", valued="bdfhilnsvw", long_flags=words("no-renumber"), long_valued=words(
        "body-numbering section-delimiter footer-numbering header-numbering line-increment join-blank-lines "
        "number-format number-separator starting-line-number number-width")),
    "head": Grammar(flags="qvz", valued="cn", numbers=True, long_flags=words("quiet silent verbose zero-terminated"),
                    long_valued=words("bytes lines")),
    "tail": Grammar(flags="fFqvz", valued="cns", numbers=True,
                    long_flags=words("retry quiet silent verbose zero-terminated"),
                    long_valued=words("bytes lines max-unchanged-stats pid sleep-interval"),
                    long_optional=words("follow")),
    "wc": Grammar(flags="cmlLw", long_flags=words("bytes chars lines max-line-length words"),
                  long_valued=words("files0-from total")),
    "ls": Grammar(flags="aAbBcCdDfFgGhHiklLmnNopqQrRsStuUvxXZ1", valued="ITw", long_flags=words(
        "all almost-all author escape ignore-backups directory dired file-type full-time "
        "group-directories-first no-group human-readable si dereference-command-line "
        "dereference-command-line-symlink-to-dir inode kibibytes dereference literal numeric-uid-gid "
        "hide-control-chars show-control-chars quote-name reverse recursive size context zero"),
        long_valued=words("block-size format hide ignore indicator-style quoting-style sort time time-style "
                          "tabsize width"),
        long_optional=words("color classify hyperlink")),
    "stat": Grammar(flags="Lft", valued="c", long_flags=words("dereference file-system terse"),
                    long_valued=words("format printf cached")),
    "du": Grammar(flags="0abcDhHklLmPsSx", valued="dBtX", long_flags=words(
        "null all apparent-size bytes total dereference-args human-readable inodes dereference count-links "
        "no-dereference separate-dirs si summarize one-file-system"),
        long_valued=words("max-depth block-size threshold exclude exclude-from files0-from time-style"),
        long_optional=words("time")),
    # Not --sync (a sync() of every file system).
    "df": Grammar(flags="ahHiklPT", valued="Btx", long_flags=words(
        "all human-readable si inodes local portability print-type total no-sync"),
        long_valued=words("block-size type exclude-type"), long_optional=words("output")),
    # file: not -C (compiles a magic file in the cwd), -z/-Z (may run decompressors), -p (sets
    # the files' access times back), -S (turns off file's own seccomp filter), -m, -P.
    "file": Grammar(flags="bEhikLlNnrs0", valued="eFf", long_flags=words(
        "brief mime mime-type mime-encoding apple extension keep-going dereference no-dereference no-pad "
        "no-buffer raw special-files print0"), long_valued=words("exclude exclude-quiet separator files-from")),
    # Not egrep or fgrep: Debian's are scripts that run `grep` from PATH, which the agent may write.
    "grep": _GREP,
    # ripgrep: not --pre/--pre-glob (runs a program per file), -z/--search-zip (runs
    # decompressors), --hostname-bin; its config file comes only from RIPGREP_CONFIG_PATH, a
    # variable outside the safe environment.
    "rg": Grammar(flags="iIsSvnNlcowxFHLpUPu0.", valued="efgtTABCmMjrdE", long_flags=words(
        "ignore-case case-sensitive smart-case invert-match line-number no-line-number files-with-matches "
        "files-without-match count count-matches only-matching word-regexp line-regexp fixed-strings "
        "with-filename no-filename follow hidden no-ignore no-ignore-vcs no-ignore-dot no-ignore-parent "
        "no-ignore-global no-ignore-exclude no-ignore-files no-heading heading null multiline "
        "multiline-dotall pcre2 json vimgrep column no-column stats trim files type-list no-messages "
        "unrestricted text byte-offset quiet crlf no-config passthru pretty max-columns-preview "
        "no-unicode sort-files"),
        long_valued=words("regexp file glob iglob type type-not max-count max-depth max-filesize max-columns "
                          "context after-context before-context replace sort sortr threads encoding color "
                          "colors context-separator field-match-separator path-separator ignore-file "
                          "engine type-add")),
    # diff: not -l/--paginate (runs pr).
    "diff": Grammar(flags="abBcdeEfHinNpqrstTuwyZ", valued="CDFILSUWxX", long_flags=words(
        "normal brief report-identical-files ed rcs side-by-side left-column suppress-common-lines "
        "show-c-function new-file unidirectional-new-file ignore-case ignore-file-name-case "
        "no-ignore-file-name-case ignore-tab-expansion ignore-trailing-space ignore-space-change "
        "ignore-all-space ignore-blank-lines text strip-trailing-cr expand-tabs initial-tab "
        "suppress-blank-empty minimal speed-large-files recursive no-dereference"),
        long_valued=words("ifdef show-function-line ignore-matching-lines label starting-file width exclude "
                          "exclude-from tabsize horizon-lines from-file to-file line-format old-line-format "
                          "new-line-format unchanged-line-format old-group-format new-group-format "
                          "changed-group-format unchanged-group-format"),
        long_optional=words("context unified color")),
    "cmp": Grammar(flags="bls", valued="in", long_flags=words("print-bytes verbose quiet silent"),
                   long_valued=words("ignore-initial bytes"), max_operands=4),
    # sort: not -o (writes), --compress-program (runs it), -T/-S/--batch-size (temporary files).
    "sort": Grammar(flags="bcCdfghiMmnRrsuVz", valued="kt", long_flags=words(
        "ignore-leading-blanks dictionary-order ignore-case general-numeric-sort ignore-nonprinting month-sort "
        "human-numeric-sort numeric-sort random-sort reverse version-sort merge stable unique zero-terminated "
        "debug"), long_valued=words("key field-separator sort random-source files0-from parallel"),
        long_optional=words("check")),
    # uniq: a second operand is the file it writes.
    "uniq": Grammar(flags="cdDiuz", valued="fsw", long_flags=words(
        "count repeated ignore-case unique zero-terminated"), long_valued=words("skip-fields skip-chars check-chars"),
        long_optional=words("all-repeated group"), max_operands=1),
    "cut": Grammar(flags="nsz", valued="bcdf", long_flags=words("complement only-delimited zero-terminated"),
                   long_valued=words("bytes characters delimiter fields output-delimiter")),
    "paste": Grammar(flags="sz", valued="d", long_flags=words("serial zero-terminated"),
                     long_valued=words("delimiters")),
    "tr": Grammar(flags="cCdst", long_flags=words("complement delete squeeze-repeats truncate-set1"), max_operands=2),
    "seq": Grammar(flags="w", valued="fs", long_flags=words("equal-width"), long_valued=words("format separator"),
                   max_operands=3),
    "base64": Grammar(flags="di", valued="w", long_flags=words("decode ignore-garbage"), long_valued=words("wrap"),
                      max_operands=1),
    "od": Grammar(flags="abcdfilosxv", valued="AjNSt", attached="w", long_flags=words("output-duplicates"),
                  long_valued=words("address-radix skip-bytes read-bytes format endian"),
                  long_optional=words("width strings")),
    "basename": Grammar(flags="az", valued="s", long_flags=words("multiple zero"), long_valued=words("suffix")),
    "dirname": Grammar(flags="z", long_flags=words("zero")),
    "realpath": Grammar(flags="eLmPqsz", long_flags=words(
        "canonicalize-existing canonicalize-missing logical physical quiet strip no-symlinks zero"),
        long_valued=words("relative-to relative-base")),
    "readlink": Grammar(flags="efmnqsvz", long_flags=words(
        "canonicalize canonicalize-existing canonicalize-missing no-newline quiet silent verbose zero")),
    "sha256sum": _SUMS, "sha1sum": _SUMS, "md5sum": _SUMS, "sha224sum": _SUMS, "sha384sum": _SUMS,
    "sha512sum": _SUMS,
}

# date: not -s/--set, and an operand only as +FORMAT (MMDDhhmm... sets the clock).
_DATE = Grammar(flags="uR", valued="dfr", attached="I", long_flags=words("utc universal rfc-email debug"),
                long_valued=words("date file reference rfc-3339"), long_optional=words("iso-8601"))


def _date(args: Sequence[str]) -> bool:
    parsed = parse(_DATE, args)
    return parsed is not None and all(operand.startswith("+") for operand in parsed.operands)


# -- find: its expression, word by word (findutils 4.9) --------------------------------------------

# Not -exec, -execdir, -ok, -okdir (run programs), -delete, -fls, -fprint, -fprint0, -fprintf
# (remove or write files).
FIND_ALONE = frozenset((
    "-print", "-print0", "-ls", "-prune", "-quit", "-true", "-false", "-empty", "-readable", "-writable",
    "-executable", "-nouser", "-nogroup", "-depth", "-d", "-xdev", "-mount", "-follow", "-noleaf", "-daystart",
    "-ignore_readdir_race", "-noignore_readdir_race", "-not", "!", "-a", "-and", "-o", "-or", "(", ")", ",",
))
FIND_VALUED = frozenset((
    "-name", "-iname", "-path", "-ipath", "-wholename", "-iwholename", "-regex", "-iregex", "-lname", "-ilname",
    "-type", "-xtype", "-size", "-perm", "-user", "-group", "-uid", "-gid", "-links", "-inum", "-samefile",
    "-newer", "-anewer", "-cnewer", "-mtime", "-mmin", "-atime", "-amin", "-ctime", "-cmin", "-used",
    "-maxdepth", "-mindepth", "-regextype", "-fstype", "-context", "-printf", "-files0-from",
))
FIND_TIMES = "amcBt"


def _find(args: Sequence[str]) -> bool:
    index = 0
    while index < len(args) and args[index] in ("-H", "-L", "-P"):
        index += 1
    while index < len(args) and not args[index].startswith("-") and args[index] not in ("(", "!", ")", ","):
        index += 1                                         # the starting points
    while index < len(args):
        word = args[index]
        index += 1
        if word in FIND_ALONE:
            continue
        newer = len(word) == 8 and word.startswith("-newer") and word[6] in FIND_TIMES and word[7] in FIND_TIMES
        if (word in FIND_VALUED or newer) and index < len(args):
            index += 1
            continue
        return False
    return True


# -- sed: only printing lines by number ----------------------------------------------------------


def _sed_address(text: str) -> bool:
    return text == "$" or (text.isdigit() and text.isascii())


def _sed(args: Sequence[str]) -> bool:
    """``sed -n Np FILE...`` and ``sed -n N,Mp FILE...``: no other script (``e`` runs a command,
    ``w`` writes a file, ``s///e`` and ``s///w`` too) and no other option (``-i`` edits in place)."""
    if len(args) < 2 or args[0] != "-n" or not args[1].endswith("p"):
        return False
    first, comma, last = args[1][:-1].partition(",")
    if not _sed_address(first) or (comma and not _sed_address(last)):
        return False
    return all(operand and not operand.startswith("-") for operand in args[2:])


# -- git: read-only subcommands, with no global option that points it elsewhere -------------------

# Not -c/--config-env (any configuration: core.fsmonitor, core.pager ...), -C, --git-dir,
# --work-tree, --exec-path, --namespace, --bare, --super-prefix, -p/--paginate, and none of what
# git would run a program for.
GIT_GLOBAL = words("no-pager no-optional-locks literal-pathspecs glob-pathspecs noglob-pathspecs icase-pathspecs "
                   "no-replace-objects")
GIT_GLOBAL_SHORT = ("-P",)

# What the revision walk and the diff machinery of log, show and diff accept that neither writes
# nor runs a program: not --output, --ext-diff, --textconv, --show-signature (runs gpg.program),
# --submodule, --open-files-in-pager, -O, --remerge-diff (it writes objects into a temporary
# directory of .git/objects: the differential test saw .git/objects change). Long options never take the next word here (the
# grammar's long_optional: only --name=value), so a value cannot hide an option.
_REVISIONS = words(
    "oneline graph stat shortstat numstat name-only name-status patch no-patch raw patch-with-stat patch-with-raw "
    "all branches tags remotes decorate no-decorate abbrev-commit no-abbrev-commit abbrev pretty format date "
    "relative-date reverse first-parent merges no-merges follow since until after before author committer grep "
    "all-match invert-grep regexp-ignore-case extended-regexp fixed-strings perl-regexp basic-regexp diff-filter "
    "find-renames find-copies find-copies-harder no-renames color no-color word-diff word-diff-regex color-words "
    "skip max-count left-right cherry-pick cherry-mark cherry boundary topo-order date-order author-date-order "
    "full-history simplify-by-decoration simplify-merges ancestry-path dense sparse show-pulls no-walk do-walk "
    "reflog walk-reflogs parents children full-diff log-size mailmap no-mailmap use-mailmap no-use-mailmap source "
    "summary compact-summary dirstat cumulative full-index binary unified minimal patience histogram "
    "diff-algorithm anchored ignore-space-at-eol ignore-space-change ignore-all-space ignore-blank-lines "
    "ignore-cr-at-eol ignore-matching-lines function-context relative text no-ext-diff no-textconv no-prefix "
    "src-prefix dst-prefix line-prefix exit-code quiet check notes no-notes expand-tabs no-expand-tabs encoding "
    "diff-merges no-diff-merges combined-all-paths cc color-moved no-color-moved irreversible-delete "
    "inter-hunk-context break-rewrites")
_LOG = Grammar(flags="puszwbWmciEFPRrtgD", valued="nSGL", attached="MCBUl", numbers=True, long_optional=_REVISIONS,
               option_like_values=False)
_DIFF = _LOG.replace(long_optional=_REVISIONS | words("cached staged no-index merge-base"))

GIT_SUBCOMMANDS: dict[str, Grammar] = {
    "status": Grammar(flags="sbvz", attached="u", long_optional=words(
        "short branch show-stash long verbose no-renames renames ahead-behind no-ahead-behind null porcelain "
        "untracked-files ignored ignore-submodules column no-column find-renames")),
    "log": _LOG, "show": _LOG, "diff": _DIFF,
    "rev-parse": Grammar(flags="q", long_optional=words(
        "show-toplevel abbrev-ref short verify git-dir is-inside-work-tree is-inside-git-dir show-prefix show-cdup "
        "symbolic symbolic-full-name quiet is-bare-repository absolute-git-dir git-common-dir "
        "show-superproject-working-tree is-shallow-repository show-object-format all branches tags remotes "
        "revs-only no-revs flags no-flags sq not since until path-format")),
    "ls-files": Grammar(flags="cdmoiskutvfz", valued="xX", long_optional=words(
        "cached deleted modified others ignored stage unmerged killed directory no-empty-directory eol deduplicate "
        "exclude-standard error-unmatch full-name sparse debug resolve-undo exclude exclude-from "
        "exclude-per-directory abbrev format with-tree")),
    "blame": Grammar(flags="bclnpstfew", valued="LS", attached="MC", long_optional=words(
        "porcelain line-porcelain incremental root show-stats show-name show-number show-email score-debug "
        "minimal color-lines color-by-age date abbrev ignore-rev ignore-revs-file contents encoding")),
    # git grep: not -O/--open-files-in-pager (runs the program it names), --textconv.
    "grep": Grammar(flags="ivwnlLchHoqrEFGPazIWp", valued="efABCm", numbers=True, long_optional=words(
        "cached no-index untracked no-exclude-standard exclude-standard text ignore-case word-regexp invert-match "
        "full-name extended-regexp basic-regexp perl-regexp fixed-strings line-number column files-with-matches "
        "name-only files-without-match null only-matching count heading break show-function function-context and "
        "or not all-match quiet no-color color max-depth threads context after-context before-context "
        "max-count")),
    "describe": Grammar(long_optional=words(
        "tags all long always exact-match contains first-parent debug abbrev dirty broken candidates match "
        "exclude")),
    "branch": Grammar(flags="arvl", long_optional=words(
        "list show-current all remotes verbose no-color ignore-case no-column color format sort contains "
        "no-contains merged no-merged points-at column abbrev")),
}


def git_subcommand(args: Sequence[str]) -> tuple[str, list[str]] | None:
    """The subcommand and its arguments, when every global option before it is harmless."""
    for index, arg in enumerate(args):
        if arg in GIT_GLOBAL_SHORT or (arg.startswith("--") and arg[2:] in GIT_GLOBAL):
            continue
        if arg.startswith("-"):
            return None
        return arg, list(args[index + 1:])
    return None


def _git(args: Sequence[str]) -> bool:
    found = git_subcommand(args)
    if found is None or found[0] not in GIT_SUBCOMMANDS:
        return False
    subcommand, rest = found
    parsed = parse(GIT_SUBCOMMANDS[subcommand], rest)
    if parsed is None:
        return False
    if subcommand == "branch":                 # operands are patterns only when listing, else new branches
        listing = any(name in ("l", "list") for name, _ in parsed.options)
        return listing or not parsed.operands
    return True


CHECKED: dict[str, Callable[[Sequence[str]], bool]] = {"date": _date, "find": _find, "sed": _sed, "git": _git}


def read_only(program: str, args: Sequence[str]) -> bool:
    """``program`` (a bare name) with ``args`` is in a form that runs nothing and writes nowhere."""
    checked = CHECKED.get(program)
    if checked is not None:
        return checked(args)
    grammar = READ_ONLY_PROGRAMS.get(program)
    if grammar is None:
        return False
    return grammar == ANY_ARGUMENTS or (isinstance(grammar, Grammar) and parse(grammar, args) is not None)


# -- programs that write the paths they name --------------------------------------------------------


def _mode(text: str) -> bool:
    """A permission mode without the set-user-ID and set-group-ID bits (a workspace file that runs as
    its owner for anyone would be a write far beyond the workspace): 755, 0644, u+x,go-w."""
    if text.isdigit() and text.isascii():
        return len(text) <= 3 or (len(text) == 4 and text[0] in "01")
    for clause in text.split(","):
        who = clause.lstrip("ugoa")
        if not who or who[0] not in "+-=" or not all(char in "rwxXt" for char in who[1:]):
            return False
    return bool(text)


class Writer(Grammar):
    """A program that writes the paths it is given: which options' values are paths it writes, and
    which operands are not paths (chmod's mode)."""

    target_options: frozenset[str] = frozenset()
    leading_data: int = 0                      # operands before the paths (chmod MODE)


# Not ln (a symbolic link's target is read from the link's own directory, where a lexical check
# on the command line cannot follow it), not cp -l/-s/--parents, not the backup options (-b, -S,
# --backup, --suffix: a suffix with a slash names another path), not rm --no-preserve-root,
# not rmdir -p (it climbs above the path it was given).
WRITERS: dict[str, Writer] = {
    "mkdir": Writer(flags="pv", valued="m", long_flags=words("parents verbose"), long_valued=words("mode")),
    "touch": Writer(flags="acfhm", valued="drt", long_flags=words("no-create no-dereference"),
                    long_valued=words("date reference time")),
    "cp": Writer(flags="afHLnPpRrTuvx", valued="t", long_flags=words(
        "archive force dereference no-clobber no-dereference recursive no-target-directory verbose "
        "one-file-system"), long_valued=words("target-directory"), long_optional=words("update preserve"),
        target_options=frozenset(("t", "target-directory"))),
    "mv": Writer(flags="fnTuv", valued="t", long_flags=words("force no-clobber no-target-directory verbose"),
                 long_valued=words("target-directory"), long_optional=words("update"),
                 target_options=frozenset(("t", "target-directory"))),
    "rm": Writer(flags="dfrRv", long_flags=words("dir force recursive verbose one-file-system"),
                 long_optional=words("preserve-root")),
    "rmdir": Writer(flags="v", long_flags=words("ignore-fail-on-non-empty verbose")),
    "chmod": Writer(flags="cfvR", long_flags=words("changes silent quiet verbose recursive preserve-root"),
                    leading_data=1),
    "truncate": Writer(flags="co", valued="rs", long_flags=words("no-create io-blocks"),
                       long_valued=words("reference size")),
}


def written_paths(program: str, args: Sequence[str]) -> list[str] | None:
    """The paths ``program`` with ``args`` writes (every one it names: sources too, which a move
    removes), or None when the command is not in a known form."""
    writer = WRITERS.get(program)
    if writer is None:
        return None
    parsed: Parsed | None = parse(writer, args)
    if parsed is None:
        return None
    modes = [value for name, value in parsed.options if name in ("m", "mode")]
    operands = list(parsed.operands)
    if writer.leading_data:
        if not operands:
            return None
        modes.append(operands.pop(0))
    if not all(_mode(mode) for mode in modes):
        return None
    targets = [value for name, value in parsed.options if name in writer.target_options]
    paths = operands + targets
    if program in ("cp", "mv") and paths:
        # Into a directory, each source lands below it under its own name (``cp -r home /tmp``
        # writes /tmp/home): whether the target is a directory is not known here, so both count.
        into = targets[-1] if targets else operands[-1]
        sources = operands if targets else operands[:-1]
        paths += [os.path.join(into, os.path.basename(source.rstrip("/")))
                  for source in sources if source.rstrip("/")]
    return paths or None
