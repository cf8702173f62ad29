"""The suites of no one model: the core all-reduce beside NCCL and symm_mem (``core``), and the
suites that run every registered model's benchmark case (``mhc_core.bench.case``): ``spin-bound``
and ``host``. One record per (variant, M); the byte floors are ``mhc_core.bench.floors``'."""

from __future__ import annotations

import torch

from mhc_core.bench.baselines import all_reduce_baselines
from mhc_core.bench.case import cases
from mhc_core.bench.records import Context, Record, bf16


def core_suite(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    from mhc_core import LamportAllReduce

    op = LamportAllReduce(hidden_size=hidden, max_num_tokens=max(ms), device="cuda", group=ctx.group)
    records = []
    for m in ms:
        floor = 2 * 2 * m * hidden / ctx.bandwidth  # read x, write the sum
        x, out = bf16(m, hidden), torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda")
        records.append(
            Record("core", ctx.tp, m, "lamport_all_reduce", ctx.time(lambda x=x, out=out: op(x, out=out)), floor)
        )
        if ctx.group is not None:
            nccl, one_shot = all_reduce_baselines(ctx, hidden, m)
            records.append(Record("core", ctx.tp, m, "nccl all_reduce", ctx.time(nccl), floor))
            records.append(Record("core", ctx.tp, m, "symm_mem one_shot", ctx.time(one_shot), floor))
    return records


def spin_bound(ctx: Context, ms: list[int]) -> list[Record]:
    """What the spin bound costs: every model's fused op with the bound off and at its default, at
    tp 1 and at loopback tp 2 (both ranks' kernels on this GPU, one stream, ``run_ranks``; with the
    bound on, tp 2 also checks every rank's M). One process, one GPU: not under torchrun. Variants
    ``<model key> bound off`` and ``<model key> bound on (default)``; the floor is tp times the
    model's byte floor (every rank's call on this GPU)."""
    from mhc_core import LoopbackGroup, run_ranks
    from mhc_core.host.calls.spin import DEFAULT_SPIN_TIMEOUT_MS

    if ctx.group is not None:
        raise ValueError("--suite spin-bound runs loopback ranks in one process: run it without torchrun")
    records = []
    capacity = max(ms)
    for tp in (1, 2):
        for bound, label in ((0, "bound off"), (DEFAULT_SPIN_TIMEOUT_MS, "bound on (default)")):
            group = LoopbackGroup(tp, "cuda") if tp > 1 else None
            ranks = list(group) if group is not None else [None]
            options = dict(spin_timeout_ms=bound)
            built = [
                (case, [case.build(case.preset(tp), capacity, "cuda", rank, **options) for rank in ranks])
                for case in cases()
            ]
            for m in ms:
                for case, ops in built:
                    args = [(bf16(m, case.hidden), *case.inputs(m, case.hidden)) for _ in ranks]

                    def step(case=case, ops=ops, args=args):
                        results = run_ranks(ops, "call", args)
                        for op in ops:
                            case.join(op)
                        return results

                    floor = tp * case.bytes(m, case.hidden) / ctx.bandwidth
                    records.append(Record("spin-bound", tp, m, f"{case.key} {label}", ctx.time(step), floor))
    return records


def host_overhead(ctx: Context, ms: list[int]) -> list[Record]:
    """Eager host and wall microseconds per call (``benchmarks.host``): three records per call,
    variants ``"<call> | host"`` (median of the rounds), ``"<call> | best"`` and ``"<call> | wall"``;
    ``floor_us`` is the launch floor (a native program launching the one-warp kernel, same run) times
    the call's launches."""
    from . import host

    if ctx.group is not None:
        raise ValueError("--suite host runs tp 1 and loopback tp 2 in one process: run it without torchrun")
    records = []
    for m in ms:
        measured = host.rows(m)
        floor = next(h for label, _, h, _, _, _ in measured if label == "launch floor: native program")
        for label, tp, host_us, best_us, wall_us, launches in measured:
            records.append(Record("host", tp, m, f"{label} | host", host_us, floor * launches))
            records.append(Record("host", tp, m, f"{label} | best", best_us, floor * launches))
            records.append(Record("host", tp, m, f"{label} | wall", wall_us, floor * launches))
    return records
