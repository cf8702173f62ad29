"""Issue #52, rows 8 to 13 and the IPC bullet, on the GPU: close() during another thread's capture
and after a peer left, run_ranks over the same ops in opposite orders from two threads,
``lamport_all_reduce`` shared by threads while it grows, growth on one rank only or to different
sizes, graphs captured on a replaced op, a rank failing in its warm-up, and a peer's IPC handle that
maps less than the voted mailbox. At tp 1, in loopback and as processes on one GPU (a gloo group,
the IPC allocation). The CPU halves: tests/core/test_{close_retry,lock_order,all_reduce_cache,
warm_up_vote,ipc_mapped_size}_cpu.py."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref
from typing import Any

import pytest
import torch

from tests.processes import run_ranks_as_processes
from tests.support import assert_bitwise_equal, bf16_randn, build_ranks

pytestmark = pytest.mark.gpu
HIDDEN = 4096
SPIN_MS = 20_000.0


def all_reduce(group: Any = None, capacity: int = 64, **options: Any) -> Any:
    from mhc_core import LamportAllReduce

    return LamportAllReduce(hidden_size=HIDDEN, max_num_tokens=capacity, device="cuda", group=group, **options)


# ------------------------------------------------------------------ row 8
@pytest.mark.parametrize("tp", [1, 2])
def test_close_during_another_threads_capture_raises_then_a_second_close_frees(tp: int) -> None:
    from mhc_core import reference, run_ranks

    ops = build_ranks(tp, lambda group: all_reduce(group, capacity=8))
    x = [bf16_randn(4, HIDDEN) for _ in ops]
    for result in run_ranks(ops, "call", [(t,) for t in x]):
        assert_bitwise_equal(result, reference.all_reduce(x))
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    errors: list[str] = []

    def close_from_another_thread() -> None:
        try:
            ops[0].close()
        except RuntimeError as error:
            errors.append(str(error))

    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = run_ranks(ops, "call", [(t,) for t in x])
        closer = threading.Thread(target=close_from_another_thread)
        closer.start()
        closer.join(60)
    assert errors and "capture is in progress" in errors[0], f"close() during the capture: {errors}"
    state = weakref.ref(ops[0].mailbox.stage_state)
    for op in ops:
        op.close()  # the capture has ended: rank 0's second close() releases the rest
    assert ops[0].mailbox is None
    graph.replay()  # every op was poisoned on the device first: the replay writes NaN, touches no mailbox
    torch.cuda.synchronize()
    for out in outs:
        assert torch.isnan(out.float()).all(), "a replay of the closed ops' graph wrote numbers"
    assert state() is not None, "a captured op's stage state must outlive its graphs"
    gc.collect()


def _close_after_the_peer_left(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    op = all_reduce(dist.group.WORLD, spin_timeout_ms=SPIN_MS)
    x = bf16_randn(2, HIDDEN)
    op(x)
    torch.cuda.synchronize()
    if rank == 1:
        return {}  # leaves without close(): its process group is destroyed
    time.sleep(3.0)
    errors = []
    for _ in range(2):
        try:
            op.close()
            errors.append(None)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
    return {"errors": errors, "kept": op.mailbox is not None}


def test_close_after_a_peer_left_is_retried_by_the_next_close() -> None:
    outcomes = run_ranks_as_processes(_close_after_the_peer_left, 2, deadline_s=150.0)
    assert outcomes[0].kind == "ok", outcomes[0].message
    first, second = outcomes[0].value["errors"]
    assert first is not None and second is not None, outcomes[0].value
    assert outcomes[0].value["kept"], "the mailbox was freed though the barrier never passed"


# ------------------------------------------------------------------ row 9
def test_run_ranks_in_opposite_orders_from_two_threads() -> None:
    from mhc_core import reference, run_ranks

    op0, op1 = build_ranks(2, lambda group: all_reduce(group, capacity=8))
    x = [bf16_randn(3, HIDDEN) for _ in range(2)]
    expected = reference.all_reduce(x)
    failures: list[BaseException] = []

    def body(ops: list[Any], inputs: list[torch.Tensor]) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(400):
                    for result in run_ranks(ops, "call", [(t,) for t in inputs]):
                        assert_bitwise_equal(result, expected)
        except BaseException as error:
            failures.append(error)

    threads = [
        threading.Thread(target=body, args=([op0, op1], x), daemon=True),
        threading.Thread(target=body, args=([op1, op0], x[::-1]), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert not any(thread.is_alive() for thread in threads), "run_ranks in opposite orders deadlocked"
    assert not failures, failures[0]


# ------------------------------------------------------------------ row 10
def test_lamport_all_reduce_shared_by_two_threads_while_one_grows() -> None:
    from mhc_core import close_lamport_all_reduce, lamport_all_reduce, reference

    failures: list[BaseException] = []

    def body(grow: bool) -> None:
        try:
            for call in range(150):
                m = min(1 + 2 * call, 300) if grow else 4
                x = bf16_randn(m, HIDDEN)
                # tp 1: the sum of one row, from +0 (x's -0 come back +0, as the reference's do)
                assert_bitwise_equal(lamport_all_reduce(x), reference.all_reduce([x]))
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=body, args=(grow,)) for grow in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    close_lamport_all_reduce()
    assert not failures, failures[0]


# ------------------------------------------------------------------ row 11
def _grow(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core import TokenCountError, close_lamport_all_reduce, lamport_all_reduce

    torch.cuda.set_device(0)
    group = dist.group.WORLD
    lamport_all_reduce(bf16_randn(4, HIDDEN), group=group, spin_timeout_ms=SPIN_MS)
    torch.cuda.synchronize()
    found: dict[str, Any] = {}
    for _ in range(2):  # the call, then the next one (a peer learns of the mismatch from its kernel)
        try:
            lamport_all_reduce(bf16_randn(sizes[rank], HIDDEN), group=group, spin_timeout_ms=SPIN_MS)
            torch.cuda.synchronize()
        except TokenCountError as error:
            found = {"ranks": sorted(error.ranks), "message": str(error)}
            break
    close_lamport_all_reduce(group)
    return found


@pytest.mark.parametrize(("sizes", "named"), [([64, 3], {0: [1], 1: [0]}), ([64, 32], {0: [1], 1: [0]})])
def test_growth_that_the_ranks_do_not_share_raises_token_count_error_on_every_rank(sizes, named) -> None:
    outcomes = run_ranks_as_processes(_grow, 2, sizes, deadline_s=150.0)
    for rank, outcome in outcomes.items():
        assert outcome.kind == "ok", f"rank {rank}: {outcome.message}"
        assert outcome.value.get("ranks") == named[rank], f"rank {rank}: {outcome.value}"


# ------------------------------------------------------------------ row 12
def test_a_graph_on_a_replaced_op_replays_nan_and_the_growth_warns() -> None:
    from mhc_core import close_lamport_all_reduce, lamport_all_reduce

    x = bf16_randn(4, HIDDEN)
    lamport_all_reduce(x)  # built and warm
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = lamport_all_reduce(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lamport_all_reduce(bf16_randn(256, HIDDEN))  # grows: the old op is closed
    assert any("replay NaN" in str(w.message) for w in caught), [str(w.message) for w in caught]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()
    close_lamport_all_reduce()


# ------------------------------------------------------------------ row 13
def _fail_in_warm_up(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core import LamportAllReduce

    torch.cuda.set_device(0)
    if rank == 1:

        def out_of_memory(self: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (stood in)")

        LamportAllReduce.warmup_rounds = out_of_memory
    started = time.monotonic()
    try:
        all_reduce(dist.group.WORLD, spin_timeout_ms=600_000.0)
    finally:
        print(f"rank {rank}: construction took {time.monotonic() - started:.1f} s")


def test_a_rank_failing_in_its_warm_up_is_named_within_the_warm_up_bound() -> None:
    started = time.monotonic()
    outcomes = run_ranks_as_processes(_fail_in_warm_up, 2, deadline_s=170.0)
    for rank, outcome in outcomes.items():
        assert outcome.kind == "StartupError", f"rank {rank}: {outcome}"
        assert "rank 1: OutOfMemoryError" in outcome.first_line, outcome.first_line
    assert "rank 0: LamportTimeoutError" in outcomes[0].first_line, outcomes[0].first_line
    assert time.monotonic() - started < 150.0


# ------------------------------------------------------------------ IPC bullet
def _short_handle(rank: int, world: int) -> None:
    import torch.distributed as dist

    from mhc_core.host.ranks import cuda_ipc

    torch.cuda.set_device(0)
    if rank == 1:  # exports the handle of another, smaller allocation than its mailbox
        real, small = cuda_ipc.DeviceAllocation.handle, cuda_ipc.DeviceAllocation(4096, torch.device("cuda", 0))
        cuda_ipc.DeviceAllocation.handle = lambda self: real(small)
    all_reduce(dist.group.WORLD, spin_timeout_ms=SPIN_MS, mailbox_allocation="ipc")


def test_a_peer_handle_that_maps_less_than_the_mailbox_is_refused() -> None:
    outcomes = run_ranks_as_processes(_short_handle, 2, deadline_s=150.0)
    assert outcomes[0].kind == "ValueError" and "rank 1's mailbox handle maps" in outcomes[0].first_line, outcomes[0]
    assert outcomes[1].kind == "StartupError" and "rank 0: ValueError" in outcomes[1].first_line, outcomes[1]
