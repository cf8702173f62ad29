"""Helpers for the codegen tests: temporary copies of the presets and of the model packages' src trees.

The models are the registry's (``mhc_core.registry.models()``); their tables are in the root presets.toml."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

from mhc_core import registry

ROOT = Path(__file__).resolve().parents[2]
MODELS = registry.models()
#: The presets files: the repository's root presets.toml (the in-repo models' tables) and each
#: model's own file where it declares one (``Model.presets_file``: a model kept elsewhere).
ROOT_PRESETS = ROOT / "presets.toml"
PRESETS = [
    ROOT_PRESETS,
    *(
        ROOT / "packages" / model.distribution / model.presets_file
        for model in MODELS.values()
        if model.presets_file is not None
    ),
]
DISTRIBUTIONS = ("mhc-core", *(model.distribution for model in MODELS.values()))
#: Where each model's shipped presets go: its package's ``presets/``.
OUTPUT_DIRS = {
    key: Path("packages", model.distribution, "src", model.package, "presets") for key, model in MODELS.items()
}
#: Where the test presets (names starting ``test-``) go: the tests', not the packages'.
TEST_OUTPUT_DIRS = {key: Path("tests/presets", key) for key in MODELS}


def repo_presets() -> dict[str, Any]:
    """Every model's tables, ``{key: {name: table}}``, read from the presets files."""
    document: dict[str, Any] = {}
    for path in PRESETS:
        with path.open("rb") as stream:
            document |= tomllib.load(stream)
    return document


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def dump_presets(document: dict[str, Any]) -> str:
    """``{model: {name: {key: value}}}`` as TOML; a non-table model entry as a plain key."""
    lines = []
    for model, tables in document.items():
        if not isinstance(tables, dict):
            lines.append(f"{model} = {_toml_value(tables)}")
            continue
        for name, table in tables.items():
            lines.append(f'[{model}."{name}"]')
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
            lines.append("")
    return "\n".join(lines) + "\n"


def write_presets(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(dump_presets(document), encoding="utf-8")
    return path


def make_root(path: Path, *, with_outputs: bool = True) -> Path:
    """A copy of the packages' src trees under ``path`` (generated presets/ included or not, the test
    presets' folders under tests/presets/ too)."""
    # "presets" matches the generated folders only (mhc_core/presets.py is a module of its own).
    # kernels: the exported libraries (git-ignored), which codegen never reads.
    ignore = shutil.ignore_patterns("__pycache__", "kernels", *(() if with_outputs else ("presets",)))
    for distribution in DISTRIBUTIONS:
        source = ROOT / "packages" / distribution / "src"
        shutil.copytree(source, path / "packages" / distribution / "src", ignore=ignore)
    if with_outputs:
        for folder in TEST_OUTPUT_DIRS.values():
            shutil.copytree(ROOT / folder, path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return path


def make_repository(path: Path) -> Path:
    """A copy of the repository that runs ``python3 -m codegen`` on its own: the packages (their
    pyproject.toml, which the registry reads, and src trees with the generated modules), codegen/,
    templates/, the root presets.toml and the test presets."""
    make_root(path)
    for distribution in DISTRIBUTIONS:
        shutil.copy(ROOT / "packages" / distribution / "pyproject.toml", path / "packages" / distribution)
    for folder in ("codegen", "templates"):
        shutil.copytree(ROOT / folder, path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT_PRESETS, path / ROOT_PRESETS.name)
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root``'s packages/ and tests/, by relative path (to show that nothing was written)."""
    return {
        str(file.relative_to(root)): file.read_bytes()
        for top in ("packages", "tests")
        for file in sorted((root / top).rglob("*"))
        if file.is_file() and "__pycache__" not in file.parts
    }


def source_path(root: Path) -> str:
    """PYTHONPATH for a subprocess that must import the packages from ``root``."""
    return ":".join(str(root / "packages" / distribution / "src") for distribution in DISTRIBUTIONS)
