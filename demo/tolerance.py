"""How far the fused path may be from the unfused one: per boundary (strict), then at the logits (propagated).

Notation as ``tests/tolerances.py``: ``u = 2^-24`` (FP32 unit roundoff), ``ulp(v)`` one BF16 ulp at
``|v|`` (the next binade's just below a power of two), ``APPROX = 2^-21`` the relative error of the
device's ``rsqrt`` / ``ex2`` / ``rcp`` approximations.

**1. Per boundary, strict.** The references (``demo.reference``) compute each boundary in FP64
between the kernels' BF16 rounding points. A kernel differs from them only by its FP32 arithmetic:
a sum of ``n`` products, in any order, with or without FMA, is within ``n u S`` of the exact sum
(``S`` the terms' magnitude); two FP32 values within ``d`` round to BF16 values within ``d + ulp``.
Term by term, for the kernel's outputs against the reference evaluated *at the kernel's own
inputs* (and, after the post-mix, at the kernel's own BF16 streams, so that a one-ulp stream
difference is not counted twice), with the factors of ``tests/tolerances.py`` (two-sided, so they
also cover the reference's own FP64 -> BF16 conversion):

* reduced input: ``demo.reference.reduced`` (finalize and TP sum);
* ``residual_out``: ``ulp + 2 (hc + 1) u S + |post| e_x``, ``e_x`` the reduced input's error;
* collapse: ``ulp(c) + 2 hc u S`` (DSV), plus the pre-mix's error times ``|s|`` (GLM);
* ``layer_input``: ``ulp + |inv_rms w| e_c + (APPROX + 2^-12 + r) |y|``, ``r = (sum |c| e_c + sum
  e_c^2 / 2) / (sum c^2 + n eps)`` the first-order change of ``inv_rms`` when every collapse element
  moves by its bound (``tests/tolerances.py`` leaves ``r`` to the ``2^-12`` slack; it is explicit here);
* GLM raw mixes: ``(2 d u + 2 APPROX) S rstd + APPROX |raw|`` with ``d = GEMV_DEPTH``; the pre- and
  post-mix move by at most ``1/4 |scale|`` times that (sigmoid' <= 1/4) plus ``2 APPROX``; Sinkhorn
  keeps relative perturbations: a logit error ``delta`` moves each ``comb`` entry by at most
  ``4 delta`` relative, ``rcp.approx`` adds ``2^-22`` per step (``tests/glm5/checks.py``).

``demo.check`` evaluates these at every boundary of every decode step (``conformance``): the fused
path's recorded inputs and outputs, every element within its bound.

**2. At the logits, propagated.** A strict bound through a whole stack is not feasible: a
sublayer's first-order response to its input is ``|W|`` times the input's change elementwise, and
with the random GEMMs here a product of such worst cases over 8 sublayers grows far past the
logits themselves. The boundaries' bounds are propagated through the stack *by the stack*:
``demo.boundaries.EmulatedBoundary`` is a kernel that conforms to section 1 by construction (the
FP64 reference moved by its full bound with random signs, rounded where the kernel rounds), and the
unfused path run with it in every boundary is a fused path with the largest per-element
differences section 1 allows. Per token ``m`` (the max over the vocabulary):

    tolerance[m] = MARGIN * max over DRAWS emulations |emulated - unfused_eager|
                   + |unfused_compiled - unfused_eager| + ulp(logits)

The compiled unfused path's own deviation from eager (Inductor keeps some intermediates in FP32
that eager rounds to BF16) is measured, not bounded, and counted once. ``MARGIN = 4`` is a factor
of 2 for the sampling (an emulation puts every element at its bound with a random sign; a real
kernel's differences are at most that large and just as sign-random, and two draws estimate the
propagated size, not its worst case) times 2 for the fused path's own compile-induced deviation,
which has no eager twin to be measured against.

Section 1 is strict; section 2 is an estimate, stated as such, and a coarse gate: on the tiny CPU
stack a kernel that transposes the residual mix stays within it (near-uniform mixes barely
change), and one that scales every stream by ``1 + 2^-5`` reaches 0.6-0.9 of it; the per-boundary
check rejects both by factors of 9 to 10^4 (``tests/demo/test_model_cpu.py``). It is the
per-boundary check that proves the kernels right inside the model; the logit check shows what
their differences amount to at the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

U = 2.0**-24
APPROX = 2.0**-21
#: Relative error per step of the device Sinkhorn's ``rcp.approx`` (``tests/glm5/checks.py``).
RCP = 2.0**-22
#: FP32 additions on the longest path of the GLM kernels' GEMV trees: ``tests/glm5/checks.py``'s
#: ``gemv_depth`` for the tensor-core kernel (``2 * 16 * 17``: each MMA's 16 products and accumulator
#: as adds, doubled for truncation) plus one add per warp and per cluster peer, at most 32 each.
GEMV_DEPTH = 2 * 16 * 17 + 64
#: Section 2 of the module docstring.
MARGIN = 4.0
DRAWS = 2


def bf16_ulp(values: Tensor) -> Tensor:
    """The BF16 spacing around each ``|value|``: ``2^(exponent - 7)``, at least the subnormal step.

    A value within one ulp below a power of two takes the next binade's (double) spacing: a result
    one rounding away may land just above the power of two (as ``tests.support.bf16_ulp``).
    """
    magnitude = values.float().abs() * (1 + 2.0**-7)
    exponent = torch.floor(torch.log2(torch.clamp(magnitude, min=2.0**-126)))
    return torch.exp2(exponent - 7)


def ratio(actual: Tensor, expected: Tensor, bound: Tensor) -> float:
    """``max |actual - expected| / bound`` (inf where ``actual`` is not finite): <= 1 is within."""
    a, e = actual.float(), expected.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float(((a - e).abs() / bound.float().expand_as(a)).max())


# ----------------------------------------------------------------- both models
def post_mix_bound(
    x: Tensor, residual: Tensor, post: Tensor, comb: Tensor, expected: Tensor, x_error: Tensor
) -> Tensor:
    """``residual_out[:, j] = bf16(x post_j + sum_i residual_i comb_ij)``: hc + 1 products, and x off by ``x_error``."""
    m, hc = residual.shape[:2]
    post = post.reshape(m, hc, 1).float().abs()
    x_error = x_error.float()
    x = (x.float().abs() + x_error).unsqueeze(1)
    x_error = x_error.unsqueeze(1) if x_error.dim() else x_error  # [M, 1, hidden], or 0 where x is read as is
    magnitude = x * post + torch.einsum("mih,mij->mjh", residual.float().abs(), comb.float().abs())
    return bf16_ulp(expected) + 2 * (hc + 1) * U * magnitude + post * x_error


def rms_norm_bound(prenorm: Tensor, prenorm_error: Tensor, weight: Tensor, eps: float, expected: Tensor) -> Tensor:
    """``y = bf16(c rsqrt(mean(c^2) + eps) w)`` when the kernel's ``c`` may be off by ``prenorm_error``."""
    c, e = prenorm.double(), prenorm_error.double()
    n = c.shape[-1]
    sum_squares = (c * c).sum(-1, keepdim=True)
    inv_rms = torch.rsqrt(sum_squares / n + eps)
    moved = ((c.abs() * e).sum(-1, keepdim=True) + 0.5 * (e * e).sum(-1, keepdim=True)) / (sum_squares + n * eps)
    scale = (inv_rms * weight.double()).abs()
    y = expected.double().abs()
    return (bf16_ulp(expected).double() + scale * e + (APPROX + 2.0**-12 + moved) * y).float()


# ---------------------------------------------------------------------- DSV4.1
def dsv41_input_bound(
    streams: Tensor, pre: Tensor, weight: Tensor, eps: float, collapse: Tensor, expected: Tensor
) -> Tensor:
    """``layer_input`` from the kernel's own BF16 streams: the collapse (hc products), then the norm."""
    hc = streams.shape[1]
    magnitude = (streams.float().abs() * pre.float().abs().unsqueeze(-1)).sum(1)
    collapse_error = bf16_ulp(collapse) + 2 * hc * U * magnitude
    return rms_norm_bound(collapse, collapse_error, weight, eps, expected)


# --------------------------------------------------------------------- GLM-5.3
def glm5_bounds(
    streams: Tensor, scale: Tensor, weight: Tensor, norm_eps: float, post_mult: float, sinkhorn_repeat: int, ref: dict
) -> dict[str, Tensor]:
    """Bounds of ``layer_input``, ``post_out``, ``comb_out`` from the kernel's own BF16 streams;
    ``ref`` is ``demo.reference.glm5_mixes`` of those streams."""
    hc = streams.shape[1]
    scale = scale.double().abs()
    raw_error = (2 * GEMV_DEPTH * U + 2 * APPROX) * ref["magnitude"] * ref["rstd"] + APPROX * ref["raw"].abs()
    pre_error = 0.25 * scale[0] * raw_error[:, :hc] + 2 * APPROX
    s = streams.double().abs()
    collapse_error = (
        bf16_ulp(ref["collapse"]).double()
        + (s * pre_error.unsqueeze(-1)).sum(1)
        + 2 * (hc - 1) * U * (s * (ref["pre"].abs() + pre_error).unsqueeze(-1)).sum(1)
    )
    post_error = post_mult * (0.25 * scale[1] * raw_error[:, hc : 2 * hc] + 2 * APPROX)
    logit_error = (scale[2] * raw_error[:, 2 * hc :]).amax(-1).reshape(-1, 1, 1)
    comb = ref["comb_out"].double().abs()
    comb_error = comb * (4 * logit_error + 2 * (2 * sinkhorn_repeat + 1) * RCP) + 1e-9
    return {
        "layer_input": rms_norm_bound(ref["collapse"], collapse_error, weight, norm_eps, ref["layer_input"]),
        "post_out": post_error.unsqueeze(-1).float(),
        "comb_out": comb_error.float(),
    }


# ---------------------------------------------------------------------- logits
def logit_tolerance(unfused_eager: Tensor, unfused_compiled: Tensor, emulated: Sequence[Tensor]) -> Tensor:
    """``[M]``: section 2 of the module docstring."""
    base = unfused_eager.float()
    spread = torch.stack([(e.float() - base).abs().amax(-1) for e in emulated]).amax(0)
    compiled = (unfused_compiled.float() - base).abs().amax(-1)
    return MARGIN * spread + compiled + bf16_ulp(unfused_compiled).amax(-1)


def logit_ratio(fused: Tensor, unfused: Tensor, tolerance: Tensor) -> Tensor:
    """``[M]``: the largest logit difference of each token over its tolerance (<= 1 passes)."""
    difference = (fused.float() - unfused.float()).abs().amax(-1)
    finite = torch.isfinite(fused.float()).all(-1)
    return torch.where(finite, difference / tolerance, torch.full_like(difference, float("inf")))
