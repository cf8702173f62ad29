"""Graphs that outlive their op, and ops dropped with kernels queued (issue #32): each sequence runs
in a child process, so that a crash is a failure and not the end of the suite."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch

from tests.conftest import ROOT
from tests.lifecycle.common import core_ops
from tests.support import bf16_randn

pytestmark = pytest.mark.gpu

CASES = (
    ("core", "1"),
    ("core", "2"),
    ("dsv", "h200-tp1-h5120"),
    ("glm", "h200-tp1-h4096"),
    ("glm", "h200-tp2-h4096"),
)


@pytest.mark.parametrize(("model", "target"), CASES)
def test_a_replay_after_close_writes_nan_and_nothing_else(model: str, target: str) -> None:
    child = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tests.lifecycle.replay_after_close", model, target],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}:\n{child.stdout}\n{child.stderr[-4000:]}"
    assert "replay after close: ok" in child.stdout


def test_an_op_dropped_with_a_kernel_queued_writes_no_reused_pinned_memory() -> None:
    """Rank 0 of a loopback pair launches a collective that will time out (rank 1 never publishes),
    then the ops are dropped before it does: its error report must not land in pinned memory the
    process allocates meanwhile."""
    from mhc_core.constants import ERROR_RANKS

    ops = core_ops(2, 8, spin_timeout_ms=300.0)
    x = bf16_randn(3, ops[0].hidden_size)
    torch.cuda.synchronize()
    ops[0].publish(x)
    ops[0].collect()  # spins until its bound: rank 1 never publishes
    alive = weakref.ref(ops[0])
    del ops
    gc.collect()
    assert alive() is None, "the op outlived its last reference: this test would prove nothing"
    pinned = [torch.zeros(ERROR_RANKS + 2, dtype=torch.int32, pin_memory=True) for _ in range(64)]
    torch.cuda.synchronize()  # the collective gives up and reports
    written = [index for index, words in enumerate(pinned) if words.any()]
    assert not written, f"a dropped op's timeout report landed in pinned tensors allocated later: {written}"
