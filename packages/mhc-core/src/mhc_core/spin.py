"""Bounded spins: a device-side time limit on every poll, reported through host-mapped memory.

The host cannot watch a spinning kernel (it may itself be blocked inside a launch),
so the bound lives in the kernel: every poll loop gives up after ``limit_ns`` of
the global timer, records the generation, token and the ranks whose slots still
hold -0 in a pinned host buffer (readable without a device sync), and exits. The
op raises at its next call or on ``check()``; the mailbox is then inconsistent
(some slots were never consumed), so the op refuses every later call until it is
rebuilt.

The same bound covers a side-stream kernel's wait for a handed-off row
(``mhc_core.handoff``, ``ERROR_HANDOFF_TIMEOUT``). It is off by default (a limit of 0
costs one predicated compare per poll round); ``spin_timeout_ms=`` or
``MHC_SPIN_TIMEOUT_MS`` turns it on. The project's own tests run with it on.
"""

from __future__ import annotations

import os

import torch

from .constants import (
    ERROR_CODE,
    ERROR_DETAIL,
    ERROR_HANDOFF_TIMEOUT,
    ERROR_NONE,
    ERROR_RANKS,
    ERROR_ROUTE_INDEX,
    ERROR_SPIN_TIMEOUT,
    ERROR_STAGE,
    ERROR_TOKEN,
)

SPIN_TIMEOUT_ENV = "MHC_SPIN_TIMEOUT_MS"


class LamportTimeoutError(RuntimeError):
    """A collective gave up waiting for some ranks' publishes."""

    def __init__(self, message: str, *, stage: int, token: int, missing_ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.stage = stage
        self.token = token
        self.missing_ranks = missing_ranks


class RouteIndexError(ValueError):
    """The finalize publish met a route index outside [-1, rows) (debug mode)."""


def resolve_timeout_ms(spin_timeout_ms: float | None) -> float | None:
    """The explicit argument, else ``MHC_SPIN_TIMEOUT_MS``, else off; 0 means off (None)."""
    if spin_timeout_ms is None:
        raw = os.environ.get(SPIN_TIMEOUT_ENV, "").strip()
        if not raw:
            return None
        try:
            spin_timeout_ms = float(raw)
        except ValueError:
            raise ValueError(f"{SPIN_TIMEOUT_ENV}: expected a number of milliseconds, got {raw!r}") from None
    if isinstance(spin_timeout_ms, bool) or not isinstance(spin_timeout_ms, (int, float)):
        raise TypeError(f"spin_timeout_ms: expected a float or None, got {type(spin_timeout_ms).__name__}")
    if not spin_timeout_ms >= 0:
        raise ValueError(f"spin_timeout_ms: expected >= 0 (0: no bound), got {spin_timeout_ms}")
    return float(spin_timeout_ms) or None


class SpinGuard:
    """The pinned error flag of one op: ``[code, stage, token, detail, missing rank 0 .. tp-1]``."""

    def __init__(self, tp: int, timeout_ms: float | None, device: torch.device) -> None:
        self.tp = tp
        self.timeout_ms = timeout_ms
        self.limit_ns = int(timeout_ms * 1e6) if timeout_ms else 0
        # Pinned host memory is mapped into the device's address space under UVA:
        # the kernels store into it at its host address.
        self.flag = torch.zeros(ERROR_RANKS + tp, dtype=torch.int32, pin_memory=True)
        self.address = self.flag.data_ptr()
        self._words = self.flag.numpy()
        self.device = device
        self.failure: Exception | None = None

    def check(self) -> None:
        """Raise what a kernel reported; after a timeout, raise on every later call too."""
        if self.failure is not None:
            raise RuntimeError(
                f"this op's Lamport mailbox is inconsistent after an earlier failure ({self.failure}); "
                "rebuild the op before calling it again"
            ) from self.failure
        code = int(self._words[ERROR_CODE])
        if code == ERROR_NONE:
            return
        # The reporting kernel has finished waiting; let it finish writing the flag.
        torch.cuda.synchronize(self.device)
        words = [int(w) for w in self._words]
        self._words[:] = 0
        if code == ERROR_SPIN_TIMEOUT:
            missing = tuple(rank for rank in range(self.tp) if words[ERROR_RANKS + rank])
            error = LamportTimeoutError(
                f"Lamport collective timed out after {self.timeout_ms} ms waiting for generation (stage) "
                f"{words[ERROR_STAGE]}, token {words[ERROR_TOKEN]}: ranks {list(missing)} never published",
                stage=words[ERROR_STAGE],
                token=words[ERROR_TOKEN],
                missing_ranks=missing,
            )
            self.failure = error
            raise error
        if code == ERROR_HANDOFF_TIMEOUT:
            error = LamportTimeoutError(
                f"the side-stream kernel timed out after {self.timeout_ms} ms waiting for token "
                f"{words[ERROR_TOKEN]}'s hand-off row (the main-stream kernel never wrote it)",
                stage=-1,
                token=words[ERROR_TOKEN],
                missing_ranks=(),
            )
            self.failure = error
            raise error
        if code == ERROR_ROUTE_INDEX:
            raise RouteIndexError(
                f"expanded_idx_to_permuted_idx: token {words[ERROR_TOKEN]}, route {words[ERROR_DETAIL]} "
                "held an index outside [-1, rows); that route was skipped"
            )
        self.failure = RuntimeError(f"unknown device error code {code}")
        raise self.failure
