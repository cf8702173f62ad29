"""The layer-input option's core plumbing (issue #33, ``mhc_core.host.calls.layer_input``), model-neutral:
the option's validation, the outputs' rules (the native executor's dtypes, aligned extents, strides
and storage), their allocation against ``mhc_core.fp8.Fp8Format.empty_scales`` (real tensors and
symbolic sizes), and the kernel sources. The ops' use of it: ``tests/dsv41/test_fp8_op_cpu.py``."""

from __future__ import annotations

import pytest
import torch

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
HIDDEN = 640  # 5 groups of 128 (a partial packed word), 20 of 32


def test_the_formats_are_mhc_core_fp8s() -> None:
    from mhc_core import fp8
    from mhc_core.host.calls import layer_input

    assert tuple(layer_input.FORMATS) == ("bf16", *fp8.FORMATS)


@pytest.mark.parametrize(
    "fmt, both, error, message",
    [
        (None, False, TypeError, "layer_input_format: expected a str, one of bf16, .*; got None"),
        ("e4m3", False, ValueError, "layer_input_format: expected one of bf16, fp32-g128"),
        ("mx-g32", 0, TypeError, r"layer_input_bf16: expected a bool \(True or False\); got 0"),
        ("bf16", True, ValueError, "layer_input_bf16: .*expected False"),
        ("fp32-g128", False, ValueError, r"layer_input_format: 'fp32-g128' .* multiple of 128 \(hidden = 96\)"),
        ("mx-g32", False, ValueError, r"layer_input_format: 'mx-g32' .* multiple of 32 \(hidden = 80\)"),
    ],
)
def test_bad_options_name_their_argument(fmt: object, both: object, error: type, message: str) -> None:
    from mhc_core.host.calls.layer_input import LayerInput

    with pytest.raises(error, match=f"^{message}"):
        LayerInput.checked(fmt, both, 80 if fmt == "mx-g32" else 96)  # 2.5 groups of 32; 0.75 of 128


def test_names_and_order() -> None:
    from mhc_core.host.calls.layer_input import LayerInput

    assert LayerInput.checked("bf16", False, HIDDEN).output_names(1) == ("out[1] (layer_input)",)
    assert LayerInput.checked("mx-g32", False, HIDDEN).output_names(3) == (
        "out[3] (layer_input_q)",
        "out[4] (layer_input_scales)",
    )
    assert LayerInput.checked("mx-g32", True, HIDDEN).names == ("layer_input_q", "layer_input_scales", "layer_input")


def resolved(rule, m: int):
    from mhc_core.host.calls.rules import resolve

    shape = tuple(resolve(dim, m, -1) for dim in rule.shapes[0])
    strides = None if rule.strides is None else tuple(resolve(dim, m, -1) for dim in rule.strides)
    storage = None if rule.storage is None else resolve(rule.storage, m, -1)
    return shape, strides, storage


@pytest.mark.parametrize("m", (1, 3, 4, 5, 128, 130))
@pytest.mark.parametrize("fmt", FORMATS)
def test_rules_and_allocation_are_the_formats(fmt: str, m: int) -> None:
    from mhc_core import fp8
    from mhc_core.host.calls.layer_input import LayerInput

    option = LayerInput.checked(fmt, True, HIDDEN)
    layout = fp8.get_format(fmt)
    x = torch.randn(m, HIDDEN).to(torch.bfloat16)
    q, scales, hidden = option.allocate(x, x, m, HIDDEN)
    reference = layout.empty_scales(m, HIDDEN)
    assert (q.dtype, q.shape, hidden.dtype, hidden.shape) == (torch.float8_e4m3fn, (m, HIDDEN), torch.bfloat16, x.shape)
    assert (scales.dtype, scales.shape, scales.stride()) == (reference.dtype, reference.shape, reference.stride())
    assert scales.untyped_storage().nbytes() == layout.scale_storage_bytes(m, HIDDEN), "the whole allocation"
    # A collect (no publish input): the BF16 copy new from the base tensor.
    assert option.allocate(None, x, m, HIDDEN)[2].shape == (m, HIDDEN)

    q_rule, scale_rule, hidden_rule = option.output_rules(1, HIDDEN)
    assert q_rule.dtypes == (torch.float8_e4m3fn,) and not q_rule.aliases, "q is memory of its own"
    assert hidden_rule.aliases == ("x", "shared_output"), "the BF16 copy may be the publish input, in place"
    shape, strides, storage = resolved(scale_rule, m)
    assert scale_rule.dtypes == (reference.dtype,) and shape == tuple(reference.shape)
    if strides is not None:
        assert strides == tuple(reference.stride())
    if storage is not None:  # the padding rows lie past the view
        assert storage == layout.scale_storage_numel(m, HIDDEN) >= scales.numel()


def test_symbolic_allocation() -> None:
    """The fake implementations allocate with M symbolic (``torch.compile(dynamic=True)``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mhc_core import fp8
    from mhc_core.host.calls.layer_input import LayerInput

    mode = FakeTensorMode(shape_env=ShapeEnv())
    for m in (3, 130):
        base = mode.from_tensor(torch.empty(m, 4, HIDDEN), static_shapes=False)
        with mode:
            for fmt in FORMATS:
                symbolic = base.shape[0]
                assert not isinstance(symbolic, int)
                _, scales = LayerInput.checked(fmt, False, HIDDEN).allocate(None, base, symbolic, HIDDEN)
                reference = fp8.get_format(fmt).empty_scales(m, HIDDEN)
                assert tuple(int(s) for s in scales.shape) == tuple(reference.shape)
                assert tuple(int(s) for s in scales.stride()) == tuple(reference.stride())


def test_sources() -> None:
    from mhc_core.host.calls.layer_input import LayerInput
    from mhc_core.host.calls.programs import Pointer

    assert LayerInput().sources(1) == {"layer_input": Pointer("out[1] (layer_input)")}
    assert LayerInput.checked("fp32-g128", False, HIDDEN).sources(3) == {
        "layer_input": Pointer("out[3] (layer_input_q)"),  # FP8 alone: no BF16 store, any aligned address
        "layer_input_q": Pointer("out[3] (layer_input_q)"),
        "layer_input_scales": Pointer("out[4] (layer_input_scales)"),
    }
    assert LayerInput.checked("fp32-g128", True, HIDDEN).sources(1)["layer_input"] == Pointer("out[3] (layer_input)")


def test_the_executor_takes_every_dtype_and_dimension() -> None:
    """Programs with FP8 outputs bind into the native executor (no kernel: a check-only call)."""
    from mhc_core.host.calls.layer_input import LayerInput
    from mhc_core.host.calls.programs import CHECK_ONLY, Program
    from mhc_core.host.calls.rules import M, tensor

    for fmt in FORMATS:
        option = LayerInput.checked(fmt, True, HIDDEN)
        rules = (tensor("x", (M, HIDDEN), dtype=torch.bfloat16),)
        program = Program(rules, option.output_rules(0, HIDDEN), [], torch.device("cpu"), 160)
        for m in (3, 130):
            x = torch.randn(m, HIDDEN).to(torch.bfloat16)
            outputs = option.allocate(x, x, m, HIDDEN)
            assert program.native(CHECK_ONLY, -1, -1, 0, 0, x, *outputs) == m
            with pytest.raises(ValueError, match="mhc-invalid"):  # the scales of another M
                program.native(CHECK_ONLY, -1, -1, 0, 0, x, *option.allocate(None, x, m + 128, HIDDEN))
        assert [index for index, _ in program.sized_outputs] == ([1] if fmt == "ue8m0-g128-packed" else [])
