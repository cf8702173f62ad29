"""Helpers for the codegen tests: temporary copies of presets.toml and of the packages' src trees."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "presets.toml"
DISTRIBUTIONS = ("mhc-core", "mhc-dsv41", "mhc-glm5")
OUTPUT_DIRS = {
    "dsv41": Path("packages/mhc-dsv41/src/mhc_dsv41/presets"),
    "glm5": Path("packages/mhc-glm5/src/mhc_glm5/presets"),
}
#: Where the test presets (names starting ``test-``) go: the tests', not the packages'.
TEST_OUTPUT_DIRS = {"dsv41": Path("tests/presets/dsv41"), "glm5": Path("tests/presets/glm5")}


def repo_presets() -> dict[str, Any]:
    with PRESETS.open("rb") as stream:
        return tomllib.load(stream)


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
    ignore = shutil.ignore_patterns("__pycache__", *(() if with_outputs else ("presets",)))
    for distribution in DISTRIBUTIONS:
        source = ROOT / "packages" / distribution / "src"
        shutil.copytree(source, path / "packages" / distribution / "src", ignore=ignore)
    if with_outputs:
        for folder in TEST_OUTPUT_DIRS.values():
            shutil.copytree(ROOT / folder, path / folder, ignore=shutil.ignore_patterns("__pycache__"))
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
