"""The custom-op path at a direct call's cost (issue #34 part 8), without a GPU: the ops are
registered through ``torch.library.Library`` (one Python kernel per call: no Python autograd or
ADInplaceOrView kernel), and the typed wrappers call the op itself in eager mode, going through
``torch.ops.mhc`` only where something traces (a dispatch mode here; ``torch.compile`` in
tests/library/test_trace_cpu.py and the GPU library tests). Ops are the host-wiring tests' CPU ops
with recorder kernels (tests/core/test_launch_wiring_cpu.py), registered under a handle."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_core.host import library
from tests.core.test_launch_wiring_cpu import HIDDEN, M, dsv_args, dsv_op, glm_args, glm_op

OPS = [
    "all_reduce", "all_reduce_moe", "publish", "publish_moe", "all_reduce_collect",
    "dsv41_boundary", "dsv41_finalize", "dsv41_collect",
    "glm5_boundary", "glm5_boundary_moe", "glm5_collect", "glm5_join",
]  # fmt: skip


class SeenOps(TorchDispatchMode):
    """Records every op the dispatcher runs (what a profiler or FLOP counter mode sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        if str(func).startswith("mhc."):
            raise RuntimeError("reached the custom op")  # its CUDA kernel cannot run on CPU tensors
        return func(*args, **(kwargs or {}))


def registered(op):
    op.handle = library.register(op)
    return op


@pytest.mark.parametrize("name", OPS)
def test_each_op_has_one_python_kernel(name: str) -> None:
    """``torch.library.custom_op`` registered Python autograd and ADInplaceOrView kernels too: three
    Python calls per eager call, about 8 times a direct call's host instructions."""
    import mhc_dsv41.library  # noqa: F401  (registers the ops)
    import mhc_glm5.library  # noqa: F401

    qualname = f"mhc::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
    for key in ("Autograd", "AutogradCUDA", "ADInplaceOrView"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), key


def test_dsv_wrapper_calls_the_op_in_eager_mode() -> None:
    """Through the dispatcher this call would fail: the ops have CUDA kernels only."""
    from mhc_dsv41 import library as dsv_library

    op, kernels = dsv_op(1)
    registered(op)
    x, args = torch.randn(M, HIDDEN).to(torch.bfloat16), dsv_args()
    residual_out, layer_input = dsv_library.boundary(op, x, *args)
    assert kernels.names() == ["collective"] and residual_out.shape == args[0].shape
    assert layer_input.shape == (M, HIDDEN)


def test_glm_wrappers_hand_the_side_outputs_to_join_in_eager_mode() -> None:
    from mhc_glm5 import library as glm_library

    op, _, side = glm_op(1)
    registered(op)
    op.join = lambda: None  # the recorder op's side work is a stand-in
    x, args = torch.randn(M, HIDDEN).to(torch.bfloat16), glm_args()
    residual_out, _ = glm_library.boundary(op, x, *args)
    post_out, comb_out = glm_library.join(op, residual_out)
    assert side.launched_with == [(post_out, comb_out, args[4], args[5])], "the boundary call's side outputs"
    with pytest.raises(RuntimeError, match="no boundary call to join"):
        glm_library.join(op, residual_out)


def test_under_a_dispatch_mode_the_wrappers_go_through_the_custom_op() -> None:
    """A mode (a profiler's, a FLOP counter, tracing) must see the call: no bypass there."""
    from mhc_dsv41 import library as dsv_library

    op, kernels = dsv_op(1)
    registered(op)
    x, args = torch.randn(M, HIDDEN).to(torch.bfloat16), dsv_args()
    with SeenOps() as mode, pytest.raises(RuntimeError, match="reached the custom op"):
        dsv_library.boundary(op, x, *args)
    assert mode.names == ["mhc.dsv41_boundary.default"] and kernels.names() == []


def test_an_op_without_a_live_handle_goes_through_the_custom_op() -> None:
    """A stand-in with state and handle alone (the tracing tests'), or a closed op: the custom op
    raises its clear error, the wrapper never calls the object."""
    from mhc_dsv41 import library as dsv_library

    op, kernels = dsv_op(1)
    registered(op)
    library.unregister(op.handle)
    x, args = torch.randn(M, HIDDEN).to(torch.bfloat16), dsv_args()
    with pytest.raises((NotImplementedError, ValueError, RuntimeError)):
        dsv_library.boundary(op, x, *args)
    assert kernels.names() == []


def test_a_tensor_subclass_goes_through_the_custom_op() -> None:
    class Marked(torch.Tensor):
        pass

    op, _ = dsv_op(1)
    registered(op)
    assert library.eager(op, torch.zeros(1))
    assert not library.eager(op, torch.zeros(1).as_subclass(Marked))
