"""The GLM-5.3 boundary kernels' FP8 layer input (issue #33) without a GPU: the option's validation
(kernel config and preset), its group placement, the signatures, every variant x format compiled and
its PTX read, and the BF16 kernels' PTX unchanged by the option.

What the PTX must show per fragment a thread quantises (``QUANTISED``: one a token for the CUDA-core
kernels' lane 0, one a token for each lane of the tensor-core ones; the persistent boundary traces
its store twice, in the loop and after it): 4 ``cvt.rn.satfinite.e4m3x2.f32`` (8 codes), one 8-byte
``q`` store, 3 ``max.u16x2`` (the fragment's absmax) and the group's butterfly shuffles; ``fp32-g128``
divides the scale with ``div.rn.f32`` and its 8 values through one shared ``rcp.approx`` (8
``div.rn.f32`` for a scale that is not normal), the UE8M0 formats once (the scale) and store one
exponent byte; a 128-column group adds one CTA barrier per store (its warps' maxima exchanged).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from tests.ptx_checks import count, has_local_memory, runtime_divisions

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
GROUP = {"fp32-g128": 128, "ue8m0-g128-packed": 128, "mx-g32": 32}
#: The H200 presets' geometry and constants.
GEOMETRY = {"hidden": 4096, "cluster_size": 8, "rms_eps": 1e-6, "hc_eps": 1e-6, "norm_eps": 1e-5}
#: The four boundary kernels: (tokens, persistent) and the fragments a thread quantises per call
#: traced (tokens for the CUDA-core kernels, halves of 8 for the tensor-core one, twice one half for
#: the persistent boundary).
VARIANTS = {
    "one-token": ((1, False), 1),
    "grouped": ((4, False), 4),
    "tensor-core": ((16, False), 2),
    "persistent": ((8, True), 2),
}
#: The group's butterfly shuffles per quantised fragment: within a warp (4 fragments: 2 steps) or
#: over the whole warp (CUDA-core kernels: 8 fragments, 3 steps; tensor-core ones: 4, 2 steps).
SHUFFLES = {
    ("one-token", 128): 3, ("grouped", 128): 3, ("tensor-core", 128): 2, ("persistent", 128): 2,
    ("one-token", 32): 2, ("grouped", 32): 2, ("tensor-core", 32): 2, ("persistent", 32): 2,
}  # fmt: skip
#: CTA barriers a 128-column group adds per store (the persistent boundary traces two stores).
EXCHANGES = {"one-token": 1, "grouped": 1, "tensor-core": 1, "persistent": 2}


def config(variant: str = "one-token", fmt: str = "bf16", both: bool = False, arch: str = "sm_90a", **fields):
    from mhc_glm5.boundary import BoundaryConfig

    (tokens, persistent), _ = VARIANTS[variant]
    base = {
        **GEOMETRY, "tp": 1, "mixed_fma": arch != "sm_90a", "tokens": tokens, "persistent": persistent,
        "layer_input_format": fmt, "layer_input_bf16": both,
    }  # fmt: skip
    return BoundaryConfig(**{**base, **fields})


def kernel_path(variant: str) -> str:
    from mhc_glm5.config import PERSISTENT_KERNEL, grouped_kernel_path

    (tokens, persistent), _ = VARIANTS[variant]
    if persistent:
        return PERSISTENT_KERNEL
    return "mhc_glm5.boundary:BoundaryKernel" if tokens == 1 else grouped_kernel_path(tokens)


# ------------------------------------------------------------------ the option
def test_bf16_is_the_default_and_reads_as_before() -> None:
    plain = config()
    assert plain.layer_input_format == "bf16" and not plain.layer_input_bf16
    assert not plain.quantizes and plain.stores_bf16_layer_input
    # The kernel's symbol is built from this text: unchanged, so the BF16 PTX is too.
    assert "layer_input" not in repr(plain)
    assert repr(plain).startswith("BoundaryConfig(hidden=4096, tp=1, cluster_size=8, rms_eps=1e-06")
    fp8 = config(fmt="mx-g32", both=True)
    assert "layer_input_format='mx-g32', layer_input_bf16=True" in repr(fp8)
    assert fp8.quantizes and fp8.stores_bf16_layer_input and not config(fmt="mx-g32").stores_bf16_layer_input


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_on_every_preset(fmt: str) -> None:
    """Every preset (shipped and test) takes every format where its CTAs hold whole groups (the
    test preset's 72 fragments per CTA hold 32-column groups, not 128-column ones); its boundary
    configs then list the option, as a kernel's key is built from the dict."""
    from mhc_core.presets import PresetError
    from mhc_glm5.boundary import BoundaryConfig
    from tests import presets  # shipped and test presets

    for name in presets.names("glm5"):
        preset = presets.get("glm5", name).PRESET
        whole_groups = (preset.hidden // 8 // preset.cluster_size) % (GROUP[fmt] // 8) == 0
        for both in (False, True):
            if not whole_groups:
                with pytest.raises(PresetError, match=r"^key 'cluster_size': .*may not straddle"):
                    dataclasses.replace(preset, layer_input_format=fmt, layer_input_bf16=both)
                continue
            quantized = dataclasses.replace(preset, layer_input_format=fmt, layer_input_bf16=both)
            for arch in preset.archs:
                for kernel, (_, fields) in quantized.kernel_specs(arch).items():
                    if not kernel.startswith("boundary"):
                        continue
                    boundary = BoundaryConfig(**fields)
                    assert dataclasses.asdict(boundary) == fields, (name, kernel)
                    assert boundary.quantizes and boundary.layer_input_format == fmt
                    assert boundary.stores_bf16_layer_input == both
        assert name.startswith("test-") or whole_groups, f"shipped preset {name} refuses {fmt}"


def test_preset_configs_list_the_option() -> None:
    from mhc_glm5.boundary import BoundaryConfig
    from tests import presets  # shipped and test presets

    for name in presets.names("glm5"):
        module = presets.get("glm5", name)
        assert module.PRESET.layer_input_format == "bf16" and module.PRESET.layer_input_bf16 is False
        for arch in module.PRESET.archs:
            for kernel, (_, fields) in module.KERNELS[arch].items():
                if kernel.startswith("boundary"):
                    assert dataclasses.asdict(BoundaryConfig(**fields)) == fields
                    assert fields["layer_input_format"] == "bf16" and fields["layer_input_bf16"] is False


@pytest.mark.parametrize(
    "fields, field, rule",
    [
        ({"layer_input_format": "fp8"}, "layer_input_format", "expected one of bf16, fp32-g128"),
        ({"layer_input_format": "FP32-G128"}, "layer_input_format", "expected one of"),
        ({"layer_input_format": None}, "layer_input_format", "expected a str, one of"),
        ({"layer_input_bf16": True}, "layer_input_bf16", "expected False"),
        ({"layer_input_format": "mx-g32", "layer_input_bf16": 1}, "layer_input_bf16", "True or False"),
        # 4608 / 8 / 8 = 72 fragments per CTA: 4.5 groups of 16 fragments (18 of 4).
        ({"hidden": 4608, "layer_input_format": "fp32-g128"}, "cluster_size", "may not straddle"),
        ({"hidden": 4608, "layer_input_format": "ue8m0-g128-packed"}, "cluster_size", "whole groups of 16"),
    ],
)
def test_invalid_options_name_their_field(fields: dict, field: str, rule: str) -> None:
    """The kernel config and the preset refuse it alike, naming the field (``PresetError``, a
    ``ValueError``; the op re-raises it as ``field: rule``)."""
    from mhc_core.presets import PresetError
    from tests import presets

    with pytest.raises(PresetError, match=f"^key '{field}': .*{rule}"):
        config(**fields)
    preset = presets.get("glm5", "h200-tp1-h4096").PRESET
    # A preset checks its geometry first: one that fits hidden 4608 (the test preset's).
    geometry = {"cluster_tokens": (), "persistent_min_tokens": 0} if "hidden" in fields else {}
    with pytest.raises(PresetError, match=f"^key '{field}': .*{rule}"):
        dataclasses.replace(preset, **geometry, **fields)


@pytest.mark.parametrize(
    "hidden, fmt, field, rule",
    [
        # 4160 = 32.5 groups of 128 (a whole number of 32-column groups; 65 fragments per CTA).
        (4160, "fp32-g128", "layer_input_format", "multiple of 128"),
        (4160, "ue8m0-g128-packed", "layer_input_format", "multiple of 128"),
        (4160, "mx-g32", "cluster_size", "whole groups of 4 fragments"),
        (4112, "mx-g32", "layer_input_format", "multiple of 32"),
    ],
)
def test_hidden_must_hold_whole_groups(hidden: int, fmt: str, field: str, rule: str) -> None:
    """Kernel configs (a preset's geometry rules refuse these hidden sizes before the option's)."""
    from mhc_core.presets import PresetError

    with pytest.raises(PresetError, match=f"^key '{field}': .*{rule}"):
        config(fmt=fmt, hidden=hidden)


# ------------------------------------------------------------------ the placement
def lanes_of_group(variant: str, group_fragments: int, fragments_per_cta: int, fragment: int) -> set:
    """(CTA, warp, lane) of every thread holding one of the group's fragments that starts at
    ``fragment`` (of a token), by the kernels' thread mappings (``mhc_glm5.fp8_store``)."""
    held = set()
    for f in range(fragment, fragment + group_fragments):
        cta, local = divmod(f, fragments_per_cta)
        if variant in ("one-token", "grouped"):
            threads = [4 * local + j for j in range(4)]  # lane j of the fragment's 4
        else:
            threads = [32 * (local // 4) + 4 * g + local % 4 for g in range(8)]  # lane (g, q): token g
        held |= {(cta, thread // 32, thread % 32) for thread in threads}
    return held


@pytest.mark.parametrize("variant", tuple(VARIANTS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hidden, cluster_size", [(4096, 8), (4096, 4), (4608, 8), (2048, 2), (1280, 2)])
def test_group_placement(variant: str, fmt: str, hidden: int, cluster_size: int) -> None:
    """Wherever a config is valid, each group lies in one CTA, and there in an aligned segment of one
    warp (``lanes_per_fragment`` lanes a fragment) or in ``warps_per_group`` whole consecutive warps,
    the first a multiple of it: what ``Fp8Store``'s shuffles and shared words assume."""
    from mhc_core.presets import PresetError
    from mhc_glm5.config import CUDA_CORE_FRAGMENTS_PER_WARP, MMA_FRAGMENTS_PER_WARP

    try:
        config(variant, fmt, hidden=hidden, cluster_size=cluster_size)
    except PresetError:
        assert (hidden // 8 // cluster_size) % (GROUP[fmt] // 8) != 0
        return
    group_fragments = GROUP[fmt] // 8
    cuda_core = variant in ("one-token", "grouped")
    per_warp = CUDA_CORE_FRAGMENTS_PER_WARP if cuda_core else MMA_FRAGMENTS_PER_WARP
    warps_per_group = max(1, group_fragments // per_warp)
    fragments_per_cta = hidden // 8 // cluster_size
    for start in range(0, hidden // 8, group_fragments):
        held = lanes_of_group(variant, group_fragments, fragments_per_cta, start)
        assert len({cta for cta, _, _ in held}) == 1, "a group straddles CTAs"
        warps = sorted({warp for _, warp, _ in held})
        assert len(warps) == warps_per_group and warps[0] % warps_per_group == 0
        assert warps == list(range(warps[0], warps[0] + warps_per_group))
        if warps_per_group > 1:
            if cuda_core:
                assert len(held) == 32 * warps_per_group, "whole warps"
            continue
        lanes = sorted(lane for _, _, lane in held)
        if cuda_core:
            segment = 4 * group_fragments  # lanes 4 apart hold the same fragment's copies
            assert lanes == list(range(lanes[0], lanes[0] + segment)) and lanes[0] % segment == 0
        else:
            # Token g's 4 lanes hold the warp's 4 fragments: the whole group.
            assert {lane % 4 for lane in lanes} == set(range(4))


def test_shared_words_only_for_groups_across_warps() -> None:
    """A 128-column group spans warps in every kernel: a word per (token, warp); a 32-column one lies
    in a warp: none. The BF16 kernels' sizes are unchanged, the FP8 ones fit every shipped preset."""
    from mhc_glm5 import config as c

    hidden, cluster = 4096, 8
    cuda_warps, mma_warps = c.boundary_threads(hidden, cluster) // 32, c.mma_threads(hidden, cluster) // 32
    for fmt in FORMATS:
        scratch = 4 if GROUP[fmt] == 128 else 0
        grow = {
            "one-token": c.boundary_shared_bytes(hidden, cluster, fmt) - c.boundary_shared_bytes(hidden, cluster),
            "grouped": c.grouped_shared_bytes(hidden, cluster, 4, fmt) - c.grouped_shared_bytes(hidden, cluster, 4),
            "tensor-core": c.mma_shared_bytes(hidden, cluster, 16, fmt) - c.mma_shared_bytes(hidden, cluster, 16),
            "persistent": c.persistent_shared_bytes(hidden, cluster, fmt) - c.persistent_shared_bytes(hidden, cluster),
        }
        assert grow == {
            "one-token": scratch * cuda_warps,
            "grouped": scratch * 4 * cuda_warps,
            "tensor-core": scratch * 16 * mma_warps,
            "persistent": scratch * 8 * mma_warps,
        }
        assert c.persistent_fits(hidden, cluster, fmt) is None
        assert c.persistent_shared_bytes(hidden, cluster, fmt) <= c.MAX_SHARED_BYTES


# ------------------------------------------------------------------ signatures
@pytest.mark.parametrize("variant", tuple(VARIANTS))
@pytest.mark.parametrize("fmt", ("bf16", *FORMATS))
def test_signature_and_entry(variant: str, fmt: str) -> None:
    """A BF16 kernel's signature is what it was; an FP8 one appends the codes (E4M3) and the scales
    (FP32, int32 or bytes by layout, 4-byte aligned). The compiled entry takes exactly those."""
    import inspect

    from cutlass import Float8E4M3FN, Float32, Int32, Uint8

    from mhc_core.host.binaries.compiler import kernel_from_spec
    from mhc_glm5.boundary import boundary_signature

    kernel = kernel_from_spec(kernel_path(variant), dataclasses.asdict(config(variant, fmt)))
    names = [param.name for param in kernel.signature()]
    plain = [param.name for param in boundary_signature()]
    assert list(inspect.signature(kernel.entry()).parameters) == names
    if fmt == "bf16":
        assert names == plain
        return
    assert names == [*plain, "layer_input_q", "layer_input_scales"]
    q, scales = kernel.signature()[-2:]
    assert q.kind.dtype is Float8E4M3FN
    assert scales.kind.dtype is {"fp32-g128": Float32, "ue8m0-g128-packed": Int32, "mx-g32": Uint8}[fmt]
    assert scales.kind.align == 4


# ------------------------------------------------------------------ the kernels
def compiled(variant: str, fmt: str, both: bool, arch: str = "sm_90a", **fields):
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel

    spec = KernelSpec(kernel_path(variant), dataclasses.asdict(config(variant, fmt, both, arch, **fields)))
    result = compile_kernel(spec, arch, inspect=True, prebuilt=False)
    assert result.ptx, "no PTX kept"
    report = result.report
    assert report.registers is not None, "ptxas report missing"
    assert report.spill_stores == 0 and report.spill_loads == 0, report
    assert report.stack_bytes == 0 and not has_local_memory(result.ptx), report
    return result.ptx


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", tuple(VARIANTS))
def test_fp8_boundary_compiles_and_quantises(variant: str, fmt: str) -> None:
    _, quantised = VARIANTS[variant]
    group = GROUP[fmt]
    plain = compiled(variant, "bf16", False)
    both = compiled(variant, fmt, True)
    alone = compiled(variant, fmt, False)
    for ptx in (both, alone):
        assert count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == 4 * quantised
        assert count(ptx, "st.global.v2.u32") == quantised, "one 8-byte store of 8 codes per fragment"
        assert count(ptx, "max.u16x2") == 3 * quantised
        assert count(ptx, "shfl.sync.bfly") - count(plain, "shfl.sync.bfly") == SHUFFLES[variant, group] * quantised
        barriers = EXCHANGES[variant] if group == 128 else 0
        assert count(ptx, "bar.sync") - count(plain, "bar.sync") == barriers, "one exchange per store"
        for approximate in ("div.approx", "div.full"):
            assert count(ptx, approximate) == count(plain, approximate), f"no {approximate} of the quantiser's"
        divisions = count(ptx, "div.rn.f32") - count(plain, "div.rn.f32")
        reciprocals = count(ptx, "rcp.") - count(plain, "rcp.")
        if fmt == "fp32-g128":
            # The scale; the 8 values by one shared reciprocal (exact: tests/core/test_fp8_division_gpu.py),
            # or by IEEE divisions for a scale that is not normal.
            assert divisions == (1 + 8) * quantised
            assert reciprocals == count(ptx, "rcp.approx.ftz.f32") - count(plain, "rcp.approx.ftz.f32") == quantised
            assert count(ptx, "st.global.u8") == 0
        else:
            assert divisions == quantised
            assert reciprocals == 0
            assert count(ptx, "st.global.u8") == quantised, "one exponent byte per group (its first fragment's lane)"
    # The swizzled layout zeroes whole 16-byte units of padding rows with one 16-byte store: the
    # padding is one call per thread, after its tokens, in every kernel (no other format adds any).
    stores = count(plain, "st.global.v4.u32")
    padding = count(both, "st.global.v4.u32") - stores
    assert padding == (1 if fmt == "mx-g32" else 0), "the BF16 layer input beside the FP8 one"
    # No integer division by a runtime value (M) of the quantiser's: one per token, unrolled, cost the
    # tensor-core kernels 2 us (BENCHMARKS.md, twentieth run).
    for ptx in (both, alone):
        assert runtime_divisions(ptx) == runtime_divisions(plain), "an integer division by a register"
    assert count(alone, "st.global.v4.u32") == stores + padding - quantised, "FP8 alone: no BF16 layer-input store"
    for fp8_only in ("cvt.rn.satfinite.e4m3x2", "max.u16x2", "st.global.v2.u32"):
        assert count(plain, fp8_only) == 0, f"the BF16 boundary has no {fp8_only}"


@pytest.mark.parametrize(
    "arch, variant, fmt",
    [
        ("sm_100a", "one-token", "ue8m0-g128-packed"),
        ("sm_100a", "grouped", "mx-g32"),
        ("sm_100a", "tensor-core", "fp32-g128"),
        ("sm_100a", "persistent", "mx-g32"),
        ("sm_103a", "one-token", "fp32-g128"),
        ("sm_103a", "grouped", "ue8m0-g128-packed"),
        ("sm_103a", "tensor-core", "mx-g32"),
        ("sm_103a", "persistent", "ue8m0-g128-packed"),
    ],
)
def test_fp8_boundary_compiles_for_blackwell(arch: str, variant: str, fmt: str) -> None:
    """The GB300 preset's archs (each variant and format on each, in turn): the same conversions."""
    _, quantised = VARIANTS[variant]
    ptx = compiled(variant, fmt, True, arch, tp=4)
    assert count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == 4 * quantised
    assert count(ptx, "fma.rn.f32.bf16") > 0, "the GEMV's mixed-precision dot of sm_100+"


def test_padding_bytes_of_a_partial_scale_word() -> None:
    """With ``G % 4 != 0`` (hidden 1280: 10 groups of 128) the last group's lane also zeroes the 2
    bytes after it in its word."""
    ptx = compiled("one-token", "ue8m0-g128-packed", False, hidden=1280, cluster_size=2)
    assert count(ptx, "st.global.u8") == 1 + 2


# ------------------------------------------------------------------ BF16 kernels unchanged
#: sha256 of the BF16 boundary kernels' PTX before the option existed (``python -m
#: tools.compile_presets --model glm5 --ptx-digest``, at e2879c6), one of each class per arch.
BF16_PTX_SHA256 = {
    ("h200-tp1-h4096", "boundary", "sm_90a"): "3806bd5b694e8efbb882985e6dad801cbc2c4c0ffc2c042b4dcdb688571ee840",
    ("h200-tp1-h4096", "boundary_x8", "sm_90a"): "6c970a38947e571c319f16f2317b12e717f48c42cbf52bf15cc15718deef0dde",
    ("h200-tp1-h4096", "boundary_x16", "sm_90a"): "bac6ba25eff37dac47228023ac7344cc24aa538a2288872491282290aaecb55a",
    ("h200-tp1-h4096", "boundary_persistent", "sm_90a"): (
        "a9271f88de3dff042c2b394125e957d5be44efb23c9228b6c8c27bec281db79d"
    ),
    ("h200-tp2-h4096", "boundary_x2", "sm_90a"): "bca75c16a6ff8aeecc4ae68b065fdfe57bccdc9fa5e69c55edbea1ac067cde1b",
    ("h200-tp2-h4096", "boundary_x4", "sm_90a"): "653040e7b318f39f753071557e221523c2ddca838e88f5a2a1f1a93604f5caa8",
}
#: The compiler those digests come from: the DSL release and the PTX's toolchain line.
BF16_PTX_TOOLCHAIN = ("4.8.1", "// Cuda compilation tools, release 13.4, V13.4.59")


@pytest.mark.parametrize("preset, kernel, arch", tuple(BF16_PTX_SHA256))
def test_bf16_kernels_ptx_unchanged(preset: str, kernel: str, arch: str) -> None:
    from mhc_core.host.binaries.artifacts import dsl_release
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel
    from tests import presets

    path, fields = presets.get("glm5", preset).KERNELS[arch][kernel]
    ptx = compile_kernel(KernelSpec(path, fields), arch, inspect=True, prebuilt=False).ptx
    toolchain = (dsl_release(), next(line for line in ptx.splitlines() if "compilation tools" in line).strip())
    if toolchain != BF16_PTX_TOOLCHAIN:
        pytest.skip(f"digests recorded with {BF16_PTX_TOOLCHAIN}, this compiler is {toolchain}")
    assert hashlib.sha256(ptx.encode()).hexdigest() == BF16_PTX_SHA256[preset, kernel, arch]
