"""What every suite returns (``Record``) and what it times with (``Context``: the run's group, tp and
copy bandwidth, and CUDA-graph timing with every rank's replays started together)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .timing import graph_time_us


@dataclass
class Record:
    suite: str
    tp: int
    m: int
    variant: str
    us: float
    floor_us: float
    #: At tp > 1, the floor with the mailbox bytes the protocol moves through this GPU's memory
    #: (``floors.mailbox_bytes``) added; None at tp = 1 (the direct read moves none).
    mailbox_floor_us: float | None = None
    #: What a suite checked about this figure (``--suite fp8``: whether the outputs equal the reference).
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    tp: int
    rank: int
    group: Any  # None at tp = 1, else the process group
    bandwidth: float  # bytes per microsecond, read + written
    compile_baselines: bool = True
    _device_barrier: Any = field(default=None, repr=False)

    def sync(self) -> None:
        torch.cuda.synchronize()
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def start_together(self) -> None:
        """Before a timed replay: the host barrier, then (tp > 1) a device-side barrier kernel on
        the current stream (torch symm_mem), so that the ranks' start events are recorded together
        rather than whenever each host left the barrier: a rank whose GPU starts first waits for
        the others inside its first call, and that wait would count as its time. On the H200 pair
        it removed the outlier replays seen without it (tp 2, M = 1: 9.3 against 7.0-7.3 us); a
        steady 0.5-0.7 us difference between the two ranks' medians remains, unexplained
        (BENCHMARKS.md, fifth run)."""
        self.sync()
        if self.group is None:
            return
        if self._device_barrier is None:
            import torch.distributed._symmetric_memory as symm_mem

            flags = symm_mem.empty(1, dtype=torch.int32, device="cuda")
            self._device_barrier = symm_mem.rendezvous(flags, self.group.group_name)
        self._device_barrier.barrier(channel=0)

    def time(self, step: Callable[[], object]) -> float:
        """``graph_time_us`` with every rank's replays started together; the slowest rank's median."""
        self.sync()
        us = graph_time_us(step, before_replay=self.start_together)
        if self.group is None:
            return us
        import torch.distributed as dist

        value = torch.tensor([us], device="cuda")
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return float(value.item())


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)
