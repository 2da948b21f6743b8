"""The packages of sandboxd import only downward: each entry of LAYERS may import the entries
below it, never one above it or beside it. Read from the source (no import), so it is quick and
a new package must be placed in the table before it can be imported at all."""

from __future__ import annotations

import ast
from pathlib import Path

SANDBOXD = Path(__file__).resolve().parents[1] / "sandboxd"

# Bottom first. Entries of one tuple are side by side: neither imports the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "_record", "errors", "defaults", "printable", "v1"),
    ("policy", "client"),
    ("kernel", "mcp"),
    ("launcher", "gitguard", "config", "review"),
    ("network",),          # the front door, relays, egress proxy, published ports, DNS
    ("supervisor",),
    ("audit",),
    ("service",),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    """The entry of LAYERS a source file belongs to: its package, or its own name at the top."""
    parts = path.relative_to(SANDBOXD).with_suffix("").parts
    return parts[0]


def _is_unit(name: str) -> bool:
    return (SANDBOXD / name).is_dir() or (SANDBOXD / f"{name}.py").is_file()


def _imported_units(tree: ast.AST) -> set[str]:
    units = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "sandboxd":
                # A module or package of sandboxd, else a name of sandboxd/__init__.py (__version__).
                names = [f"sandboxd.{alias.name}" if _is_unit(alias.name) else "sandboxd.__init__"
                         for alias in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        units |= {name.split(".")[1] for name in names if name.startswith("sandboxd.")}
    return units


def test_every_package_is_placed() -> None:
    units = {_unit(path) for path in SANDBOXD.rglob("*.py")}
    assert units - RANK.keys() == set(), "place these in LAYERS"


def test_imports_go_only_downward() -> None:
    upward = []
    for path in sorted(SANDBOXD.rglob("*.py")):
        unit = _unit(path)
        for target in _imported_units(ast.parse(path.read_text(), str(path))):
            if target != unit and RANK.get(target, len(LAYERS)) >= RANK.get(unit, -1):
                upward.append(f"{path.relative_to(SANDBOXD.parent)} imports sandboxd.{target}")
    assert upward == []


def test_the_check_sees_an_upward_import() -> None:
    """The control: the same reading finds an import the table forbids."""
    tree = ast.parse("from sandboxd.service.servicer import Servicer\nfrom sandboxd import cli\n")
    assert _imported_units(tree) == {"service", "cli"}
    assert RANK["service"] > RANK["network"] and RANK["cli"] > RANK["network"]
