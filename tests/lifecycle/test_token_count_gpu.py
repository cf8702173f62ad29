"""Unequal M across ranks with the spin bound on (loopback tp 2: LamportAllReduce, AllReduceMHC,
AllReduceMhcBoundary): rank 0 calls with M = 4, rank 1 with M = 5. The collectives notice within
a fraction of the 10 s bound; check() on each rank raises a ValueError (TokenCountError) naming
the other rank and both M values; later calls raise too."""

from __future__ import annotations

import re
import time

import pytest
import torch

from tests.lifecycle.common import CORE, DSV, GLM, core_ops, dsv_ops, glm_ops
from tests.support import run_ranks

pytestmark = pytest.mark.gpu

CAPACITY = 8
TIMEOUT_MS = 10_000.0
FAMILIES = {"core": CORE, "dsv41": DSV, "glm5": GLM}


def build(family: str) -> list:
    """Fresh ops: the mismatch leaves them unusable."""
    if family == "core":
        return core_ops(2, CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    if family == "dsv41":
        return dsv_ops("h200-tp2-h5120", CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    return glm_ops("h200-tp2-h4096", CAPACITY, spin_timeout_ms=TIMEOUT_MS)


@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_unequal_token_counts_are_reported_fast(family: str) -> None:
    model, ops = FAMILIES[family], build(family)
    generator = torch.Generator("cuda").manual_seed(45)
    cases = [model.case(ops, m, generator) for m in (4, 5)]  # cases[r] is rank r's
    outs = [model.outputs(ops, case.m)[rank] for rank, case in enumerate(cases)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    args = [model.rank_args(case, rank) for rank, case in enumerate(cases)]
    run_ranks(ops, "call", args, [dict(out=o) for o in outs])
    if model.glm:
        for op in ops:
            op.join()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.1f} s: the mismatch was found only by the spin bound"
    for rank, op in enumerate(ops):
        with pytest.raises(ValueError) as caught:
            op.check()
        message = str(caught.value)
        assert "M = 4" in message and "M = 5" in message, message
        assert re.search(rf"\branks?\W+{1 - rank}\b", message), f"rank {rank}'s error does not name rank {1 - rank}"
    for rank, op in enumerate(ops):
        with pytest.raises((ValueError, RuntimeError)):
            model.call_rank(op, cases[0], rank, None)  # refused before any launch
