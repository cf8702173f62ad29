"""Issue #32 on the GPU: threads sharing one op, and interrupts at points of a call. Every op here
has a 2 s spin bound, so a protocol bug fails within seconds instead of hanging; the outputs are
checked bit for bit (against the reference, or against a serial call of the same op).

* Threads: two Python threads, each on its own stream, call one op many times (tp 1: the plain
  all-reduce, GLM's boundary with its join; loopback tp 2/4/8: ``run_ranks``). Unserialised, the
  native calls (which release the GIL) interleaved their launches: wrong results and timeouts.
  And GLM's joins from two streams: one stream's join no longer ends the other's side work.
* Interrupts: a ``KeyboardInterrupt`` before a call's launch changes nothing; after it, the op
  poisons itself: every later call raises, nothing is launched twice, nothing hangs, and what the
  interrupted call launched completes correctly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.core.test_misuse_cpu import POISONED, interrupt, interrupt_allocation, run_threads
from tests.lifecycle.common import CORE_HIDDEN, DSV, GLM, core_ops, dsv_ops, glm_ops, sleep_cycles
from tests.support import assert_bitwise_equal, bf16_randn, bits, poisoned

pytestmark = pytest.mark.gpu

SPIN_MS = 2000.0
CAPACITY = 16
GLM_PRESET = "h200-tp1-h4096"
DSV_PRESET = "h200-tp1-h5120"


def mismatches(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many elements differ bit for bit (a device scalar: no host sync per call)."""
    return (bits(actual) != bits(expected)).sum()


def on_own_stream(body: Callable[[torch.cuda.Stream], int]) -> Callable[[], None]:
    """A thread body run on a new stream of its own; it returns the mismatches it counted, which
    must be 0."""

    def run() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            wrong = body(stream)
        assert wrong == 0, f"thread {threading.get_ident()}: {wrong} elements differ from the reference"

    return run


# ------------------------------------------------------------------ threads
def test_two_threads_share_one_all_reduce_each_on_its_own_stream() -> None:
    """Row 1 of the issue: 2000 calls per thread on one LamportAllReduce (tp 1), M varying."""
    from mhc_core import reference

    [op] = core_ops(1, CAPACITY, spin_timeout_ms=SPIN_MS)
    generator = torch.Generator("cuda").manual_seed(32)
    inputs = [[bf16_randn(m, CORE_HIDDEN, generator=generator) for m in (1, 5, CAPACITY)] for _ in range(2)]
    expected = [[reference.all_reduce([x]) for x in xs] for xs in inputs]
    torch.cuda.synchronize()

    def calls(thread: int) -> Callable[[torch.cuda.Stream], int]:
        def body(stream: torch.cuda.Stream) -> int:
            wrong = torch.zeros((), dtype=torch.int64, device="cuda")
            for index in range(2000):
                case = index % len(inputs[thread])
                wrong += mismatches(op(inputs[thread][case]), expected[thread][case])
            return int(wrong)

        return body

    run_threads(on_own_stream(calls(0)), on_own_stream(calls(1)))
    torch.cuda.synchronize()
    op.check()  # no timeout either


def moe_input(op: Any, m: int, generator: torch.Generator) -> Any:
    """An unfinalized MoE output for ``op`` (its top_k; every route taken, FP32 weights)."""
    from mhc_core import MoEOutput

    rows = m * op.top_k
    index = torch.randperm(rows, generator=generator, device="cuda").to(torch.int32).view(m, op.top_k)
    weights = torch.rand(m, op.top_k, generator=generator, device="cuda")
    gemm2 = bf16_randn(rows, op.hidden_size, generator=generator)
    return MoEOutput(gemm2, weights, index, bf16_randn(m, op.hidden_size, generator=generator))


def test_two_threads_share_one_glm_boundary_and_join_on_their_own_streams() -> None:
    """GLM at tp 1: one thread's calls take the direct path (one launch), the other's MoE input (a
    finalize publish, then the boundary); each joins on its own stream. Every call's outputs, the
    side stream's post_out / comb_out included, must be a serial call's, bit for bit."""
    [op] = glm_ops(GLM_PRESET, CAPACITY, spin_timeout_ms=SPIN_MS)
    generator = torch.Generator("cuda").manual_seed(33)
    cases = [GLM.case([op], m, generator) for m in (3, CAPACITY)]
    inputs = [GLM.rank_args(cases[0], 0), (moe_input(op, CAPACITY, generator), *GLM.rank_args(cases[1], 0)[1:])]
    references = []
    for args in inputs:  # one serial call each: the outputs every threaded call must reproduce
        references.append([tensor.clone() for tensor in op(*args)])
        op.join()
    torch.cuda.synchronize()

    def calls(thread: int) -> Callable[[torch.cuda.Stream], int]:
        def body(stream: torch.cuda.Stream) -> int:
            wrong = torch.zeros((), dtype=torch.int64, device="cuda")
            for _ in range(500):
                outputs = op(*inputs[thread])
                op.join()
                for actual, expected in zip(outputs, references[thread], strict=True):
                    wrong += mismatches(actual, expected)
            return int(wrong)

        return body

    run_threads(on_own_stream(calls(0)), on_own_stream(calls(1)))
    torch.cuda.synchronize()
    op.check()


def test_a_join_on_another_stream_does_not_end_the_side_work_of_this_one() -> None:
    """Calls on streams A then B, joins on A then B (what two threads do): A's join cleared the op's
    pending side work, so B's join waited for nothing and B read post_out / comb_out before its
    mixes kernel wrote them. The side stream sleeps before each mixes kernel, so that kernel is late."""
    [op] = glm_ops(GLM_PRESET, CAPACITY, spin_timeout_ms=SPIN_MS)
    generator = torch.Generator("cuda").manual_seed(35)
    cases = [GLM.case([op], CAPACITY, generator) for _ in range(2)]
    expected = [[tensor.clone() for tensor in GLM.call_rank(op, case, 0, None)] for case in cases]
    outs = [GLM.outputs([op], CAPACITY)[0] for _ in cases]
    cycles = sleep_cycles(200.0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for stream, case, out in zip(streams, cases, outs, strict=True):
        with torch.cuda.stream(op.side_stream):
            torch.cuda._sleep(cycles)  # before this call's mixes kernel
        with torch.cuda.stream(stream):
            op(*GLM.rank_args(case, 0), out=out)
    seen = []
    for stream, out in zip(streams, outs, strict=True):
        with torch.cuda.stream(stream):
            op.join()
            seen.append([tensor.clone() for tensor in out])  # what this stream reads right after its join
    torch.cuda.synchronize()
    for call, (copies, wanted) in enumerate(zip(seen, expected, strict=True)):
        for name, actual, reference in zip(GLM.names, copies, wanted, strict=True):
            assert_bitwise_equal(actual, reference, f"call {call} {name}")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_two_threads_drive_one_set_of_loopback_ranks(tp: int) -> None:
    """``run_ranks`` from two threads over the same ranks: each run holds every rank's op, so the
    two threads' runs come one after the other, whole."""
    from mhc_core import reference, run_ranks

    ops = core_ops(tp, CAPACITY, spin_timeout_ms=SPIN_MS)
    generator = torch.Generator("cuda").manual_seed(tp)
    partials = [[bf16_randn(m, CORE_HIDDEN, generator=generator) for _ in ops] for m in (2, 7)]
    expected = [reference.all_reduce(xs) for xs in partials]
    torch.cuda.synchronize()

    def calls(thread: int) -> Callable[[torch.cuda.Stream], int]:
        def body(stream: torch.cuda.Stream) -> int:
            wrong = torch.zeros((), dtype=torch.int64, device="cuda")
            for _ in range(60):
                for result in run_ranks(ops, "call", [(x,) for x in partials[thread]]):
                    wrong += mismatches(result, expected[thread])
            return int(wrong)

        return body

    run_threads(on_own_stream(calls(0)), on_own_stream(calls(1)))
    torch.cuda.synchronize()
    for op in ops:
        op.check()


# --------------------------------------------------------------- interrupts
def test_a_collect_interrupted_after_its_launch_is_never_collected_again() -> None:
    """Loopback tp 2: rank 1's collect() is interrupted once its collective launched. Retrying it
    launched a second collective, which polled slots the first had re-armed until the bound ran out;
    now the retry raises the poisoning, and the first collective's result is right."""
    from mhc_core import reference

    ops = core_ops(2, CAPACITY, spin_timeout_ms=SPIN_MS)
    partials = [bf16_randn(5, CORE_HIDDEN) for _ in ops]
    outs = [poisoned((5, CORE_HIDDEN), torch.bfloat16) for _ in ops]
    for op, x in zip(ops, partials, strict=True):
        op.publish(x)
    ops[0].collect(out=outs[0])
    interrupt(ops[1]._programs.collect, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        ops[1].collect(out=outs[1])
    with pytest.raises(RuntimeError, match=POISONED):
        ops[1].collect()
    with pytest.raises(RuntimeError, match=POISONED):
        ops[1].publish(partials[1])
    torch.cuda.synchronize()  # returns: no kernel is left waiting
    expected = reference.all_reduce(partials)
    for rank, out in enumerate(outs):
        assert_bitwise_equal(out, expected, f"rank {rank}")
    ops[0].check()


def test_a_dsv_call_interrupted_before_its_launch_works_after_it_poisons() -> None:
    """tp 1 (the direct path): an interrupt in the output allocation changes nothing (the next call is
    right); one after the native launch poisons the op, and the interrupted call's outputs are right."""
    [op] = dsv_ops(DSV_PRESET, CAPACITY, spin_timeout_ms=SPIN_MS)
    case = DSV.case([op], 6, torch.Generator("cuda").manual_seed(6))
    interrupt_allocation(op)
    with pytest.raises(KeyboardInterrupt):
        op(*DSV.rank_args(case, 0))
    outs = DSV.outputs([op], case.m)
    DSV.check([op], [op(*DSV.rank_args(case, 0), out=outs[0])], case)
    outs = DSV.outputs([op], case.m)
    interrupt(op._programs.call, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        op(*DSV.rank_args(case, 0), out=outs[0])
    with pytest.raises(RuntimeError, match=POISONED):
        op(*DSV.rank_args(case, 0))
    DSV.check([op], outs, case)  # synchronises: nothing hangs


def test_a_glm_call_interrupted_after_its_launch_keeps_its_side_work_joined() -> None:
    """The mixes kernel of the interrupted call runs late (its side stream sleeps 200 ms). Its
    bookkeeping never ran: the next boundary did not wait for it and overwrote the hand-off rows it
    had not read (wrong post_out / comb_out, then a hand-off timeout). Now the next call raises, and
    the interrupted call's outputs, once joined, are right."""
    [op] = glm_ops(GLM_PRESET, CAPACITY, spin_timeout_ms=SPIN_MS)
    generator = torch.Generator("cuda").manual_seed(34)
    first, second = (GLM.case([op], CAPACITY, generator) for _ in range(2))
    expected = [tensor.clone() for tensor in GLM.call_rank(op, first, 0, None)]
    torch.cuda.synchronize()
    cycles = sleep_cycles(200.0)
    outs = GLM.outputs([op], CAPACITY)[0]
    with torch.cuda.stream(op.side_stream):
        torch.cuda._sleep(cycles)
    interrupt(op._programs.call, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        op(*GLM.rank_args(first, 0), out=outs)
    with pytest.raises(RuntimeError, match=POISONED):
        op(*GLM.rank_args(second, 0))
    op.join()  # still works on a poisoned op: its side work may run
    torch.cuda.synchronize()
    for name, actual, wanted in zip(GLM.names, outs, expected, strict=True):
        assert_bitwise_equal(actual, wanted, name)
