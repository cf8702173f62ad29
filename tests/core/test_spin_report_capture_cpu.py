"""Issue #52, the ``SpinGuard.check`` bullet, on a CPU with a real thread as the kernel: a finalize
publish with ``check_routes=True`` reports a bad route (its code word lands first; its token and
route follow) while the host checks the op inside a CUDA-graph capture, where it cannot synchronise.
The check must neither raise a half-written report nor clear words the kernel is still writing: the
report is raised whole by the first check outside the capture. (The report words are plain CPU
memory here; on the GPU they are pinned host memory the kernel stores into.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch


class Slots:
    def take(self, words: int) -> torch.Tensor:
        return torch.zeros(words, dtype=torch.int32)


def test_a_route_report_seen_inside_a_capture_is_raised_whole_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.constants import ERROR_ROUTE_INDEX, ROUTE_CODE, ROUTE_INDEX, ROUTE_TOKEN
    from mhc_core.host.calls import spin

    monkeypatch.setattr(spin, "_REPORT_SLOTS", Slots())
    capturing = True
    monkeypatch.setattr(spin.torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(spin.torch.cuda, "synchronize", lambda device=None: kernel.join())
    guard = spin.SpinGuard(2, 1000.0, torch.device("cuda", 0))
    code_written = threading.Event()

    def reporting_kernel() -> None:
        guard._words[ROUTE_CODE] = ERROR_ROUTE_INDEX
        code_written.set()
        time.sleep(0.3)  # still writing when the host looks
        guard._words[ROUTE_TOKEN] = 5
        guard._words[ROUTE_INDEX] = 1

    kernel = threading.Thread(target=reporting_kernel)
    kernel.start()
    code_written.wait(10)
    guard.check()  # inside the capture: nothing raised, nothing cleared
    kernel.join()
    capturing = False
    with pytest.raises(spin.RouteIndexError, match="token 5, route 1"):
        guard.check()
    guard.check()  # raised once, then cleared: the op stays usable
