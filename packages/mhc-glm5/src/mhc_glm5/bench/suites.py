"""GLM-5.3's suites (``--suite glm5 glm5-thresholds glm5-persistent glm5-breakdown``): the fused op
beside the baselines, its boundary kernels by size and cluster count, and where a call spends its
time, one record per (variant, M)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mhc_core.bench.baselines import boundary_baselines
from mhc_core.bench.floors import mailbox_floor
from mhc_core.bench.records import Context, Record, bf16

from . import baseline
from .case import CASE, call_bytes

#: The --m values ``glm5-thresholds`` runs at, whatever the run's.
THRESHOLD_M = (8, 16, 32, 64, 128, 256, 512, 1024)


def _time(ctx: Context, op: Any, m: int, hidden: int) -> tuple[float, float, torch.Tensor, tuple]:
    """The op on fresh inputs, its side-stream mixes joined inside the timed call: (us, floor us,
    x, the other inputs)."""
    x, args = bf16(m, hidden), CASE.inputs(m, hidden)
    return ctx.time(CASE.step(op, x, args)), call_bytes(m, hidden) / ctx.bandwidth, x, args


def _kernel(op: Any, m: int) -> str:
    """The boundary kernel an op runs for M tokens, as the tables name it."""
    return "persistent" if op.persistent(m) else f"x{op.tokens_per_cluster(m)}"


def glm5_suite(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    op = CASE.build(f"h200-tp{ctx.tp}-h{hidden}", max(ms), "cuda", group=ctx.group)
    records = []
    for m in ms:
        fused, floor, x, args = _time(ctx, op, m, hidden)
        label = f"fused AllReduceMhcBoundary ({_kernel(op, m)})"
        second = mailbox_floor(ctx, call_bytes(m, hidden), m, hidden)
        records.append(Record("glm5", ctx.tp, m, label, fused, floor, second))
        records += boundary_baselines(ctx, "glm5", m, hidden, x, args, floor, baseline.boundary, baseline.compiled)
    return records


#: The persistent boundary among ``glm5-thresholds``' sizes.
PERSISTENT = "persistent"


def glm5_thresholds_suite(ctx: Context, ms: list[int]) -> list[Record]:
    """``--suite glm5-thresholds``: ``glm5_thresholds`` at ``THRESHOLD_M`` (the run's --m ignored)."""
    return glm5_thresholds(ctx, list(THRESHOLD_M))


def glm5_thresholds(
    ctx: Context, ms: list[int], hidden: int = 4096, sizes=(1, 2, 4, 8, 16, PERSISTENT)
) -> list[Record]:
    """Every tokens-per-cluster size and the persistent boundary at every M, to choose
    ``cluster_tokens`` and ``persistent_min_tokens``."""
    from mhc_glm5 import presets

    preset = presets.get(f"h200-tp{ctx.tp}-h{hidden}").PRESET
    records = []
    for tokens in sizes:
        if tokens == PERSISTENT:
            op = _op(ctx, preset, max(ms), cluster_tokens=(), persistent_min_tokens=1)
            label = f"persistent ({op.clusters} clusters)"
        else:
            thresholds = ((1, tokens),) if tokens > 1 else ()
            op = _op(ctx, preset, max(ms), cluster_tokens=thresholds, persistent_min_tokens=0)
            label = f"x{tokens}"
        records += _time_variant(ctx, "glm5-thresholds", op, label, ms, hidden)
        op.close()
    return records


#: ``glm5-persistent``'s cluster counts (None: ``mhc_glm5.config.persistent_clusters``, all the device holds).
PERSISTENT_CLUSTERS = (None, 16, 14, 12, 8)


def glm5_persistent(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    """Issue #20: the persistent GLM boundary at every M against the 16-token kernel, by cluster
    count (fewer clusters leave SMs to the side-stream mixes kernel and loop more)."""
    from mhc_glm5 import presets

    preset = presets.get(f"h200-tp{ctx.tp}-h{hidden}").PRESET
    op = _op(ctx, preset, max(ms), cluster_tokens=((1, 16),), persistent_min_tokens=0)
    records = _time_variant(ctx, "glm5-persistent", op, "x16", ms, hidden)
    op.close()
    for clusters in PERSISTENT_CLUSTERS:
        op = _op(ctx, preset, max(ms), cluster_tokens=(), persistent_min_tokens=1, clusters=clusters)
        records += _time_variant(ctx, "glm5-persistent", op, f"persistent, {op.clusters} clusters", ms, hidden)
        op.close()
    return records


def _op(ctx: Context, preset, capacity: int, *, cluster_tokens, **options):
    from mhc_glm5 import AllReduceMhcBoundary

    config = dataclasses.replace(preset, cluster_tokens=cluster_tokens, persistent_min_tokens=0)
    return AllReduceMhcBoundary.from_config(config, max_num_tokens=capacity, device="cuda", group=ctx.group, **options)


def _time_variant(ctx: Context, suite: str, op, label: str, ms: list[int], hidden: int) -> list[Record]:
    """The fused call (mixes joined) of one op at every M."""
    records = []
    for m in ms:
        us, floor, _, _ = _time(ctx, op, m, hidden)
        records.append(Record(suite, ctx.tp, m, label, us, floor))
    return records


def glm5_breakdown(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    """Where a fused GLM call spends its time: publish + boundary alone (no side-stream mixes)
    beside the whole call joined; the difference is what the mixes add to the critical path."""
    op = CASE.build(f"h200-tp{ctx.tp}-h{hidden}", max(ms), "cuda", group=ctx.group)
    records = []
    for m in ms:
        x, args = bf16(m, hidden), CASE.inputs(m, hidden)
        kernel = _kernel(op, m)

        def call(op=op, x=x, args=args):
            op(x, *args)
            op.join()

        boundary = boundary_alone(op, m)

        def publish_boundary(op=op, x=x, args=args, m=m, boundary=boundary):
            residual, post, comb, fn, scale, base, weight = args
            op.publish(x)
            op._pending_m = None  # the boundary below consumes this publish
            boundary(
                residual=residual, post=post, comb=comb, fn=fn, scale=scale, base=base, gamma=weight,
                residual_out=torch.empty_like(residual), mixes_out=op.raw_mixes,  # not the hand-off rows
                layer_input=torch.empty_like(x), x=x, prefetch=1, direct=0, m=m,
            )  # fmt: skip

        floor = call_bytes(m, hidden) / ctx.bandwidth
        records.append(Record("glm5-breakdown", ctx.tp, m, f"call + join ({kernel})", ctx.time(call), floor))
        records.append(Record("glm5-breakdown", ctx.tp, m, "publish + boundary", ctx.time(publish_boundary), floor))
    return records


def boundary_alone(op, m: int):
    """The op's boundary kernel for M tokens launched by itself (with the op's buffers), no mixes."""
    from mhc_core.host.binaries.launch import BoundKernel

    kernel = op.boundary_kernel(m)
    fixed = dict(
        mailbox=op.mailbox.buffer, stage_state=op.mailbox.stage_state, capacity=op.capacity,
        spin_limit_ns=op.spin.limit_ns, error_flag=op.spin.address, arrivals=op._arrivals, clusters=op.clusters,
    )  # fmt: skip
    return BoundKernel(kernel.function, kernel.signature, fixed, op.device)
