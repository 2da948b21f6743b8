"""The generated gRPC code in sandboxd/v1 is committed; this proves it is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("sandboxd_pb2.py", "sandboxd_pb2_grpc.py", "sandboxd_pb2.pyi")


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    """Regenerate from protos/sandboxd/v1/sandboxd.proto and compare byte for byte. If this fails,
    run: python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=.
    protos/sandboxd/v1/sandboxd.proto"""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'protos'}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    str(REPO / "protos" / "sandboxd" / "v1" / "sandboxd.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "sandboxd" / "v1" / name).read_text()
        committed = (REPO / "sandboxd" / "v1" / name).read_text()
        assert fresh == committed, f"sandboxd/v1/{name} is stale: regenerate it (see this test's docstring)"


def test_service_has_the_documented_calls() -> None:
    from sandboxd.v1 import sandboxd_pb2
    methods = {m.name for m in sandboxd_pb2.DESCRIPTOR.services_by_name["Sandbox"].methods}
    assert {"CreateSession", "GetSession", "ListSessions", "CloseSession", "UpdateSessionPolicy", "Exec"} <= methods
