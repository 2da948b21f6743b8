"""Our scripts that have no .py suffix (packaging/vm/run-matrix, packaging/container/pod-from-manifest),
loaded as modules so tests can call their functions."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from types import ModuleType


def load_script(path: str, name: str) -> ModuleType:
    """The script at ``path``, executed as the module ``name`` (not added to sys.modules)."""
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
