"""Loopback ranks that really overlap: every rank on its own stream, a random 0-20 us sleep before
each rank's call, the ranks issued in a random order, a random M per call (the same on every
rank), GLM joined under each rank's stream; 150 calls each for GLM tp 2, DSV tp 2 and DSV tp 4.
Every call is checked after the last: ranks bitwise identical and within the reference's
tolerances."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tests.lifecycle.common import DSV, GLM, Case, dsv_ops, glm_ops, sleep_cycles

pytestmark = pytest.mark.gpu

CALLS = 150
MAX_SLEEP_US = 20.0
MIX = 24
# A spinning collective must leave SMs to the other ranks' publishes: on one H200 (132 SMs) the GLM
# one-token kernel takes 8 SMs per token and shares none, so M stays small.
CASES = (
    ("glm5", "h200-tp2-h4096", 8),
    ("dsv41", "h200-tp2-h5120", 16),
    ("dsv41", "h200-tp4-h5120", 4),
)


@dataclass
class Call:
    case: Case
    outs: list
    raw_mixes: list | None  # GLM: each rank's raw mixes of this call, copied after its join
    sleeps: list[int]
    order: list[int]


@pytest.mark.parametrize(("family", "name", "max_m"), CASES)
def test_overlapping_loopback_ranks(family: str, name: str, max_m: int) -> None:
    model, ops = (GLM, glm_ops(name, max_m)) if family == "glm5" else (DSV, dsv_ops(name, max_m))
    rng = random.Random(name)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)))
    cycles_per_us = sleep_cycles(1.0) / 1000
    # Everything is made before the first stressed call: a kernel launched for the first time waits
    # for the running ones (a spinning collective among them), so no new kind of kernel may launch.
    calls = []
    for _ in range(CALLS):
        m = rng.randint(1, max_m)
        calls.append(
            Call(
                case=model.case(ops, m, generator),
                outs=model.outputs(ops, m),
                raw_mixes=[torch.empty(m, MIX, device="cuda") for _ in ops] if model.glm else None,
                sleeps=[int(rng.uniform(0, MAX_SLEEP_US) * cycles_per_us) + 1 for _ in ops],
                order=rng.sample(range(len(ops)), len(ops)),
            )
        )
    streams = [torch.cuda.Stream() for _ in ops]
    torch.cuda.synchronize()
    for call in calls:
        for rank in call.order:
            op = ops[rank]
            with torch.cuda.stream(streams[rank]):
                torch.cuda._sleep(call.sleeps[rank])
                model.call_rank(op, call.case, rank, call.outs[rank])  # GLM: joined under this stream
                if call.raw_mixes is not None:
                    call.raw_mixes[rank].copy_(op.raw_mixes[: call.case.m])  # a copy, no kernel
    torch.cuda.synchronize()
    for op in ops:
        op.check()
    for index, call in enumerate(calls):
        try:
            model.check(ops, call.outs, call.case, call.raw_mixes)
        except AssertionError as error:
            raise AssertionError(f"call {index} (M = {call.case.m}): {error}") from None
