"""Issue #52, row 8, on a CPU: ``close()`` whose release raises, as real processes over a gloo group
and real threads. The device parts are stood in for at the CUDA boundary: ``torch.cuda.synchronize``
fails as CUDA does while a capture is in progress (and would invalidate it), and the capture a
thread holds is what ``captures_in_progress`` reports.

* Another thread captures while rank 0 closes: close() must not synchronise the device; it poisons
  the op on the device first, raises saying why, keeps the mailbox; a second close() once the
  capture ended releases everything and meets rank 1 in the barrier (which was waiting there).
* A peer is gone (its process group destroyed) when rank 0 closes: the barrier fails; the op is
  closed and poisoned but keeps its mailbox, and a second close() tries the barrier again instead
  of returning as if it were done.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from tests.processes import run_ranks_as_processes


def fake_op(group: Any) -> Any:
    """A LamportAllReduce as construction leaves it over ``group`` (a real process group), with the
    device parts stood in for."""
    from mhc_core import LamportAllReduce
    from mhc_core.host import library
    from mhc_core.host.ranks.groups import resolve_group

    library.torch._dynamo.mark_static_address = lambda tensor: None
    torch.cuda.is_current_stream_capturing = lambda: False  # this thread never captures
    op = LamportAllReduce.__new__(LamportAllReduce)
    op.device, op.group, op._closed, op._peers_ready = torch.device("cuda", 0), resolve_group(group), False, True
    op.rank = op.group.rank
    op._init_call_state()
    op._order = SimpleNamespace(follow=lambda: None)
    op.mailbox = SimpleNamespace(stage_state=torch.zeros(8, dtype=torch.int32), memory=torch.zeros(16))
    op._programs = object()
    op.spin = SimpleNamespace(check=lambda: None)
    op.handle = library.register(op)
    return op


class FakeCapture:
    """A CUDA-graph capture on a thread of its own, as CUDA sees it: while it is in progress a
    device-wide synchronise fails (and would invalidate the graph)."""

    def __init__(self) -> None:
        self.active = False
        self.synchronised_during = 0
        self.stream = SimpleNamespace(cuda_stream=0x5EED)

    def synchronize(self, device: Any = None) -> None:
        if self.active:
            self.synchronised_during += 1
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def in_progress(self) -> list[Any]:
        return [self.stream] if self.active else []


def _close_during_a_capture(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core.constants import ERROR_CLOSED, ERROR_COPY, ERROR_WORD
    from mhc_core.host import library, lifetime

    op = fake_op(dist.group.WORLD)
    capture = FakeCapture()
    torch.cuda.synchronize = capture.synchronize
    lifetime.captures_in_progress = capture.in_progress
    if rank == 1:
        op.close()  # waits in the barrier for rank 0's close()
        return {"released": op.mailbox is None}
    started, closed_once = threading.Event(), threading.Event()

    def capturing_thread() -> None:
        capture.active = True
        started.set()
        closed_once.wait(30)
        capture.active = False

    thread = threading.Thread(target=capturing_thread)
    thread.start()
    started.wait(30)
    first = None
    try:
        op.close()
    except RuntimeError as error:
        first = str(error)
    finally:
        closed_once.set()
    thread.join()
    state = op.mailbox.stage_state if op.mailbox is not None else None
    after_first = {
        "error": first,
        "synchronised_during_capture": capture.synchronised_during,
        "poisoned": state is not None and int(state[ERROR_WORD]) == int(state[ERROR_COPY]) == ERROR_CLOSED,
        "kept_mailbox": op.mailbox is not None,
        "registered": op.handle in library._OPS,
    }
    try:
        op(torch.zeros(1, 8))
    except RuntimeError as error:
        after_first["call"] = str(error)
    op.close()  # the capture has ended: the rest of the release, and the barrier rank 1 waits in
    return after_first | {"released": op.mailbox is None, "unregistered": op.handle not in library._OPS}


def test_close_during_another_threads_capture_can_be_retried():
    outcomes = run_ranks_as_processes(_close_during_a_capture, 2, deadline_s=120.0)
    assert outcomes[0].kind == "ok", outcomes[0].message
    zero = outcomes[0].value
    assert zero["synchronised_during_capture"] == 0, "close() synchronised the device while another thread captured"
    assert zero["error"] and "capture is in progress" in zero["error"] and "close() again" in zero["error"], zero
    assert zero["poisoned"], "the first close() did not poison the op on the device"
    assert zero["kept_mailbox"] and zero["registered"], zero
    assert "was closed" in zero.get("call", ""), zero
    assert zero["released"] and zero["unregistered"], "the second close() did not release what the first left"
    assert outcomes[1].kind == "ok" and outcomes[1].value == {"released": True}, outcomes[1].message


def _close_after_the_peer_left(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core.host import library

    op = fake_op(dist.group.WORLD)
    torch.cuda.synchronize = lambda device=None: None
    if rank == 1:
        return {}  # leaves without closing: its process group is destroyed, the process exits
    time.sleep(3.0)
    errors = []
    for _ in range(2):
        try:
            op.close()
            errors.append(None)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error} {getattr(error, '__notes__', '')}")
    return {"errors": errors, "kept_mailbox": op.mailbox is not None, "registered": op.handle in library._OPS}


def test_close_after_a_peer_left_keeps_trying_the_barrier():
    outcomes = run_ranks_as_processes(_close_after_the_peer_left, 2, deadline_s=150.0)
    zero = outcomes[0]
    assert zero.kind == "ok", zero.message
    first, second = zero.value["errors"]
    assert first is not None and second is not None, (
        "the second close() returned as if done: the mailbox and the handle leak for good"
    )
    assert "call close() again to retry the barrier" in first, first
    assert zero.value["kept_mailbox"] and zero.value["registered"], zero.value
