"""The demo decoder on the GPU at tp 1 (issue #19): fused against unfused, fresh random weights.

Both stacks at their real hidden sizes (one layer, a small vocabulary: two boundaries per step),
both paths compiled and captured in CUDA graphs as ``python3 -m demo`` runs them, a short decode
with the logits and every fused boundary checked at every step (``demo.check``); and the same
without ``torch.compile``, which tells a compile problem from a kernel one.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

STEPS = 4


def demo_for(name: str, compile_mode: str, seed: int):
    from demo.config import default
    from demo.run import Demo, Environment

    config = default(name).replace(layers=1, vocab=1024)
    return Demo(config, Environment(), capacity=8, compile_mode=compile_mode, gpu="h200", seed=seed)


def assert_passed(steps) -> None:
    assert len(steps) == STEPS
    for step in steps:
        assert step.conformance <= 1, f"step {step.step}: {step.worst} at {step.conformance:.2f} of its bound"
        assert step.logit_ratio <= 1, f"step {step.step}: logits at {step.logit_ratio:.2f} of the tolerance"
        assert step.emulated_spread > 0


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("name", ["dsv41", "glm5"])
def test_compiled_and_graphed_fused_decode_matches_unfused(name: str, m: int) -> None:
    torch._dynamo.reset()
    demo = demo_for(name, "default", seed=100 + m)
    with torch.no_grad():
        steps, _ = demo.check(m, STEPS)
    assert_passed(steps)


@pytest.mark.parametrize("name", ["dsv41", "glm5"])
def test_eager_graphed_fused_decode_matches_unfused(name: str) -> None:
    demo = demo_for(name, "none", seed=7)
    with torch.no_grad():
        steps, _ = demo.check(8, STEPS)
    assert_passed(steps)
