"""One constant per default (sandboxd/defaults.py): the network mode a sandbox gets when it does not
say, and the egress proxy's port, are written once and used everywhere. Read from the source: a
default written again as a literal anywhere in sandboxd/ fails here, with where it is."""

from __future__ import annotations

import ast
from pathlib import Path

from sandboxd import defaults
from sandboxd.policy import policy_from_name
from sandboxd.policy.sandbox import NETWORK_MODES, WorkspaceWrite
from sandboxd.policy.spec import policy_from_dict

SANDBOXD = Path(__file__).resolve().parents[1] / "sandboxd"


def _mode_defaults(tree: ast.AST) -> list[int]:
    """Lines where a network mode name stands as a default: a parameter's or a field's default, the
    right side of an ``or``, or getattr's fallback."""
    found: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            found += node.defaults + node.kw_defaults
        elif isinstance(node, ast.AnnAssign):
            found.append(node.value)
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            found += node.values[1:]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) == 3):
            found.append(node.args[2])
    return [value.lineno for value in found
            if isinstance(value, ast.Constant) and value.value in NETWORK_MODES]


def _port_literals(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value == defaults.PROXY_PORT]


def test_no_default_is_written_twice() -> None:
    stray = []
    for path in sorted(SANDBOXD.rglob("*.py")):
        if path.name == "defaults.py" or "v1" in path.relative_to(SANDBOXD).parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(SANDBOXD.parent)
        stray += [f"{where}:{line}: a network mode as a default" for line in _mode_defaults(tree)]
        stray += [f"{where}:{line}: the proxy port" for line in _port_literals(tree)]
    assert stray == [], "use sandboxd.defaults.NETWORK_MODE / PROXY_PORT"


def test_the_check_sees_a_stray_default() -> None:
    """The control: each form the check looks for is found."""
    tree = ast.parse('def f(mode: str = "isolated"): pass\n'
                     'class P:\n    network_mode: str = "host"\n'
                     'mode = given or "isolated"\n'
                     'mode = getattr(policy, "network_mode", "host")\n'
                     'port = 3128\n')
    assert _mode_defaults(tree) == [1, 3, 4, 5] and _port_literals(tree) == [6]


def test_every_path_gives_the_same_default() -> None:
    """A policy built without a mode, from the wire form without one, and the class default agree."""
    assert defaults.NETWORK_MODE in NETWORK_MODES
    built = policy_from_name("workspace-write", network_access=True)
    assert isinstance(built, WorkspaceWrite)
    stored = policy_from_dict({"name": "workspace-write", "network_access": True})
    assert isinstance(stored, WorkspaceWrite)
    assert built.network_mode == stored.network_mode == WorkspaceWrite().network_mode == defaults.NETWORK_MODE
