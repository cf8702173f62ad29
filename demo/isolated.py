"""The per-boundary saving in isolation: the model's own boundaries, called alone on real inputs.

Two kinds per stack, as many of each per step: the attention boundary (plain ``[M, hidden]`` input,
boundary 0) and the MoE boundary (finalize form, boundary 1). Their inputs are those boundaries'
records from the fused path's last checked decode step (cloned): the same shapes and values the
model runs. Each call is the ``UnfusedBoundary`` / ``FusedBoundary`` method the stack calls,
compiled the same way as the model (``compile``), timed like ``mhc_core.bench.timing`` (a CUDA graph
of back-to-back calls, the median replay). GLM's fused call includes its join: the side-stream mixes
are on the critical path here, as in the benchmarks' suites.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mhc_core import MoEOutput

from .model import Routing, Stack

KINDS = ("attention", "moe")


def _arguments(model: Stack, trace: list[dict], routing: Routing, s: int) -> tuple:
    """Boundary ``s``'s inputs from its record, cloned: the sublayer output first (a MoE's four tensors)."""
    record = {key: value.clone() for key, value in trace[s].items()}
    if "gemm2" in record:
        route = routing[s // 2]
        x = (record["gemm2"], route.weights.clone(), route.index.clone(), record["shared"])
    else:
        x = (record["x"],)
    weights = model.boundary_weights(s)
    if model.config.model == "dsv41":
        rest = (record["residual"], record["post"], record["comb"], record["pre"], weights["norm_weight"])
    else:
        names = ("fn", "scale", "base", "norm_weight")
        rest = (record["residual"], record["post"], record["comb"], *(weights[name] for name in names))
    return (*x, *rest)


def _call(model: Stack, boundary, moe: bool) -> Callable:
    """The boundary call the stack makes, as a function of that boundary's inputs (``_arguments``)."""
    split = 4 if moe else 1

    def sublayer_output(parts: tuple):
        return MoEOutput(*parts) if moe else parts[0]

    if model.config.model == "dsv41":
        eps = model.config.norm_eps

        def dsv41(*arguments):
            residual, post, comb, pre, norm_weight = arguments[split:]
            return boundary.dsv41(sublayer_output(arguments[:split]), residual, post, comb, pre, norm_weight, eps)

        return dsv41

    def glm5(*arguments):
        x = sublayer_output(arguments[:split])
        streams, layer_input, pending = boundary.glm5(x, *arguments[split:])
        return streams, layer_input, *boundary.glm5_join(pending)

    return glm5


def measure(
    model: Stack, boundaries: dict[str, object], trace: list[dict], routing: Routing, time_us: Callable, compile_fn
) -> dict[str, float]:
    """``{"attention unfused": us, "attention fused": us, "moe unfused": us, "moe fused": us}``."""
    timings = {}
    for s, kind in enumerate(KINDS):
        arguments = _arguments(model, trace, routing, s)
        for path, boundary in boundaries.items():
            call = compile_fn(_call(model, boundary, moe=kind == "moe"))
            timings[f"{kind} {path}"] = time_us(lambda call=call, arguments=arguments: call(*arguments))
    torch.cuda.synchronize()
    return timings
