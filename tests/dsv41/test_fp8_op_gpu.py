"""``AllReduceMHC`` with an FP8 layer input (issue #33) on the GPU: the op's three call forms at tp 1
and loopback tp 2, 4 and 8, against the BF16 op of the same preset on the same inputs.

What every call checks, bit for bit (outputs start poisoned: residual and BF16 outputs with
``tests.support``'s NaN, ``q`` with NaN codes 0x7F, FP32 scales NaN, UE8M0 bytes 0xFF, padding too):

* ``residual_out`` (and, with ``layer_input_bf16``, the BF16 layer input) equal the BF16 op's;
* ``q`` and the scales, their whole allocation (padding rows and bytes included), equal
  ``mhc_core.fp8.quantize`` of the BF16 layer input: the op's own BF16 copy, from the same call, in
  both-outputs mode; the BF16 op's in FP8-only mode;
* the returned tensors have ``Fp8Format.empty_scales``' dtype, shape, strides and allocation
  (allocated by the op, or the caller's ``out=`` returned as given); every rank's equal rank 0's.

Inputs: the norm weight sets all-zero groups (0 and -0 columns: +-0 codes, the scale from the
absmax floor), -0 values, groups below the floor (2^-120) and at large exponents (2^100); a token
of zeros (every group all-zero); with FP32 scales every group above the floor has a +-448 code.
``M`` = 1, 5 and 130 (padding rows of both UE8M0 layouts, a second 128-row tile).

The matrix (``CONFIGS``): every H200 preset in both modes and every format in both modes at tp > 1;
at tp 1 every format beside the BF16 copy; ``test-tp4-h7168`` (three trips in rank-lane pairs, the
last partial) and two plain-constructor hidden sizes whose last packed scale word is partial. Each
configuration is one op whose two collectives (one-token, persistent) compile once: 2 x 14 = 28
kernels, and the plain sizes' publish and finalize 4 more, built at construction (its warm-up
launches each once: nothing is first launched behind a spinning collective). Each config's ops: the
default threshold (every call one-token) and the persistent collective at every M with few clusters
(looping over tokens), as the BF16 ops of ``test_allreduce_mhc_gpu`` (shared: their kernels are the
BF16 suite's). A poisoned op (closed, a captured graph
replayed) writes NaN codes and NaN scales, padding 0.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

from tests.dsv41.test_allreduce_mhc_gpu import (
    CAPACITY,
    LOOPING_CLUSTERS,
    NORM_EPS,
    inputs,
    ops_for,
    persistent_ops_for,
)
from tests.support import bf16_randn, build_ranks, cached_ranks, poison, run_ranks

pytestmark = pytest.mark.gpu

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: (preset or hidden size, format, BF16 copy beside it) of every FP8 op built here (module docstring).
CONFIGS: tuple[tuple[str | int, str, bool], ...] = (
    ("h200-tp1-h5120", "fp32-g128", True),
    ("h200-tp1-h5120", "ue8m0-g128-packed", True),
    ("h200-tp1-h5120", "mx-g32", True),
    ("h200-tp1-h5120", "mx-g32", False),
    ("h200-tp2-h5120", "fp32-g128", True),
    ("h200-tp2-h5120", "ue8m0-g128-packed", False),
    ("h200-tp4-h5120", "mx-g32", True),
    ("h200-tp4-h5120", "fp32-g128", False),
    ("h200-tp8-h5120", "ue8m0-g128-packed", True),
    ("h200-tp8-h5120", "mx-g32", False),
    ("test-tp4-h7168", "mx-g32", True),
    ("test-tp4-h7168", "ue8m0-g128-packed", True),
    # Plain constructors at tp 1: 41 groups of 128 (3 padding bytes in each row's last packed word),
    # 161 groups of 32 (the same in the swizzled layout).
    (5248, "ue8m0-g128-packed", True),
    (5152, "mx-g32", True),
)
HC, TOP_K = 4, 8
#: Calls per op: (M, how) for the default threshold (one-token) and the persistent op.
ONE_TOKEN_CALLS = ((1, "call"), (5, "call"), (130, "call"), (5, "finalize"), (130, "collect"))
PERSISTENT_CALLS = ((LOOPING_CLUSTERS + 1, "call"), (130, "finalize"), (37, "collect"))
#: Poison patterns per dtype: what no healthy kernel writes (checked bytes untouched show as such).
E4M3_NAN, UE8M0_NAN = 0x7F, 0xFF
E4M3_MAX_CODES = (0x7E, 0xFE)
E4M3_NEGATIVE_ZERO = 0x80


def config_id(config: tuple) -> str:
    target, fmt, both = config
    return f"{target if isinstance(target, str) else f'h{target}'}-{fmt}-{'both' if both else 'fp8'}"


# ------------------------------------------------------------------ ops
def preset_for(target: str | int):
    """The named preset, or one of a plain constructor's shape (tp 1, ``default_geometry``)."""
    from mhc_dsv41.config import DSV41Preset, default_geometry
    from tests import presets

    if isinstance(target, str):
        return presets.get("dsv41", target).PRESET
    geometry = default_geometry(target, HC, 1)
    return DSV41Preset(
        name=f"plain-h{target}", hidden=target, hc=HC, tp=1, top_k=TOP_K, norm_eps=NORM_EPS, archs=("sm_90a",),
        **geometry,
    )  # fmt: skip


def fp8_ops(target: str | int, fmt: str, both: bool, *, persistent: bool) -> list:
    """Every rank's FP8 op for a preset (its tp) or a plain hidden size (tp 1), cached for the session.
    Their kernels ship in no package: compiled, or loaded from the cache (``kernel_specs``)."""
    from mhc_dsv41 import AllReduceMHC

    options: dict[str, Any] = dict(layer_input_format=fmt, layer_input_bf16=both)
    if persistent:
        options.update(persistent_min_tokens=1, clusters=LOOPING_CLUSTERS)
    preset = preset_for(target)

    def factory(group):
        if isinstance(target, int):
            return AllReduceMHC(
                hidden_size=target, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, device="cuda", group=group,
                **options,
            )  # fmt: skip
        return AllReduceMHC.from_config(preset, max_num_tokens=CAPACITY, device="cuda", group=group, **options)

    try:
        return cached_ranks(("dsv41-fp8", target, fmt, both, persistent), preset.tp, factory)
    except RuntimeError as error:
        if importlib.util.find_spec("cutlass") is None:
            pytest.skip(f"an FP8 DSV op: its kernels ship in no package and are not in the cache ({error})")
        raise


def bf16_ops(target: str | int, *, persistent: bool) -> list | None:
    """The BF16 op of the same preset (``test_allreduce_mhc_gpu``'s, shared), or None for a plain size."""
    if isinstance(target, int):
        return None
    return persistent_ops_for(target) if persistent else ops_for(target)


def kernel_specs(arch: str = "sm_90a") -> list[tuple[str, dict[str, Any]]]:
    """Every kernel these tests' ops launch, as (class path, config), each once: to compile them ahead
    into the cache for a host without the DSL compiler (``mhc_core.host.binaries.compiler.compile_kernel(
    KernelSpec(path, config), arch, persist=True)``). The presets' publishes ship; the plain sizes'
    do not."""
    specs: dict[str, tuple[str, dict[str, Any]]] = {}
    for target, fmt, both in CONFIGS:
        preset = dataclasses.replace(preset_for(target), layer_input_format=fmt, layer_input_bf16=both)
        for path, config in preset.kernel_specs(arch).values():
            specs.setdefault(repr((path, sorted(config.items()))), (path, config))
    return list(specs.values())


def kernel_configs() -> list[dict[str, Any]]:
    """The FP8 collectives' configs among ``kernel_specs`` (``mhc_dsv41.config.COLLECTIVE_KERNEL``)."""
    from mhc_dsv41.config import COLLECTIVE_KERNEL

    return [config for path, config in kernel_specs() if path == COLLECTIVE_KERNEL]


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
    """Every rank's partial and the shared collect inputs (residual, post, comb, pre, weight)."""
    op = ops[0]
    residual, post, comb, pre, _ = inputs(m, op.hc_mult, op.hidden_size, generator, post_3d=False, negative_zero=True)
    weight = special_weight(op.hidden_size, generator)
    partials = [bf16_randn(m, op.hidden_size, generator=generator) for _ in ops]
    if m > 2:  # a token of zeros: every group all-zero
        residual[2] = 0.0
        for partial in partials:
            partial[2] = 0.0
    return partials, (residual, post, comb, pre, weight)


def moe_inputs(ops: list, m: int, generator: torch.Generator) -> list:
    from mhc_core import MoEOutput

    hidden, moes = ops[0].hidden_size, []
    for _ in ops:
        rows = 2 * m + 3
        index = torch.randint(0, rows, (m, TOP_K), generator=generator, device="cuda", dtype=torch.int32)
        index[torch.rand(m, TOP_K, generator=generator, device="cuda") < 0.3] = -1
        moes.append(
            MoEOutput(
                bf16_randn(rows, hidden, generator=generator),
                torch.rand(m, TOP_K, generator=generator, device="cuda") / TOP_K,
                index,
                bf16_randn(m, hidden, generator=generator),
            )
        )
    return moes


def poisoned_outputs(fmt: str, both: bool, m: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """``out=`` for one rank, every byte poisoned (module docstring)."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    residual_out = poison(torch.empty(m, HC, hidden, dtype=torch.bfloat16, device="cuda"))
    q = torch.full((m, hidden), E4M3_NAN, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scales = layout.empty_scales(m, hidden, device="cuda")
    storage = flat_bytes(scales)
    if layout.scale_encoding == "fp32":
        poison(storage.view(torch.float32))
    else:
        storage.fill_(UE8M0_NAN)
    outputs = (residual_out, q, scales)
    return (*outputs, poison(torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda"))) if both else outputs


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s whole allocation from its first element (a view of them)."""
    nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return tensor.as_strided((nbytes // tensor.element_size(),), (1,)).view(torch.uint8)


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
    assert len(outputs) == (4 if both else 3), f"{what}: {len(outputs)} outputs"
    q, scales = outputs[1], outputs[2]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, hidden) and q.is_contiguous(), what
    assert scales.dtype == layout.scale_dtype, what
    assert tuple(scales.shape) == layout.scale_shape(m, hidden), what
    assert tuple(scales.stride()) == layout.scale_strides(m, hidden), what
    assert flat_bytes(scales).numel() >= layout.scale_storage_bytes(m, hidden), f"{what}: allocation"


def check_special_values(q: torch.Tensor, layer_input: torch.Tensor, fmt: str, m: int, what: str) -> None:
    """The inputs' special cases showed up: -0 codes; with FP32 scales +-448 in exactly the groups
    above the absmax floor; all-zero groups (their scales the floor's)."""
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


def check_call(results: list, references: list | None, fmt: str, both: bool, m: int, hidden: int, what: str) -> None:
    """``results``: every rank's FP8 outputs; ``references``: every rank's BF16-op outputs
    ``(residual_out, layer_input)`` on the same inputs, or None (then the op's own BF16 copy, which
    both-outputs mode has, is the layer input)."""
    from mhc_core import fp8

    for rank, outputs in enumerate(results):
        where = f"{what}, rank {rank}"
        check_layout(outputs, fmt, both, m, hidden, where)
        if references is not None:
            assert_bytes_equal(outputs[0], references[rank][0], f"{where}: residual_out")
            if both:
                assert_bytes_equal(outputs[3], references[rank][1], f"{where}: BF16 layer input beside FP8")
        if rank:  # every rank's outputs are rank 0's (whose q and scales are checked below)
            for index, (mine, first) in enumerate(zip(outputs, results[0], strict=True)):
                assert_bytes_equal(mine, first, f"{where}: output {index} against rank 0")
            continue
        layer_input = references[0][1] if references is not None else outputs[3]
        assert bool(torch.isfinite(layer_input).all()), f"{where}: the inputs must give a finite layer input"
        q, scales = fp8.quantize(fmt, layer_input.cpu())  # on the CPU: IEEE divisions, no reciprocal
        assert_bytes_equal(outputs[1], q, f"{where}: q")
        assert_bytes_equal(outputs[2], scales, f"{where}: the scales, padding included")
        check_special_values(outputs[1], layer_input, fmt, m, where)


# ------------------------------------------------------------------ calls
def run(ops: list, how: str, m: int, generator: torch.Generator, outs: list | None) -> tuple[list, list, Any]:
    """One call of every rank (``how``: call, finalize or collect): (FP8 results, the inputs the BF16
    op takes for the same outputs, its method)."""
    partials, shared = case(ops, m, generator)
    kwargs: list[dict] = [{} for _ in ops] if outs is None else [dict(out=out) for out in outs]
    if how == "finalize":
        moes = moe_inputs(ops, m, generator)
        args = [
            (mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output, *shared,
             NORM_EPS)
            for mo in moes
        ]  # fmt: skip
        return run_ranks(ops, "finalize", args, kwargs), args, "finalize"
    args = [(partial, *shared, NORM_EPS) for partial in partials]
    if how == "call":
        return run_ranks(ops, "call", args, kwargs), args, "call"
    for op, partial in zip(ops, partials, strict=True):  # every rank publishes before any collects
        op.publish(partial)
    return [op.collect(*shared, NORM_EPS, **kw) for op, kw in zip(ops, kwargs, strict=True)], args, "call"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fp8_layer_input_matches_the_bf16_op(config: tuple) -> None:
    target, fmt, both = config
    groups = {persistent: fp8_ops(target, fmt, both, persistent=persistent) for persistent in (False, True)}
    plain = {persistent: bf16_ops(target, persistent=persistent) for persistent in (False, True)}
    hidden = groups[False][0].hidden_size
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, config_id(config))))
    for persistent, calls in ((False, ONE_TOKEN_CALLS), (True, PERSISTENT_CALLS)):
        ops = groups[persistent]
        for index, (m, how) in enumerate(calls):
            what = f"{config_id(config)} {'persistent' if persistent else 'one-token'} {how} M = {m}"
            given = index % 2 == 0
            outs = [poisoned_outputs(fmt, both, m, hidden) for _ in ops] if given else None
            results, args, method = run(ops, how, m, generator, outs)
            if given:
                for result, out in zip(results, outs, strict=True):
                    assert all(a is b for a, b in zip(result, out, strict=True)), f"{what}: out= not returned"
            references = None
            if plain[persistent] is not None:
                references = run_ranks(plain[persistent], method, args)
            elif not both:
                raise AssertionError("an FP8-only op needs the BF16 op's layer input")
            check_call(results, references, fmt, both, m, hidden, what)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_poisoned_op_poisons_q_and_the_scales(fmt: str) -> None:
    """A graph captured on an op replayed after ``close()`` (the op poisoned on the device): NaN
    everywhere, NaN codes and NaN scales, scale padding 0. The op is fresh (its kernels the matrix's)."""
    from mhc_core import fp8
    from mhc_dsv41 import AllReduceMHC, presets

    fp8_ops("h200-tp1-h5120", fmt, True, persistent=False)  # its kernels (or the skip without them)
    preset = presets.get("h200-tp1-h5120").PRESET
    (op,) = build_ranks(
        1,
        lambda group: AllReduceMHC.from_config(
            preset, max_num_tokens=CAPACITY, device="cuda", group=group, layer_input_format=fmt, layer_input_bf16=True
        ),
    )
    m, hidden = 5, op.hidden_size
    generator = torch.Generator("cuda").manual_seed(5)
    (partial,), shared = case([op], m, generator)
    out = poisoned_outputs(fmt, True, m, hidden)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(partial, *shared, NORM_EPS, out=out)
    graph.replay()
    torch.cuda.synchronize()
    check_call([out], None, fmt, True, m, hidden, f"{fmt}: a healthy replay")
    op.close()
    for tensor, value in zip(out, poisoned_outputs(fmt, True, m, hidden), strict=True):
        flat_bytes(tensor).copy_(flat_bytes(value))
    graph.replay()
    torch.cuda.synchronize()
    residual_out, q, scales, layer_input = out
    assert bool(residual_out.isnan().all()) and bool(layer_input.isnan().all()), "the BF16 outputs are NaN"
    assert bool((q.view(torch.uint8) == E4M3_NAN).all()), "every code is NaN (0x7F)"
    layout = fp8.get_format(fmt)
    if layout.scale_encoding == "fp32":
        assert bool(scales.isnan().all()), "every FP32 scale is NaN"
        return
    codes = torch.full((m, layout.groups(hidden)), UE8M0_NAN, dtype=torch.uint8)
    assert_bytes_equal(scales, fp8.pack_scales(layout, codes, hidden), "every UE8M0 scale 0xFF, padding 0")
