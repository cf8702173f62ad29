"""The measured configurations: the fused ops beside the baselines, one record per (variant, M).

Byte floors count what the boundary must move once through HBM (inputs read and
outputs written, weights once per call; the mailbox traffic not counted) divided by
the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import baselines
from .harness import graph_time_us

HC = 4
MIX = 24


@dataclass
class Record:
    suite: str
    tp: int
    m: int
    variant: str
    us: float
    floor_us: float
    #: At tp > 1, the floor with the mailbox bytes the protocol moves through this GPU's memory
    #: (``mailbox_bytes``) added; None at tp = 1 (the direct read moves none).
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


# --------------------------------------------------------------------- reductions
def all_reduce_baselines(ctx: Context, hidden: int, m: int):
    """NCCL all_reduce and torch symm_mem one_shot_all_reduce of [m, hidden] BF16 (needs a group)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    x = bf16(m, hidden)
    buffer = symm_mem.empty((m, hidden), dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buffer, ctx.group.group_name)
    buffer.copy_(x)

    def nccl():
        dist.all_reduce(x, group=ctx.group)
        return x

    def one_shot():
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", ctx.group.group_name)

    return nccl, one_shot


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


# ------------------------------------------------------------------------ DSV4.1
def dsv41_inputs(m: int, hidden: int = 5120) -> tuple:
    """``(residual, post, comb, pre, norm_weight, norm_eps)``: mixes in the ranges mHC produces."""
    residual = bf16(m, HC, hidden)
    post, pre = torch.rand(m, HC, device="cuda") * 2, torch.rand(m, HC, device="cuda")
    comb = torch.softmax(torch.randn(m, HC, HC, device="cuda"), -1)
    return residual, post, comb, pre, bf16(hidden), 1e-6


def mailbox_bytes(m: int, hidden: int, tp: int) -> int:
    """What the Lamport protocol adds to one GPU's memory traffic per call at tp > 1: every rank's
    BF16 slot of each token written into this GPU's mailbox, read by its collective and re-armed
    with -0 (3 x tp x M x hidden x 2 bytes; the token-count headers, 16 bytes per rank, left out).
    The (tp - 1) x M x hidden x 2 bytes each rank sends over NVLink are another link's, not counted."""
    return 3 * tp * m * hidden * 2 if tp > 1 else 0


def mailbox_floor(ctx: Context, floor_bytes: int, m: int, hidden: int) -> float | None:
    """The second floor at tp > 1 (``Record.mailbox_floor_us``)."""
    return (floor_bytes + mailbox_bytes(m, hidden, ctx.tp)) / ctx.bandwidth if ctx.tp > 1 else None


def dsv41_bytes(m: int, hidden: int) -> int:
    """x, the hc streams in and out, the layer input, post / comb / pre, the norm weight once."""
    return 2 * m * hidden * (1 + 2 * HC + 1) + 2 * hidden + 4 * m * (2 * HC + HC * HC)


def _time_dsv41(ctx: Context, op: Any, m: int, hidden: int) -> tuple[float, float, torch.Tensor, tuple]:
    """A DSV op on fresh inputs with its outputs given (``out=``): (us, floor us, x, the other inputs)."""
    x, args = bf16(m, hidden), dsv41_inputs(m, hidden)
    out = (torch.empty_like(args[0]), torch.empty_like(x))
    us = ctx.time(lambda: op(x, *args, out=out))
    return us, dsv41_bytes(m, hidden) / ctx.bandwidth, x, args


def dsv41_suite(ctx: Context, ms: list[int], hidden: int = 5120) -> list[Record]:
    from mhc_dsv41 import AllReduceMHC

    preset = f"h200-tp{ctx.tp}-h{hidden}"
    op = AllReduceMHC.from_preset(preset, max_num_tokens=max(ms), device="cuda", group=ctx.group)
    records = []
    for m in ms:
        fused, floor, x, args = _time_dsv41(ctx, op, m, hidden)
        second = mailbox_floor(ctx, dsv41_bytes(m, hidden), m, hidden)
        records.append(Record("dsv41", ctx.tp, m, "fused AllReduceMHC", fused, floor, second))
        records += _boundary_baselines(ctx, "dsv41", m, hidden, x, args, floor)
    return records


#: The DSV collective's variants ``dsv41-geometry`` times, as (cluster_size, threads, persistent from
#: M, clusters, staged tokens): the H200 preset's geometry (5 CTAs of 128 threads, one trip over
#: hidden 5120's 640 fragments) with the one-token collective at every M, and with the persistent one
#: at every M (the clusters the op picks, None: ``mhc_dsv41.config.resident_clusters``, or fewer; one
#: token staged ahead, or two); the op itself switches at ``PERSISTENT_MIN_TOKENS``.
ONE_TOKEN_ONLY = 1 << 30
DSV_GEOMETRIES = (
    (5, 128, ONE_TOKEN_ONLY, None, 2), (5, 128, 1, None, 2), (5, 128, 1, 88, 3), (5, 128, 1, 66, 2),
)  # fmt: skip


def dsv41_geometry(ctx: Context, ms: list[int], hidden: int = 5120) -> list[Record]:
    """Issue #20: what holds the DSV collective above its floor at large M, tried as launch geometry
    (CTAs per token, threads per CTA, trips per thread) and persistent clusters, every other
    constant the preset's."""
    from mhc_dsv41 import AllReduceMHC, presets

    preset = presets.get(f"h200-tp{ctx.tp}-h{hidden}").PRESET
    records = []
    for cluster_size, threads, persistent_from, clusters, staged in DSV_GEOMETRIES:
        config = dataclasses.replace(preset, cluster_size=cluster_size, threads=threads)
        options = dict(persistent_min_tokens=persistent_from, clusters=clusters, staged_tokens=staged)
        op = AllReduceMHC.from_config(config, max_num_tokens=max(ms), device="cuda", group=ctx.group, **options)
        variant = f"{cluster_size} x {threads}, {config.trips} trip(s), one token per cluster"
        if persistent_from != ONE_TOKEN_ONLY:
            variant = f"{cluster_size} x {threads}, persistent: {op.clusters} clusters, {staged} staged"
        for m in ms:
            us, floor, _, _ = _time_dsv41(ctx, op, m, hidden)
            records.append(Record("dsv41-geometry", ctx.tp, m, variant, us, floor))
        op.close()
    return records


# ----------------------------------------------------------------------- GLM-5.3
def glm5_inputs(m: int, hidden: int):
    residual = bf16(m, HC, hidden)
    post = torch.rand(m, HC, 1, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, HC, HC, device="cuda"), -1)
    fn = (torch.randn(MIX, HC * hidden, device="cuda") * 0.02).to(torch.bfloat16)
    scale = torch.rand(3, device="cuda") + 0.5
    base = torch.randn(MIX, device="cuda")
    return residual, post, comb, fn, scale, base, bf16(hidden)


def glm5_bytes(m: int, hidden: int) -> int:
    per_token = 2 * hidden * (1 + 2 * HC + 1) + 4 * (HC + HC * HC) * 2  # x, streams in/out, input; mixes in/out
    return m * per_token + 2 * MIX * HC * hidden + 2 * hidden + 4 * (3 + MIX)  # fn and weights once


def glm5_suite(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    from mhc_glm5 import AllReduceMhcBoundary

    preset = f"h200-tp{ctx.tp}-h{hidden}"
    op = AllReduceMhcBoundary.from_preset(preset, max_num_tokens=max(ms), device="cuda", group=ctx.group)
    records = []
    for m in ms:
        fused, floor, x, args = _time_glm5(ctx, op, m, hidden)
        label = f"fused AllReduceMhcBoundary ({_glm5_kernel(op, m)})"
        second = mailbox_floor(ctx, glm5_bytes(m, hidden), m, hidden)
        records.append(Record("glm5", ctx.tp, m, label, fused, floor, second))
        records += _boundary_baselines(ctx, "glm5", m, hidden, x, args, floor)
    return records


def _time_glm5(ctx: Context, op: Any, m: int, hidden: int) -> tuple[float, float, torch.Tensor, tuple]:
    """A GLM op on fresh inputs, its side-stream mixes joined inside the timed call: (us, floor us,
    x, the other inputs)."""
    x, args = bf16(m, hidden), glm5_inputs(m, hidden)

    def fused() -> Any:
        outputs = op(x, *args)
        op.join()  # the fused time includes the side-stream mixes
        return outputs

    return ctx.time(fused), glm5_bytes(m, hidden) / ctx.bandwidth, x, args


def _glm5_kernel(op: Any, m: int) -> str:
    """The boundary kernel a GLM op runs for M tokens, as the tables name it."""
    return "persistent" if op.persistent(m) else f"x{op.tokens_per_cluster(m)}"


#: The persistent boundary among ``glm5-thresholds``' sizes.
PERSISTENT = "persistent"


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
            op = _glm5_op(ctx, preset, max(ms), cluster_tokens=(), persistent_min_tokens=1)
            label = f"persistent ({op.clusters} clusters)"
        else:
            thresholds = ((1, tokens),) if tokens > 1 else ()
            op = _glm5_op(ctx, preset, max(ms), cluster_tokens=thresholds, persistent_min_tokens=0)
            label = f"x{tokens}"
        records += _time_glm5_variant(ctx, "glm5-thresholds", op, label, ms, hidden)
        op.close()
    return records


#: ``glm5-persistent``'s cluster counts (None: ``mhc_glm5.config.persistent_clusters``, all the device holds).
PERSISTENT_CLUSTERS = (None, 16, 14, 12, 8)


def glm5_persistent(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    """Issue #20: the persistent GLM boundary at every M against the 16-token kernel, by cluster
    count (fewer clusters leave SMs to the side-stream mixes kernel and loop more)."""
    from mhc_glm5 import presets

    preset = presets.get(f"h200-tp{ctx.tp}-h{hidden}").PRESET
    op = _glm5_op(ctx, preset, max(ms), cluster_tokens=((1, 16),), persistent_min_tokens=0)
    records = _time_glm5_variant(ctx, "glm5-persistent", op, "x16", ms, hidden)
    op.close()
    for clusters in PERSISTENT_CLUSTERS:
        op = _glm5_op(ctx, preset, max(ms), cluster_tokens=(), persistent_min_tokens=1, clusters=clusters)
        records += _time_glm5_variant(ctx, "glm5-persistent", op, f"persistent, {op.clusters} clusters", ms, hidden)
        op.close()
    return records


def _glm5_op(ctx: Context, preset, capacity: int, *, cluster_tokens, **options):
    from mhc_glm5 import AllReduceMhcBoundary

    config = dataclasses.replace(preset, cluster_tokens=cluster_tokens, persistent_min_tokens=0)
    return AllReduceMhcBoundary.from_config(config, max_num_tokens=capacity, device="cuda", group=ctx.group, **options)


def _time_glm5_variant(ctx: Context, suite: str, op, label: str, ms: list[int], hidden: int) -> list[Record]:
    """The fused call (mixes joined) of one op at every M."""
    records = []
    for m in ms:
        us, floor, _, _ = _time_glm5(ctx, op, m, hidden)
        records.append(Record(suite, ctx.tp, m, label, us, floor))
    return records


def glm5_breakdown(ctx: Context, ms: list[int], hidden: int = 4096) -> list[Record]:
    """Where a fused GLM call spends its time: publish + boundary alone (no side-stream mixes)
    beside the whole call joined; the difference is what the mixes add to the critical path."""
    from mhc_glm5 import AllReduceMhcBoundary

    preset = f"h200-tp{ctx.tp}-h{hidden}"
    op = AllReduceMhcBoundary.from_preset(preset, max_num_tokens=max(ms), device="cuda", group=ctx.group)
    records = []
    for m in ms:
        x, args = bf16(m, hidden), glm5_inputs(m, hidden)
        kernel = _glm5_kernel(op, m)

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

        floor = glm5_bytes(m, hidden) / ctx.bandwidth
        records.append(Record("glm5-breakdown", ctx.tp, m, f"call + join ({kernel})", ctx.time(call), floor))
        records.append(Record("glm5-breakdown", ctx.tp, m, "publish + boundary", ctx.time(publish_boundary), floor))
    return records


def boundary_alone(op, m: int):
    """The op's boundary kernel for M tokens launched by itself (with the op's buffers), no mixes."""
    from mhc_core.host.launch import BoundKernel

    kernel = op.boundary_kernel(m)
    fixed = dict(
        mailbox=op.mailbox.buffer, stage_state=op.mailbox.stage_state, capacity=op.capacity,
        spin_limit_ns=op.spin.limit_ns, error_flag=op.spin.address, arrivals=op._arrivals, clusters=op.clusters,
    )  # fmt: skip
    return BoundKernel(kernel.function, kernel.signature, fixed, op.device)


# ------------------------------------------------------------------ spin bound
def spin_bound(ctx: Context, ms: list[int]) -> list[Record]:
    """What the spin bound costs: both fused ops with the bound off and at its default, at tp 1
    and at loopback tp 2 (both ranks' kernels on this GPU, one stream, ``run_ranks``; with the
    bound on, tp 2 also checks every rank's M). One process, one GPU: not under torchrun."""
    from mhc_core import LoopbackGroup, run_ranks
    from mhc_core.host.spin import DEFAULT_SPIN_TIMEOUT_MS
    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    if ctx.group is not None:
        raise ValueError("--suite spin-bound runs loopback ranks in one process: run it without torchrun")
    records = []
    capacity = max(ms)
    for tp in (1, 2):
        for bound, label in ((0, "bound off"), (DEFAULT_SPIN_TIMEOUT_MS, "bound on (default)")):
            options = dict(max_num_tokens=capacity, device="cuda", spin_timeout_ms=bound)
            group = LoopbackGroup(tp, "cuda") if tp > 1 else None
            ranks = list(group) if group is not None else [None]
            dsv = [AllReduceMHC.from_preset(f"h200-tp{tp}-h5120", group=rank, **options) for rank in ranks]
            glm = [AllReduceMhcBoundary.from_preset(f"h200-tp{tp}-h4096", group=rank, **options) for rank in ranks]
            for m in ms:
                dsv_args = [(bf16(m, 5120), *dsv41_inputs(m, 5120)) for _ in ranks]
                glm_args = [(bf16(m, 4096), *glm5_inputs(m, 4096)) for _ in ranks]

                def dsv_step(dsv=dsv, dsv_args=dsv_args):
                    return run_ranks(dsv, "call", dsv_args)

                def glm_step(glm=glm, glm_args=glm_args):
                    results = run_ranks(glm, "call", glm_args)
                    for op in glm:
                        op.join()
                    return results

                dsv_floor = tp * (2 * m * 5120 * (1 + 2 * HC + 1)) / ctx.bandwidth
                glm_floor = tp * glm5_bytes(m, 4096) / ctx.bandwidth
                records.append(Record("spin-bound", tp, m, f"dsv41 {label}", ctx.time(dsv_step), dsv_floor))
                records.append(Record("spin-bound", tp, m, f"glm5 {label}", ctx.time(glm_step), glm_floor))
    return records


# -------------------------------------------------------------------- baselines
def _boundary_baselines(ctx: Context, model: str, m: int, hidden: int, x, args, floor: float) -> list[Record]:
    """The unfused boundary (eager and compiled) after the reduction an engine would use."""
    if model == "dsv41":
        eager = baselines.dsv41_boundary
    else:
        constants = dict(rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20, norm_eps=1e-5)

        def eager(*a):
            return baselines.glm5_boundary(*a, **constants)

    compiled = None
    if ctx.compile_baselines:
        started = time.perf_counter()
        compiled_function = baselines.compiled(model)
        if model == "dsv41":
            compiled = compiled_function
        else:

            def compiled(*a):
                return compiled_function(*a, **constants)

        compiled(x, *args)  # compile (and autotune) outside the timed graph
        torch.cuda.synchronize()
        print(f"  [{model} M={m}] torch.compile took {time.perf_counter() - started:.0f} s", flush=True)
    records = []
    reductions: dict[str, Callable[[], object] | None] = {"": None}
    if ctx.group is not None:
        nccl, one_shot = all_reduce_baselines(ctx, hidden, m)
        reductions = {"nccl all_reduce + ": nccl, "symm_mem one_shot + ": one_shot}
    for prefix, reduce in reductions.items():
        for name, function in (("eager", eager), ("torch.compile", compiled)):
            if function is None:
                continue

            def step(function=function, reduce=reduce):
                reduced = reduce() if reduce is not None else x
                return function(reduced, *args)

            records.append(Record(model, ctx.tp, m, f"{prefix}{name}", ctx.time(step), floor))
    return records


# ------------------------------------------------------------------ host overhead
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
