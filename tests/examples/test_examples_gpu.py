"""Every example in examples/ runs as a user would run it (a fresh interpreter, the packages' sources on
the path) and prints what it says; the tp 2 one under torchrun where two GPUs exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc_core import registry

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [str(ROOT / "packages" / package / "src") for package in ("mhc-core", *registry.distributions())]
EXPECTED = {
    "tp1_quickstart.py": "torch.Size([4, 4, 5120]) torch.Size([4, 5120])",
    "dsv41_finalize.py": "torch.Size([8, 4, 5120]) torch.Size([8, 5120])",
    "glm5_boundary.py": "torch.Size([8, 4, 1]) torch.Size([8, 4, 4]) True",
    "cuda_graphs.py": "{1: (1, 4096), 8: (8, 4096), 32: (32, 4096)}",
    "compiled_model.py": "[(8, 4, 4096), (8, 4, 1), (8, 4, 4), (8, 4096)]",
}


def run(*command: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_runs(example: str) -> None:
    result = run(sys.executable, f"examples/{example}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == EXPECTED[example], result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the tp 2 example needs two GPUs")
def test_tp2_example_under_torchrun() -> None:
    result = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "examples/tp2_torchrun.py")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("bitwise equal on every rank") == 2, result.stdout
