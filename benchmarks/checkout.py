"""This checkout's packages for the benchmark commands run from the repository root without an install:
on ``sys.path`` (``packages/*/src``), and a module of them loaded from its file into a process whose
packages are another tree's (``benchmarks.ab``, ``benchmarks.host_instructions``: an older commit may
lack the module)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def add_packages() -> None:
    for folder in sorted((ROOT / "packages").glob("*/src"), reverse=True):  # mhc-core's first on sys.path
        source = str(folder)
        if source not in sys.path:
            sys.path.insert(0, source)


def module_file(module: str) -> str:
    """The file of an importable module (imports its parent packages, not the module)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    return spec.origin


def load_file(name: str, path: str) -> Any:
    """The module in ``path``, loaded as ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
