"""AllReduceMHC rejects bad arguments before any launch: one test per rule, message checked,
stage state and poisoned outputs unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import bf16_randn, is_poisoned, poisoned

pytestmark = pytest.mark.gpu

HIDDEN, HC, TOP_K, CAPACITY, M = 5120, 4, 8, 16, 3


@pytest.fixture(scope="module")
def op():
    from mhc_dsv41 import AllReduceMHC

    return AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, device="cuda")


def good(m: int = M) -> dict:
    return dict(
        x=bf16_randn(m, HIDDEN),
        residual=bf16_randn(m, HC, HIDDEN),
        post=torch.rand(m, HC, device="cuda"),
        comb=torch.rand(m, HC, HC, device="cuda"),
        pre=torch.rand(m, HC, device="cuda"),
        norm_weight=bf16_randn(HIDDEN),
        norm_eps=1e-6,
    )


def misaligned(shape, dtype=torch.bfloat16) -> torch.Tensor:
    flat = torch.zeros(math.prod(shape) + 1, dtype=dtype, device="cuda")
    return flat[1:].view(shape)


CALL_CASES = {
    "x dtype": ("x", lambda: torch.randn(M, HIDDEN, device="cuda"), TypeError, "x: expected dtype bfloat16"),
    "x hidden": ("x", lambda: bf16_randn(M, HIDDEN - 8), ValueError, r"x: expected shape \[3, 5120\], got \[3, 5112\]"),
    "M zero": ("x", lambda: bf16_randn(0, HIDDEN), ValueError, "x: expected 1 <= M <= max_num_tokens = 16, got M = 0"),
    "M too large": ("x", lambda: bf16_randn(CAPACITY + 1, HIDDEN), ValueError, "got M = 17"),
    "x misaligned": ("x", lambda: misaligned((M, HIDDEN)), ValueError, "x: expected a 16-byte aligned"),
    "residual shape": (
        "residual",
        lambda: bf16_randn(M, HC + 1, HIDDEN),
        ValueError,
        r"residual: expected shape \[3, 4, 5120\], got \[3, 5, 5120\]",
    ),
    "residual M": ("residual", lambda: bf16_randn(M + 1, HC, HIDDEN), ValueError, r"residual: expected shape \[3, 4"),
    "residual dtype": (
        "residual",
        lambda: torch.zeros(M, HC, HIDDEN, device="cuda"),
        TypeError,
        "residual: expected dtype",
    ),
    "residual device": (
        "residual",
        lambda: bf16_randn(M, HC, HIDDEN, device="cpu"),
        ValueError,
        "residual: expected device",
    ),
    "residual strided": (
        "residual",
        lambda: bf16_randn(HC, M, HIDDEN).transpose(0, 1),
        ValueError,
        "residual: expected a contiguous tensor",
    ),
    "residual misaligned": (
        "residual",
        lambda: misaligned((M, HC, HIDDEN)),
        ValueError,
        "residual: expected a 16-byte",
    ),
    "post shape": (
        "post",
        lambda: torch.rand(M, HC, 2, device="cuda"),
        ValueError,
        r"post: expected shape \[3, 4\] or \[3, 4, 1\], got \[3, 4, 2\]",
    ),
    "post dtype": (
        "post",
        lambda: torch.rand(M, HC, device="cuda").double(),
        TypeError,
        "post: expected dtype float32",
    ),
    "post strided": ("post", lambda: torch.rand(HC, M, device="cuda").t(), ValueError, "post: expected a contiguous"),
    "comb shape": (
        "comb",
        lambda: torch.rand(M, HC, HC + 1, device="cuda"),
        ValueError,
        r"comb: expected shape \[3, 4, 4\]",
    ),
    "comb dtype": (
        "comb",
        lambda: torch.rand(M, HC, HC, device="cuda").half(),
        TypeError,
        "comb: expected dtype float32",
    ),
    "pre shape": ("pre", lambda: torch.rand(M, HC, 1, device="cuda"), ValueError, r"pre: expected shape \[3, 4\]"),
    "pre device": ("pre", lambda: torch.rand(M, HC), ValueError, "pre: expected device cuda:0, got cpu"),
    "norm_weight shape": (
        "norm_weight",
        lambda: bf16_randn(HIDDEN + 8),
        ValueError,
        r"norm_weight: expected shape \[5120\]",
    ),
    "norm_weight dtype": (
        "norm_weight",
        lambda: torch.ones(HIDDEN, device="cuda"),
        TypeError,
        "norm_weight: expected dtype",
    ),
    "norm_eps zero": ("norm_eps", lambda: 0.0, ValueError, "norm_eps: expected a finite value > 0, got 0.0"),
    "norm_eps negative": ("norm_eps", lambda: -1e-6, ValueError, "norm_eps: expected a finite value > 0"),
    "norm_eps nan": ("norm_eps", lambda: float("nan"), ValueError, "norm_eps: expected a finite value > 0, got nan"),
    "norm_eps inf": ("norm_eps", lambda: float("inf"), ValueError, "norm_eps: expected a finite value > 0, got inf"),
    "norm_eps type": ("norm_eps", lambda: "1e-6", TypeError, "norm_eps: expected a float, got str"),
}


def check_nothing_ran(op, outputs) -> None:
    torch.cuda.synchronize()
    for tensor in outputs:
        assert is_poisoned(tensor).all(), "a kernel ran: an output was written"


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_call_rule(op, case: str) -> None:
    key, make, error, message = CALL_CASES[case]
    args = good()
    args[key] = make()
    out = (poisoned((M, HC, HIDDEN), torch.bfloat16), poisoned((M, HIDDEN), torch.bfloat16))
    torch.cuda.synchronize()
    stage = op.mailbox.stage_state.clone()
    with pytest.raises(error, match=message):
        op(**args, out=out)
    check_nothing_ran(op, out)
    assert torch.equal(op.mailbox.stage_state, stage), "a kernel ran: the stage state moved"


def finalize_args(m: int = M, rows: int = 7, **changes) -> dict:
    args = good(m)
    del args["x"]
    args.update(
        gemm2_permuted=bf16_randn(rows, HIDDEN),
        expert_weights=torch.rand(m, TOP_K, device="cuda"),
        expanded_idx_to_permuted_idx=torch.full((m, TOP_K), -1, dtype=torch.int32, device="cuda"),
        shared_output=bf16_randn(m, HIDDEN),
    )
    args.update(changes)
    return args


FINALIZE_CASES = {
    "weights bf16": (
        dict(expert_weights=torch.rand(M, TOP_K).to(torch.bfloat16)),
        TypeError,
        "expert_weights: expected dtype float32, got bfloat16",
    ),
    "weights shape": (
        dict(expert_weights=torch.rand(M, TOP_K - 1)),
        ValueError,
        r"expert_weights: expected shape \[3, 8\]",
    ),
    "index dtype": (
        dict(expanded_idx_to_permuted_idx=torch.zeros(M, TOP_K, dtype=torch.int64)),
        TypeError,
        "expanded_idx_to_permuted_idx: expected dtype int32, got int64",
    ),
    "index shape": (
        dict(expanded_idx_to_permuted_idx=torch.zeros(M, TOP_K + 1, dtype=torch.int32)),
        ValueError,
        r"expanded_idx_to_permuted_idx: expected shape \[3, 8\], got \[3, 9\]",
    ),
    "gemm2 hidden": (
        dict(gemm2_permuted=torch.zeros(7, HIDDEN // 2, dtype=torch.bfloat16)),
        ValueError,
        "gemm2_permuted",
    ),
    "shared shape": (dict(shared_output=torch.zeros(M, HIDDEN + 8, dtype=torch.bfloat16)), ValueError, "shared_output"),
}


@pytest.mark.parametrize("case", sorted(FINALIZE_CASES))
def test_finalize_rule(op, case: str) -> None:
    changes, error, message = FINALIZE_CASES[case]
    args = finalize_args(**{key: value.cuda() for key, value in changes.items()})
    out = (poisoned((M, HC, HIDDEN), torch.bfloat16), poisoned((M, HIDDEN), torch.bfloat16))
    torch.cuda.synchronize()
    stage = op.mailbox.stage_state.clone()
    with pytest.raises(error, match=message):
        op.finalize(**args, out=out)
    check_nothing_ran(op, out)
    assert torch.equal(op.mailbox.stage_state, stage)


def test_out_rules(op) -> None:
    stage = op.mailbox.stage_state.clone()
    bad_residual = (poisoned((M, HC, HIDDEN + 8), torch.bfloat16), poisoned((M, HIDDEN), torch.bfloat16))
    with pytest.raises(ValueError, match=r"out\[0\] \(residual_out\): expected shape \[3, 4, 5120\]"):
        op(**good(), out=bad_residual)
    bad_input = (poisoned((M, HC, HIDDEN), torch.bfloat16), poisoned((M, HIDDEN), torch.float32))
    with pytest.raises(TypeError, match=r"out\[1\] \(layer_input\): expected dtype bfloat16, got float32"):
        op(**good(), out=bad_input)
    with pytest.raises(TypeError, match="out: expected a"):
        op(**good(), out=bad_input[0])
    check_nothing_ran(op, [*bad_residual, *bad_input])
    assert torch.equal(op.mailbox.stage_state, stage)


def test_constructor_rules() -> None:
    from mhc_dsv41 import AllReduceMHC

    common = dict(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=4, top_k=TOP_K, device="cuda")
    with pytest.raises(ValueError, match="hc_mult: expected >= 1, got 0"):
        AllReduceMHC(**{**common, "hc_mult": 0})
    with pytest.raises(ValueError, match="top_k: expected >= 1, got 0"):
        AllReduceMHC(**{**common, "top_k": 0})
    with pytest.raises(ValueError, match="rank_lanes: expected 1, 2, 4 or 8 dividing tp = 1, got 2"):
        AllReduceMHC(**common, rank_lanes=2)
    with pytest.raises(ValueError, match="threads: expected a multiple of 32"):
        AllReduceMHC(**common, threads=100)
    with pytest.raises(ValueError, match=r"cluster_size: expected 1\.\.8, got 9"):
        AllReduceMHC(**common, cluster_size=9)
    with pytest.raises(ValueError, match="max_num_tokens: expected >= 1"):
        AllReduceMHC(**{**common, "max_num_tokens": 0})


def test_cached_checks_see_a_reused_address(op) -> None:
    """A call whose arguments passed before skips the checks; the same addresses with any other
    dtype, shape, strides or alignment are checked again (the allocator reuses addresses)."""
    args = good()
    out = (poisoned((M, HC, HIDDEN), torch.bfloat16), poisoned((M, HIDDEN), torch.bfloat16))
    op(**args, out=out)
    op(**args, out=out)  # cached
    x = args["x"]
    same_address = {
        "dtype": (x.view(torch.float16), TypeError, "x: expected dtype bfloat16, got float16"),
        "shape": (x.view(M * 2, HIDDEN // 2), ValueError, "x: expected shape"),
        "strides": (x.as_strided((M, HIDDEN), (1, M)), ValueError, "x: expected a contiguous tensor"),
    }
    for name, (bad, error, message) in same_address.items():
        assert bad.data_ptr() == x.data_ptr(), name
        with pytest.raises(error, match=message):
            op(**dict(args, x=bad), out=out)
    residual = args["residual"]
    with pytest.raises(ValueError, match="out\\[0\\] \\(residual_out\\): expected shape"):
        op(**args, out=(residual.view(M, HC * 2, HIDDEN // 2), out[1]))
    torch.cuda.synchronize()
