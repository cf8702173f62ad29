"""The GLM-5.3 boundary kernels' FP8 layer input on the GPU (issue #33), each compiled kernel launched
directly (``mhc_core.host.binaries.launch.BoundKernel``).

Every variant (one-token; CUDA-core grouped, 4 tokens per cluster; tensor-core grouped, 16; the
persistent boundary, groups of 8 looping over 3 clusters) x every format, once each (``MATRIX``: 12
FP8 kernels; each variant and each format both FP8 alone and beside BF16). The one-token,
tensor-core and persistent kernels read ``x`` directly at tp = 1 (the op's plain call); the
CUDA-core grouped kernel runs at tp = 2 and polls a mailbox the test fills as two ranks' publishes
would. Every case also launches the BF16 kernel of the same geometry (a preset's kernel: the H200
TP1 preset's, the TP2 preset's ``boundary_x4``) on the same inputs:

* ``q`` and the scales (their whole allocation, padding included) equal ``mhc_core.fp8.quantize`` of
  the BF16 layer input, bit for bit: the kernel's own, from the same launch, where it writes it
  beside FP8, else the BF16 kernel's (equal to it: the same operations in the same order);
* the BF16 layer input beside FP8 and ``residual_out`` equal the BF16 kernel's; FP8 alone writes no
  BF16 layer input;
* the inputs hold -0 layer-input values, all-zero groups (a zero weight; a token of zeros), groups
  below the absmax floor and at large exponents; with FP32 scales every group above the floor has
  its absmax element at +-448 exactly (saturated);
* M = 1 (127 padding rows of the 128x4 layout), 5 or 6 (padding rows of the packed one; a short last
  group of the grouped kernels), 130 (a second 128-row tile);
* a poisoned op (its error word set) writes NaN codes (0x7F) and NaN scales (FP32 NaN, UE8M0 0xFF),
  padding still 0.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch

from tests.support import needs_compiler

pytestmark = pytest.mark.gpu

HC, MIX = 4, 24
#: The H200 presets' geometry and constants (public glm5_next config).
GEOMETRY: dict[str, Any] = {"hidden": 4096, "cluster_size": 8, "rms_eps": 1e-6, "hc_eps": 1e-6, "norm_eps": 1e-5}
VARIANTS: dict[str, dict[str, Any]] = {
    "one-token": {"tp": 1, "tokens": 1, "persistent": False},
    "grouped": {"tp": 2, "tokens": 4, "persistent": False},
    "tensor-core": {"tp": 1, "tokens": 16, "persistent": False},
    "persistent": {"tp": 1, "tokens": 8, "persistent": True},
}
#: (variant, format, BF16 beside FP8): every variant x format once.
MATRIX = (
    ("one-token", "fp32-g128", True),
    ("one-token", "ue8m0-g128-packed", False),
    ("one-token", "mx-g32", True),
    ("grouped", "fp32-g128", False),
    ("grouped", "ue8m0-g128-packed", True),
    ("grouped", "mx-g32", False),
    ("tensor-core", "fp32-g128", True),
    ("tensor-core", "ue8m0-g128-packed", False),
    ("tensor-core", "mx-g32", True),
    ("persistent", "fp32-g128", False),
    ("persistent", "ue8m0-g128-packed", True),
    ("persistent", "mx-g32", False),
)
#: Tokens per call: 1, 5 or 6 (short last groups), 130.
SHAPES = {"one-token": (1, 5, 130), "grouped": (1, 6, 130), "tensor-core": (5, 130), "persistent": (7, 130)}
#: Clusters of the persistent boundary: fewer than its groups, so that each loops.
PERSISTENT_CLUSTERS = 3
#: Error word a closed op carries (``mhc_core.constants.ERROR_CLOSED``): poisons every kernel.
POISON_CODE = 5
#: E4M3 codes: NaN, +-448, -0.
E4M3_NAN, E4M3_MAX_CODE, E4M3_NEGATIVE_MAX_CODE, E4M3_NEGATIVE_ZERO = 0x7F, 0x7E, 0xFE, 0x80
UE8M0_NAN = 0xFF
#: What every output holds before a launch: anything the kernel should write and does not shows.
UNWRITTEN = 0xA5


def boundary_config(variant: str, fmt: str = "bf16", both: bool = False, arch: str | None = None) -> dict[str, Any]:
    """The kernel config of ``variant`` for ``arch`` (None: this process's GPU's)."""
    from mhc_core.host.binaries.compiler import device_arch
    from mhc_glm5.boundary import BoundaryConfig

    fields = {**GEOMETRY, **VARIANTS[variant], "mixed_fma": (arch or device_arch()) != "sm_90a"}
    return asdict(BoundaryConfig(**fields, layer_input_format=fmt, layer_input_bf16=both))


def kernel_configs(arch: str = "sm_90a") -> list[dict[str, Any]]:
    """The FP8 configs these tests launch (to build them ahead of a run on a host without the DSL
    compiler: ``mhc_core.host.binaries.compiler.compile_kernel(..., persist=True)``); the BF16 ones are the
    presets'."""
    return [boundary_config(variant, fmt, both, arch) for variant, fmt, both in MATRIX]


def bound_boundary(config: dict[str, Any]):
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel
    from mhc_glm5.config import PERSISTENT_KERNEL, grouped_kernel_path

    if config["persistent"]:
        path = PERSISTENT_KERNEL
    elif config["tokens"] == 1:
        path = "mhc_glm5.boundary:BoundaryKernel"
    else:
        path = grouped_kernel_path(config["tokens"])
    if config["layer_input_format"] != "bf16":
        needs_compiler("the FP8 boundary kernels under test")
    compiled = compile_kernel(KernelSpec(path, config), device_arch())
    return BoundKernel(compiled.function, compiled.signature, {})


def make_inputs(tp: int, m: int, seed: int) -> dict[str, torch.Tensor]:
    """Residual streams, mixes, weights and each rank's partial sublayer output, with the special
    columns and tokens the module docstring lists (the norm weight decides them: the layer input is
    ``prenorm * inv_rms * weight``)."""
    hidden = GEOMETRY["hidden"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    weight = 1.0 + 0.25 * randn(hidden)
    weight[0:128] = 0.0  # an all-zero group: +-0 by the sign of the pre-norm value
    weight[128:160] = -0.0  # -0 again, in a 32-column group
    weight[256:384] = 2.0**-120  # absmax far below 448e-10: the scale comes from the floor
    weight[384:512] = 2.0**100  # large exponents (finite in BF16)
    weight[512:640] = 2.0**-20  # small, above the floor
    partials = randn(tp, m, hidden)
    residual = randn(m, HC, hidden)
    if m > 2:
        partials[:, 2] = 0.0  # a token of zeros: every group all-zero
        residual[2] = 0.0
    return {
        "partials": partials.to(torch.bfloat16).cuda(),
        "residual": residual.to(torch.bfloat16).cuda(),
        "post": (2.0 * torch.rand(m, HC, 1, generator=generator)).cuda(),
        "comb": torch.softmax(randn(m, HC, HC), dim=-1).cuda(),
        "fn": (0.02 * randn(MIX, HC * hidden)).to(torch.bfloat16).cuda(),
        "scale": (torch.rand(3, generator=generator) + 0.5).cuda(),
        "base": randn(MIX).cuda(),
        "gamma": weight.to(torch.bfloat16).cuda(),
    }


def unwritten(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, UNWRITTEN, dtype=torch.uint8, device="cuda").view(dtype)


def launch(config: dict[str, Any], inputs: dict[str, torch.Tensor], m: int, poisoned: bool = False) -> dict:
    """One launch of ``config``'s boundary kernel; returns its outputs (FP8 ones where it has them)."""
    from mhc_core import fp8
    from mhc_core.constants import ERROR_COPY, ERROR_WORD, HEADER_ENTRY_BYTES, LAMPORT_GENERATIONS
    from mhc_core.host.calls.spin import SpinGuard
    from mhc_core.host.ranks.mailbox import mailbox_elements

    hidden, tp = config["hidden"], config["tp"]
    device = torch.device("cuda")
    capacity = m
    mailbox = torch.full((mailbox_elements(tp, capacity, hidden),), -0.0, dtype=torch.bfloat16, device=device)
    if tp > 1:
        # Stage 0 as every rank's publish leaves it: each rank's slot (its -0s as +0), its M.
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

    outputs = {
        "residual_out": unwritten(m, HC, hidden * 2, dtype=torch.bfloat16),
        "layer_input": unwritten(m, hidden * 2, dtype=torch.bfloat16),
    }
    fmt = config["layer_input_format"]
    if fmt != "bf16":
        layout = fp8.get_format(fmt)
        outputs["layer_input_q"] = unwritten(m, hidden, dtype=torch.float8_e4m3fn)
        outputs["layer_input_scales"] = unwritten(layout.scale_storage_bytes(m, hidden), dtype=torch.uint8)
    bound_boundary(config)(
        residual=inputs["residual"],
        post=inputs["post"],
        comb=inputs["comb"],
        fn=inputs["fn"],
        scale=inputs["scale"],
        base=inputs["base"],
        gamma=inputs["gamma"],
        # The raw mixes' hand-off rows, empty (-0): the boundary writes them, no mixes kernel reads.
        mixes_out=torch.full((m, MIX), -0.0, dtype=torch.float32, device=device),
        x=inputs["partials"][0],
        prefetch=0,
        direct=int(tp == 1),
        mailbox=mailbox,
        stage_state=stage_state,
        capacity=capacity,
        spin_limit_ns=guard.limit_ns,
        error_flag=guard.address,
        arrivals=torch.zeros(1, dtype=torch.int32, device=device),
        clusters=PERSISTENT_CLUSTERS if config["persistent"] else m,
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


def expected_fp8(fmt: str, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mhc_core.fp8.quantize`` of a BF16 layer input: ``q`` and the scales' whole allocation."""
    from mhc_core import fp8

    q, scales = fp8.quantize(fmt, layer_input)
    m, hidden = layer_input.shape
    return q, scales.as_strided((fp8.get_format(fmt).scale_storage_numel(m, hidden),), (1,))


@pytest.mark.parametrize(
    ("variant", "fmt", "both"), MATRIX, ids=[f"{v}-{f}-{'both' if b else 'fp8'}" for v, f, b in MATRIX]
)
def test_fp8_layer_input_matches_the_reference(variant: str, fmt: str, both: bool) -> None:
    from mhc_core import fp8

    tp = VARIANTS[variant]["tp"]
    for index, m in enumerate(SHAPES[variant]):
        inputs = make_inputs(tp, m, seed=1000 * index + m)
        out = launch(boundary_config(variant, fmt, both), inputs, m)
        plain = launch(boundary_config(variant), inputs, m)
        where = f"{variant} {fmt} {'beside BF16' if both else 'alone'} M = {m}"

        assert_bytes_equal(out["residual_out"], plain["residual_out"], f"{where}: residual_out")
        if both:
            layer_input = out["layer_input"]
            assert_bytes_equal(layer_input, plain["layer_input"], f"{where}: BF16 layer input beside FP8")
        else:
            layer_input = plain["layer_input"]
            untouched = torch.full_like(out["layer_input"].view(torch.uint8), UNWRITTEN)
            assert_bytes_equal(out["layer_input"], untouched, f"{where}: FP8 alone writes no BF16 layer input")
        assert bool(torch.isfinite(layer_input).all()), f"{where}: the inputs must give a finite layer input"

        q_ref, scales_ref = expected_fp8(fmt, layer_input)
        assert_bytes_equal(out["layer_input_q"], q_ref, f"{where}: q")
        assert_bytes_equal(out["layer_input_scales"], scales_ref, f"{where}: scales and padding")

        codes = out["layer_input_q"].view(torch.uint8)
        assert bool((codes == E4M3_NEGATIVE_ZERO).any()), f"{where}: no -0 in the layer input"
        if fmt == "fp32-g128":
            # A group's absmax element becomes +-448 exactly (saturated) unless the floor sets the
            # scale (all-zero groups, the 2^-120 ones: their codes are all +-0).
            groups = codes.view(m, -1, 128)
            saturated = ((groups == E4M3_MAX_CODE) | (groups == E4M3_NEGATIVE_MAX_CODE)).any(dim=-1)
            above_floor = layer_input.float().abs().view(m, -1, 128).amax(dim=-1) > fp8.EPS
            assert bool((saturated == above_floor).all()), f"{where}: +-448 in exactly the groups above the floor"
            assert bool(above_floor.any()) and not bool(above_floor.all())


#: One poisoned case per variant, the formats in turn (the kernels of ``MATRIX``).
POISONED = (
    ("one-token", "mx-g32"),
    ("grouped", "fp32-g128"),
    ("tensor-core", "fp32-g128"),
    ("persistent", "ue8m0-g128-packed"),
)


@pytest.mark.parametrize(("variant", "fmt"), POISONED)
def test_a_poisoned_op_poisons_q_and_the_scales(variant: str, fmt: str) -> None:
    from mhc_core import fp8

    both = next(b for v, f, b in MATRIX if (v, f) == (variant, fmt))
    m = SHAPES[variant][1]
    inputs = make_inputs(VARIANTS[variant]["tp"], m, seed=7)
    out = launch(boundary_config(variant, fmt, both), inputs, m, poisoned=True)
    layout = fp8.get_format(fmt)
    hidden = GEOMETRY["hidden"]
    if both:
        assert bool(out["layer_input"].isnan().all()), "the BF16 layer input is NaN"
    assert bool((out["layer_input_q"].view(torch.uint8) == E4M3_NAN).all()), "every code is NaN (0x7F)"
    if layout.scale_encoding == "fp32":
        assert bool(out["layer_input_scales"].view(torch.float32).isnan().all()), "every FP32 scale is NaN"
        return
    codes = torch.full((m, layout.groups(hidden)), UE8M0_NAN, dtype=torch.uint8, device="cuda")
    expected = fp8.pack_scales(layout, codes, hidden).as_strided((layout.scale_storage_numel(m, hidden),), (1,))
    assert_bytes_equal(out["layer_input_scales"], expected, "every UE8M0 scale 0xFF, padding 0")
