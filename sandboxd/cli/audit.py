"""`sandboxd audit verify` and `sandboxd audit pubkey`: the audit chain checked offline.

verify opens the database immutable (nothing is written or locked beside it, so it may be a copy in
someone else's directory; one with a ``-wal`` beside it is refused, saying what to do), checks
the checkpoints with --pubkey (pinned) or else --state-dir's key, never the --db directory's, says
which, and prints one line: "whole: ..." with
the count, the head and the last checkpoint and its key, or the first edited, inserted, deleted or
reordered event. Exit status 0 whole, 1 not whole, 2 bad usage or an unreadable database.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys

from sandboxd import defaults
from sandboxd.errors import InvalidPolicy
from sandboxd.printable import printable



def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd audit", description="check the audit log's hash chain")
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="verify the chain and the signed checkpoints (offline, read-only)")
    verify.add_argument("--db", help="the event store (default: STATE_DIR/events.db)")
    verify.add_argument("--pubkey", help="the public key to verify checkpoints with, as `sandboxd audit pubkey` "
                        "printed it (default: the state directory's, not pinned)")
    verify.add_argument("--state-dir", default=defaults.STATE_DIR, help="the daemon's state directory, whose key "
                        f"checks the checkpoints without --pubkey (also with --db; default {defaults.STATE_DIR})")
    verify.add_argument("--session", default="", help="verify one session's stream only")
    pubkey = commands.add_parser("pubkey", help="print the public key checkpoints are signed with")
    pubkey.add_argument("--state-dir", default=defaults.STATE_DIR, help=f"default {defaults.STATE_DIR}")
    args = parser.parse_args(argv)
    from sandboxd.audit.integrity import keys

    if args.command == "pubkey":
        try:
            print(keys.public_line(keys.read_public_of_state(args.state_dir)))
        except FileNotFoundError:
            sys.stderr.write(f"sandboxd audit: no audit signing key in {printable(args.state_dir)} (the daemon makes "
                             "one at its first start)\n")
            return 2
        except (InvalidPolicy, OSError) as exc:
            sys.stderr.write(f"sandboxd audit: {printable(str(exc))}\n")
            return 2
        return 0
    return _verify(args)


def _verify(args: argparse.Namespace) -> int:
    from sandboxd.audit.integrity import keys
    from sandboxd.audit.integrity.verify import Kind, Verifier, open_read_only

    path = args.db or os.path.join(args.state_dir, "events.db")
    try:
        if args.pubkey:
            public, pinned = keys.read_public_file(args.pubkey), True
            source = f"pinned key of {args.pubkey}"
        else:
            # The state directory's key (--state-dir), never the --db file's directory's: whoever
            # writes that directory would choose the key a forged log is checked with.
            source = f"key of {args.state_dir} (--state-dir; not pinned: pass --pubkey)"
            try:
                public, pinned = keys.read_public_of_state(args.state_dir), False
            except FileNotFoundError:
                public, pinned, source = None, False, f"no key: none in {args.state_dir} (--state-dir)"
        db = open_read_only(path)
    except FileNotFoundError as exc:
        sys.stderr.write(f"sandboxd audit: no such file {printable(exc.filename or str(exc))}\n")
        return 2
    except (InvalidPolicy, OSError, sqlite3.Error, ValueError) as exc:
        sys.stderr.write(f"sandboxd audit: {printable(str(exc))}\n")
        return 2
    try:
        verifier = Verifier(db, public, pinned=pinned)
        report = verifier.verify_session(args.session) if args.session else verifier.verify()
    except Exception as exc:          # a crafted file: one line, exit 2 ("unreadable"), never a traceback
        sys.stderr.write(f"sandboxd audit: cannot read {printable(path)}: {printable(type(exc).__name__)}: "
                         f"{printable(str(exc))[:300]}\n")
        return 2
    finally:
        db.close()
    if args.session and report.whole and not report.events and not report.legacy:
        sys.stderr.write(f"sandboxd audit: no events of session {printable(args.session)} in {printable(path)}\n")
        return 2
    print(printable(report.text()))
    sys.stderr.write(f"sandboxd audit: checkpoints checked with the {printable(source)}\n")
    if report.whole:
        rate = report.events / report.seconds if report.seconds > 0 else 0.0
        print(f"  verified in {report.seconds:.2f} s ({rate:,.0f} events/s)")
    if report.problem is not None and report.problem.kind == Kind.UNCHAINED:
        return 2                      # not a store this sandboxd can check (no chain, a view, another schema)
    return 0 if report.whole else 1
