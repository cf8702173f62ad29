"""``fp32-g128``'s quotients on the GPU: the shared-reciprocal fast path ``quant.quantize_fragment_divide``
takes for a normal scale equals ``div.rn.f32`` for every absmax and every value a group can hold
(``tests.core.fp8_division_kernel``: about 2^31 pairs, exhaustively, on this GPU's arch)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_shared_reciprocal_divides_as_div_rn_for_every_group_value() -> None:
    from mhc_core.host.binaries.compiler import compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel
    from tests.core.fp8_division_kernel import BF16_MAX_FINITE, DivisionConfig, DivisionKernel

    config = DivisionConfig()
    kernel = DivisionKernel(config)
    bound = BoundKernel(compile_kernel(kernel, device_arch()).function, kernel.signature(), {})
    n = (BF16_MAX_FINITE + 1) * config.chunks
    out = torch.full((n, 2), -1, dtype=torch.int32, device="cuda")  # poisoned: every thread writes
    bound(out=out, n=n)
    torch.cuda.synchronize()
    assert (out >= 0).all(), "a thread did not report"
    codes, quotients = out.sum(dim=0).tolist()
    assert codes == 0, f"{codes} E4M3 codes differ from div.rn.f32's"
    assert quotients == 0, f"{quotients} FP32 quotients (|q| >= 2^-11) differ from div.rn.f32's"
