"""Scalar device math shared by the GLM kernels: approximate reciprocal and sigmoid.

Both are the seeds' choices: ``rcp.approx.ftz.f32`` (about 1 ulp) and a sigmoid
built from ``ex2.approx`` and that reciprocal (a few ulp). The references use
torch's correctly rounded functions; the tests' tolerances cover the difference.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

LOG2_E = 1.4426950408889634


@cute.jit
def rcp(value: Float32) -> Float32:
    return cute.arch.rcp_approx(value)


@cute.jit
def sigmoid(value: Float32) -> Float32:
    """``1 / (1 + 2^(-x log2 e))``."""
    return rcp(Float32(1.0) + cute.math.exp2(-value * Float32(LOG2_E), fastmath=True))
