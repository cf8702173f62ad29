"""GLM-5.3's paths of ``benchmarks.host_instructions`` (callgrind's host instructions per eager call, CPU
ops with no-op kernels). That worker runs another tree's packages and loads this file by path: it
imports only torch and, when called, ``mhc_glm5``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The ``torch.ops.mhc`` ops its paths call (the worker registers their implementations for CPU tensors).
CUSTOM_OPS = ("glm5_boundary", "glm5_join")


def paths(wiring: Any, x: Any, streams: Any, core_library: Any) -> tuple[dict[str, Callable[[], object]], Callable]:
    """``({path: step}, release)``: the op from ``wiring`` (``tests.core.test_launch_wiring_cpu``: recorder
    kernels) with a real ``CallOrder`` and ``SideWork`` and a registered handle; ``release`` after the
    counted loops."""
    import torch

    from mhc_glm5 import library

    cpu = torch.device("cpu")
    op, _, _ = wiring.glm_op(1)
    op._order = streams.CallOrder(cpu)
    op._side_work = streams.SideWork(cpu)
    op.handle = core_library.register(op)
    args = wiring.glm_args(1)
    out = op(x, *args)
    op.join()

    def library_step() -> None:
        fused = library.boundary(op, x, *args)
        library.join(op, fused[0])

    def release() -> None:
        op._side_work._eager_held = ()  # its __del__ would record them on a stand-in stream

    steps = {
        "glm call + join": lambda: (op(x, *args), op.join()),
        "glm call(out=) + join": lambda: (op(x, *args, out=out), op.join()),
        "glm library.boundary + join": library_step,
    }
    return steps, release
