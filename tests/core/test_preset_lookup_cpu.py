"""Issue #34, "finding a preset": an engine knows the model, the GPU, tp, hidden and hc, not the
preset's name. ``mhc_core.find_preset`` returns the shipped preset for them, or raises naming the
closest ones and what differs; test presets are never returned, and their kernels leave the
wheels' libraries (``tools.export_kernels``)."""

from __future__ import annotations

import pytest
import torch

import mhc_core
from mhc_core import preset_lookup, registry


@pytest.mark.parametrize(
    ("model", "query", "name"),
    [
        ("dsv41", dict(arch="sm_90a", tp=1, hidden=5120), "h200-tp1-h5120"),
        ("dsv41", dict(capability=(9, 0), tp=2, hidden=5120, hc=4), "h200-tp2-h5120"),
        ("dsv41", dict(capability=(10, 3), tp=8, hidden=5120), "gb300-tp8-h5120"),
        ("dsv41", dict(arch="sm_100a", tp=4, hidden=5120), "gb300-tp4-h5120"),
        ("glm5", dict(arch="sm_90a", tp=4, hidden=4096, hc=4), "h200-tp4-h4096"),
    ],
)
def test_found_by_what_an_engine_knows(model: str, query: dict, name: str) -> None:
    assert mhc_core.find_preset(model, **query).PRESET.name == name


def test_found_by_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert mhc_core.find_preset("glm5", device="cuda:0", tp=1, hidden=4096).NAME == "h200-tp1-h4096"


def test_no_match_names_the_closest_and_what_differs() -> None:
    with pytest.raises(LookupError) as raised:
        mhc_core.find_preset("dsv41", arch="sm_90a", tp=2, hidden=7168, hc=4)
    assert str(raised.value) == (
        "no dsv41 preset for arch sm_90a, tp 2, hidden 7168, hc 4; closest: h200-tp2-h5120 (hidden 5120, "
        "not 7168); h200-tp1-h5120 (tp 1, not 2, hidden 5120, not 7168); h200-tp4-h5120 (tp 4, not 2, "
        "hidden 5120, not 7168)"
    )


def test_a_test_preset_is_never_found() -> None:
    """test-tp4-h7168 has exactly this shape; it is a test's, not an engine's."""
    with pytest.raises(LookupError, match=r"no dsv41 preset for arch sm_90a, tp 4, hidden 7168"):
        mhc_core.find_preset("dsv41", arch="sm_90a", tp=4, hidden=7168)
    assert not [name for name in preset_lookup.shipped_presets("glm5") if name.startswith("test-")]
    from mhc_dsv41 import presets as shipped
    from tests import presets as tested

    assert "test-tp4-h7168" not in shipped.names() and "test-tp4-h7168" in tested.names("dsv41")


def test_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"expected one of arch, capability or device; got \['arch', 'capability'\]"):
        mhc_core.find_preset("dsv41", arch="sm_90a", capability=(9, 0), tp=1, hidden=5120)
    with pytest.raises(ValueError, match=r"capability: expected one of 9.0, 10.0, 10.3, got 8.0"):
        mhc_core.find_preset("dsv41", capability=(8, 0), tp=1, hidden=5120)
    with pytest.raises(ValueError, match=r"unknown model 'llama'; known: dsv41, glm5"):
        mhc_core.find_preset("llama", arch="sm_90a", tp=1, hidden=5120)


def test_test_presets_leave_the_wheels_kernel_libraries() -> None:
    """tools.export_kernels (what the wheels carry) selects no test preset; compile_presets still does."""
    from tools.compile_presets import select_presets

    models = list(registry.models())
    exported = select_presets(models, [], shipped_only=True)
    assert exported and not [name for _, name, _ in exported if name.startswith("test-")]
    checked = [name for _, name, _ in select_presets(models, [])]
    assert "test-tp4-h7168" in checked


@pytest.mark.parametrize(
    ("arch", "name"),
    [
        ("sm_90a", "h200-tp2-h5120"),
        ("sm_90", "h200-tp2-h5120"),  # torch.cuda.get_arch_list()'s spelling
        ("SM_90A", "h200-tp2-h5120"),
        ("90", "h200-tp2-h5120"),  # TORCH_CUDA_ARCH_LIST without its dot, vLLM's
        ("90a", "h200-tp2-h5120"),
        ("9.0", "h200-tp2-h5120"),  # TORCH_CUDA_ARCH_LIST's
        ("compute_90a", "h200-tp2-h5120"),  # nvcc's virtual arch
        ((9, 0), "h200-tp2-h5120"),  # torch.cuda.get_device_capability()
        ([9, 0], "h200-tp2-h5120"),
        (90, "h200-tp2-h5120"),
        ("sm_100", "gb300-tp4-h5120"),
        ("100a", "gb300-tp4-h5120"),
        ((10, 3), "gb300-tp4-h5120"),
        ("sm_103", "gb300-tp4-h5120"),
    ],
)
def test_the_arch_is_taken_as_torch_and_engines_spell_it(arch: object, name: str) -> None:
    """Issue #49: ``arch="sm_90"`` was refused, only ``"sm_90a"`` taken."""
    tp = int(name.split("-tp")[1].split("-")[0])
    found = mhc_core.find_preset("dsv41", arch=arch, tp=tp, hidden=5120)
    assert found.PRESET.name == name


@pytest.mark.parametrize(
    ("arch", "error", "message"),
    [
        (
            "sm_80",
            ValueError,
            r"arch: expected one of sm_90a \(9, 0\), sm_100a \(10, 0\), sm_103a \(10, 3\) .* 'sm_80'",
        ),
        ((8, 6), ValueError, r"arch: expected one of .* got \(8, 6\)"),
        ("hopper", ValueError, r"arch: expected one of .* got 'hopper'"),
        ("9.x", ValueError, r"arch: expected one of .* got '9.x'"),
        (9.0, TypeError, r"arch: expected a str such as 'sm_90a' or a capability such as \(9, 0\), got 9.0"),
        ((9, "0"), TypeError, r"arch: expected a str .* got \(9, '0'\)"),
    ],
)
def test_an_arch_of_no_kernel_is_named(arch: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mhc_core.find_preset("dsv41", arch=arch, tp=2, hidden=5120)
