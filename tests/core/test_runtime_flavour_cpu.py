"""Issue #34, "dependencies": the kernels' loader picks the DSL runtime flavour the driver runs (a CUDA
13 runtime beside a CUDA 12 one was taken first, whatever the driver), and without any runtime an op
says what to install instead of falling back to a compile that cannot happen. The installed
flavours and the driver's CUDA version are fakes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhc_core.host.binaries import artifacts


@pytest.fixture
def both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    installed = {flavour: tmp_path / flavour / "libcute_dsl_runtime.so" for flavour in ("cu13", "cu12")}
    monkeypatch.setattr(artifacts, "runtime_libraries", lambda: installed)
    return installed


def test_a_cuda_12_driver_gets_the_cuda_12_runtime(both: dict[str, Path]) -> None:
    assert artifacts.runtime_library(12) == both["cu12"]


def test_a_cuda_13_driver_gets_the_cuda_13_runtime(both: dict[str, Path]) -> None:
    assert artifacts.runtime_library(13) == both["cu13"]


def test_only_a_runtime_the_driver_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(artifacts, "runtime_libraries", lambda: {"cu13": tmp_path / "cu13.so"})
    assert artifacts.runtime_library(12) is None
    message = artifacts.missing_runtime_message(12)
    assert "for a CUDA 12 driver (installed flavours: cu13): pip install 'mhc-core[cu12]'" in message


def test_no_runtime_is_an_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(artifacts, "runtime_libraries", dict)
    monkeypatch.setattr(artifacts, "driver_cuda_major", lambda: 13)
    artifacts._module.cache_clear()
    with pytest.raises(artifacts.MissingRuntime, match=r"installed flavours: none\): pip install 'mhc-core\[cu13\]'"):
        artifacts._module(tmp_path / "libmhc_dsv41_sm_90a.so")


def test_the_installed_runtime_is_found() -> None:
    """This venv's DSL brings one flavour at least (CI: the CUDA 12 libraries, with the compiler)."""
    assert artifacts.runtime_libraries(), "no libcute_dsl_runtime.so under nvidia_cutlass_dsl"
