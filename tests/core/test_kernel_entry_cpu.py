"""A compiled kernel takes exactly the parameters its ``signature()`` lists, and nothing else.

The host (``mhc_core.host.calls.programs``, the C++ executor) passes one argument per ``Param``; TVM-FFI's
entry point expects one per parameter of the ``@cute.jit`` function the compiler traced, a
defaulted ``None`` one included. At e2879c6 the DSV collective's ``__call__`` ended in
``layer_input_q=None, layer_input_scales=None`` (issue #33's FP8 outputs), so every BF16 DSV kernel
compiled on the H200 expected 21 arguments where the host passes 19: 128 GPU tests failed with
``TypeError: Expects 21 parameters``, and no CPU test saw it. Here:

* for every preset kernel (shipped and test presets, both models, every arch), the parameters of
  ``kernel.entry()`` are the signature's names, in order (no compile: the DSL builds its entry point
  from this Python signature);
* compiled for real, a BF16 and an FP8 DSV collective's entry points take 19 and 21 arguments.
"""

from __future__ import annotations

import inspect

import pytest

from mhc_core import registry
from mhc_core.device.kernel import KernelSpec
from tests import presets

pytest.importorskip("cutlass")

MODELS = tuple(registry.models())


def _preset_kernels() -> list[tuple[str, KernelSpec]]:
    found: dict[tuple[str, str], tuple[str, KernelSpec]] = {}
    for model in MODELS:
        for name in presets.names(model):
            for arch, kernels in presets.get(model, name).KERNELS.items():
                for kernel, (path, config) in kernels.items():
                    spec = KernelSpec(path, config)
                    found.setdefault((path, repr(sorted(config.items()))), (f"{model}:{name}:{arch}:{kernel}", spec))
    return sorted(found.values(), key=lambda item: item[0])


def _entry_parameters(spec: KernelSpec) -> tuple[list[str], list[str]]:
    kernel = spec.instantiate()
    wanted = [param.name for param in kernel.signature()]
    parameters = inspect.signature(kernel.entry()).parameters
    return wanted, list(parameters)


def test_every_preset_kernels_entry_takes_exactly_its_signature() -> None:
    kernels = _preset_kernels()
    assert len(kernels) > 20
    wrong = []
    for label, spec in kernels:
        wanted, actual = _entry_parameters(spec)
        if actual != wanted:
            wrong.append(f"{label}: signature {wanted}, entry {actual}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("layer_input_format", "arguments"), [("bf16", 19), ("fp32-g128", 21)])
def test_the_compiled_dsv_collective_takes_one_argument_per_param(layer_input_format: str, arguments: int) -> None:
    from mhc_core.host.binaries.compiler import compile_kernel

    path, config = presets.get("dsv41", "h200-tp1-h5120").KERNELS["sm_90a"]["collective"]
    spec = KernelSpec(path, dict(config, layer_input_format=layer_input_format))
    compiled = compile_kernel(spec, "sm_90a", prebuilt=False).compiled
    parameters = compiled.execution_args.signature.parameters  # what TVM-FFI checks a call against
    assert len(parameters) == arguments == len(spec.instantiate().signature())
