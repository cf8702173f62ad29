"""Test setup shared by every package's suite.

* The packages' ``src`` folders are importable even where nothing is installed
  (the GPU host has no nox and no hatchling).
* Spin bounds are on: a protocol bug fails within seconds instead of hanging.
* NVLink multicast stays off on every host the tests run on.
* GPU tests (``@pytest.mark.gpu``) skip with a reason where no CUDA GPU is visible.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE_SRC = ROOT / "packages" / "mhc-core" / "src"
if importlib.util.find_spec("mhc_core") is None and str(CORE_SRC) not in sys.path:
    sys.path.insert(0, str(CORE_SRC))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The model packages are the registry's: discovering them puts the src/ of each one found in this
# checkout (packages/*/pyproject.toml) on sys.path where it is not importable already.
from mhc_core import registry  # noqa: E402

registry.models()

os.environ.setdefault("MHC_SPIN_TIMEOUT_MS", "10000")
for variable, value in (
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[variable] = value


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here: GPU tests run on the H200 (python3 -m pytest -m gpu tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def close_captured_ops(request: pytest.FixtureRequest) -> Any:
    """After a GPU test, close the ops its CUDA graphs captured (a captured op lives until
    ``close()``: issue #32), except the session's cached ranks, so that their mailboxes do not
    pile up over the suite."""
    yield
    if "gpu" not in request.keywords or "mhc_core.host.op" not in sys.modules:
        return
    from mhc_core.host import op as op_module
    from tests import support

    cached = {id(rank) for ranks in support._RANKS.values() for rank in ranks}
    for op in list(op_module._CAPTURED.values()):
        if id(op) not in cached and op.group.kind != "process_group":
            op.close()
