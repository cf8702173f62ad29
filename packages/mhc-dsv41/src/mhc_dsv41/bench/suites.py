"""DSV4.1's suites (``--suite dsv41 dsv41-geometry``): the fused op beside the baselines, and the
collective's launch geometry, one record per (variant, M)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mhc_core.bench.baselines import boundary_baselines
from mhc_core.bench.floors import mailbox_floor
from mhc_core.bench.records import Context, Record, bf16
from mhc_core.host.op import MAX_NUM_TOKENS

from . import baseline
from .case import CASE, call_bytes


def _time(ctx: Context, op: Any, m: int, hidden: int) -> tuple[float, float, torch.Tensor, tuple]:
    """The op on fresh inputs with its outputs given (``out=``): (us, floor us, x, the other inputs)."""
    x, args = bf16(m, hidden), CASE.inputs(m, hidden)
    us = ctx.time(CASE.step(op, x, args))
    return us, call_bytes(m, hidden) / ctx.bandwidth, x, args


def dsv41_suite(ctx: Context, ms: list[int], hidden: int = 5120) -> list[Record]:
    op = CASE.build(f"h200-tp{ctx.tp}-h{hidden}", max(ms), "cuda", group=ctx.group)
    records = []
    for m in ms:
        fused, floor, x, args = _time(ctx, op, m, hidden)
        second = mailbox_floor(ctx, call_bytes(m, hidden), m, hidden)
        records.append(Record("dsv41", ctx.tp, m, "fused AllReduceMHC", fused, floor, second))
        records += boundary_baselines(ctx, "dsv41", m, hidden, x, args, floor, baseline.boundary, baseline.compiled)
    return records


#: The DSV collective's variants ``dsv41-geometry`` times, as (cluster_size, threads, persistent from
#: M, clusters, staged tokens): the H200 preset's geometry (5 CTAs of 128 threads, one trip over
#: hidden 5120's 640 fragments) with the one-token collective at every M, and with the persistent one
#: at every M (the clusters the op picks, None: ``mhc_dsv41.config.resident_clusters``, or fewer; one
#: token staged ahead, or two); the op itself switches at ``PERSISTENT_MIN_TOKENS``. One-token only:
#: the persistent collective from the largest M an op allows (``1 << 30`` was one past it, refused).
ONE_TOKEN_ONLY = MAX_NUM_TOKENS
GEOMETRIES = (
    (5, 128, ONE_TOKEN_ONLY, None, 2), (5, 128, 1, None, 2), (5, 128, 1, 88, 3), (5, 128, 1, 66, 2),
)  # fmt: skip


def dsv41_geometry(ctx: Context, ms: list[int], hidden: int = 5120) -> list[Record]:
    """Issue #20: what holds the DSV collective above its floor at large M, tried as launch geometry
    (CTAs per token, threads per CTA, trips per thread) and persistent clusters, every other
    constant the preset's."""
    from mhc_dsv41 import AllReduceMHC, presets

    preset = presets.get(f"h200-tp{ctx.tp}-h{hidden}").PRESET
    records = []
    for cluster_size, threads, persistent_from, clusters, staged in GEOMETRIES:
        config = dataclasses.replace(preset, cluster_size=cluster_size, threads=threads)
        options = dict(persistent_min_tokens=persistent_from, clusters=clusters, staged_tokens=staged)
        op = AllReduceMHC.from_config(config, max_num_tokens=max(ms), device="cuda", group=ctx.group, **options)
        variant = f"{cluster_size} x {threads}, {config.trips} trip(s), one token per cluster"
        if persistent_from != ONE_TOKEN_ONLY:
            variant = f"{cluster_size} x {threads}, persistent: {op.clusters} clusters, {staged} staged"
        for m in ms:
            us, floor, _, _ = _time(ctx, op, m, hidden)
            records.append(Record("dsv41-geometry", ctx.tp, m, variant, us, floor))
        op.close()
    return records
