"""The DSV collective's FP8 layer input on the GPU (issue #33), the compiled kernel launched directly.

The op's plumbing for the option is not there yet (``AllReduceMHC`` has no ``layer_input_format``),
so these tests bind the collective themselves (``mhc_core.host.launch.BoundKernel``): at tp = 1 it
reads ``x`` directly (the op's plain call), at tp = 2 it polls a mailbox whose slots the test fills
as two ranks' publishes would. Both variants (one token per cluster; persistent, clusters looping
over tokens), every format, FP8 alone and beside the BF16 layer input:

* ``q`` and the scales (their whole allocation, padding included) equal ``mhc_core.fp8.quantize``
  of the kernel's own BF16 layer input, written by the same launch, bit for bit;
* the FP8-only kernel writes the same ``q`` and scales, and the BF16 layer input and the residual
  outputs equal the BF16 kernel's, bit for bit;
* the inputs hold -0 layer-input values, all-zero groups (a zero weight; a token of zeros), groups
  below the absmax floor and at large exponents; with FP32 scales every group's absmax element
  saturates at +-448;
* a poisoned op (its error word set) writes NaN codes (0x7F) and NaN scales (FP32 NaN, UE8M0 0xFF),
  padding still 0.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

HC = 4  # hc_mult: public DeepSeek-V4 config
EPS = 1e-6  # rms_norm_eps: public DeepSeek-V4 config
FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: Geometries (``MHCConfig`` fields): the H200 tp 1 preset's (one trip); hidden 7168 at tp 1 (two
#: trips, the second covering 256 of 640 fragments); tp 2 in rank-lane pairs (a 128-column group
#: is a whole warp; three trips), read through the mailbox.
GEOMETRIES: dict[str, dict[str, int]] = {
    "tp1-h5120": {"hidden": 5120, "tp": 1, "cluster_size": 5, "threads": 128, "rank_lanes": 1},
    "tp1-h7168": {"hidden": 7168, "tp": 1, "cluster_size": 5, "threads": 128, "rank_lanes": 1},
    "tp2-h7168-lanes2": {"hidden": 7168, "tp": 2, "cluster_size": 5, "threads": 128, "rank_lanes": 2},
}
#: (M, clusters) per variant: M = 1 (127 padding rows of the 128x4 layout), 5 (3 padding rows of the
#: packed one), 130 (a second 128-row tile); the persistent kernel with fewer clusters than tokens.
SHAPES = {False: ((1, 1), (5, 5), (130, 130)), True: ((7, 3), (130, 16))}
#: Error word a closed op carries (``mhc_core.constants.ERROR_CLOSED``): poisons every kernel.
POISON_CODE = 5
#: E4M3 codes: NaN, +-448, -0.
E4M3_NAN, E4M3_MAX_CODE, E4M3_NEGATIVE_MAX_CODE, E4M3_NEGATIVE_ZERO = 0x7F, 0x7E, 0xFE, 0x80
UE8M0_NAN = 0xFF


def collective_config(geometry: str, fmt: str, both: bool, persistent: bool) -> dict[str, Any]:
    from mhc_dsv41.config import MHCConfig

    return asdict(
        MHCConfig(hc=HC, **GEOMETRIES[geometry], persistent=persistent, layer_input_format=fmt, layer_input_bf16=both)
    )


def kernel_configs() -> list[dict[str, Any]]:
    """Every collective config these tests launch (to build them ahead of a run on a host
    without the DSL compiler: ``mhc_core.host.compiler.compile_kernel(..., persist=True)``)."""
    configs = []
    for geometry in GEOMETRIES:
        for persistent in (False, True):
            configs.append(collective_config(geometry, "bf16", False, persistent))
            for fmt in FORMATS:
                for both in (False, True):
                    configs.append(collective_config(geometry, fmt, both, persistent))
    return configs


def bound_collective(config: dict[str, Any]):
    from mhc_core.host.compiler import KernelSpec, compile_kernel, device_arch
    from mhc_core.host.launch import BoundKernel
    from mhc_dsv41.config import COLLECTIVE_KERNEL

    try:
        compiled = compile_kernel(KernelSpec(COLLECTIVE_KERNEL, config), device_arch())
    except RuntimeError as error:
        if importlib.util.find_spec("cutlass") is None:
            pytest.skip(f"the FP8 collective ships in no package and the DSL compiler is not installed: {error}")
        raise
    return BoundKernel(compiled.function, compiled.signature, {})


def make_inputs(geometry: str, m: int, seed: int) -> dict[str, torch.Tensor]:
    """Residual streams, mixes, weight and each rank's partial sublayer output, with the special
    columns and tokens the module docstring lists (the weight decides them: the layer input is
    ``prenorm * inv_rms * weight``)."""
    hidden, tp = GEOMETRIES[geometry]["hidden"], GEOMETRIES[geometry]["tp"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    gamma = 1.0 + 0.25 * randn(hidden)
    gamma[0:128] = 0.0  # an all-zero group: +-0 by the sign of the pre-norm value
    gamma[128:160] = -0.0  # -0 again, in a 32-column group
    gamma[256:384] = 2.0**-120  # absmax far below 448e-10: the scale comes from the floor
    gamma[384:512] = 2.0**100  # large exponents (finite in BF16)
    gamma[512:640] = 2.0**-20  # small, above the floor
    partials = randn(tp, m, hidden)
    residual = randn(m, HC, hidden)
    if m > 2:
        partials[:, 2] = 0.0  # a token of zeros: every group all-zero
        residual[2] = 0.0
    return {
        "partials": partials.to(torch.bfloat16).cuda(),
        "residual": residual.to(torch.bfloat16).cuda(),
        "post": (2.0 * torch.rand(m, HC, generator=generator)).cuda(),
        "comb": torch.softmax(randn(m, HC, HC), dim=-1).cuda(),
        "pre": torch.sigmoid(randn(m, HC)).cuda(),
        "gamma": gamma.to(torch.bfloat16).cuda(),
    }


def launch(config: dict[str, Any], inputs: dict[str, torch.Tensor], m: int, clusters: int, poisoned: bool = False):
    """One launch of ``config``'s collective; returns its outputs (FP8 ones where it has them).

    Outputs start as 0xA5 bytes, so anything the kernel should write and does not shows.
    """
    from mhc_core import fp8
    from mhc_core.constants import ERROR_COPY, ERROR_WORD, HEADER_ENTRY_BYTES, LAMPORT_GENERATIONS
    from mhc_core.host.mailbox import mailbox_elements
    from mhc_core.host.spin import SpinGuard

    hidden, tp = config["hidden"], config["tp"]
    device = torch.device("cuda")
    capacity = m
    mailbox = torch.full((mailbox_elements(tp, capacity, hidden),), -0.0, dtype=torch.bfloat16, device=device)
    if tp > 1:
        # Stage 0 as every rank's publish leaves it: each rank's fragment (its -0s as +0), its M.
        slots = mailbox[: LAMPORT_GENERATIONS * tp * capacity * hidden].view(LAMPORT_GENERATIONS, tp, capacity, hidden)
        partials = inputs["partials"]
        slots[0] = torch.where(partials == 0, torch.zeros_like(partials), partials)
        header = mailbox[LAMPORT_GENERATIONS * tp * capacity * hidden :].view(torch.int32)
        header = header.view(LAMPORT_GENERATIONS, tp, HEADER_ENTRY_BYTES // 4)
        header[0] = 2 * m + 1  # the M a publish encodes (``protocol.encode_count``)
    stage_state = torch.zeros(4, dtype=torch.int32, device=device)
    if poisoned:
        stage_state[ERROR_WORD] = stage_state[ERROR_COPY] = POISON_CODE
    guard = SpinGuard(tp=tp, timeout_ms=2000.0, device=device)

    def garbage(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(dtype)

    outputs = {
        "residual_out": garbage(m, HC, hidden * 2, dtype=torch.bfloat16),
        "layer_input": garbage(m, hidden * 2, dtype=torch.bfloat16),
    }
    fmt = config["layer_input_format"]
    if fmt != "bf16":
        layout = fp8.get_format(fmt)
        outputs["layer_input_q"] = garbage(m, hidden, dtype=torch.float8_e4m3fn)
        outputs["layer_input_scales"] = garbage(layout.scale_storage_bytes(m, hidden), dtype=torch.uint8)
    bound_collective(config)(
        residual=inputs["residual"],
        post=inputs["post"],
        comb=inputs["comb"],
        pre=inputs["pre"],
        gamma=inputs["gamma"],
        eps=EPS,
        prefetch=0,
        x=inputs["partials"][0],
        direct=int(tp == 1),
        mailbox=mailbox,
        stage_state=stage_state,
        capacity=capacity,
        spin_limit_ns=guard.limit_ns,
        error_flag=guard.address,
        clusters=clusters,
        m=m,
        **outputs,
    )
    torch.cuda.synchronize()
    if not poisoned:
        guard.check()
    return outputs


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    differ = (actual != expected).nonzero()
    assert differ.numel() == 0, (
        f"{what}: {differ.shape[0]} bytes differ, first at {differ[0].tolist()}: "
        f"{actual[tuple(differ[0])].item():#04x} != {expected[tuple(differ[0])].item():#04x}"
    )


@pytest.mark.parametrize("persistent", (False, True), ids=("one-token", "persistent"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("geometry", tuple(GEOMETRIES))
def test_fp8_layer_input_matches_the_reference(geometry: str, fmt: str, persistent: bool) -> None:
    from mhc_core import fp8

    for index, (m, clusters) in enumerate(SHAPES[persistent]):
        inputs = make_inputs(geometry, m, seed=1000 * index + m)
        both = launch(collective_config(geometry, fmt, True, persistent), inputs, m, clusters)
        alone = launch(collective_config(geometry, fmt, False, persistent), inputs, m, clusters)
        plain = launch(collective_config(geometry, "bf16", False, persistent), inputs, m, clusters)
        where = f"{geometry} {fmt} {'persistent' if persistent else 'one-token'} M = {m}"

        layer_input = both["layer_input"]
        assert_bytes_equal(layer_input, plain["layer_input"], f"{where}: BF16 layer input beside FP8")
        assert_bytes_equal(both["residual_out"], plain["residual_out"], f"{where}: residual_out")
        assert_bytes_equal(alone["residual_out"], plain["residual_out"], f"{where}: residual_out, FP8 alone")
        assert bool(torch.isfinite(layer_input).all()), f"{where}: the inputs must give a finite layer input"

        q_ref, scales_ref = fp8.quantize(fmt, layer_input)
        expected_scales = scales_ref.as_strided(
            (fp8.get_format(fmt).scale_storage_numel(m, layer_input.shape[1]),), (1,)
        )
        for name, out in (("both", both), ("FP8 alone", alone)):
            assert_bytes_equal(out["layer_input_q"], q_ref, f"{where}: q ({name})")
            assert_bytes_equal(out["layer_input_scales"], expected_scales, f"{where}: scales and padding ({name})")
        untouched = torch.full_like(alone["layer_input"].view(torch.uint8), 0xA5)
        assert_bytes_equal(alone["layer_input"], untouched, f"{where}: FP8 alone writes no BF16 layer input")

        codes = both["layer_input_q"].view(torch.uint8)
        assert bool((codes == E4M3_NEGATIVE_ZERO).any()), f"{where}: no -0 in the layer input"
        if fmt == "fp32-g128":
            # A group's absmax element becomes +-448 exactly (clamped) unless the floor sets the
            # scale (all-zero groups, the 2^-120 ones: their codes are all +-0).
            groups = codes.view(m, -1, 128)
            saturated = ((groups == E4M3_MAX_CODE) | (groups == E4M3_NEGATIVE_MAX_CODE)).any(dim=-1)
            above_floor = layer_input.float().abs().view(m, -1, 128).amax(dim=-1) > fp8.EPS
            assert bool((saturated == above_floor).all()), f"{where}: +-448 in exactly the groups above the floor"
            assert bool(above_floor.any()) and not bool(above_floor.all())


@pytest.mark.parametrize("persistent", (False, True), ids=("one-token", "persistent"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_poisoned_op_poisons_q_and_the_scales(fmt: str, persistent: bool) -> None:
    from mhc_core import fp8

    geometry = "tp1-h5120"
    m, clusters = SHAPES[persistent][0]
    inputs = make_inputs(geometry, m, seed=7)
    out = launch(collective_config(geometry, fmt, True, persistent), inputs, m, clusters, poisoned=True)
    layout = fp8.get_format(fmt)
    hidden = GEOMETRIES[geometry]["hidden"]
    assert bool(out["layer_input"].isnan().all()), "the BF16 layer input is NaN"
    assert bool((out["layer_input_q"].view(torch.uint8) == E4M3_NAN).all()), "every code is NaN (0x7F)"
    if layout.scale_encoding == "fp32":
        assert bool(out["layer_input_scales"].view(torch.float32).isnan().all()), "every FP32 scale is NaN"
        return
    codes = torch.full((m, layout.groups(hidden)), UE8M0_NAN, dtype=torch.uint8, device="cuda")
    expected = fp8.pack_scales(layout, codes, hidden).as_strided((layout.scale_storage_numel(m, hidden),), (1,))
    assert_bytes_equal(out["layer_input_scales"], expected, "every UE8M0 scale 0xFF, padding 0")
