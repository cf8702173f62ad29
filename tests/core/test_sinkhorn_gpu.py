"""The Sinkhorn device function against its torch reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("repeat", (1, 20))
def test_sinkhorn_device_function(repeat: int) -> None:
    from mhc_core.device.sinkhorn import SinkhornConfig, SinkhornKernel
    from mhc_core.host.binaries.compiler import compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel
    from mhc_core.reference import sinkhorn

    kernel = SinkhornKernel(SinkhornConfig(repeat=repeat))
    compiled = compile_kernel(kernel, device_arch())
    bound = BoundKernel(compiled.function, kernel.signature(), {})
    generator = torch.Generator("cuda").manual_seed(repeat)
    logits = torch.randn(1000, 16, generator=generator, device="cuda") * 3
    logits[:4] = -0.0  # a row of -0 logits is the uniform mix
    logits[4:8, :4] = -0.0
    out = torch.full_like(logits, float("nan"))
    bound(logits=logits, out=out, eps=1e-6, n=1000)
    torch.cuda.synchronize()
    expected = sinkhorn(logits.view(-1, 4, 4), 1e-6, repeat).view(-1, 16)
    # rcp.approx (<= 1 ulp), the DSL's exp against torch's, and the scaling form's other
    # rounding (a 4-term dot per scale instead of rescaled entries): each of the 2 * repeat
    # normalisations rescales by a factor good to ~2^-22; the errors add, so about
    # 4 * repeat FP32 ulps of the value (at least 1e-6 relative).
    tolerance = expected.abs() * max(4 * repeat * 2.0**-23, 1e-6) + 1e-7
    assert torch.isfinite(out).all()
    assert ((out - expected).abs() <= tolerance).all(), (out - expected).abs().max()
