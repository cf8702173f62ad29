"""Helpers for the test suites: data, poisoning, BF16 tolerances, building ops on loopback ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: A NaN pattern no kernel produces: an output still holding it was never written.
POISON_BF16 = 0x7FA5
POISON_F32 = 0x7FA5A5A5


def poison(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bfloat16:
        tensor.view(torch.int16).fill_(POISON_BF16)
    elif tensor.dtype == torch.float32:
        tensor.view(torch.int32).fill_(POISON_F32)
    else:
        raise TypeError(f"cannot poison {tensor.dtype}")
    return tensor


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return poison(torch.empty_like(tensor))


def poisoned(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cuda") -> torch.Tensor:
    return poison(torch.empty(tuple(shape), dtype=dtype, device=device))


def is_poisoned(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16) == POISON_BF16
    return tensor.view(torch.int32) == POISON_F32


def bf16_randn(
    *shape: int, generator: torch.Generator | None = None, scale: float = 1.0, device="cuda"
) -> torch.Tensor:
    """Random BF16 with a sprinkle of -0.0 and +0.0 (the sentinel must never leak)."""
    values = torch.randn(*shape, generator=generator, device=device) * scale
    flat = values.view(-1)
    if flat.numel() == 0:
        return values.to(torch.bfloat16)
    count = max(1, flat.numel() // 50)
    index = torch.randint(0, flat.numel(), (count,), generator=generator, device=device)
    flat[index] = -0.0
    flat[index[: count // 2]] = 0.0
    return values.to(torch.bfloat16)


def negative_zeros(*shape: int, device="cuda") -> torch.Tensor:
    return torch.full(shape, -0.0, dtype=torch.bfloat16, device=device)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    different = bits(actual) != bits(expected)
    if different.any():
        index = different.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(different.sum())} of {actual.numel()} elements differ bitwise; first at {index}: "
            f"{actual[tuple(index)].item()!r} vs {expected[tuple(index)].item()!r}"
        )


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing around each |value|: 2^(exponent - 7), at least the subnormal step.

    A value within one ulp below a power of two takes the next binade's (double)
    spacing: a result one rounding away may land just above the power of two.
    """
    magnitude = values.float().abs() * (1 + 2.0**-7)
    exponent = torch.floor(torch.log2(torch.clamp(magnitude, min=2.0**-126)))
    return torch.exp2(exponent - 7)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor, what: str = "") -> None:
    """``|actual - expected| <= tolerance`` elementwise, no NaN, no poison left."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not is_poisoned(actual).any(), f"{what}: output still holds poison (never written)"
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all(), f"{what}: non-finite output"
    error = (a - e).abs()
    excess = error - tolerance.float().expand_as(error)
    if (excess > 0).any():
        index = torch.argmax(excess).item()
        flat = (
            a.reshape(-1)[index].item(),
            e.reshape(-1)[index].item(),
            tolerance.float().expand_as(error).reshape(-1)[index].item(),
        )
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {a.numel()} elements outside tolerance; worst: "
            f"got {flat[0]!r}, expected {flat[1]!r}, tolerance {flat[2]!r}"
        )


def build_ranks(tp: int, factory: Callable[[Any], Any], device: str = "cuda") -> list[Any]:
    """One op per rank: ``factory(None)`` at tp = 1, else over a fresh LoopbackGroup."""
    import mhc_core

    if tp == 1:
        return [factory(None)]
    group = mhc_core.LoopbackGroup(tp, device)
    return group.build(factory)


_RANKS: dict[tuple, list] = {}


def cached_ranks(key: tuple, tp: int, factory: Callable[[Any], Any]) -> list[Any]:
    """``build_ranks`` once per ``key`` for the whole session: compiles and mailboxes are reused."""
    if key not in _RANKS:
        _RANKS[key] = build_ranks(tp, factory)
    return _RANKS[key]


def needs_compiler(what: str) -> None:
    """Skip where the DSL compiler is absent (a host with its runtime alone): ``what`` is built from a
    configuration no package ships, so only the compiler can make its kernels."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("cutlass") is None:
        pytest.skip(f"{what}: its kernels ship in no package and the DSL compiler is not installed (mhc-core[jit])")


def all_reduce_ranks(tp: int, hidden: int, *, capacity: int, top_k: int = 0, lanes: int = 1) -> list[Any]:
    """``LamportAllReduce`` on every rank (cached): the protocol alone, or the reduced x a fused op must see."""
    from mhc_core import LamportAllReduce

    needs_compiler("the reference LamportAllReduce")

    return cached_ranks(
        ("all-reduce", tp, hidden, capacity, top_k, lanes),
        tp,
        lambda group: LamportAllReduce(
            hidden_size=hidden, max_num_tokens=capacity, device="cuda", group=group, top_k=top_k, lanes=lanes
        ),
    )


def run_ranks(ops: Sequence[Any], method: str, args: Sequence[Sequence[Any]], kwargs=None) -> list[Any]:
    import mhc_core

    return mhc_core.run_ranks(ops, method, args, kwargs)
