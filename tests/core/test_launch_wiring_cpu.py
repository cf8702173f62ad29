"""What the ops pass to their kernels, without a GPU: an op whose launches are recorded (no CUDA,
no compile) is planned and run on CPU tensors. Covers the tp = 1 direct path against the
mailbox path, the norm_eps default, output allocation and the validation cache's skip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

HIDDEN, HC, M = 64, 4, 3


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def launch(self, stream: int | None = None, **values) -> None:
        self.calls.append((self.name, stream, values))


def bare(op_type, tp: int, **attributes):
    """An op with its host attributes set and every kernel replaced by a recorder."""
    from mhc_core.host.validation import ValidatedCalls

    op = object.__new__(op_type)
    calls: list = []
    op.__dict__.update(
        hidden_size=HIDDEN, device=torch.device("cpu"), tp=tp, capacity=8, top_k=2, _validated=ValidatedCalls(),
        _publish=Recorder("publish", calls), **attributes,
    )  # fmt: skip
    return op, calls


def dsv_args(m: int = M):
    return (
        torch.randn(m, HC, HIDDEN).to(torch.bfloat16), torch.rand(m, HC), torch.rand(m, HC, HC), torch.rand(m, HC),
        torch.ones(HIDDEN, dtype=torch.bfloat16),
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_dsv_call_launches(tp: int) -> None:
    from mhc_dsv41 import AllReduceMHC

    op, calls = bare(AllReduceMHC, tp, hc_mult=HC, norm_eps=1e-6)
    op._collective = Recorder("collective", calls)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    residual, post, comb, pre, weight = dsv_args()
    plan = op._plan_call(x, residual, post, comb, pre, weight)
    plan.publish()
    residual_out, layer_input = plan.collect(True)
    names = [name for name, _, _ in calls]
    assert names == (["collective"] if tp == 1 else ["publish", "collective"])
    values = calls[-1][2]
    assert values["eps"] == 1e-6, "norm_eps defaults to the op's"
    if tp == 1:
        assert values["direct"] == 1 and values["x"] is x and values["prefetch"] == 0
    else:
        assert values["direct"] == 0 and values["x"] is residual and values["prefetch"] == 1
        assert calls[0][2] == {"x": x, "m": M}
    assert values["residual_out"] is residual_out and values["layer_input"] is layer_input and values["m"] == M
    assert residual_out.shape == (M, HC, HIDDEN) and residual_out.dtype == torch.bfloat16
    assert layer_input.shape == (M, HIDDEN) and layer_input.dtype == torch.bfloat16
    assert residual_out.is_contiguous() and layer_input.is_contiguous()
    op._plan_call(x, residual, post, comb, pre, weight, 1e-3).collect(True)
    assert calls[-1][2]["eps"] == 1e-3, "an explicit norm_eps wins"


def test_dsv_cache_never_skips_a_changed_property() -> None:
    from mhc_dsv41 import AllReduceMHC

    op, calls = bare(AllReduceMHC, 1, hc_mult=HC, norm_eps=1e-6)
    op._collective = Recorder("collective", calls)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = dsv_args()
    op._plan_call(x, *args)
    op._plan_call(x, *args)  # the cached key
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float16"):
        op._plan_call(x.view(torch.float16), *args)
    with pytest.raises(ValueError, match="norm_eps: expected a finite value > 0"):
        op._plan_call(x, *args, 0.0)


def test_glm_call_launches_boundary_then_mixes_on_the_side_stream() -> None:
    from mhc_glm5 import AllReduceMhcBoundary

    op, calls = bare(AllReduceMhcBoundary, 1)
    op._boundaries = {1: Recorder("boundary", calls)}
    op._mixes = Recorder("mixes", calls)
    op.preset = SimpleNamespace(tokens_per_cluster=lambda m: 1)
    events: list = []
    op._order = SimpleNamespace(in_call=True, stream="main", capture=0)
    op._side = SimpleNamespace(
        handle=1234,
        join=lambda stream, capture: events.append(("join", stream)),
        fork=lambda stream: events.append(("fork", stream)),
        launched=lambda capture, tensors: events.append(("launched", len(tuple(tensors)))),
    )
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = (
        torch.randn(M, HC, HIDDEN).to(torch.bfloat16), torch.rand(M, HC, 1), torch.rand(M, HC, HC),
        torch.randn(24, HC * HIDDEN).to(torch.bfloat16), torch.rand(3), torch.rand(24),
        torch.ones(HIDDEN).to(torch.bfloat16),
    )  # fmt: skip
    plan = op._plan_call(x, *args)
    plan.publish()
    residual_out, post_out, comb_out, layer_input = plan.collect(True)
    assert [name for name, _, _ in calls] == ["boundary", "mixes"]
    assert calls[0][1] is None and calls[1][1] == 1234, "the mixes go onto the side stream by handle"
    assert calls[0][2]["direct"] == 1 and calls[0][2]["x"] is x and calls[0][2]["prefetch"] == 0
    assert events == [("join", "main"), ("fork", "main"), ("launched", 4)]
    shapes = [(M, HC, HIDDEN), (M, HC, 1), (M, HC, HC), (M, HIDDEN)]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    for tensor, shape, dtype in zip((residual_out, post_out, comb_out, layer_input), shapes, dtypes, strict=True):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
