"""The decode check: route once per step, feed every path, compare (``demo.tolerance`` derives the bounds).

Per step of the decode:

1. ``route(tokens)`` once; the same ``Routing`` object goes to every path below.
2. The unfused and the fused path (compiled and CUDA-graphed in ``demo.run``; any callables here),
   then two eager runs of the same stack for the tolerance: the unfused boundary, and
   ``tolerance.DRAWS`` emulated conforming kernels (``demo.boundaries.EmulatedBoundary``).
3. ``conformance``: every fused boundary's recorded outputs against the FP64 reference at its own
   recorded inputs, within the strict per-element bounds (section 1 of ``demo.tolerance``).
4. The logits: ``|fused - unfused| <= logit_tolerance`` for every token (section 2).
5. The next tokens are sampled from the unfused path's logits (seeded; the same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from mhc_core import MoEOutput

from . import reference, tolerance
from .model import Routing, Stack


@dataclass(frozen=True)
class StepResult:
    """One decode step's check: ``logit_ratio`` and ``conformance`` pass at <= 1."""

    step: int
    logit_ratio: float  # max over tokens of max |fused - unfused| / tolerance
    max_logit_difference: float
    conformance: float  # max over boundaries and outputs of |kernel - reference| / bound
    worst: str  # the boundary output with that ratio
    compile_deviation: float  # max |unfused compiled - unfused eager|
    emulated_spread: float  # max |emulated - unfused eager| over the draws

    @property
    def passed(self) -> bool:
        return self.logit_ratio <= 1.0 and self.conformance <= 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def moe_input(record: dict, routing: Routing, s: int) -> MoEOutput | Tensor:
    """Boundary ``s``'s sublayer output from its trace record (a MoE's weights and index are the routing's)."""
    if "x" in record:
        return record["x"]
    route = routing[s // 2]
    return MoEOutput(record["gemm2"], route.weights, route.index, record["shared"])


def conformance(model: Stack, trace: Sequence[dict], routing: Routing, group=None) -> list[dict[str, float]]:
    """Per boundary, each output's ``max |recorded - reference| / bound`` at its recorded inputs."""
    config = model.config
    results = []
    for s, record in enumerate(trace):
        weights = model.boundary_weights(s)
        residual, post, comb = record["residual"], record["post"], record["comb"]
        red = reference.reduced(moe_input(record, routing, s), group)
        expected = reference.post_mix(red.value, residual, post, comb)
        bound = tolerance.post_mix_bound(red.value, residual, post, comb, expected, red.error)
        ratios = {"residual_out": tolerance.ratio(record["residual_out"], expected, bound)}
        streams = record["residual_out"]  # the rest from the kernel's own streams
        if config.model == "dsv41":
            collapse, layer_input = reference.dsv41_collapse(
                streams, record["pre"], weights["norm_weight"], config.norm_eps
            )
            bound = tolerance.dsv41_input_bound(
                streams, record["pre"], weights["norm_weight"], config.norm_eps, collapse, layer_input
            )
            ratios["layer_input"] = tolerance.ratio(record["layer_input"], layer_input, bound)
        else:
            mixes = config.mixes
            ref = reference.glm5_mixes(
                streams,
                weights["fn"],
                weights["scale"],
                weights["base"],
                weights["norm_weight"],
                mixes,
                config.norm_eps,
            )
            bounds = tolerance.glm5_bounds(
                streams, weights["scale"], weights["norm_weight"], config.norm_eps, mixes.post_mult,
                mixes.sinkhorn_repeat, ref,
            )  # fmt: skip
            for name in ("layer_input", "post_out", "comb_out"):
                ratios[name] = tolerance.ratio(record[name], ref[name], bounds[name])
        results.append(ratios)
    return results


def sample(logits: Tensor, generator: torch.Generator, group=None) -> Tensor:
    """The next ``[M]`` tokens, drawn from ``softmax(logits)``; at tp > 1 rank 0's draw on every rank."""
    tokens = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator).squeeze(-1)
    if group is not None:
        import torch.distributed as dist

        dist.broadcast(tokens, dist.get_global_rank(group, 0), group=group)
    return tokens


@dataclass
class Paths:
    """What one decode step runs. ``route(tokens) -> Routing``; ``unfused(tokens, routing) -> logits``;
    ``fused(tokens, routing) -> (logits, trace)``; ``eager(tokens, routing, boundary) -> logits`` (the stack
    itself, for the tolerance); ``emulated``: the emulated boundaries, one per draw."""

    route: Callable[[Tensor], Routing]
    unfused: Callable[[Tensor, Routing], Tensor]
    fused: Callable[[Tensor, Routing], tuple[Tensor, list]]
    eager: Callable[..., Tensor]
    unfused_boundary: object
    emulated: Sequence[object]


def check_step(step: int, model: Stack, paths: Paths, tokens: Tensor, group=None) -> tuple[StepResult, Tensor]:
    """One decode step, checked; returns the result and the unfused logits (to sample from)."""
    routing = paths.route(tokens)  # once: every path below gets this very object
    unfused = paths.unfused(tokens, routing)
    fused, trace = paths.fused(tokens, routing)
    eager = paths.eager(tokens, routing, paths.unfused_boundary)
    emulated = [paths.eager(tokens, routing, boundary) for boundary in paths.emulated]
    ratios = conformance(model, trace, routing, group)
    worst_ratio, worst = max(
        ((ratio, f"boundary {s} {name}") for s, entry in enumerate(ratios) for name, ratio in entry.items()),
        key=lambda item: item[0],
    )
    bound = tolerance.logit_tolerance(eager, unfused, emulated)
    result = StepResult(
        step=step,
        logit_ratio=float(tolerance.logit_ratio(fused, unfused, bound).max()),
        max_logit_difference=float((fused.float() - unfused.float()).abs().max()),
        conformance=worst_ratio,
        worst=worst,
        compile_deviation=float((unfused.float() - eager.float()).abs().max()),
        emulated_spread=max(float((e.float() - eager.float()).abs().max()) for e in emulated),
    )
    return result, unfused.clone()


def decode_check(
    model: Stack, paths: Paths, tokens: Tensor, *, steps: int, seed: int = 0, group=None
) -> list[StepResult]:
    """``steps`` checked decode steps from ``tokens`` (``[M]``), sampling each next step's tokens."""
    generator = torch.Generator(tokens.device)
    generator.manual_seed(seed)
    results = []
    for step in range(steps):
        result, logits = check_step(step, model, paths, tokens, group)
        results.append(result)
        tokens = sample(logits, generator, group)
    return results
