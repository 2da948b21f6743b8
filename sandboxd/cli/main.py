"""`sandboxd` entry point: dispatches to a subcommand, importing only what it needs."""

from __future__ import annotations

import sys

USAGE = """usage: sandboxd COMMAND [ARGS...]

commands:
  run      run one command in a sandbox, no daemon (see: sandboxd run --help)
  serve    run the daemon: sessions with persistent sandboxes over gRPC (see: sandboxd serve --help)
  version  print the version
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        from sandboxd.cli.run import main as run_main
        return run_main(rest)
    if command == "serve":
        from sandboxd.cli.serve import main as serve_main
        return serve_main(rest)
    if command in ("version", "--version"):
        from sandboxd import __version__
        print(f"sandboxd {__version__}")
        return 0
    sys.stderr.write(f"sandboxd: unknown command {command!r}\n{USAGE}")
    return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
