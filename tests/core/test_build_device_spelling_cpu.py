"""A preset's ``build`` on a torch without CUDA names that first, however the device is spelled
(issue #49 item 8): ``"cuda"`` raised the CPU-only build's RuntimeError, ``"cuda:0"`` the group-size
ValueError of the preset's tp, which sent a user after the wrong problem."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0), torch.device("cuda")])
@pytest.mark.parametrize(("package", "name"), [("mhc_dsv41", "h200-tp8-h5120"), ("mhc_glm5", "h200-tp4-h4096")])
def test_the_environment_is_checked_first_whatever_the_spelling(
    monkeypatch: pytest.MonkeyPatch, package: str, name: str, device: object
) -> None:
    import importlib

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)  # a CPU-only torch, on any build
    presets = importlib.import_module(f"{package}.presets")
    with pytest.raises(RuntimeError, match="is a CPU-only build, not compiled with CUDA"):
        presets.get(name).build(64, device)


def test_a_device_that_is_no_cuda_one_is_left_to_the_op() -> None:
    from mhc_core.host.binaries.support import require_cuda_build

    require_cuda_build("cpu")  # a CPU op (a third model's toy) is the op's to judge
    require_cuda_build("not a device")  # the op names the argument
