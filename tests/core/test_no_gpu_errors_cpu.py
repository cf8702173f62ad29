"""Issue #34, "errors without a GPU": a CPU-only torch, no visible GPU or an unsupported arch raise a
RuntimeError saying which, before anything else (torch's ``AssertionError: Torch not compiled with
CUDA enabled`` came out of ``normalize_device``); the ``mhc`` logger has a ``NullHandler``; the ops'
docstrings state the spin bound's real default. torch.cuda's queries are faked where a CPU cannot
show the case."""

from __future__ import annotations

import logging

import pytest
import torch

import mhc_core
from mhc_core.host.binaries import support
from mhc_core.host.calls.spin import DEFAULT_SPIN_TIMEOUT_MS
from mhc_core.host.ranks.groups import normalize_device


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *, count: int, capability: tuple[int, int] = (9, 0)) -> None:
    """A CUDA build of torch seeing ``count`` GPUs of ``capability`` (no CUDA call is made)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a CPU-only torch (CI's)")
def test_cpu_only_torch_is_named_by_the_op() -> None:
    """The issue's call, as written: it raised AssertionError from inside torch."""
    from mhc_dsv41 import AllReduceMHC

    with pytest.raises(RuntimeError, match=r"CPU-only build, not compiled with CUDA"):
        AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=64, device="cuda")


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a CPU-only torch (CI's)")
def test_cpu_only_torch_is_named_by_the_glm_op_and_device_arch() -> None:
    from mhc_glm5 import AllReduceMhcBoundary

    with pytest.raises(RuntimeError, match=r"CPU-only build"):
        AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=64, device="cuda")
    with pytest.raises(RuntimeError, match=r"CPU-only build"):
        mhc_core.device_arch("cuda:0")


def test_no_visible_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match=r"no CUDA GPU is visible to this process \(CUDA_VISIBLE_DEVICES=''\)"):
        normalize_device("cuda")
    with pytest.raises(RuntimeError, match=r"no CUDA GPU is visible"):
        mhc_core.device_arch(0)


def test_an_index_past_the_visible_gpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=2)
    with pytest.raises(
        RuntimeError, match=r"cuda:3 is not visible: this process sees 2 CUDA GPU\(s\), cuda:0 .. cuda:1"
    ):
        mhc_core.device_arch("cuda:3")


def test_unsupported_arch_is_named_with_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=1, capability=(8, 0))
    with pytest.raises(
        RuntimeError, match=r"unsupported GPU 'NVIDIA A100-SXM4-80GB': compute capability 8\.0; .*sm_90a"
    ):
        mhc_core.device_arch("cuda")
    assert "compute capability 8.0" in str(mhc_core.device_problem("cuda:0"))
    assert mhc_core.is_supported("cuda:0") is False


def test_a_supported_device_has_no_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=1, capability=(9, 0))
    assert support.device_problem("cuda") is None
    assert mhc_core.is_supported() is True
    assert mhc_core.device_arch("cuda:0") == "sm_90a"
    assert normalize_device("cuda") == torch.device("cuda", 0)


def test_not_a_cuda_device() -> None:
    assert support.device_problem("cpu") == "device: expected a CUDA device, got cpu"
    assert "expected a CUDA device" in str(support.device_problem("nonsense"))
    with pytest.raises(ValueError, match=r"device: expected a CUDA device, got cpu"):
        normalize_device("cpu")


def test_the_mhc_logger_has_a_null_handler() -> None:
    assert any(isinstance(handler, logging.NullHandler) for handler in logging.getLogger("mhc").handlers)


def test_docstrings_state_the_spin_bound_default() -> None:
    """AllReduceMHC's docstring said the spin bound was off by default; it is 600 s."""
    from mhc_dsv41 import AllReduceMHC

    assert f"{DEFAULT_SPIN_TIMEOUT_MS:,.0f}".replace(",", " ") == "600 000"
    doc = " ".join((AllReduceMHC.__doc__ or "").split())
    assert "default 600 000" in doc and "off by default" not in doc
