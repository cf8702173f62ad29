"""What an engine runs instead of a fused op: the reduction (NCCL all_reduce, torch symm_mem's
one_shot_all_reduce), then the model's unfused torch boundary, eager and under ``torch.compile``.
The model package gives its boundary (``<package>.bench.baseline``); this module times the pairs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .records import Context, Record, bf16


def all_reduce_baselines(ctx: Context, hidden: int, m: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """NCCL all_reduce and torch symm_mem one_shot_all_reduce of [m, hidden] BF16 (needs a group)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    x = bf16(m, hidden)
    buffer = symm_mem.empty((m, hidden), dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buffer, ctx.group.group_name)
    buffer.copy_(x)

    def nccl() -> torch.Tensor:
        dist.all_reduce(x, group=ctx.group)
        return x

    def one_shot() -> object:
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", ctx.group.group_name)

    return nccl, one_shot


def boundary_baselines(
    ctx: Context,
    suite: str,
    m: int,
    hidden: int,
    x: torch.Tensor,
    args: tuple,
    floor: float,
    eager: Callable[..., object],
    compile_boundary: Callable[[], Callable[..., object]],
) -> list[Record]:
    """The unfused boundary (``eager(x, *args)``, and ``compile_boundary()``'s compiled one unless the
    run skips them) after each reduction an engine would use (none at tp = 1), one record each."""
    compiled = None
    if ctx.compile_baselines:
        started = time.perf_counter()
        compiled = compile_boundary()
        compiled(x, *args)  # compile (and autotune) outside the timed graph
        torch.cuda.synchronize()
        print(f"  [{suite} M={m}] torch.compile took {time.perf_counter() - started:.0f} s", flush=True)
    records = []
    reductions: dict[str, Callable[[], object] | None] = {"": None}
    if ctx.group is not None:
        nccl, one_shot = all_reduce_baselines(ctx, hidden, m)
        reductions = {"nccl all_reduce + ": nccl, "symm_mem one_shot + ": one_shot}
    for prefix, reduce in reductions.items():
        for name, function in (("eager", eager), ("torch.compile", compiled)):
            if function is None:
                continue

            def step(
                function: Callable[..., object] = function, reduce: Callable[..., object] | None = reduce
            ) -> object:
                reduced = reduce() if reduce is not None else x
                return function(reduced, *args)

            records.append(Record(suite, ctx.tp, m, f"{prefix}{name}", ctx.time(step), floor))
    return records
