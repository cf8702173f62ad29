"""DSV4.1's paths of ``benchmarks.host_instructions`` (callgrind's host instructions per eager call, CPU
ops with no-op kernels). That worker runs another tree's packages and loads this file by path: it
imports only torch and, when called, ``mhc_dsv41``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The ``torch.ops.mhc`` ops its paths call (the worker registers their implementations for CPU tensors).
CUSTOM_OPS = ("dsv41_boundary",)


def paths(wiring: Any, x: Any, streams: Any, core_library: Any) -> tuple[dict[str, Callable[[], object]], Callable]:
    """``({path: step}, release)``: the op from ``wiring`` (``tests.core.test_launch_wiring_cpu``: recorder
    kernels) with a real ``CallOrder`` and a registered handle; ``release`` after the counted loops."""
    import torch

    from mhc_dsv41 import library

    op, _ = wiring.dsv_op(1)
    op._order = streams.CallOrder(torch.device("cpu"))
    op.handle = core_library.register(op)
    args = wiring.dsv_args(1)
    out = op(x, *args)
    steps = {
        "dsv call": lambda: op(x, *args),
        "dsv call(out=)": lambda: op(x, *args, out=out),
        "dsv library.boundary": lambda: library.boundary(op, x, *args),
        "dsv torch.ops.mhc": lambda: torch.ops.mhc.dsv41_boundary(op.state, op.handle, x, *args, 1e-6),
    }
    return steps, lambda: None
