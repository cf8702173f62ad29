"""The public API type-checks: ``mypy --strict`` on the op modules and the packages' ``__init__``, plus a
user's snippet that names ``AllReduceMHC``, ``AllReduceMhcBoundary``, ``presets.get()`` and the
re-exported core names through the packages (the lazy exports are visible to the checker)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mhc_core import registry

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "packages" / package / "src" for package in ("mhc-core", *registry.distributions())]
STRICT = [
    "mhc-core/src/mhc_core/__init__.py",
    "mhc-core/src/mhc_core/host/op.py",
    "mhc-dsv41/src/mhc_dsv41/__init__.py",
    "mhc-dsv41/src/mhc_dsv41/op.py",
    "mhc-glm5/src/mhc_glm5/__init__.py",
    "mhc-glm5/src/mhc_glm5/op.py",
]
SNIPPET = """
import torch
import mhc_dsv41
import mhc_glm5
from mhc_dsv41 import AllReduceMHC
from mhc_glm5 import AllReduceMhcBoundary


def build(device: torch.device) -> tuple[AllReduceMHC, AllReduceMhcBoundary]:
    dsv = AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=8, device=device)
    glm = mhc_glm5.presets.get("h200-tp1-h4096").build(8, device)
    assert isinstance(glm, AllReduceMhcBoundary)
    error: type[Exception] = mhc_dsv41.LamportTimeoutError
    moe: type = mhc_glm5.MoEOutput
    del error, moe
    return dsv, glm


def call(op: AllReduceMHC, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    residual_out, layer_input = op(x, x, w, w, w, x, 1e-6)
    return layer_input
"""


def test_public_api_type_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (nox -s tests installs it)")
    snippet = tmp_path / "user.py"
    snippet.write_text(SNIPPET)
    monkeypatch.setenv("MYPYPATH", os.pathsep.join(str(source) for source in SOURCES))
    files = [str(ROOT / "packages" / path) for path in STRICT] + [str(snippet)]
    options = ["--strict", "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "c")]
    out, err, status = api.run([*options, *files])
    assert status == 0, out + err


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for this module's checks (torch's stubs are most of a first run)."""
    return tmp_path_factory.mktemp("mypy-cache")


def run_mypy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, cache: Path) -> tuple[int, str]:
    """mypy --strict on a user's script alone (the packages found through MYPYPATH, as installed)."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (nox -s tests installs it)")
    path = tmp_path / "engine.py"
    path.write_text(script)
    monkeypatch.setenv("MYPYPATH", os.pathsep.join(str(source) for source in SOURCES))
    options = ["--strict", "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", str(cache)]
    out, err, status = api.run([*options, str(path)])
    return status, out + err


def test_a_misspelt_core_name_fails_type_checking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mypy_cache: Path
) -> None:
    """``mhc_core.is_supportd()`` passed ``mypy --strict``: the lazy exports' ``__getattr__`` made every
    attribute of the package ``Any`` (issue #34)."""
    status, output = run_mypy(tmp_path, monkeypatch, "import mhc_core\n\nmhc_core.is_supportd()\n", mypy_cache)
    assert status == 1, output
    assert 'engine.py:3: error: Module has no attribute "is_supportd"' in output, output


#: Each line assigns a public name's value to ``str``: mypy must refuse every one, which it cannot for
#: an ``Any`` (the lazy exports, ``library.boundary(op: Any, ...)``, ``presets.get(...).PRESET`` were).
NOT_ANY = """
import torch
import mhc_core
import mhc_dsv41
import mhc_glm5
from mhc_dsv41 import library as dsv_library
from mhc_glm5 import library as glm_library


def engine(dsv: mhc_dsv41.AllReduceMHC, glm: mhc_glm5.AllReduceMhcBoundary, x: torch.Tensor) -> None:
    a: str = mhc_core.is_supported()
    b: str = mhc_core.LamportAllReduce
    c: str = mhc_core.MoEOutput
    d: str = mhc_core.check_fused_support()
    e: str = mhc_core.find_preset("dsv41", arch="sm_90a", tp=1, hidden=5120).PRESET
    f: str = mhc_dsv41.presets.get("h200-tp1-h5120").PRESET
    g: str = mhc_glm5.presets.get("h200-tp1-h4096").build(8, "cuda")
    h: str = dsv_library.boundary(dsv, x, x, x, x, x, x)
    i: str = glm_library.join(glm, x)
    dsv_library.boundary(glm, x, x, x, x, x, x)
    glm_library.join(dsv, x)
"""


def test_public_names_have_their_real_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mypy_cache: Path) -> None:
    status, output = run_mypy(tmp_path, monkeypatch, NOT_ANY, mypy_cache)
    assert status == 1, output
    first = NOT_ANY.splitlines().index("    a: str = mhc_core.is_supported()") + 1
    flagged = {int(number) for number in re.findall(r"engine\.py:(\d+): error", output)}
    expected = set(range(first, first + 11))
    assert expected <= flagged, f"lines typed Any (not flagged): {sorted(expected - flagged)}\n{output}"


def test_pyright_sees_the_same_types(tmp_path: Path) -> None:
    """pyright (where installed: ``nox -s tests`` installs it; it runs on node) flags the misspelt name and
    every line of ``NOT_ANY`` too."""
    import shutil
    import subprocess
    import sys

    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which("pyright")
    if pyright is None:
        pytest.skip("pyright is not installed (nox -s tests installs it)")
    script = tmp_path / "engine.py"
    script.write_text("import mhc_core\n\nmhc_core.is_supportd()\n" + NOT_ANY)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(str(source) for source in SOURCES)}
    done = subprocess.run(
        [pyright, "--pythonpath", sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    if done.returncode not in (0, 1):  # pyright could not start (its node package is fetched on first use)
        pytest.skip(f"pyright did not run: {(done.stdout + done.stderr)[-500:]}")
    flagged = {int(number) for number in re.findall(r"engine\.py:(\d+):\d+ - error", done.stdout)}
    first = 3 + NOT_ANY.splitlines().index("    a: str = mhc_core.is_supported()") + 1
    assert {3, *range(first, first + 11)} <= flagged, done.stdout
