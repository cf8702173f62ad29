"""The public API type-checks: ``mypy --strict`` on the op modules and the packages' ``__init__``, plus a
user's snippet that names ``AllReduceMHC``, ``AllReduceMhcBoundary``, ``presets.get()`` and the
re-exported core names through the packages (the lazy exports are visible to the checker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "packages" / package / "src" for package in ("mhc-core", "mhc-dsv41", "mhc-glm5")]
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
