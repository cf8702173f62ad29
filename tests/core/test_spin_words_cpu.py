"""The host side of the pinned error report (``mhc_core.host.calls.spin.SpinGuard``) without numpy.

``SpinGuard`` reads the words the kernels store into pinned host memory through a ctypes view of
that address (it used ``Tensor.numpy()``, which made numpy a dependency of mhc-core for this one
read). Here the pinned slot is replaced by a plain CPU tensor (pinned memory needs CUDA), the test
writes words as a kernel would, and ``check()`` must see them: in this process, and in a child
process where ``import numpy`` fails, as it does in an environment without numpy.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mhc_core.constants import ERROR_CODE, ERROR_NONE, ERROR_RANKS, ERROR_STAGE, ERROR_TOKEN, ROUTE_CODE
from mhc_core.host.calls import spin
from mhc_core.host.calls.spin import LamportTimeoutError, RouteIndexError

TP = 2


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> spin.SpinGuard:
    slots: list[torch.Tensor] = []
    monkeypatch.setattr(
        spin._REPORT_SLOTS, "take", lambda words: slots.append(torch.zeros(words, dtype=torch.int32)) or slots[-1]
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return spin.SpinGuard(TP, 200.0, torch.device("cpu"))


def test_a_timeout_written_after_construction_is_read_and_sticks(guard: spin.SpinGuard) -> None:
    guard.check()  # nothing reported
    guard.flag[ERROR_STAGE], guard.flag[ERROR_TOKEN], guard.flag[ERROR_RANKS + 1] = 2, 5, 1
    guard.flag[ERROR_CODE] = spin.ERROR_SPIN_TIMEOUT
    with pytest.raises(LamportTimeoutError, match=r"ranks \[1\] never published") as first:
        guard.check()
    assert (first.value.stage, first.value.token, first.value.missing_ranks) == (2, 5, (1,))
    guard.flag.zero_()  # a failure is the host's too: clearing the device words does not clear it
    with pytest.raises(LamportTimeoutError, match="reported earlier"):
        guard.check()


def test_a_route_report_is_raised_once_and_its_words_cleared(guard: spin.SpinGuard) -> None:
    guard.flag[ROUTE_CODE] = 1
    with pytest.raises(RouteIndexError):
        guard.check()
    assert int(guard.flag[ROUTE_CODE]) == ERROR_NONE
    guard.check()


def test_spin_guard_needs_no_numpy() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
        import torch
        from mhc_core.host.calls import spin
        slot = torch.zeros(16, dtype=torch.int32)
        spin._REPORT_SLOTS.take = lambda words: slot[:words]
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.is_current_stream_capturing = lambda: False
        guard = spin.SpinGuard(2, 100.0, torch.device("cpu"))
        guard.check()
        slot[spin.ERROR_CODE] = spin.ERROR_SPIN_TIMEOUT
        try:
            guard.check()
        except spin.LamportTimeoutError as error:
            print("raised", type(error).__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "raised LamportTimeoutError" in result.stdout
