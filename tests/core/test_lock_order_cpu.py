"""Issue #52, rows 9 and the ``_call`` lock bullet, on a CPU with real threads: ops whose kernels are
recorders (``tests.core.test_launch_wiring_cpu``) run their real native programs.

* Two threads call ``run_ranks`` over the same two ops listed in opposite orders: each must not hold
  one op's lock while waiting for the other's (a lock taken in the order given deadlocked).
* An interrupt that arrives as the eager call's ``acquire()`` returns (where the interpreter checks
  for signals, outside the ``try``) must not leave the op's lock held: another thread's call then
  waits forever. A profile hook raises ``KeyboardInterrupt`` at exactly that point.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from tests.core.test_launch_wiring_cpu import HIDDEN, M
from tests.core.test_misuse_cpu import slow_all_reduce

#: How long a thread may take before the test calls it deadlocked (a run takes milliseconds).
STUCK_S = 10.0


def start(body: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """``body`` on a daemon thread (a deadlocked one must not keep the test process alive)."""
    failures: list[BaseException] = []

    def guarded() -> None:
        try:
            body()
        except BaseException as error:  # reported by the test
            failures.append(error)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    return thread, failures


class MeetingLock:
    """An op's RLock that, the first time each thread takes its first op lock, waits (up to 2 s) for
    the other thread to hold its own first lock too: the interleaving that deadlocks two runs
    whose locks are taken in the order of their arguments."""

    held = threading.local()

    def __init__(self, meeting: threading.Barrier) -> None:
        self._lock = threading.RLock()
        self._meeting = meeting

    def acquire(self, *args: Any) -> bool:
        taken = self._lock.acquire(*args)
        depth = getattr(MeetingLock.held, "depth", 0)
        MeetingLock.held.depth = depth + 1
        if depth == 0 and not getattr(MeetingLock.held, "met", False):
            MeetingLock.held.met = True
            # Broken: the other thread waits for this very lock, so there is no cycle.
            with contextlib.suppress(threading.BrokenBarrierError):
                self._meeting.wait(timeout=2.0)
        return taken

    def release(self) -> None:
        MeetingLock.held.depth -= 1
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def test_run_ranks_over_the_same_ops_in_opposite_orders_does_not_deadlock() -> None:
    from mhc_core import run_ranks

    (op0, kernels0), (op1, kernels1) = slow_all_reduce(), slow_all_reduce()
    meeting = threading.Barrier(2)
    op0._lock, op1._lock = MeetingLock(meeting), MeetingLock(meeting)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)

    def forward() -> None:
        for _ in range(5):
            run_ranks([op0, op1], "call", [(x,), (x,)])

    def backward() -> None:
        for _ in range(5):
            run_ranks([op1, op0], "call", [(x,), (x,)])

    runs = [start(forward), start(backward)]
    for thread, _ in runs:
        thread.join(STUCK_S)
    stuck = [thread.name for thread, _ in runs if thread.is_alive()]
    assert not stuck, f"run_ranks([op0, op1]) and run_ranks([op1, op0]) deadlocked ({stuck} still waiting)"
    for _, failures in runs:
        assert not failures, failures
    assert len(kernels0.calls) == len(kernels1.calls) == 2 * 10


def test_an_interrupt_as_the_call_takes_its_lock_leaves_the_lock_free() -> None:
    op, kernels = slow_all_reduce()
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)

    def interrupt_as_acquire_returns(frame: Any, event: str, arg: Any) -> None:
        # ``c_return`` of the lock's acquire: the lock is held, the call's code has not run yet.
        if event == "c_return" and getattr(arg, "__name__", "") in ("acquire", "__enter__"):
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(interrupt_as_acquire_returns)
    try:
        op(x)
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    thread, failures = start(lambda: op(x))  # another thread's call of the same op
    thread.join(STUCK_S)
    assert not thread.is_alive(), "the interrupted call left the op's lock held: another thread's call waits forever"
    assert not failures, failures
    assert [name for name, _ in kernels.calls][-2:] == ["publish", "collective"]
