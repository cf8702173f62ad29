"""Ranks as real processes for the tests: ``run_ranks_as_processes(target, world, ...)`` spawns
``world`` processes joined in a gloo process group (a file store under a temporary folder), runs
``target(rank, world, *args)`` in each and returns every rank's outcome; a rank still running
after the deadline is killed and fails the test (it was waiting for a peer that never came)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Long enough for a process to import torch and the packages on a loaded 2-core machine.
DEADLINE_S = 180.0
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Outcome:
    """What a rank's ``target`` did: ``"ok"`` with its return value, or the exception's class name."""

    kind: str
    message: str = ""
    value: Any = None

    @property
    def first_line(self) -> str:
        return self.message.splitlines()[0] if self.message else ""


def _rank_main(
    target: Callable[..., Any], rank: int, world: int, store: str, args: tuple[Any, ...], results: Any
) -> None:
    os.environ.update(NO_MULTICAST)
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=DEADLINE_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        value = target(rank, world, *args)
        results.put((rank, Outcome("ok", value=value)))
    except BaseException as error:  # report any outcome: the test decides
        results.put((rank, Outcome(type(error).__name__, f"{error}\n{traceback.format_exc()}")))
    finally:
        dist.destroy_process_group()


def run_ranks_as_processes(
    target: Callable[..., Any], world: int, *args: Any, deadline_s: float = DEADLINE_S
) -> dict[int, Outcome]:
    """``target(rank, world, *args)`` on ``world`` gloo ranks (a module-level function: spawned)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="mhc-ranks-") as folder:
        store = os.path.join(folder, "store")
        processes = [
            context.Process(target=_rank_main, args=(target, rank, world, store, args, results))
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        outcomes: dict[int, Outcome] = {}
        try:
            for _ in range(world):
                rank, outcome = results.get(timeout=deadline_s)
                outcomes[rank] = outcome
        except Exception:  # the queue's Empty: some rank is still waiting
            pass
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    hung = [rank for rank in range(world) if rank not in outcomes]
    assert not hung, f"ranks {hung} did not finish within {deadline_s} s (waiting for a peer); the others: {outcomes}"
    return outcomes
