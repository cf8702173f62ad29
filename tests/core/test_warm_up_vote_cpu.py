"""Issue #52, row 13, on a CPU with real processes (a gloo group): rank 1 fails in its warm-up (out
of memory), after the ``mapped`` vote. Its peer's warm-up kernels wait for rank 1's publish; they
must give up within a short bound of the warm-up's own, not the op's (600 s here), and the ``ready``
vote must name rank 1 and its error on every rank.

The op's construction runs from ``_setup`` on (the startup's ``kernels`` vote, the mailbox, the
programs, the ``mapped`` vote, the warm-up, ``ready``) inside the real ``construction`` context, with
the device parts stood in for: the mailbox, the GPU's identity, and kernels whose collective "spins"
for the bound it was bound with (scaled: one second per 10 s), then reports a timeout naming rank 1.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import torch

from tests.processes import run_ranks_as_processes

#: The op's own spin bound: far beyond the warm-up's.
OP_BOUND_MS = 600_000.0


class Spin:
    def __init__(self) -> None:
        self.timeout_ms, self.limit_ns, self.timed_out = OP_BOUND_MS, int(OP_BOUND_MS * 1e6), False

    def check(self) -> None:
        from mhc_core.host.calls.spin import LamportTimeoutError

        if self.timed_out:
            raise LamportTimeoutError(
                f"warm-up timed out after {self.timeout_ms} ms: ranks [1] never published",
                stage=0, token=0, missing_ranks=(1,),
            )  # fmt: skip


def _build(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core import LamportAllReduce
    from mhc_core.host import library
    from mhc_core.host import op as op_module
    from mhc_core.host.ranks.startup import construction

    library.torch._dynamo.mark_static_address = lambda tensor: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.device = lambda device: contextlib.nullcontext()
    op_module.device_identity = lambda device: "GPU-shared"
    op_module.LamportMailbox = lambda group, **kw: SimpleNamespace(
        stage_state=torch.zeros(8, dtype=torch.int32), destinations=torch.zeros(2), memory=torch.zeros(2)
    )
    started = time.monotonic()
    with construction(dist.group.WORLD, "LamportAllReduce"):
        op = LamportAllReduce.__new__(LamportAllReduce)
        op._startup = op_module.active_startup()
        op.group = op._startup.group
        op.tp, op.rank, op.device, op.hidden_size, op.capacity = world, rank, torch.device("cuda", 0), 64, 8
        op.transport, op.arch, op._allocation_request, op._kernel_specs = "unicast", "sm_90a", "ipc", []
        op.construction_seconds, op._phase_start = {}, time.perf_counter()
        op._order = SimpleNamespace(own=lambda *tensors: None)
        op.spin = Spin()
        op._init_call_state()

        def build_programs() -> Any:
            bound_s = op.spin.limit_ns / 1e9 / 10  # scaled: a second per 10 s of the bound it is built with

            def collect(after_publish: bool) -> None:
                if rank == 0:  # rank 1 never publishes: this collective waits out its bound
                    time.sleep(min(bound_s, 60.0))
                    op.spin.timed_out = True

            return SimpleNamespace(collect=collect)

        op._build_programs = build_programs

        def warmup_rounds() -> list[Any]:
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            return [SimpleNamespace(publish=lambda: None, collect=op._programs.collect)]

        op.warmup_rounds = warmup_rounds
        op._setup()
    return {"seconds": time.monotonic() - started}


def test_a_rank_failing_in_its_warm_up_is_named_by_every_rank_within_seconds():
    started = time.monotonic()
    outcomes = run_ranks_as_processes(_build, 2, deadline_s=150.0)
    elapsed = time.monotonic() - started
    for rank, outcome in outcomes.items():
        assert outcome.kind == "StartupError", f"rank {rank}: expected StartupError, got {outcome.kind}: {outcome}"
        message = outcome.first_line
        assert "rank 1: OutOfMemoryError" in message, f"rank {rank}: {message}"
    assert "rank 0: LamportTimeoutError" in outcomes[0].first_line, outcomes[0].first_line
    assert elapsed < 50.0, f"the peer waited {elapsed:.0f} s: the warm-up used the op's bound, not a short one"
