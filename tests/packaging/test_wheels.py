"""Each package builds a wheel that declares its pins and ships py.typed (and the generated presets)."""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DSL = "nvidia-cutlass-dsl==4.8.1"
PACKAGES = {
    # distribution: (import name, pins its METADATA must declare)
    "mhc-core": ("mhc_core", {DSL, "torch", "numpy"}),  # numpy: mhc_core.spin uses Tensor.numpy()
    "mhc-dsv41": ("mhc_dsv41", {"mhc-core~=0.3.0", DSL, "torch"}),
    "mhc-glm5": ("mhc_glm5", {"mhc-core~=0.3.0", DSL, "torch"}),  # 0.3.0: error word, header, token_check
}
#: Each package's own version (its __init__); bumped when its kernels or API change.
VERSIONS = {"mhc-core": "0.3.0", "mhc-dsv41": "0.2.0", "mhc-glm5": "0.6.0"}

BUILD = """
import sys
from hatchling.build import build_wheel
print(build_wheel(sys.argv[1]))
"""


def version_of(package: str) -> str:
    text = (ROOT / "packages" / package / "src" / PACKAGES[package][0] / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert match, f"{package}: no __version__"
    return match.group(1)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every package's wheel, built with hatchling's PEP 517 hook (what ``python -m build --wheel`` calls)."""
    pytest.importorskip("hatchling", reason="hatchling builds the wheels (nox -s tests installs it)")
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for package in PACKAGES:
        result = subprocess.run(
            [sys.executable, "-c", BUILD, str(out)],
            cwd=ROOT / "packages" / package,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"{package}: {result.stderr}"
        built[package] = out / result.stdout.strip().splitlines()[-1]
    return built


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


@pytest.mark.parametrize("package", PACKAGES)
def test_metadata(package: str, wheels: dict[str, Path]) -> None:
    meta = metadata(wheels[package])
    assert meta["Name"] == package
    assert meta["Version"] == version_of(package) == VERSIONS[package]
    assert meta["Requires-Python"] == ">=3.11"
    assert set(meta.get_all("Requires-Dist")) == PACKAGES[package][1]
    assert wheels[package].name == f"{PACKAGES[package][0]}-{VERSIONS[package]}-py3-none-any.whl"


@pytest.mark.parametrize("package", PACKAGES)
def test_contents(package: str, wheels: dict[str, Path]) -> None:
    module = PACKAGES[package][0]
    names = set(zipfile.ZipFile(wheels[package]).namelist())
    assert f"{module}/py.typed" in names
    assert f"{module}/__init__.py" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    source = ROOT / "packages" / package / "src" / module
    shipped = {name for name in names if not name.startswith(f"{module}-{VERSIONS[package]}.dist-info/")}
    assert shipped == {str(path.relative_to(source.parent)) for path in source.rglob("*.py")} | {f"{module}/py.typed"}


@pytest.mark.parametrize("package", ["mhc-dsv41", "mhc-glm5"])
def test_presets_are_shipped(package: str, wheels: dict[str, Path]) -> None:
    module = PACKAGES[package][0]
    names = set(zipfile.ZipFile(wheels[package]).namelist())
    generated = sorted((ROOT / "packages" / package / "src" / module / "presets").glob("*.py"))
    assert len(generated) > 1, "no generated presets: run python3 -m codegen"
    for path in generated:
        assert f"{module}/presets/{path.name}" in names
