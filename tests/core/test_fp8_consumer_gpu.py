"""Issue #33, item 4: a GEMM that reads the FP8 layer input multiplies the op's ``q`` and scales.

The op: ``AllReduceMHC`` of ``h200-tp1-h5120`` with ``layer_input_format=<format>, layer_input_bf16=True``
(``tests.dsv41.test_fp8_op_gpu``'s ops, shared: no new kernels when that file runs in the same session,
else its 2 collectives per format, 6 kernels); each call gives ``q``, the scales and the BF16 layer input
from one launch. Inputs are non-negative (-0 among them) so that ``tests.core.fp8_consumers``' bound is
relative to the product itself; the norm weight gives every group a power-of-two factor of its own (a
scale read from the wrong group is off by 2x or more), an all-zero group (scale from the absmax floor), a
-0 group and a group of 32 below the floor.

Which consumer ran is in each test's name (and printed):

* ``test_scaled_mm_1x128`` (``fp32-g128``, and ``ue8m0-g128-packed`` read the way DeepGEMM's SM100 GEMM
  reads it, then given as FP32 values): ``torch._scaled_mm`` with 1 x 128 activation scales (MN-major)
  and 128 x 128 FP8 weight blocks, cuBLASLt's block scaling (CUDA >= 12.9, sm_90 in torch's checks;
  ``fp8_consumers.scaled_mm_problem`` tries a small one and the test skips with its reason where it does
  not run). Two products: against an identity weight (scales 1) the FP32 output must be ``q * scale``
  exactly, element by element (one product and zeros per sum: exact whatever the accumulator); against a
  random non-negative block-FP8 weight the BF16 output must lie within ``product_bound`` of the exact
  product of the BF16 layer input and that weight.
* ``test_scaled_mm_mxfp8`` (``mx-g32``): the same through ``torch._scaled_mm`` with UE8M0 scales per 32
  (cuBLASLt VEC32_UE8M0, sm_100 and later): skipped on the H200 with its reason.
* ``test_emulated_consumer`` (every format, always): the consumer's read of the scale layout
  re-implemented from its public source (``fp8_consumers.READS``; not ``mhc_core.fp8``'s unpack), each
  scale equal to the one expected from the BF16 layer input, every byte no (row, group) reads 0, and the
  FP64 GEMM of the dequantised ``q`` within the bound (accumulation 2^-40, no output rounding).

Every case also checks ``q * scale`` against the BF16 layer input element by element (the quantisation
bound alone). M = 16 and 144 for the real GEMMs (16-byte aligned MN-major scale columns), 5 and 130 for
the emulated reads (padding rows in both UE8M0 layouts, a second 128-row tile).
"""

from __future__ import annotations

import pytest
import torch

from tests.core import fp8_consumers as consumers
from tests.support import bf16_randn

pytestmark = pytest.mark.gpu

PRESET = "h200-tp1-h5120"
NORM_EPS = 1e-6
#: Output columns of the random weight (two 128-row weight blocks).
N = 256
SCALED_MM_M = (16, 144)
EMULATED_M = (5, 130)
#: The 1 x 128 consumer per format, as its test id says.
SCALED_MM_READS = {"fp32-g128": "row-major", "ue8m0-g128-packed": "deepgemm-sm100-read"}
EMULATED_IDS = {
    "fp32-g128": "fp32-g128-triton-w8a8-row-major",
    "ue8m0-g128-packed": "ue8m0-g128-packed-deepgemm-sm100",
    "mx-g32": "mx-g32-swizzled-128x4",
}


# ------------------------------------------------------------------ the op and its data
def layer_input_op(name: str):
    """The both-outputs DSV op of ``PRESET`` (``test_fp8_op_gpu``'s, cached for the session)."""
    from tests.dsv41.test_fp8_op_gpu import fp8_ops

    try:
        return fp8_ops(PRESET, name, True, persistent=False)[0]
    except TypeError as error:  # an AllReduceMHC without the option
        pytest.skip(f"AllReduceMHC has no layer_input_format option here ({error})")


def nonnegative(values: torch.Tensor) -> torch.Tensor:
    """``|values|`` except that -0 stays -0."""
    return torch.where(values < 0, -values, values)


def norm_weight(hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Around one, times ``2^(g % 5 - 2)`` per 128 columns; an all-zero group, a -0 group and 32 columns
    below the absmax floor (module docstring)."""
    factor = torch.exp2((torch.arange(hidden, device="cuda") // 128 % 5 - 2).float())
    weight = (torch.rand(hidden, generator=generator, device="cuda") + 0.5) * factor
    weight[0:128] = 0.0
    weight[128:256] = -0.0
    weight[256:288] = 2.0**-120
    return weight.to(torch.bfloat16)


def op_outputs(op, m: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One both-outputs call on fresh non-negative inputs: ``(q, scales, BF16 layer input)``."""
    hidden, hc = op.hidden_size, op.hc_mult
    x = nonnegative(bf16_randn(m, hidden, generator=generator))
    residual = nonnegative(bf16_randn(m, hc, hidden, generator=generator))
    post = torch.rand(m, hc, generator=generator, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, hc, hc, generator=generator, device="cuda"), dim=-1)
    pre = torch.rand(m, hc, generator=generator, device="cuda")
    outputs = op(x, residual, post, comb, pre, norm_weight(hidden, generator), NORM_EPS)
    assert len(outputs) == 4, f"(residual_out, q, scales, layer_input) expected, got {len(outputs)} outputs"
    _, q, scales, layer_input = outputs
    assert bool((layer_input.float() >= 0).all()), "non-negative inputs give a non-negative layer input"
    return q, scales, layer_input


def positive_weight(k: int, generator: torch.Generator) -> torch.Tensor:
    return nonnegative(torch.randn(N, k, generator=generator, device="cuda")).to(torch.bfloat16)


# ------------------------------------------------------------------ checks
def check_scales(name: str, rows: torch.Tensor, layer_input: torch.Tensor, what: str) -> None:
    expected = consumers.expected_scales(name, layer_input)
    differ = rows.view(torch.int32) != expected.view(torch.int32)
    assert not bool(differ.any()), (
        f"{what}: {int(differ.sum())} of {rows.numel()} scales read differ from the expected; first at "
        f"{tuple(differ.nonzero()[0].tolist())}"
    )


def check_quantization(q: torch.Tensor, rows: torch.Tensor, layer_input: torch.Tensor, what: str) -> None:
    """``|q * scale - x| <= 2^-4 (1 + 2^-19) x + 2^-10 scale`` element by element (``fp8_consumers``)."""
    x = layer_input.double()
    spread = rows.double().repeat_interleave(x.shape[1] // rows.shape[1], dim=1)
    bound = 2.0**-4 * (1 + 2.0**-19) * x.abs() + 2.0**-10 * spread
    consumers.assert_within_bound(consumers.dequantized(q, rows), x, bound, f"{what}: q * scale against x")


def announce(request: pytest.FixtureRequest, consumer: str) -> None:
    request.node.user_properties.append(("consumer", consumer))
    print(f"{request.node.name}: consumer {consumer}")


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", tuple(SCALED_MM_READS), ids=[f"{n}-{r}" for n, r in SCALED_MM_READS.items()])
def test_scaled_mm_1x128(name: str, request: pytest.FixtureRequest) -> None:
    problem = consumers.scaled_mm_problem("1x128")
    if problem is not None:
        pytest.skip(f"no block-scaled FP8 matmul with 1x128 activation scales here ({problem}); "
                    "test_emulated_consumer covers the format")  # fmt: skip
    announce(request, f"torch._scaled_mm, 1x128 activation x 128x128 weight scales, torch {torch.__version__}")
    op = layer_input_op(name)
    hidden = op.hidden_size
    generator = torch.Generator("cuda").manual_seed(331)
    identity = torch.eye(hidden, device="cuda").to(torch.float8_e4m3fn)  # [N, K]; the GEMM takes its .t()
    unit_scales = torch.ones(hidden // 128, hidden // 128, device="cuda")
    for m in SCALED_MM_M:
        what = f"{name} M = {m}"
        q, scales, layer_input = op_outputs(op, m, generator)
        rows = consumers.READS[name](scales, m, hidden)
        check_scales(name, rows, layer_input, what)
        check_quantization(q, rows, layer_input, what)
        scale_a = consumers.mn_major(rows)
        exact_q = torch._scaled_mm(q, identity.t(), scale_a=scale_a, scale_b=unit_scales.t(), out_dtype=torch.float32)
        expected = q.float() * rows.repeat_interleave(128, dim=1)
        differ = exact_q != expected
        assert not bool(differ.any()), f"{what}: identity product != q * scale at {int(differ.sum())} elements"
        w_q, w_scales, w_hat = consumers.block_quantized_weight(positive_weight(hidden, generator))
        y = torch._scaled_mm(q, w_q.t(), scale_a=scale_a, scale_b=w_scales.t(), out_dtype=torch.bfloat16)
        exact, bound = consumers.product_bound(
            layer_input, rows, w_hat,
            accumulation=consumers.hopper_fp8_accumulation(hidden // 128), output=consumers.BF16_OUTPUT,
        )  # fmt: skip
        worst = consumers.assert_within_bound(y, exact, bound, f"{what}: scaled_mm against the BF16 layer input")
        print(f"  {what}: identity exact, random weight at {worst:.3f} of the bound")


def test_scaled_mm_mxfp8(request: pytest.FixtureRequest) -> None:
    problem = consumers.scaled_mm_problem("mx")
    if problem is not None:
        pytest.skip(f"no MXFP8 matmul here ({problem}); test_emulated_consumer covers mx-g32")
    announce(request, f"torch._scaled_mm, MXFP8 (UE8M0 per 32, 128x4 swizzle), torch {torch.__version__}")
    name = "mx-g32"
    op = layer_input_op(name)
    hidden = op.hidden_size
    generator = torch.Generator("cuda").manual_seed(332)
    identity = torch.eye(hidden, device="cuda").to(torch.float8_e4m3fn)
    unit_scales = torch.full((consumers.ceil_div(hidden, 128) * 128 * hidden // 32,), 127, dtype=torch.uint8)
    unit_scales = unit_scales.cuda().view(torch.float8_e8m0fnu)
    for m in SCALED_MM_M:
        what = f"{name} M = {m}"
        q, scales, layer_input = op_outputs(op, m, generator)
        rows = consumers.read_swizzled(scales, m, hidden)
        check_scales(name, rows, layer_input, what)
        check_quantization(q, rows, layer_input, what)
        scale_a = scales.view(torch.float8_e8m0fnu)
        exact_q = torch._scaled_mm(q, identity.t(), scale_a=scale_a, scale_b=unit_scales, out_dtype=torch.bfloat16)
        expected = q.float() * rows.repeat_interleave(32, dim=1)  # a power-of-two multiple of an E4M3: BF16-exact
        differ = exact_q.float() != expected
        assert not bool(differ.any()), f"{what}: identity product != q * scale at {int(differ.sum())} elements"
        w_q, w_scales, w_hat = consumers.mx_quantized_weight(positive_weight(hidden, generator))
        y = torch._scaled_mm(
            q, w_q.t(), scale_a=scale_a, scale_b=w_scales.view(torch.float8_e8m0fnu), out_dtype=torch.bfloat16
        )
        exact, bound = consumers.product_bound(
            layer_input, rows, w_hat,
            accumulation=consumers.hopper_fp8_accumulation(hidden // 32), output=consumers.BF16_OUTPUT,
        )  # fmt: skip
        worst = consumers.assert_within_bound(y, exact, bound, f"{what}: MXFP8 scaled_mm against the layer input")
        print(f"  {what}: identity exact, random weight at {worst:.3f} of the bound")


@pytest.mark.parametrize("name", consumers.FORMATS, ids=[EMULATED_IDS[n] for n in consumers.FORMATS])
def test_emulated_consumer(name: str, request: pytest.FixtureRequest) -> None:
    announce(request, f"torch re-implementation of the {EMULATED_IDS[name]} read, FP64 GEMM")
    op = layer_input_op(name)
    hidden = op.hidden_size
    generator = torch.Generator("cuda").manual_seed(333)
    for m in EMULATED_M:
        what = f"{name} M = {m}"
        q, scales, layer_input = op_outputs(op, m, generator)
        rows = consumers.READS[name](scales, m, hidden)
        check_scales(name, rows, layer_input, what)
        unread = consumers.padding(name, scales, m, hidden)
        assert not bool(unread.any()), f"{what}: {int((unread != 0).sum())} padding bytes are not 0"
        check_quantization(q, rows, layer_input, what)
        weight = positive_weight(hidden, generator).double()
        y = consumers.dequantized(q, rows) @ weight.t()
        exact, bound = consumers.product_bound(
            layer_input, rows, weight, accumulation=consumers.FP64_ACCUMULATION, output=0.0
        )
        worst = consumers.assert_within_bound(y, exact, bound, f"{what}: emulated GEMM against the layer input")
        print(f"  {what}: scales as expected, padding 0, product at {worst:.3f} of the bound")
