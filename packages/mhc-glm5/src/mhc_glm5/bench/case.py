"""GLM-5.3's benchmark case (``mhc_core.bench.case.BenchmarkCase``): its preset, inputs, call and bytes.

Imports torch and, when called, ``mhc_glm5``'s op only: ``benchmarks.ab`` loads this file into a
process whose packages are another tree's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

HC = 4
#: The prenorm GEMV's outputs: pre (4), post (4) and comb (16) logits.
MIX = 24


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


def inputs(m: int, hidden: int = 4096) -> tuple:
    """``(residual, post, comb, fn, scale, base, norm_weight)``."""
    residual = _bf16(m, HC, hidden)
    post = torch.rand(m, HC, 1, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, HC, HC, device="cuda"), -1)
    fn = (torch.randn(MIX, HC * hidden, device="cuda") * 0.02).to(torch.bfloat16)
    scale = torch.rand(3, device="cuda") + 0.5
    base = torch.randn(MIX, device="cuda")
    return residual, post, comb, fn, scale, base, _bf16(hidden)


def call_bytes(m: int, hidden: int) -> int:
    per_token = 2 * hidden * (1 + 2 * HC + 1) + 4 * (HC + HC * HC) * 2  # x, streams in/out, input; mixes in/out
    return m * per_token + 2 * MIX * HC * hidden + 2 * hidden + 4 * (3 + MIX)  # fn and weights once


class Case:
    key = "glm5"
    hidden = 4096
    hc = HC
    first_layer_output = 3  # (residual_out, post_out, comb_out, layer_input)
    instructions = "mhc_glm5.bench.instructions"

    def preset(self, tp: int) -> str:
        return f"h200-tp{tp}-h{self.hidden}"

    def build(self, preset: str, capacity: int, device: Any, group: Any = None, **options: Any) -> Any:
        from mhc_glm5 import AllReduceMhcBoundary

        return AllReduceMhcBoundary.from_preset(preset, max_num_tokens=capacity, device=device, group=group, **options)

    def inputs(self, m: int, hidden: int) -> tuple:
        return inputs(m, hidden)

    def bytes(self, m: int, hidden: int) -> int:
        return call_bytes(m, hidden)

    def join(self, op: Any) -> None:
        """The side-stream mixes: every timed call includes them."""
        op.join()

    def step(self, op: Any, x: torch.Tensor, args: tuple) -> Callable[[], object]:
        def fused() -> Any:
            outputs = op(x, *args)
            op.join()  # the fused time includes the side-stream mixes
            return outputs

        return fused

    def host_steps(self, m: int, device: torch.device) -> list:
        from mhc_glm5.bench.host import host_steps

        return host_steps(self, m, device)


CASE = Case()
