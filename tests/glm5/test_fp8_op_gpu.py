"""``AllReduceMhcBoundary`` with an FP8 layer input (issue #33) on the GPU: ``__call__`` (plain and MoE
input) and ``collect`` at tp 1 and loopback tp 2, 4 and 8, against the BF16 op of the same preset on
the same inputs.

What every call checks, bit for bit (outputs given as ``out=`` on every other call, every byte
poisoned first: the BF16 / FP32 outputs with ``tests.support``'s NaN, ``q`` with NaN codes 0x7F,
FP32 scales NaN, UE8M0 bytes 0xFF, padding too):

* ``residual_out``, ``post_out`` and ``comb_out`` (after ``join()``) and, with ``layer_input_bf16``,
  the BF16 layer input equal the BF16 op's;
* ``q`` and the scales, their whole allocation (padding rows and bytes included), equal
  ``mhc_core.fp8.quantize`` of the BF16 layer input: the op's own BF16 copy, from the same call, in
  both-outputs mode; the BF16 op's in FP8-only mode;
* the returned tensors have ``Fp8Format.empty_scales``' dtype, shape, strides and allocation; every
  rank's equal rank 0's.

Inputs: the norm weight sets all-zero groups (0 and -0 columns: +-0 codes, the scale from the
absmax floor), -0 values, groups below the floor (2^-120) and at large exponents (2^100); a token
of zeros (every group all-zero); with FP32 scales every group above the floor has a +-448 code.

The matrix (``CONFIGS``, 8 ops): every H200 preset in both modes, every format in both modes at
tp > 1. The TP1 preset's both-outputs op keeps all its boundary variants (one-token, x8, x16,
persistent: M = 1, 20, 130, 301); the other ops keep the one-token kernel alone (``cluster_tokens``
emptied, as their BF16 references'): ``test_fp8_kernel_gpu`` covers every variant x format. New
kernels: the TP1 op's x8 and persistent ones and the six tp > 1 one-token ones (8); the rest are
``test_fp8_kernel_gpu``'s. A poisoned op (closed, a captured graph replayed) writes NaN codes and
NaN scales, padding 0, in every format (``test_fp8_kernel_gpu``'s one-token kernels).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

from tests.glm5.checks import HC, boundary_inputs
from tests.glm5.test_boundary_gpu import moe_inputs, ops_for
from tests.support import bf16_randn, build_ranks, cached_ranks, poison, run_ranks

pytestmark = pytest.mark.gpu

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: (preset, format, BF16 copy beside it, every boundary variant) of every FP8 op (module docstring).
CONFIGS: tuple[tuple[str, str, bool, bool], ...] = (
    ("h200-tp1-h4096", "fp32-g128", True, True),
    ("h200-tp1-h4096", "ue8m0-g128-packed", False, False),
    ("h200-tp2-h4096", "mx-g32", True, False),
    ("h200-tp2-h4096", "fp32-g128", False, False),
    ("h200-tp4-h4096", "ue8m0-g128-packed", True, False),
    ("h200-tp4-h4096", "mx-g32", False, False),
    ("h200-tp8-h4096", "fp32-g128", True, False),
    ("h200-tp8-h4096", "ue8m0-g128-packed", False, False),
)
#: Calls per op, (M, how): the TP1 preset's variants from their thresholds (x8 from 16, x16 from 128,
#: persistent from 256: 301 pads both UE8M0 layouts); M = 1, 5 and 130 otherwise (padding rows of
#: both UE8M0 layouts, a second 128-row tile).
EVERY_VARIANT_CALLS = ((1, "call"), (20, "moe"), (130, "collect"), (301, "call"))
ONE_TOKEN_CALLS = ((1, "call"), (5, "moe"), (130, "collect"), (5, "call"))
#: Tokens of the one-token ops (their BF16 references are built for it too).
ONE_TOKEN_CAPACITY = 136
E4M3_NAN, UE8M0_NAN, E4M3_NEGATIVE_ZERO = 0x7F, 0xFF, 0x80
E4M3_MAX_CODES = (0x7E, 0xFE)


def config_id(config: tuple) -> str:
    name, fmt, both, every = config
    return f"{name}-{fmt}-{'both' if both else 'fp8'}{'-every-variant' if every else ''}"


# ------------------------------------------------------------------ ops
def one_token(name: str):
    """The preset with its one-token boundary alone."""
    from tests import presets

    return dataclasses.replace(presets.get("glm5", name).PRESET, cluster_tokens=(), persistent_min_tokens=0)


def fp8_ops(name: str, fmt: str, both: bool, every: bool) -> list:
    """Every rank's FP8 op, cached for the session. Their boundary kernels ship in no package:
    compiled, or loaded from the cache (``kernel_specs``)."""
    from mhc_glm5 import AllReduceMhcBoundary
    from tests import presets

    preset = presets.get("glm5", name).PRESET if every else one_token(name)
    capacity = max(m for m, _ in EVERY_VARIANT_CALLS) if every else ONE_TOKEN_CAPACITY
    try:
        return cached_ranks(
            ("glm5-fp8", name, fmt, both, every),
            preset.tp,
            lambda group: AllReduceMhcBoundary.from_config(
                preset, max_num_tokens=capacity, device="cuda", group=group, layer_input_format=fmt,
                layer_input_bf16=both,
            ),
        )  # fmt: skip
    except RuntimeError as error:
        if importlib.util.find_spec("cutlass") is None:
            pytest.skip(f"an FP8 GLM op: its kernels ship in no package and are not in the cache ({error})")
        raise


def bf16_ops(name: str, every: bool) -> list:
    """The BF16 op with the same boundary kernels: ``test_boundary_gpu``'s for the whole preset, else
    one with the one-token kernel alone (the preset's kernels, shipped)."""
    from mhc_glm5 import AllReduceMhcBoundary

    if every:
        return ops_for(name)
    preset = one_token(name)
    return cached_ranks(
        ("glm5-one-token", name, ONE_TOKEN_CAPACITY),
        preset.tp,
        lambda group: AllReduceMhcBoundary.from_config(
            preset, max_num_tokens=ONE_TOKEN_CAPACITY, device="cuda", group=group
        ),
    )


def kernel_specs(arch: str = "sm_90a") -> list[tuple[str, dict[str, Any]]]:
    """The FP8 boundary kernels these tests' ops launch, as (class path, config), each once: to
    compile them ahead into the cache for a host without the DSL compiler (``mhc_core.host.binaries.compiler.
    compile_kernel(KernelSpec(path, config), arch, persist=True)``); the publishes and the mixes
    kernel are the presets'."""
    from tests import presets

    specs: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, fmt, both, every in CONFIGS:
        preset = presets.get("glm5", name).PRESET if every else one_token(name)
        preset = dataclasses.replace(preset, layer_input_format=fmt, layer_input_bf16=both)
        for kernel, (path, config) in preset.kernel_specs(arch).items():
            if kernel.startswith("boundary"):
                specs.setdefault(repr((path, sorted(config.items()))), (path, config))
    return list(specs.values())


# ------------------------------------------------------------------ data
def special_weight(hidden: int, generator: torch.Generator) -> torch.Tensor:
    """The norm weight: random around 1, with the special columns of the module docstring (the layer
    input is ``prenorm * inv_rms * weight``)."""
    weight = torch.rand(hidden, generator=generator, device="cuda") + 0.5
    weight[0:128] = 0.0  # an all-zero group of every format: +-0 by the sign of the pre-norm value
    weight[128:160] = -0.0  # -0 in a 32-column group
    weight[256:384] = 2.0**-120  # absmax far below 448e-10: the scale from the floor
    weight[384:512] = 2.0**100  # large exponents, finite in BF16
    weight[512:640] = 2.0**-20  # small, above the floor
    return weight.to(torch.bfloat16)


def case(ops: list, m: int, generator: torch.Generator) -> tuple[list, tuple]:
    """Every rank's partial and the shared collect inputs (residual, post, comb, fn, scale, base,
    weight)."""
    hidden = ops[0].hidden_size
    args = boundary_inputs(m, hidden, generator, negative_zero=True)
    args["norm_weight"] = special_weight(hidden, generator)
    partials = [bf16_randn(m, hidden, generator=generator) for _ in ops]
    if m > 2:  # a token of zeros: every group all-zero
        args["residual"][2] = 0.0
        for partial in partials:
            partial[2] = 0.0
    return partials, tuple(args.values())


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s whole allocation from its first element (a view of them)."""
    nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return tensor.as_strided((nbytes // tensor.element_size(),), (1,)).view(torch.uint8)


def poisoned_outputs(fmt: str, both: bool, m: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """``out=`` for one rank, every byte poisoned (module docstring)."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)

    def nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return poison(torch.empty(shape, dtype=dtype, device="cuda"))

    q = torch.full((m, hidden), E4M3_NAN, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scales = layout.empty_scales(m, hidden, device="cuda")
    if layout.scale_encoding == "fp32":
        poison(flat_bytes(scales).view(torch.float32))
    else:
        flat_bytes(scales).fill_(UE8M0_NAN)
    outputs = (nan(m, HC, hidden, dtype=torch.bfloat16), nan(m, HC, 1, dtype=torch.float32),
               nan(m, HC, HC, dtype=torch.float32), q, scales)  # fmt: skip
    return (*outputs, nan(m, hidden, dtype=torch.bfloat16)) if both else outputs


# ------------------------------------------------------------------ checks
def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # Flattened where each lies: a copy of a strided tensor to another device would be compacted.
    actual, expected = flat_bytes(actual), flat_bytes(expected).to(actual.device)
    assert actual.shape == expected.shape, f"{what}: {actual.numel()} bytes, expected {expected.numel()}"
    differ = (actual != expected).nonzero()
    assert differ.numel() == 0, (
        f"{what}: {differ.shape[0]} of {actual.numel()} bytes differ, first at byte {differ[0].item()}: "
        f"{actual[differ[0]].item():#04x} != {expected[differ[0]].item():#04x}"
    )


def check_layout(outputs: tuple, fmt: str, both: bool, m: int, hidden: int, what: str) -> None:
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    assert len(outputs) == (6 if both else 5), f"{what}: {len(outputs)} outputs"
    q, scales = outputs[3], outputs[4]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, hidden) and q.is_contiguous(), what
    assert scales.dtype == layout.scale_dtype, what
    assert tuple(scales.shape) == layout.scale_shape(m, hidden), what
    assert tuple(scales.stride()) == layout.scale_strides(m, hidden), what
    assert flat_bytes(scales).numel() >= layout.scale_storage_bytes(m, hidden), f"{what}: allocation"


def check_special_values(q: torch.Tensor, layer_input: torch.Tensor, fmt: str, m: int, what: str) -> None:
    """The inputs' special cases showed up: -0 codes; groups under the absmax floor; with FP32 scales
    +-448 in exactly the groups above it."""
    from mhc_core import fp8

    codes = q.view(torch.uint8)
    assert bool((codes == E4M3_NEGATIVE_ZERO).any()), f"{what}: no -0 code"
    absmax = layer_input.float().abs().view(m, -1, fp8.get_format(fmt).group).amax(dim=-1)
    above_floor = absmax > fp8.EPS
    assert bool(above_floor.any()) and not bool(above_floor.all()), f"{what}: no group under the floor"
    if fmt == "fp32-g128":
        groups = codes.view(m, -1, 128)
        saturated = ((groups == E4M3_MAX_CODES[0]) | (groups == E4M3_MAX_CODES[1])).any(dim=-1)
        assert bool((saturated == above_floor).all()), f"{what}: +-448 in exactly the groups above the floor"


def check_call(results: list, references: list, fmt: str, both: bool, m: int, hidden: int, what: str) -> None:
    """``results``: every rank's FP8 outputs; ``references``: every rank's BF16-op outputs on the same
    inputs (both joined)."""
    from mhc_core import fp8

    for rank, outputs in enumerate(results):
        where = f"{what}, rank {rank}"
        check_layout(outputs, fmt, both, m, hidden, where)
        reference = references[rank]
        for index, name in enumerate(("residual_out", "post_out", "comb_out")):
            assert_bytes_equal(outputs[index], reference[index], f"{where}: {name}")
        if both:
            assert_bytes_equal(outputs[5], reference[3], f"{where}: BF16 layer input beside FP8")
        if rank:  # every rank's outputs are rank 0's (whose q and scales are checked below)
            for index, (mine, first) in enumerate(zip(outputs, results[0], strict=True)):
                assert_bytes_equal(mine, first, f"{where}: output {index} against rank 0")
            continue
        layer_input = outputs[5] if both else reference[3]
        assert bool(torch.isfinite(layer_input).all()), f"{where}: the inputs must give a finite layer input"
        q, scales = fp8.quantize(fmt, layer_input.cpu())  # on the CPU: IEEE divisions, no reciprocal
        assert_bytes_equal(outputs[3], q, f"{where}: q")
        assert_bytes_equal(outputs[4], scales, f"{where}: the scales, padding included")
        check_special_values(outputs[3], layer_input, fmt, m, where)


# ------------------------------------------------------------------ calls
def run(ops: list, how: str, inputs: list, shared: tuple, outs: list | None) -> list:
    """One call of every rank (``how``: call, moe or collect) with every rank's input, joined."""
    kwargs: list[dict] = [{} for _ in ops] if outs is None else [dict(out=out) for out in outs]
    if how == "collect":
        for op, x in zip(ops, inputs, strict=True):  # every rank publishes before any collects
            op.publish(x)
        results = [op.collect(*shared, **kw) for op, kw in zip(ops, kwargs, strict=True)]
    else:
        results = run_ranks(ops, "call", [(x, *shared) for x in inputs], kwargs)
    for op in ops:
        op.join()
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fp8_layer_input_matches_the_bf16_op(config: tuple) -> None:
    name, fmt, both, every = config
    ops, references = fp8_ops(name, fmt, both, every), bf16_ops(name, every)
    hidden = ops[0].hidden_size
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, config_id(config))))
    for index, (m, how) in enumerate(EVERY_VARIANT_CALLS if every else ONE_TOKEN_CALLS):
        what = f"{config_id(config)} {how} M = {m} ({ops[0].tokens_per_cluster(m)} tokens per cluster)"
        partials, shared = case(ops, m, generator)
        inputs = moe_inputs(ops, m, torch.float32, generator) if how == "moe" else partials
        given = index % 2 == 0
        outs = [poisoned_outputs(fmt, both, m, hidden) for _ in ops] if given else None
        results = run(ops, how, inputs, shared, outs)
        if given:
            for result, out in zip(results, outs, strict=True):
                assert all(a is b for a, b in zip(result, out, strict=True)), f"{what}: out= not returned"
        check_call(results, run(references, how, inputs, shared, None), fmt, both, m, hidden, what)


#: The poisoned ops' modes: ``test_fp8_kernel_gpu``'s one-token kernels (tp 1).
POISONED = (("fp32-g128", True), ("ue8m0-g128-packed", False), ("mx-g32", True))


@pytest.mark.parametrize("fmt, both", POISONED)
def test_a_poisoned_op_poisons_q_and_the_scales(fmt: str, both: bool) -> None:
    """A graph captured on an op replayed after ``close()`` (the op poisoned on the device): NaN
    everywhere, NaN codes and NaN scales, scale padding 0. The op is fresh (not the cached ones)."""
    from mhc_core import fp8
    from mhc_glm5 import AllReduceMhcBoundary

    fp8_ops("h200-tp1-h4096", "ue8m0-g128-packed", False, False)  # the skip without the compiler
    preset = one_token("h200-tp1-h4096")
    (op,) = build_ranks(
        1,
        lambda group: AllReduceMhcBoundary.from_config(
            preset, max_num_tokens=8, device="cuda", group=group, layer_input_format=fmt, layer_input_bf16=both
        ),
    )
    m, hidden = 5, op.hidden_size
    generator = torch.Generator("cuda").manual_seed(5)
    (partial,), shared = case([op], m, generator)
    out = poisoned_outputs(fmt, both, m, hidden)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(partial, *shared, out=out)
        op.join()
    graph.replay()
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out[0]).all()) and not bool((out[3].view(torch.uint8) == E4M3_NAN).any())
    op.close()
    for tensor, value in zip(out, poisoned_outputs(fmt, both, m, hidden), strict=True):
        flat_bytes(tensor).copy_(flat_bytes(value))
    graph.replay()
    torch.cuda.synchronize()
    assert bool(out[0].isnan().all()), "residual_out is NaN"
    if both:
        assert bool(out[5].isnan().all()), "the BF16 layer input is NaN"
    assert bool((out[3].view(torch.uint8) == E4M3_NAN).all()), "every code is NaN (0x7F)"
    layout = fp8.get_format(fmt)
    if layout.scale_encoding == "fp32":
        assert bool(out[4].isnan().all()), "every FP32 scale is NaN"
        return
    codes = torch.full((m, layout.groups(hidden)), UE8M0_NAN, dtype=torch.uint8)
    assert_bytes_equal(out[4], fp8.pack_scales(layout, codes, hidden), "every UE8M0 scale 0xFF, padding 0")
