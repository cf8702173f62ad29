"""The model packages refuse an mhc-core outside their pin (both ``~=0.6.0``) at import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mhc_core.compat import check_core_version, satisfies_compatible_release

ROOT = Path(__file__).resolve().parents[2]


def test_check_core_version_names_both_versions() -> None:
    with pytest.raises(ImportError) as raised:
        check_core_version("~=0.1.0", "mhc_dsv41", version="0.2.0")
    message = str(raised.value)
    assert "mhc_dsv41 needs mhc-core ~=0.1.0, but mhc-core 0.2.0 is installed" in message


@pytest.mark.parametrize(
    ("version", "ok"), [("0.1.0", True), ("0.1.7", True), ("0.2.0", False), ("0.0.9", False), ("1.1.0", False)]
)
def test_compatible_release(version: str, ok: bool) -> None:
    assert satisfies_compatible_release(version, "~=0.1.0") is ok


def stub_core(path: Path, version: str) -> Path:
    """An mhc_core package of ``version``: the real compat module and nothing else."""
    package = path / "mhc_core"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "version.py").write_text(f'__version__ = "{version}"\n')
    shutil.copy(ROOT / "packages/mhc-core/src/mhc_core/compat.py", package / "compat.py")
    return path


def import_with_core(package: str, distribution: str, version: str, tmp_path: Path) -> subprocess.CompletedProcess:
    stub = stub_core(tmp_path / f"core-{version}", version)
    path = os.pathsep.join([str(stub), str(ROOT / "packages" / distribution / "src")])
    code = f"import mhc_core, {package}; assert mhc_core.__file__.startswith({str(stub)!r}); print('imported')"
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)


PINS = [("mhc_dsv41", "mhc-dsv41", "~=0.6.0"), ("mhc_glm5", "mhc-glm5", "~=0.6.0")]


@pytest.mark.parametrize(("package", "distribution", "pin"), PINS)
def test_import_refuses_a_newer_core(package: str, distribution: str, pin: str, tmp_path: Path) -> None:
    result = import_with_core(package, distribution, "0.7.0", tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), result.stderr
    assert f"{package} needs mhc-core {pin}, but mhc-core 0.7.0 is installed" in last


@pytest.mark.parametrize(("package", "distribution", "pin"), PINS)
def test_import_refuses_the_core_with_ready_flags(package: str, distribution: str, pin: str, tmp_path: Path) -> None:
    result = import_with_core(package, distribution, "0.1.2", tmp_path)
    assert result.returncode != 0
    assert f"{package} needs mhc-core {pin}, but mhc-core 0.1.2 is installed" in result.stderr


@pytest.mark.parametrize(("package", "distribution"), [("mhc_dsv41", "mhc-dsv41"), ("mhc_glm5", "mhc-glm5")])
def test_import_refuses_the_core_without_error_word(package: str, distribution: str, tmp_path: Path) -> None:
    """0.2.x kernels have no sticky error word, mailbox header or token_check (0.3.0); 0.3.x
    kernels no TVM-FFI convention or shared direct read (0.4.0); 0.4.x no native call path or
    kernels named by spec (0.5.0)."""
    pin = dict((name, pin) for name, _, pin in PINS)[package]
    # Both also refuse 0.5.x: the startup votes and mailbox_allocation (0.6.0).
    for old in ("0.2.2", "0.3.5", "0.4.0", "0.5.0", "0.5.1", "0.5.2"):
        result = import_with_core(package, distribution, old, tmp_path)
        assert result.returncode != 0
        assert f"{package} needs mhc-core {pin}, but mhc-core {old} is installed" in result.stderr


@pytest.mark.parametrize(("package", "distribution"), [("mhc_dsv41", "mhc-dsv41"), ("mhc_glm5", "mhc-glm5")])
def test_import_accepts_a_patch_release(package: str, distribution: str, tmp_path: Path) -> None:
    result = import_with_core(package, distribution, "0.6.5", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"
