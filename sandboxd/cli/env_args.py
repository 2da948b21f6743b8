"""`--env K=V` and `--env-file FILE` for `sandboxctl exec` and `sandboxctl session create`.

Only what is named here leaves the caller's environment (besides PATH, LANG and TERM, see
client.caller_environment): `--env NAME` without `=` passes the caller's own value of NAME,
on purpose, by name.
"""

from __future__ import annotations

import argparse
import os

MAX_ENV_FILE_BYTES = 1 << 20      # far above any real .env file; the daemon bounds the rest


def add_env_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help=f"set a variable for {what} (repeatable); K alone: your own value of K")
    parser.add_argument("--env-file", action="append", default=[], metavar="FILE",
                        help="KEY=VALUE lines (# comments and blank lines skipped); --env wins over it")


def env_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The files in order, then each --env, a later one overriding an earlier one."""
    env: dict[str, str] = {}
    for path in args.env_file:
        env.update(parse_env_file(path))
    for item in args.env:
        name, value = parse_assignment(item, "--env", allow_bare=True)
        env[name] = value
    return env


def parse_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE per line; `export KEY=VALUE` too; blank lines and lines starting with # are
    skipped; a value in matching single or double quotes loses them (nothing else is expanded).
    ValueError naming the file and line otherwise."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_ENV_FILE_BYTES + 1)
    except OSError as error:
        raise ValueError(f"--env-file {path}: {error.strerror}") from None
    if len(data) > MAX_ENV_FILE_BYTES:
        raise ValueError(f"--env-file {path}: larger than {MAX_ENV_FILE_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text") from None
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        name, value = parse_assignment(stripped, f"{path}:{number}", allow_bare=False)
        env[name] = value
    return env


def parse_assignment(text: str, where: str, *, allow_bare: bool) -> tuple[str, str]:
    """``NAME=VALUE`` (or, with ``allow_bare``, ``NAME``: the caller's own value). A file's line
    (not ``allow_bare``) loses one pair of matching quotes around its value; --env's value is
    taken as the shell gave it."""
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals and allow_bare:
        if name not in os.environ:
            raise ValueError(f"{where} {name}: no such variable in your environment (give {name}=VALUE)")
        value = os.environ[name]
    elif not equals:
        raise ValueError(f"{where}: expected KEY=VALUE, got {text[:80]!r}")
    if not _valid_name(name):
        raise ValueError(f"{where}: bad variable name {name[:80]!r} (letters, digits and _, not starting with a digit)")
    if not allow_bare and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # a file's quotes
        value = value[1:-1]
    return name, value


def _valid_name(name: str) -> bool:
    return bool(name) and not name[0].isdigit() and all(c == "_" or (c.isascii() and c.isalnum()) for c in name)
