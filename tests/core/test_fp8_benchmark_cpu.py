"""``--suite fp8`` (``benchmarks.fp8``, ``benchmarks.quantizers``, ``benchmarks.prewarm``) without a GPU: the
separate quantisers against ``mhc_core.fp8.quantize`` (eager, both division paths; compiled by inductor's
CPU backend), the checks' reports, the byte floors, the kernels a cold run compiles, the table and the
suite's registration. The GPU run checks the compiled quantisers again (inductor's Triton backend)
before it times them."""

from __future__ import annotations

import pytest
import torch

from benchmarks import fp8 as suite
from benchmarks import quantizers
from mhc_core import fp8
from mhc_core.bench.case import cases
from mhc_core.bench.records import Record

#: (M, hidden): one row; padding rows (M % 4, M % 128); partial packed words and 4-group blocks.
SHAPES = ((1, 5120), (5, 4096), (130, 5248), (3, 5152))


def special_input(m: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Signed values over many binades, a zero group, a -0 group, a group below the absmax floor, one
    near BF16's top, and -0 scattered."""
    values = torch.randn(m, hidden, generator=generator) * torch.exp2(torch.randint(-20, 20, (m, 1)).float())
    values[:, 0:128] = 0.0
    values[:, 128:160] = -0.0
    values[:, 256:384] *= 2.0**-120
    values[:, 384:416] = torch.randn(m, 32, generator=generator) * 2.0**120
    values[torch.rand(m, hidden, generator=generator) < 0.02] = -0.0
    return values.to(torch.bfloat16)


def formats_for(hidden: int) -> list[str]:
    return [name for name in fp8.FORMATS if hidden % fp8.get_format(name).group == 0]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"m{s[0]}-h{s[1]}")
@pytest.mark.parametrize("fp64_division", [False, True], ids=["fp32-division", "fp64-division"])
def test_eager_quantizer_is_the_reference(shape: tuple[int, int], fp64_division: bool) -> None:
    m, hidden = shape
    x = special_input(m, hidden, torch.Generator().manual_seed(m + hidden))
    for name in formats_for(hidden):
        q, flat = quantizers.eager_quantize(name, x, fp64_division=fp64_division)
        scales = quantizers.storage_view(name, flat, m, hidden)
        assert quantizers.compare(name, x, q, scales, whole=True) is None, name
        assert tuple(scales.stride()) == fp8.get_format(name).scale_strides(m, hidden), name


def test_compiled_quantizer_is_the_reference_on_the_cpu() -> None:
    """Inductor's CPU backend; one shape per format with padding (three compiles)."""
    m = 5
    for name in fp8.FORMATS:
        hidden = 5248 if fp8.get_format(name).group == 128 else 5152  # a partial packed word / 4-group block
        x = special_input(m, hidden, torch.Generator().manual_seed(3))
        q, scales = quantizers.compiled_quantizer(name)(x)
        assert quantizers.compare(name, x, q, scales, whole=True) is None, name


def test_compare_names_what_differs() -> None:
    m, hidden = 5, 4096  # padding rows in both UE8M0 layouts
    x = special_input(m, hidden, torch.Generator().manual_seed(4))
    for name in fp8.FORMATS:
        q, scales = fp8.quantize(name, x)
        codes = q.view(torch.uint8).clone()
        codes[1, 700] ^= 1
        assert quantizers.compare(name, x, codes.view(torch.float8_e4m3fn), scales, whole=True) == (
            f"differ: 1 of {m * hidden} q codes"
        )
        wrong = scales.clone() if name == "fp32-g128" else scales
        if name == "fp32-g128":
            wrong[0, 3] *= 2
            assert "1 of" in quantizers.compare(name, x, q, wrong, whole=False)
        raw = quantizers.flat_bytes(scales).clone()
        raw[-1] ^= 0xFF  # the allocation's last byte: padding in the UE8M0 layouts
        rebuilt = raw.view(scales.dtype).as_strided(scales.shape, scales.stride())
        note = quantizers.compare(name, x, q, rebuilt, whole=True)
        assert note is not None and "scale bytes" in note, name
        if name != "fp32-g128":  # by values a library's padding is its own
            assert quantizers.compare(name, x, q, rebuilt, whole=False) is None, name


def test_libraries_absent_here_are_reported_with_the_reason(monkeypatch) -> None:
    import importlib

    def refuse(module: str):
        raise ImportError(f"no {module}")

    monkeypatch.setattr(importlib, "import_module", refuse)
    for name in fp8.FORMATS:
        found, missing = quantizers.library_quantizers(name)
        assert not found and len(missing) == len(quantizers.LIBRARY_QUANTIZERS[name])
        assert all("not importable (ImportError: no " in line for line in missing)


def test_floors_count_each_variants_bytes() -> None:
    case = cases()[0]
    m, hidden = 8, case.hidden
    base, layer_input = case.bytes(m, hidden), 2 * m * hidden
    for name in fp8.FORMATS:
        quantized = m * hidden + fp8.get_format(name).scale_storage_bytes(m, hidden)
        assert suite.floors_bytes(case, name, m) == {
            suite.BF16_OP: base,
            suite.SEPARATE: base + layer_input + quantized,
            suite.FUSED: base - layer_input + quantized,
            suite.FUSED_BOTH: base + quantized,
        }
    assert suite.fp8_bytes("mx-g32", 1, 4096) == 4096 + 128 * 128  # one padded 128-row tile of 32 blocks


def test_a_cold_run_compiles_every_fp8_kernel_once() -> None:
    """Per model the BF16 op's kernels and, per format and mode, the FP8 collectives (DSV: 2) or boundary
    kernels (GLM: 4); multicast publishes left out (off on the lent hosts)."""
    from benchmarks import prewarm
    from mhc_core.bench.records import Context

    ctx = Context(tp=1, rank=0, group=None, bandwidth=1.0)
    counts = {}
    for case in cases():
        preset = suite.preset_module(case, ctx, arch="sm_90a").PRESET
        specs = prewarm.preset_specs(preset, "sm_90a", suite.layer_input_options())
        assert not any("multicast" in str(config) for _, config in specs)
        counts[case.key] = len(specs)
    # DSV: publish, finalize, 2 BF16 collectives; GLM: publish, 2 finalizes, mixes, 4 BF16 boundaries
    assert counts == {"dsv41": 4 + 6 * 2, "glm5": 8 + 6 * 4}, counts


def test_table_gives_additions_goals_and_notes() -> None:
    from benchmarks.report import fp8_table

    def record(m: int, variant: str, us: float, note: str | None = "bit-equal") -> Record:
        return Record("fp8-dsv41", 1, m, variant, us, 0.5, note=note)

    records = [
        record(1, suite.BF16_OP, 2.5, None),
        record(1, "fp32-g128 | separate: torch.compile", 4.6),
        record(1, "fp32-g128 | separate: vLLM per_token_group_quant_fp8", 4.4, "differ: 3 of 40 scale values"),
        record(1, "fp32-g128 | fused fp8", 2.6),
        record(1, "fp32-g128 | fused fp8 + bf16", 2.9),
        record(8, suite.BF16_OP, 2.6, None),
        record(8, "fp32-g128 | separate: torch.compile", 4.6),
        record(8, "fp32-g128 | fused fp8", 3.2),
        record(8, "fp32-g128 | fused fp8 + bf16", 3.0),
    ]
    text = fp8_table(records)
    # best separate (vLLM's 4.4) adds 1.9; fused adds 0.1 / 0.4: 0.1 / (1.9 / 4) = 0.21, 0.4 / 0.475 = 0.84
    assert "| fp32-g128 | 1 | 2.50 (0.50) | vLLM per_token_group_quant_fp8 4.40 (0.50) | 2.60 (0.50) | " in text
    assert "| 1.90 | 0.10 / 0.40 | 0.21 (0.33 of 0.3 us) / 0.84 (1.33 of 0.3 us) |" in text
    # M = 8: adds 0.6 / 0.4 against 2.0 / 4 = 0.5: 1.20 / 0.80
    assert "| 2.00 | 0.60 / 0.40 | 1.20 / 0.80 |" in text
    assert "goal, FP8 only: missed at fp8-dsv41 fp32-g128 M = 8" in text
    assert "goal, both outputs" in text and "missed at fp8-dsv41 fp32-g128 M = 1" in text
    assert "fp8-dsv41 fp32-g128 | separate: vLLM per_token_group_quant_fp8 M = 1: differ: 3 of 40 scale values" in text


def test_suite_is_registered_and_asked_for_by_name() -> None:
    from benchmarks import report, run

    assert run.RUNNERS["fp8"] is suite.fp8_suite and run.TABLES["fp8"] is report.fp8_table
    assert "fp8" in run.SUITES and "fp8" not in run.DEFAULT_SUITES
