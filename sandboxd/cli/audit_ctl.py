"""`sandboxctl audit verify [--session S] [--json]`: the daemon checks its audit chain (the
VerifyAudit RPC) and this prints the answer: "whole: ..." or "NOT WHOLE: ..." naming the first
edited, inserted, deleted or reordered event. Exit status 0 whole, 1 not whole (or an error)."""

from __future__ import annotations

import argparse
import json

from sandboxd.client import SandboxClient
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    audit = commands.add_parser("audit", help="the audit log's hash chain: verify it")
    actions = audit.add_subparsers(dest="audit_action", required=True)
    verify = actions.add_parser("verify", help="the daemon verifies its chain (the whole node: administrators; "
                                "--session: one session of yours)")
    verify.add_argument("--session", default="", help="one session's own stream (default: the node's whole chain)")
    verify.add_argument("--json", action="store_true", help="the answer as one JSON object")


def run(client: SandboxClient, args: argparse.Namespace) -> int:
    answer = client.stub.VerifyAudit(pb.VerifyAuditRequest(session_id=args.session))
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(answer, always_print_fields_with_no_presence=True,
                                       preserving_proto_field_name=True)))
    else:
        print(printable(answer.summary))
    return 0 if answer.whole else 1
