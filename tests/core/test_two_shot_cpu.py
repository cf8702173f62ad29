"""The two-shot protocol without a GPU (issue #47): the routing and its cost model, the mailbox's
regions, the kernels' configs and compiled code, and which kernels a call launches with what
(recorder kernels on the CPU, running the real native programs: ``tests/core/test_launch_wiring_cpu.py``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.core.test_launch_wiring_cpu import CAPACITY, HC, HIDDEN, TOP_K, Kernels, common, dsv_args, glm_args

CROSSOVER = 4


# ------------------------------------------------------------------ the routing
def test_protocol_is_named_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.protocols import choose_protocol

    base = dict(tp=4, hidden=HIDDEN, transport="unicast", capacity=CAPACITY)
    assert choose_protocol("one-shot", **base).two_shot_from is None
    assert choose_protocol("two-shot", **base).two_shot_from == 1
    assert choose_protocol("auto", **base, two_shot_min_tokens=5).two_shot_from == 5
    assert choose_protocol("auto", **base, two_shot_min_tokens=CAPACITY + 1).two_shot_from is None
    with pytest.raises(
        ValueError, match=r"protocol: expected one of \('auto', 'one-shot', 'two-shot'\), got 'twoshot'"
    ):
        choose_protocol("twoshot", **base)
    monkeypatch.setenv("MHC_PROTOCOL", "fast")
    with pytest.raises(ValueError, match="MHC_PROTOCOL: expected one of"):
        choose_protocol(None, **base)
    monkeypatch.setenv("MHC_PROTOCOL", "two-shot")
    assert choose_protocol(None, **base).two_shot_from == 1
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"two_shot_min_tokens: expected a positive int or None, got {bad!r}"):
            choose_protocol("auto", **base, two_shot_min_tokens=bad)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        (dict(hidden=HIDDEN + 8), r"hidden = 72 is not a multiple of 8 \* tp = 32"),
        (dict(transport="multicast"), "transport 'multicast'"),
    ],
)
def test_a_two_shot_that_cannot_be_is_refused_or_routed_away(changes: dict, why: str) -> None:
    from mhc_core.protocols import choose_protocol

    base = {**dict(tp=4, hidden=HIDDEN, transport="unicast", capacity=CAPACITY), **changes}
    with pytest.raises(ValueError, match=f"protocol: 'two-shot' is unavailable for this op: {why}"):
        choose_protocol("two-shot", **base)
    assert choose_protocol("auto", **base, two_shot_min_tokens=2).two_shot_from is None
    assert choose_protocol("two-shot", **{**base, "tp": 1}).two_shot_from is None, "tp = 1 has no all-reduce"


def test_cost_model_crossover() -> None:
    """The two-shot is predicted faster exactly from the crossover on; never at tp 2, where it receives
    as many bytes as the one-shot; sooner at tp 8 than at tp 4 (a quarter of the bytes, not half)."""
    from mhc_core.protocols import NVLINK_H200

    assert NVLINK_H200.crossover(2, 5120) is None
    tp4, tp8 = NVLINK_H200.crossover(4, 5120), NVLINK_H200.crossover(8, 5120)
    assert tp4 is not None and tp8 is not None and tp8 < tp4
    for tp, start in ((4, tp4), (8, tp8)):
        assert NVLINK_H200.two_shot_us(tp, 5120, start) < NVLINK_H200.one_shot_us(tp, 5120, start)
        assert NVLINK_H200.two_shot_us(tp, 5120, start - 1) >= NVLINK_H200.one_shot_us(tp, 5120, start - 1)


def test_mailbox_regions_and_their_memory() -> None:
    """At tp 8, capacity 1024, hidden 7168 (the issue's case) the regions of an op routed at the cost
    model's crossover take at most 0.35 x the one-shot mailbox of the same capacity."""
    from mhc_core.host.ranks.mailbox import MailboxLayout, mailbox_elements
    from mhc_core.protocols import choose_protocol

    choice = choose_protocol("auto", tp=8, hidden=7168, transport="unicast", capacity=1024)
    layout = MailboxLayout(8, 7168, choice.one_shot_capacity, choice.two_shot_capacity)
    today = mailbox_elements(8, 1024, 7168)
    assert layout.elements <= 0.35 * today, (layout.elements / today, choice)
    assert layout.scatter_offset == mailbox_elements(8, choice.one_shot_capacity, 7168)
    assert layout.gather_offset - layout.scatter_offset == mailbox_elements(8, 1024, 7168 // 8)
    assert layout.elements - layout.gather_offset == mailbox_elements(1, 1024, 7168)
    assert MailboxLayout(8, 7168, 1024).elements == today, "one-shot only: the mailbox as it was"


def test_kernel_configs_check_the_slices() -> None:
    from mhc_core.device.configs import PublishConfig, ReduceConfig

    assert PublishConfig(hidden=5120, tp=8, scatter=True).slot_hidden == 640
    with pytest.raises(ValueError, match=r"scatter: expected tp >= 2 and hidden a multiple of 8 \* tp"):
        PublishConfig(hidden=5120 + 8, tp=8, scatter=True)
    with pytest.raises(ValueError, match="scatter: expected store 'unicast'"):
        PublishConfig(hidden=5120, tp=8, store="multicast", scatter=True)
    config = ReduceConfig(hidden=5120, tp=8)
    assert (config.slice_fragments, config.ctas_per_token) == (80, 1)
    with pytest.raises(ValueError, match="lanes: expected 1, 2, 4 or 8 dividing tp = 2"):
        ReduceConfig(hidden=5120, tp=2, lanes=4)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_two_shot_kernels_compile_without_local_memory(arch: str) -> None:
    """The scatter publish walks its destination table with compile-time indices (one predicated store
    per peer), the reduce its peers' gather mailboxes: neither may index registers at run time."""
    from mhc_core.device.configs import (
        FINALIZE_PUBLISH_KERNEL,
        PUBLISH_KERNEL,
        REDUCE_KERNEL,
        PublishConfig,
        ReduceConfig,
    )
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel

    for spec in (
        KernelSpec(PUBLISH_KERNEL, PublishConfig(hidden=5120, tp=8, scatter=True)),
        KernelSpec(FINALIZE_PUBLISH_KERNEL, PublishConfig(hidden=4096, tp=4, top_k=8, scatter=True)),
        KernelSpec(REDUCE_KERNEL, ReduceConfig(hidden=5120, tp=8)),
    ):
        report = compile_kernel(spec, arch, inspect=True)
        assert report.report.spill_stores == 0 and report.report.stack_bytes == 0, (spec, report.report)
        assert ".local" not in report.ptx, spec


# ------------------------------------------------------------------ the launches
def two_shot_state(op, tp: int, kernels: Kernels, requested: str = "auto") -> None:
    """What construction leaves for an op with a two-shot from ``CROSSOVER`` tokens (or every M)."""
    from mhc_core.device.configs import PublishConfig, ReduceConfig
    from mhc_core.device.publish import FinalizePublishKernel, PublishKernel
    from mhc_core.device.two_shot.reduce import ReduceKernel
    from mhc_core.protocols import ProtocolChoice

    start = 1 if requested == "two-shot" else CROSSOVER
    config = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_stores", store="unicast", scatter=True)
    op.mailbox.__dict__.update(
        capacity=start - 1 or 1, two_shot_capacity=CAPACITY,
        scatter_buffer=torch.zeros(64, dtype=torch.bfloat16), gather_buffer=torch.zeros(64, dtype=torch.bfloat16),
        scatter_destinations=torch.ones(tp, dtype=torch.int64), gather_destinations=torch.full((tp,), 2),
    )  # fmt: skip
    op.__dict__.update(
        protocols=ProtocolChoice(requested, start, CAPACITY),
        _scatter_kernels={
            None: kernels.compiled("scatter", PublishKernel(PublishConfig(**config))),
            **{
                dtype: kernels.compiled(
                    "scatter_finalize", FinalizePublishKernel(PublishConfig(**config, top_k=TOP_K, weights=name))
                )
                for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))
                if dtype in type(op).weight_dtypes
            },
        },
        _reduce_kernel=kernels.compiled("reduce", ReduceKernel(ReduceConfig(hidden=HIDDEN, tp=tp))),
    )


def dsv_two_shot_op(tp: int, requested: str = "auto"):
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import CollectiveTarget, collective_routing
    from mhc_dsv41.kernel import LamportMHCKernel, MHCConfig

    kernels = Kernels()
    op = object.__new__(AllReduceMHC)
    common(op, tp, kernels)
    two_shot_state(op, tp, kernels, requested)
    config = MHCConfig(hidden=HIDDEN, hc=HC, tp=tp, cluster_size=1, threads=64, rank_lanes=1)
    gather = dataclasses.replace(config, tp=1)
    persistent = 6
    op.__dict__.update(
        hc_mult=HC, norm_eps=1e-6, clusters=132, gather_clusters=66, persistent_min_tokens=persistent,
        routing=collective_routing(persistent),
        _collective_kernels={
            CollectiveTarget(False): kernels.compiled("collective", LamportMHCKernel(config)),
            CollectiveTarget(True): kernels.compiled(
                "collective_persistent", LamportMHCKernel(dataclasses.replace(config, persistent=True))
            ),
        },
        _gather_kernels={
            CollectiveTarget(False): kernels.compiled("gather", LamportMHCKernel(gather)),
            CollectiveTarget(True): kernels.compiled(
                "gather_persistent", LamportMHCKernel(dataclasses.replace(gather, persistent=True))
            ),
        },
    )  # fmt: skip
    op._programs = op._build_programs()
    return op, kernels


def test_dsv_call_routes_each_m_to_its_protocol() -> None:
    op, kernels = dsv_two_shot_op(4)
    assert op._programs.thresholds == (1, CROSSOVER, 6)
    expected = {
        1: ["publish", "collective"],
        CROSSOVER - 1: ["publish", "collective"],
        CROSSOVER: ["scatter", "reduce", "gather"],
        6: ["scatter", "reduce", "gather_persistent"],
        CAPACITY: ["scatter", "reduce", "gather_persistent"],
    }
    for m, names in expected.items():
        kernels.calls.clear()
        x = torch.randn(m, HIDDEN).to(torch.bfloat16)
        op(x, *dsv_args(m))
        assert kernels.names() == names, m
        values = [values for _, values in kernels.calls]
        if names[0] == "publish":
            assert values[0]["capacity"] == CROSSOVER - 1 and values[1]["capacity"] == CROSSOVER - 1
            assert values[0]["destinations"] is not None and values[1]["clusters"] == 132
            continue
        scatter, reduce, gather = values
        assert scatter["x"] == x.data_ptr() and scatter["m"] == m and scatter["capacity"] == CAPACITY
        assert reduce["m"] == m and reduce["capacity"] == CAPACITY and reduce["rank"] == 0
        assert gather["direct"] == 0 and gather["prefetch"] == 1, "the boundary follows the reduce, which waited"
        assert gather["capacity"] == CAPACITY and gather["clusters"] == 66 and gather["m"] == m


def test_dsv_moe_and_two_phases_with_a_two_shot() -> None:
    from tests.core.test_launch_wiring_cpu import moe_fields

    op, kernels = dsv_two_shot_op(2)
    gemm2, weights, index, shared = moe_fields(5)
    op.finalize(gemm2, weights, index, shared, *dsv_args(5))
    assert kernels.names() == ["scatter_finalize", "reduce", "gather"]
    kernels.calls.clear()
    op.publish(torch.randn(5, HIDDEN).to(torch.bfloat16))
    assert kernels.names() == ["scatter"]
    op.collect(*dsv_args(5))
    assert kernels.names() == ["scatter", "reduce", "gather"], "the public collect runs the reduce"
    assert kernels.calls[-1][1]["prefetch"] == 1
    kernels.calls.clear()
    plan = op.plan("call", torch.randn(2, HIDDEN).to(torch.bfloat16), *dsv_args(2))
    plan.publish()
    assert plan.exchange is not None
    plan.exchange()
    plan.collect(False)
    assert kernels.names() == ["publish", "collective"], "a one-shot M: the exchange launches nothing"
    kernels.calls.clear()
    plan = op.plan("call", torch.randn(5, HIDDEN).to(torch.bfloat16), *dsv_args(5))
    plan.publish()
    plan.exchange()
    plan.collect(False)
    assert kernels.names() == ["scatter", "reduce", "gather"]
    assert kernels.calls[-1][1]["prefetch"] == 0, "a loopback collect follows another rank's kernel"


def loopback_two_shot_ops(tp: int) -> list:
    """``tp`` recorder-kernel DSV ops (``dsv_two_shot_op``) joined as one instance of a real
    ``LoopbackGroup``'s ranks (built without a GPU); ``(op, kernels)`` per rank."""
    from mhc_core.host.ranks.groups import LoopbackGroup, LoopbackRank

    group = object.__new__(LoopbackGroup)
    group.__dict__.update(world_size=tp, _instances={}, _mailboxes={}, _ballots={})
    group.ranks = tuple(LoopbackRank(group, rank) for rank in range(tp))
    built = [dsv_two_shot_op(tp) for _ in range(tp)]
    for rank, (op, _) in enumerate(built):
        op.__dict__.update(rank=rank, group=group[rank])
        group[rank]._instance_of[op] = 0
        group._instances.setdefault(0, {})[rank] = op
    return built


def test_loopback_publish_on_every_rank_then_collect_on_each() -> None:
    """What a loopback user writes: ``publish()`` on every rank, then ``collect()`` on each. The first
    two-shot collect runs every rank's reduce; a later rank's collect finds its reduce run and
    launches its boundary alone (it must not ask for the earlier ranks' publishes, collected by
    then: that raised on the H100 at 73afb87). A collect before every rank has published raises."""
    tp = 2
    built = loopback_two_shot_ops(tp)
    for round_ in range(2):
        for op, kernels in built:
            kernels.calls.clear()
            op.publish(torch.randn(5, HIDDEN).to(torch.bfloat16))
        for op, _ in built:
            op.collect(*dsv_args(5))
        assert [kernels.names() for _, kernels in built] == [["scatter", "reduce", "gather"]] * tp, round_
    built[0][0].publish(torch.randn(5, HIDDEN).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"needs every rank's publish\(\) first; ranks \[1\]"):
        built[0][0].collect(*dsv_args(5))


def test_loopback_collects_of_two_ranks_from_two_threads_do_not_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's and rank 1's ``collect()`` on two threads, after every rank's publish: the first runs
    every rank's reduce. Each rank's lock taken under the other's (its own first, then its peers' in
    rank order) deadlocked; every rank's lock is now taken in the process-wide order, before the
    op's own. A slow reduce launch holds the window open."""
    import threading
    import time

    from mhc_core.host.calls.two_phase import TwoPhaseCalls

    run_exchange = TwoPhaseCalls._run_exchange

    def slow_exchange(self, *args, **kwargs):
        time.sleep(0.2)
        return run_exchange(self, *args, **kwargs)

    monkeypatch.setattr(TwoPhaseCalls, "_run_exchange", slow_exchange)
    built = loopback_two_shot_ops(2)
    for op, _ in built:
        op.publish(torch.randn(5, HIDDEN).to(torch.bfloat16))
    failures: list[BaseException] = []

    def collect(op) -> None:
        try:
            op.collect(*dsv_args(5))
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=collect, args=(op,), daemon=True) for op, _ in built]
    threads[0].start()
    time.sleep(0.05)  # rank 0's collect is inside rank 0's reduce launch
    threads[1].start()
    for thread in threads:
        thread.join(10.0)
    assert not any(thread.is_alive() for thread in threads), "two ranks' collects deadlocked"
    assert not failures, failures[0]
    assert [kernels.names() for _, kernels in built] == [["scatter", "reduce", "gather"]] * 2


def test_warm_up_launches_every_kernel_of_both_protocols() -> None:
    """Every kernel launches once at construction, before anything can spin behind it: each route
    (forced) with every publish, each phase over the ranks in turn."""
    op, kernels = dsv_two_shot_op(2)
    for plan in op.warmup_rounds():
        plan.publish()
        assert plan.exchange is not None
        plan.exchange()
        plan.collect(False)
    expected = {"publish", "finalize", "scatter", "scatter_finalize", "reduce", "collective", "gather"}
    expected.add("gather_persistent")
    # The one-shot's persistent collective serves no M here (from 6 tokens, past the crossover at 4):
    # no route launches it, so it has nothing to warm up either.
    assert set(kernels.names()) == expected


def test_forced_two_shot_has_no_one_shot_launch() -> None:
    op, kernels = dsv_two_shot_op(4, "two-shot")
    op(torch.randn(1, HIDDEN).to(torch.bfloat16), *dsv_args(1))
    assert kernels.names() == ["scatter", "reduce", "gather"]


def test_glm_shares_its_side_launch_and_forks_once() -> None:
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5.boundary import BoundaryConfig, BoundaryKernel
    from mhc_glm5.config import boundary_routing
    from mhc_glm5.mixes import MixesConfig, MixesKernel

    kernels = Kernels()
    op = object.__new__(AllReduceMhcBoundary)
    common(op, 4, kernels)
    two_shot_state(op, 4, kernels)
    boundary = BoundaryKernel(BoundaryConfig.__new__(BoundaryConfig))
    side = SimpleNamespace(handle=4321, fork_handle=0, launched_with=[], idle=True)
    side.launched = lambda capture, tensors, stream: side.launched_with.append(tuple(tensors))
    side.launching = lambda stream, capture, tensors: (0, 0)
    routing = boundary_routing(((4, 2),), 0)
    op.__dict__.update(
        cluster_tokens=((4, 2),), persistent_min_tokens=0, clusters=3, routing=routing,
        _boundary_kernels={t: kernels.compiled(t.kernel_name, boundary) for t in routing.targets},
        _gather_kernels={t: kernels.compiled("gather_" + t.kernel_name, boundary) for t in routing.targets},
        _mixes_kernel=kernels.compiled("mixes", MixesKernel(MixesConfig.__new__(MixesConfig))),
        _mixes_handoff=torch.zeros(CAPACITY, 24), _raw_mixes=torch.zeros(CAPACITY, 24),
        _arrivals=torch.zeros(1, dtype=torch.int32), _side_work=side,
    )  # fmt: skip
    op._programs = op._build_programs()
    launches = op._programs.call.launches
    assert sum(launch.side for launch in launches) == 1, "the mixes launch serves both protocols"
    for m, names in (
        (1, ["publish", "boundary", "mixes"]),
        (CROSSOVER - 1, ["publish", "boundary", "mixes"]),  # x2 from 4 tokens: the two-shot's from here
        (CROSSOVER, ["scatter", "reduce", "gather_boundary_x2", "mixes"]),
        (2, ["publish", "boundary", "mixes"]),
    ):
        kernels.calls.clear()
        op(torch.randn(m, HIDDEN).to(torch.bfloat16), *glm_args(m))
        assert kernels.names() == names, m
