"""Bad arguments raise before any launch: the stage state and poisoned outputs stay as they were."""

from __future__ import annotations

import pytest
import torch

from tests.support import bf16_randn, is_poisoned, poisoned

pytestmark = pytest.mark.gpu

HIDDEN, CAPACITY, TOP_K = 4096, 8, 4


@pytest.fixture(scope="module")
def op():
    from mhc_core import LamportAllReduce

    return LamportAllReduce(hidden_size=HIDDEN, max_num_tokens=CAPACITY, device="cuda", top_k=TOP_K)


def moe(m=2, rows=5, **changes):
    from mhc_core import MoEOutput

    fields = dict(
        gemm2_permuted=bf16_randn(rows, HIDDEN),
        expert_weights=torch.rand(m, TOP_K, device="cuda"),
        expanded_idx_to_permuted_idx=torch.zeros(m, TOP_K, dtype=torch.int32, device="cuda"),
        shared_output=bf16_randn(m, HIDDEN),
    )
    fields.update(changes)
    return MoEOutput(**fields)


CASES = {
    "x dtype": (lambda: torch.randn(2, HIDDEN, device="cuda"), TypeError, "x: expected dtype bfloat16, got float32"),
    "x shape": (lambda: bf16_randn(2, HIDDEN + 8), ValueError, r"x: expected shape \[2, 4096\], got \[2, 4104\]"),
    "x rank": (lambda: bf16_randn(2, 1, HIDDEN), ValueError, r"x: expected shape \[2, 4096\], got \[2, 1, 4096\]"),
    "M zero": (lambda: bf16_randn(0, HIDDEN), ValueError, "x: expected 1 <= M <= max_num_tokens = 8, got M = 0"),
    "M too large": (lambda: bf16_randn(9, HIDDEN), ValueError, "got M = 9"),
    "x device": (lambda: bf16_randn(2, HIDDEN, device="cpu"), ValueError, "x: expected device cuda:0, got cpu"),
    "x strided": (lambda: bf16_randn(HIDDEN, 2).t(), ValueError, "x: expected a contiguous tensor"),
    "x misaligned": (lambda: bf16_randn(2 * HIDDEN + 1)[1:].view(2, HIDDEN), ValueError, "16-byte aligned"),
    "x type": (lambda: [[0.0]], TypeError, "x: expected a torch.Tensor, got list"),
    "weights dtype": (
        lambda: moe(expert_weights=torch.rand(2, TOP_K, device="cuda").half()),
        TypeError,
        "expert_weights: expected dtype float32 or bfloat16, got float16",
    ),
    "weights shape": (
        lambda: moe(expert_weights=torch.rand(2, TOP_K + 1, device="cuda")),
        ValueError,
        r"expert_weights: expected shape \[2, 4\], got \[2, 5\]",
    ),
    "index dtype": (
        lambda: moe(expanded_idx_to_permuted_idx=torch.zeros(2, TOP_K, dtype=torch.int64, device="cuda")),
        TypeError,
        "expanded_idx_to_permuted_idx: expected dtype int32, got int64",
    ),
    "gemm2 hidden": (
        lambda: moe(gemm2_permuted=bf16_randn(5, HIDDEN // 2)),
        ValueError,
        r"gemm2_permuted: expected shape \[5, 4096\]",
    ),
    "shared M": (lambda: moe(shared_output=bf16_randn(9, HIDDEN)), ValueError, "shared_output: expected 1 <= M"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_argument_raises_before_launch(op, case: str) -> None:
    make, error, message = CASES[case]
    argument = make()
    torch.cuda.synchronize()
    stage = op.mailbox.stage_state.clone()
    out = poisoned((2, HIDDEN), torch.bfloat16)
    with pytest.raises(error, match=message):
        op(argument, out=out)
    torch.cuda.synchronize()
    assert torch.equal(op.mailbox.stage_state, stage), "a kernel ran: the stage state moved"
    assert is_poisoned(out).all(), "a kernel ran: the output was written"
    op(bf16_randn(2, HIDDEN))  # the op is still usable


def test_bad_out_raises_before_launch(op) -> None:
    stage = op.mailbox.stage_state.clone()
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 4096\], got \[2, 4096\]"):
        op(bf16_randn(3, HIDDEN), out=poisoned((2, HIDDEN), torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(op.mailbox.stage_state, stage)


def test_constructor_arguments() -> None:
    from mhc_core import LamportAllReduce, LoopbackGroup

    with pytest.raises(ValueError, match="hidden_size: expected a multiple of 8, got 4100"):
        LamportAllReduce(hidden_size=4100, max_num_tokens=4, device="cuda")
    with pytest.raises(ValueError, match="max_num_tokens: expected >= 1, got 0"):
        LamportAllReduce(hidden_size=4096, max_num_tokens=0, device="cuda")
    with pytest.raises(ValueError, match="transport: expected one of"):
        LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda", transport="nvls")
    with pytest.raises(ValueError, match="'multicast' needs a torch process group"):
        LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda", transport="multicast")
    with pytest.raises(TypeError, match=r"group: expected one rank of a LoopbackGroup \(group\[r\]\)"):
        LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda", group=LoopbackGroup(2))
    with pytest.raises(ValueError, match="world_size: expected one of"):
        LoopbackGroup(3)


def test_loopback_op_unusable_until_every_rank_built() -> None:
    from mhc_core import LamportAllReduce, LoopbackGroup

    group = LoopbackGroup(2, "cuda")
    first = LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda", group=group[0])
    with pytest.raises(RuntimeError, match=r"ranks \[1\] have not"):
        first(bf16_randn(1, 4096))
    second = LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda", group=group[1])
    assert first.ready and second.ready
    assert "transport='unicast'" in repr(first) and "group='loopback'" in repr(first)
    assert "MiB per rank" in repr(first.mailbox)
