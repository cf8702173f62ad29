"""The launch path without a GPU: every kernel is built for TVM-FFI with the PTX the DSL's default
convention gives; argument keys of the validation cache tell apart every property checked."""

from __future__ import annotations

import contextlib
import io
import tempfile

import pytest
import torch


def default_convention_ptx(kernel, arch: str) -> str:
    import cutlass.cute as cute

    from mhc_core.device.signature import fake_arguments

    with tempfile.TemporaryDirectory(prefix="mhc-ptx-") as dump, contextlib.redirect_stderr(io.StringIO()):
        options = f"--gpu-arch {arch} --keep-ptx --dump-dir {dump} remarks{{ptx}}"
        return cute.compile(kernel, *fake_arguments(kernel.signature()), options=options).__ptx__


@pytest.mark.parametrize("preset", ["dsv41:h200-tp1-h5120", "dsv41:h200-tp2-h5120"])
def test_tvm_ffi_build_has_the_default_conventions_ptx(preset: str) -> None:
    """The calling convention changes the host wrapper only: the kernel's PTX is the same."""
    import importlib

    from mhc_core.host.compiler import COMPILE_OPTIONS, compile_kernel

    assert "--enable-tvm-ffi" in COMPILE_OPTIONS
    model, name = preset.split(":")
    module = importlib.import_module(f"mhc_{model}.presets").get(name)
    for kernel in module.kernels("sm_90a").values():
        built = compile_kernel(kernel, "sm_90a", inspect=True)
        assert type(built.compiled).__name__.startswith("TVMFFI"), type(built.compiled)
        assert built.ptx == default_convention_ptx(kernel, "sm_90a"), f"{kernel}: PTX differs"


def test_argument_keys_tell_apart_every_checked_property() -> None:
    from mhc_core.host.validation import argument_key

    base = torch.zeros(4, 8, dtype=torch.bfloat16)
    same = torch.ones(4, 8, dtype=torch.bfloat16)
    assert argument_key(base, 1e-6) == argument_key(same, 1e-6)
    flat = torch.zeros(33, dtype=torch.bfloat16)
    different = {
        "dtype": base.view(torch.float16),
        "shape": base.view(8, 4),
        "strides": base.t().contiguous().t(),
        "alignment": flat[1:].view(4, 8),
        "device": torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"),
    }
    for name, tensor in different.items():
        assert argument_key(tensor, 1e-6) != argument_key(base, 1e-6), name
    assert argument_key(base, 1e-6) != argument_key(base, 1e-5)
    assert argument_key(base, 1) != argument_key(base, 1.0), "scalars enter by type and value"
    assert argument_key(base, None) != argument_key(base, (same,))


def test_argument_keys_of_moe_outputs_and_unhashable_values() -> None:
    from mhc_core import MoEOutput
    from mhc_core.host.validation import ValidatedCalls, argument_key

    t = torch.zeros(2, 8, dtype=torch.bfloat16)
    i = torch.zeros(2, 8, dtype=torch.int32)
    moe = MoEOutput(t, t.float(), i, t)
    assert argument_key(moe) == argument_key(MoEOutput(t.clone(), t.float(), i.clone(), t.clone()))
    assert argument_key(moe) != argument_key(MoEOutput(t, t, i, t))
    seen = ValidatedCalls()
    with pytest.raises(TypeError):
        _ = argument_key([1], {}) in seen  # a dict is unhashable: the op then runs every check
