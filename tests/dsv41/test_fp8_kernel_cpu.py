"""The DSV collective's FP8 layer input (issue #33) without a GPU: the config option's validation,
and the kernels compiled for sm_90a and sm_100a in every format, their PTX read.

What the PTX must show per trip (one per 640 fragments here): 4 ``cvt.rn.satfinite.e4m3x2.f32``
(8 codes), one 8-byte ``q`` store, 3 ``max.u16x2`` (the fragment's absmax) and ``log2(group / 8)``
butterfly shuffles (the group's); ``fp32-g128`` divides the scale with ``div.rn.f32`` and its 8
values through one shared ``rcp.approx`` and ``div.rn``'s fast path, with 8 ``div.rn.f32`` for a
scale that is not normal (``quant.quantize_fragment_divide``); the UE8M0 formats divide once (the
scale) and never with an approximate division or reciprocal.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.ptx_checks import count, has_local_memory, runtime_divisions

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: (preset, arch): the H200 tp 1 preset (one trip); a GB300 one on sm_100a; three trips in rank-lane
#: pairs (the last partial).
TARGETS = (("h200-tp1-h5120", "sm_90a"), ("gb300-tp4-h5120", "sm_100a"), ("test-tp4-h7168", "sm_90a"))
#: The BF16 collective's own IEEE division (the mean of squares); every other is the quantiser's.
NORM_DIVISIONS = 1
#: Per trip: E4M3 pair conversions and absmax steps of one fragment.
CONVERSIONS_PER_TRIP = 4
ABSMAX_MAX_U16X2_PER_TRIP = 3
#: 16-byte stores of scale padding (``quant.store_padding_rows``): one for a swizzled 128x4 unit.
PADDING_UNIT_STORES = {"row-major": 0, "mn-major-packed": 0, "swizzled-128x4": 1}


def geometry(**fields):
    from mhc_dsv41.config import MHCConfig

    base = {"hidden": 5120, "hc": 4, "tp": 4, "cluster_size": 5, "threads": 128, "rank_lanes": 1}
    return MHCConfig(**{**base, **fields})


# ------------------------------------------------------------------ the option
def test_bf16_is_the_default_and_reads_as_before() -> None:
    config = geometry()
    assert config.layer_input_format == "bf16" and not config.layer_input_bf16
    assert not config.quantizes and config.stores_bf16_layer_input
    # The kernel's symbol is built from this text: unchanged, so the BF16 PTX is too.
    assert "layer_input" not in repr(config)
    assert "layer_input_format='mx-g32'" in repr(geometry(layer_input_format="mx-g32"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_on_every_preset_geometry(fmt: str) -> None:
    from mhc_dsv41.config import MHCConfig
    from tests import presets  # shipped and test presets

    for name in presets.names("dsv41"):
        preset = presets.get("dsv41", name).PRESET
        for persistent in (False, True):
            for both in (False, True):
                fields = preset.collective_config(persistent, layer_input_format=fmt, layer_input_bf16=both)
                config = MHCConfig(**fields)
                assert config.quantizes and config.stores_bf16_layer_input == both
                # A kernel's key is built from the dict: it must be the dataclass's every field.
                assert dataclasses.asdict(config) == fields


def test_preset_configs_list_the_option() -> None:
    from mhc_dsv41.config import MHCConfig
    from tests import presets  # shipped and test presets

    for name in presets.names("dsv41"):
        module = presets.get("dsv41", name)
        for arch in module.PRESET.archs:
            for kernel in ("collective", "collective_persistent"):
                _, fields = module.KERNELS[arch][kernel]
                assert dataclasses.asdict(MHCConfig(**fields)) == fields
                assert fields["layer_input_format"] == "bf16" and fields["layer_input_bf16"] is False


@pytest.mark.parametrize(
    "fields, field, rule",
    [
        ({"layer_input_format": "fp8"}, "layer_input_format", "expected one of bf16, fp32-g128"),
        ({"layer_input_format": "FP32-G128"}, "layer_input_format", "expected one of"),
        ({"layer_input_bf16": True}, "layer_input_bf16", "expected False"),
        ({"layer_input_format": "mx-g32", "layer_input_bf16": 1}, "layer_input_bf16", "True or False"),
        # 5184 = 40.5 groups of 128 (a whole number of 32-column groups).
        ({"hidden": 5184, "layer_input_format": "fp32-g128"}, "layer_input_format", "multiple of 128"),
        ({"hidden": 5184, "layer_input_format": "ue8m0-g128-packed"}, "layer_input_format", "multiple of 128"),
        ({"hidden": 5000, "layer_input_format": "mx-g32"}, "layer_input_format", "multiple of 32"),
        # 16 fragments of 4 lanes: 64 threads, two warps.
        ({"rank_lanes": 4, "layer_input_format": "fp32-g128"}, "rank_lanes", "at most 2 rank lanes"),
        ({"rank_lanes": 8, "tp": 8, "layer_input_format": "ue8m0-g128-packed"}, "rank_lanes", "at most 2"),
    ],
)
def test_invalid_options_name_their_field(fields: dict, field: str, rule: str) -> None:
    with pytest.raises((ValueError, TypeError), match=f"^{field}: .*{rule}"):  # a wrong type: TypeError
        geometry(**fields)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lanes", (1, 2, 4, 8))
def test_group_placement(fmt: str, lanes: int) -> None:
    """A group is ``group / 8`` fragments of ``lanes`` threads: inside a warp, in one CTA."""
    from mhc_core.constants import WARP_SIZE

    group = {"fp32-g128": 128, "ue8m0-g128-packed": 128, "mx-g32": 32}[fmt]
    segment = group // 8 * lanes
    if segment > WARP_SIZE:
        with pytest.raises(ValueError, match=r"^rank_lanes: "):
            geometry(tp=8, rank_lanes=lanes, layer_input_format=fmt)
        return
    for threads in (32, 64, 128, 256):
        if threads < lanes:
            continue
        config = geometry(tp=8, rank_lanes=lanes, threads=threads, layer_input_format=fmt)
        assert WARP_SIZE % segment == 0, "segments tile a warp"
        assert config.groups_per_cta % (group // 8) == 0, "a CTA's fragments hold whole groups"


def test_the_quantiser_constants_are_mhc_core_fp8s() -> None:
    import torch

    from mhc_core import fp8
    from mhc_core.device import quant

    def bits(value: float) -> int:
        return int(torch.tensor(value, dtype=torch.float32).view(torch.int32).item())

    assert quant.E4M3_MAX == fp8.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert bits(fp8.EPS) == quant.ABSMAX_FLOOR_BITS
    assert bits(fp8.UE8M0_FLOOR) == quant.UE8M0_FLOOR_BITS
    assert quant.F32_EXPONENT_BIAS == fp8.UE8M0_BIAS
    # The layouts' constants: one 128x4 tile is 512 bytes; the packed rows align to 16 bytes.
    assert quant.SWIZZLE_TILE_BYTES == quant.SWIZZLE_TILE_ROWS * quant.GROUPS_PER_WORD
    assert quant.SWIZZLE_ROW_BYTES * quant.SWIZZLE_ROW_PERIOD == quant.SWIZZLE_TILE_BYTES
    m, hidden = 5, 5120
    packed = fp8.get_format("ue8m0-g128-packed")
    assert packed.scale_strides(m, hidden)[1] == -(-m // quant.PACKED_ROW_ALIGN) * quant.PACKED_ROW_ALIGN


# ------------------------------------------------------------------ the kernels
def compiled(preset: str, arch: str, fmt: str, both: bool, persistent: bool):
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel
    from mhc_dsv41.config import COLLECTIVE_KERNEL
    from tests import presets  # shipped and test presets

    fields = presets.get("dsv41", preset).PRESET.collective_config(
        persistent, layer_input_format=fmt, layer_input_bf16=both
    )
    result = compile_kernel(KernelSpec(COLLECTIVE_KERNEL, fields), arch, inspect=True, prebuilt=False)
    assert result.ptx, "no PTX kept"
    report = result.report
    assert report.registers is not None, "ptxas report missing"
    assert report.spill_stores == 0 and report.spill_loads == 0, report
    assert report.stack_bytes == 0 and not has_local_memory(result.ptx), report
    return result


@pytest.mark.parametrize("persistent", (False, True), ids=("one-token", "persistent"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("preset, arch", TARGETS)
def test_fp8_collective_compiles_and_quantises(preset: str, arch: str, fmt: str, persistent: bool) -> None:
    from mhc_core.constants import VEC_BF16
    from mhc_core.fp8_formats import FORMATS as TABLE
    from mhc_dsv41.config import COLLECTIVE_REGISTERS
    from tests import presets  # shipped and test presets

    trips = presets.get("dsv41", preset).PRESET.trips
    group, layout = TABLE[fmt].group, TABLE[fmt].layout
    steps = (group // VEC_BF16).bit_length() - 1
    plain = compiled(preset, arch, "bf16", False, persistent).ptx
    both = compiled(preset, arch, fmt, True, persistent)
    alone = compiled(preset, arch, fmt, False, persistent).ptx
    for ptx in (both.ptx, alone):
        assert count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == CONVERSIONS_PER_TRIP * trips
        assert count(ptx, "st.global.v2.u32") == trips, "one 8-byte store of 8 codes per fragment"
        assert count(ptx, "max.u16x2") == ABSMAX_MAX_U16X2_PER_TRIP * trips
        assert count(ptx, "shfl.sync.bfly") - count(plain, "shfl.sync.bfly") == steps * trips
        assert count(ptx, "div.approx") == count(ptx, "div.full") == 0
        if layout == "row-major":
            # The scale; the 8 values by the shared reciprocal (its correction exact: the GPU test
            # tests/core/test_fp8_division_gpu.py), or by IEEE divisions for a scale not normal.
            assert count(ptx, "div.rn.f32") == NORM_DIVISIONS + (1 + VEC_BF16) * trips
            assert count(ptx, "rcp.approx.ftz.f32") == count(ptx, "rcp.") == trips
            assert count(ptx, "selp.f32") - count(plain, "selp.f32") <= trips, "no select per value (-0 by the FMAs)"
            assert count(ptx, "st.global.u8") == 0
        else:
            assert count(ptx, "div.rn.f32") == NORM_DIVISIONS + trips
            assert count(ptx, "rcp.") == 0
            assert count(ptx, "st.global.u8") == trips, "one exponent byte per group (its first fragment's lane)"
    # No integer division by a runtime value (M) of the quantiser's (the padding rows' share of a
    # token cost DSV 0.35 us at M = 1: BENCHMARKS.md, eighteenth run).
    for ptx in (both.ptx, alone):
        assert runtime_divisions(ptx) == runtime_divisions(plain), "an integer division by a register"
    # The swizzled layout zeroes whole 16-byte units of padding rows with one 16-byte store.
    bf16_stores = count(plain, "st.global.v4.u32") + PADDING_UNIT_STORES[layout]
    assert count(both.ptx, "st.global.v4.u32") == bf16_stores, "the BF16 layer input beside the FP8 one"
    assert count(alone, "st.global.v4.u32") == bf16_stores - trips, "FP8 alone: no BF16 layer-input store"
    for fp8_only in ("cvt.rn.satfinite.e4m3x2", "max.u16x2", "st.global.v2.u32"):
        assert count(plain, fp8_only) == 0, f"the BF16 collective has no {fp8_only}"
    if preset.startswith("h200"):
        assert both.report.registers <= COLLECTIVE_REGISTERS, both.report


@pytest.mark.parametrize(
    "fmt, hidden",
    [("ue8m0-g128-packed", 5248), ("mx-g32", 5152)],  # 41 and 161 groups: 3 padding bytes in a row's last word
)
def test_padding_bytes_of_a_partial_scale_word(fmt: str, hidden: int) -> None:
    """With ``G % 4 != 0`` the last group's lane also zeroes the bytes after it in its word."""
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel
    from mhc_dsv41.config import COLLECTIVE_KERNEL, MHCConfig

    config = MHCConfig(hidden=hidden, hc=4, tp=1, cluster_size=5, threads=128, rank_lanes=1, layer_input_format=fmt)
    padding = 4 - config.scale_groups % 4
    assert config.trips == 2 and padding == 3
    ptx = compile_kernel(KernelSpec(COLLECTIVE_KERNEL, config), "sm_90a", inspect=True, prebuilt=False).ptx
    assert count(ptx, "st.global.u8") == config.trips * (1 + padding)
