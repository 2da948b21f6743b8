"""`sandboxd` entry point: dispatches to a subcommand, importing only what it needs."""

from __future__ import annotations

import sys

from sandboxd.printable import printable

USAGE = """usage: sandboxd COMMAND [ARGS...]

commands:
  run      run one command in a sandbox, no daemon (see: sandboxd run --help)
  changes  DIR: show a change set `sandboxd run --review` kept (see: sandboxd changes --help)
  apply    DIR: apply it to the host, as the owner of each root (conflicts and flagged changes stay)
  discard  DIR: drop it
  mcp      an MCP server whose tools run in a sandboxd session (see: sandboxd mcp --help)
  serve    run the daemon: sessions with persistent sandboxes over gRPC (see: sandboxd serve --help)
  drain    let a daemon's running calls finish, refusing new ones, then stop it (see: sandboxd drain --help)
  config   check FILE: validate a configuration file; defaults: print one with every key
  audit    verify [--db PATH] [--pubkey FILE]: check the audit log's hash chain; pubkey: print the signing key
  doctor   check this machine for everything enforcement needs, and say how to fix what is missing;
           --config FILE: also the address pool, state directory and audit database it names
  version  print the version
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        try:
            from sandboxd.cli.run import main as run_main
            return run_main(rest)
        except KeyboardInterrupt:          # Ctrl-C before a sandbox exists (after: the command gets it)
            return 128 + 2
    if command in ("changes", "apply", "discard"):
        from sandboxd.cli.review_commands import main as review_main
        return review_main(command, rest)
    if command == "mcp":
        from sandboxd.cli.mcp import main as mcp_main
        return mcp_main(rest)
    if command == "serve":
        from sandboxd.cli.serve import main as serve_main
        return serve_main(rest)
    if command == "drain":
        from sandboxd.cli.drain import main as drain_main
        return drain_main(rest)
    if command == "config":
        return _config(rest)
    if command == "audit":
        from sandboxd.cli.audit import main as audit_main
        return audit_main(rest)
    if command == "doctor":
        from sandboxd.cli.doctor import main as doctor_main
        return doctor_main(rest)
    if command in ("version", "--version"):
        from sandboxd import __version__
        print(f"sandboxd {__version__}")
        return 0
    sys.stderr.write(f"sandboxd: unknown command {printable(command)}\n{USAGE}")
    return 2


def _config(args: list[str]) -> int:
    from sandboxd import config

    if args == ["defaults"]:
        sys.stdout.write(config.defaults_file())
        return 0
    if len(args) == 2 and args[0] == "check":
        # What `sandboxd serve --config FILE` would load, through the same path: the file, this
        # environment's SANDBOXD_* variables, what the keys name (groups, users, TLS files, hosts).
        try:
            loaded = config.load(args[1]).source
        except config.ConfigError as exc:
            sys.stderr.write(f"sandboxd config: {printable(str(exc))}\n")   # it may quote the file's text
            return 2
        print(f"{printable(args[1])}: ok")
        for key in config.KEYS:
            print(f"  {key.dotted} = {printable(repr(loaded[key.dotted]))}")
        return 0
    sys.stderr.write("usage: sandboxd config check FILE | sandboxd config defaults\n")
    return 2


def entry() -> None:
    code = main()
    if sys.argv[1:2] == ["run"]:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """End `sandboxd run` without the interpreter's teardown (freeing every module: several ms of a
    run that takes tens). Nothing is lost: the run has reaped its sandbox, closed its ports and
    removed its cgroups; what remains is flushing stdio and the atexit handlers (kernel.cgroups
    removes the base groups it made there), run here as at a normal exit."""
    import atexit
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)                               # let the interpreter report it as it always does
    import os
    os._exit(code)


if __name__ == "__main__":
    entry()
