"""Properties of the torch references (CPU)."""

from __future__ import annotations

import pytest
import torch


def test_tp_sum_trees() -> None:
    from mhc_core.reference import tp_sum

    values = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, 2.0**-9, 2.0**-9, -1.0)]
    # Sequential: ((1 + e) + e) - 1 loses both e's to FP32? No: FP32 keeps them: 2^-8.
    assert tp_sum(values, 1).item() == 2.0**-8
    r = [torch.tensor([x], dtype=torch.bfloat16) for x in (3.0, 5.0, 7.0, 11.0)]
    assert tp_sum(r, 2).item() == (3.0 + 7.0) + (5.0 + 11.0)
    assert tp_sum(r[:2], 4).item() == 8.0  # lanes 2, 3 hold no rank: they add zero
    eight = [torch.tensor([float(1 << k)], dtype=torch.bfloat16) for k in range(8)]
    assert tp_sum(eight, 4).item() == 255.0


def test_tp_sum_order_is_observable() -> None:
    """FP32 addition is not associative: the lane tree must be mirrored exactly."""
    from mhc_core.reference import tp_sum

    big, small = torch.tensor([2.0**24], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16)
    partials = [big, small, -big, small]
    assert tp_sum(partials, 1).item() == 1.0  # ((2^24 + 1) - 2^24) + 1: the first 1 is lost
    assert tp_sum(partials, 2).item() == 2.0  # (2^24 - 2^24) + (1 + 1)


def test_sanitize_and_all_reduce() -> None:
    from mhc_core.reference import all_reduce, sanitize

    x = torch.tensor([-0.0, 0.0, -1.0], dtype=torch.bfloat16)
    assert sanitize(x).view(torch.int16).tolist() == [0, 0, x.view(torch.int16)[2].item()]
    assert all_reduce([x, x]).view(torch.int16)[0].item() == 0


def test_finalize_skips_missing_routes() -> None:
    from mhc_core.reference import finalize

    gemm2 = torch.tensor([[1.0, 2.0], [10.0, 20.0]], dtype=torch.bfloat16)
    weights = torch.tensor([[0.5, 2.0]], dtype=torch.float32)
    index = torch.tensor([[1, -1]], dtype=torch.int32)
    shared = torch.tensor([[-0.0, 1.0]], dtype=torch.bfloat16)
    assert finalize(gemm2, weights, index, shared).tolist() == [[5.0, 11.0]]
    empty = finalize(gemm2, weights, torch.tensor([[-1, -1]], dtype=torch.int32), shared)
    assert empty.view(torch.int16)[0, 0].item() == 0, "-0 shared output publishes +0"


@pytest.mark.parametrize("repeat", (1, 3, 20))
def test_sinkhorn_is_nearly_doubly_stochastic(repeat: int) -> None:
    from mhc_core.reference import sinkhorn

    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(repeat)) * 2
    mix = sinkhorn(logits, 1e-6, repeat)
    assert (mix > 0).all()
    columns = mix.sum(-2)
    # Columns are normalised last: each sums to S / (S + eps).
    assert torch.allclose(columns, torch.ones_like(columns), atol=1e-3)
    if repeat == 20:
        rows = mix.sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows), atol=5e-2)  # converging


def test_dsv41_reference_rounding_points() -> None:
    """residual_out is BF16 per stream; the collapse reads the rounded streams."""
    from mhc_dsv41.reference import dsv41_boundary

    m, hc, hidden = 3, 4, 64
    g = torch.Generator().manual_seed(0)
    reduced = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    residual = torch.randn(m, hc, hidden, generator=g).to(torch.bfloat16)
    post, pre = torch.rand(m, hc, generator=g), torch.rand(m, hc, generator=g)
    comb = torch.rand(m, hc, hc, generator=g)
    weight = torch.rand(hidden, generator=g).to(torch.bfloat16)
    residual_out, layer_input = dsv41_boundary(reduced, residual, post, comb, pre, weight, 1e-6)
    assert residual_out.dtype == layer_input.dtype == torch.bfloat16
    mixed = reduced.float()[:, None] * post[..., None] + torch.einsum("mih,mij->mjh", residual.float(), comb)
    assert torch.allclose(residual_out.float(), mixed, rtol=2**-7, atol=1e-6)
    collapse = (residual_out.float() * pre[..., None]).sum(1)
    normed = collapse * torch.rsqrt(collapse.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    assert torch.allclose(layer_input.float(), normed, rtol=2**-6, atol=1e-3)
