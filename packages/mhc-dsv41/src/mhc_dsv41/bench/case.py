"""DSV4.1's benchmark case (``mhc_core.bench.case.BenchmarkCase``): its preset, inputs, call and bytes.

Imports torch and, when called, ``mhc_dsv41``'s op only: ``benchmarks.ab`` loads this file into a
process whose packages are another tree's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

HC = 4


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


def inputs(m: int, hidden: int = 5120) -> tuple:
    """``(residual, post, comb, pre, norm_weight, norm_eps)``: mixes in the ranges mHC produces."""
    residual = _bf16(m, HC, hidden)
    post, pre = torch.rand(m, HC, device="cuda") * 2, torch.rand(m, HC, device="cuda")
    comb = torch.softmax(torch.randn(m, HC, HC, device="cuda"), -1)
    return residual, post, comb, pre, _bf16(hidden), 1e-6


def call_bytes(m: int, hidden: int) -> int:
    """x, the hc streams in and out, the layer input, post / comb / pre, the norm weight once."""
    return 2 * m * hidden * (1 + 2 * HC + 1) + 2 * hidden + 4 * m * (2 * HC + HC * HC)


class Case:
    key = "dsv41"
    hidden = 5120
    hc = HC
    first_layer_output = 1  # (residual_out, layer_input)
    instructions = "mhc_dsv41.bench.instructions"

    def preset(self, tp: int) -> str:
        return f"h200-tp{tp}-h{self.hidden}"

    def build(self, preset: str, capacity: int, device: Any, group: Any = None, **options: Any) -> Any:
        from mhc_dsv41 import AllReduceMHC

        return AllReduceMHC.from_preset(preset, max_num_tokens=capacity, device=device, group=group, **options)

    def inputs(self, m: int, hidden: int) -> tuple:
        return inputs(m, hidden)

    def bytes(self, m: int, hidden: int) -> int:
        return call_bytes(m, hidden)

    def join(self, op: Any) -> None:
        """Nothing runs beside the call."""

    def step(self, op: Any, x: torch.Tensor, args: tuple) -> Callable[[], object]:
        out = (torch.empty_like(args[0]), torch.empty_like(x))
        return lambda: op(x, *args, out=out)

    def host_steps(self, m: int, device: torch.device) -> list:
        from mhc_dsv41.bench.host import host_steps

        return host_steps(self, m, device)


CASE = Case()
