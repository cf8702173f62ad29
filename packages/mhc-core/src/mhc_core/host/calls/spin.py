"""Bounded spins: a device-side time limit on every poll, a sticky device error word, and
a host-mapped report the op raises from.

The host cannot watch a spinning kernel (it may itself be blocked inside a launch),
so the bound lives in the kernel: every poll loop gives up after ``limit_ns`` of
the global timer, records the generation, token and the ranks whose slots still
hold -0 in a pinned host buffer (readable without a device sync), sets the op's
device error word (``mhc_core.device.protocol``) and exits. From then on every kernel of
the op, eager, already queued or replayed from a CUDA graph, reads that word,
consumes no slot and writes NaN: nothing later is silently wrong. ``check()`` and
every later call raise ``LamportTimeoutError`` naming the missing ranks; the mailbox
is inconsistent (some slots were never consumed), so recovery is rebuilding the op
on every rank (collectively).

With the bound on, every collective also compares the M each rank published for its
generation (``TokenCountError``, a ``ValueError``, on a mismatch).

Which report wins: a failure (a timeout or unequal M: it poisons the op) is sticky on the device
(the error word is never cleared) and on the host (``check()`` keeps it and raises it again on
every later call). The finalize publish's route report (``check_routes=True``) poisons nothing and
has words of its own: it never overwrites a failure's report, and raising it clears only its own
words. With both pending, the failure is raised and its message names the route report too.
Concurrent failures (several CTAs timing out at once) write the same words; the ranks missing are
the union of theirs.

The same bound covers a side-stream kernel's wait for a handed-off row
(``mhc_core.device.handoff``, ``ERROR_HANDOFF_TIMEOUT``), with room for the producer's own
wait: ``2 * limit + HANDOFF_SLACK_MS``.

Default: on, at ``DEFAULT_SPIN_TIMEOUT_MS`` (10 minutes, the default timeout of a NCCL
process group): a dead or desynchronised peer turns into an error instead of a GPU
that spins forever, and no legitimately slow peer (another rank compiling, a long
prefill) gets near it. A bound costs one timer read per empty poll round (measured:
BENCHMARKS.md). ``spin_timeout_ms=0`` or ``MHC_SPIN_TIMEOUT_MS=0`` turns it off;
``spin_timeout_ms=`` or ``MHC_SPIN_TIMEOUT_MS`` sets another (``-0`` is refused like any
negative value: only 0 means off). Every rank must use
the same setting (the M check writes and reads a header only when it is on).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading

import torch

from ...constants import (
    ERROR_CLOSED,
    ERROR_CODE,
    ERROR_HANDOFF_TIMEOUT,
    ERROR_NONE,
    ERROR_RANKS,
    ERROR_SPIN_TIMEOUT,
    ERROR_STAGE,
    ERROR_TOKEN,
    ERROR_TOKEN_COUNT,
    ROUTE_CODE,
    ROUTE_INDEX,
    ROUTE_TOKEN,
)
from .streams import captures_in_progress

SPIN_TIMEOUT_ENV = "MHC_SPIN_TIMEOUT_MS"
#: The bound an op gets when neither ``spin_timeout_ms`` nor ``MHC_SPIN_TIMEOUT_MS`` says otherwise.
DEFAULT_SPIN_TIMEOUT_MS = 600_000.0
#: What a side-stream hand-off wait gets beyond twice the collective's bound (its compute, launch gaps).
HANDOFF_SLACK_MS = 500.0


class LamportTimeoutError(RuntimeError):
    """A collective gave up waiting for some ranks' publishes."""

    def __init__(self, message: str, *, stage: int, token: int, missing_ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.stage = stage
        self.token = token
        self.missing_ranks = missing_ranks


class TokenCountError(ValueError):
    """Ranks published different token counts M for one call (every rank must pass the same M)."""

    def __init__(self, message: str, *, m: int, peer_m: dict[int, int]) -> None:
        super().__init__(message)
        self.m = m
        self.peer_m = peer_m
        self.ranks = tuple(peer_m)


class RouteIndexError(ValueError):
    """The finalize publish met a route index outside [-1, rows) (debug mode; the route was dropped)."""


#: The range of a spin bound that is on. Below a microsecond the bound rounds to 0 ns (1e-7 ms
#: would turn it off while the op reported 1e-07); above 1e9 ms (11.6 days, far beyond any
#: collective's wait) the device's deadlines (a global-timer reading plus twice the bound plus
#: ``HANDOFF_SLACK_MS``, in Int64 nanoseconds) would come near overflowing.
MIN_SPIN_TIMEOUT_MS = 0.001
MAX_SPIN_TIMEOUT_MS = 1e9
_SPIN_RANGE = f"0 (off) or a finite value in [{MIN_SPIN_TIMEOUT_MS}, {MAX_SPIN_TIMEOUT_MS:.0e}] ms"


def resolve_timeout_ms(spin_timeout_ms: float | None) -> float | None:
    """The explicit argument, else ``MHC_SPIN_TIMEOUT_MS``, else ``DEFAULT_SPIN_TIMEOUT_MS``;
    0 means off (None). Anything else outside ``[MIN_SPIN_TIMEOUT_MS, MAX_SPIN_TIMEOUT_MS]`` (nan,
    inf, negatives, values that round to 0 ns, values that overflow the device's deadlines) raises,
    naming the argument or the variable it came from."""
    source = "spin_timeout_ms"
    if spin_timeout_ms is None:
        raw = os.environ.get(SPIN_TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_SPIN_TIMEOUT_MS
        source = SPIN_TIMEOUT_ENV
        try:
            spin_timeout_ms = float(raw)
        except ValueError:
            raise ValueError(f"{SPIN_TIMEOUT_ENV}: expected {_SPIN_RANGE}, got {raw!r}") from None
    if isinstance(spin_timeout_ms, bool) or not isinstance(spin_timeout_ms, (int, float)):
        raise TypeError(f"{source}: expected a float or None, got {type(spin_timeout_ms).__name__}")
    if spin_timeout_ms == 0 and math.copysign(1.0, spin_timeout_ms) > 0:  # -0 is a negative value, not "off"
        return None
    if not MIN_SPIN_TIMEOUT_MS <= spin_timeout_ms <= MAX_SPIN_TIMEOUT_MS:  # nan compares false
        raise ValueError(f"{source}: expected {_SPIN_RANGE}, got {spin_timeout_ms}")
    return float(spin_timeout_ms)


class _ReportSlots:
    """Pinned report words, each op's slot handed out once and never reused or freed: a kernel
    queued (or captured in a CUDA graph) when its op is dropped may still write its report, and
    must never write into memory the process has given to something else (issue #32). One
    pinned chunk serves ``CHUNK_WORDS // SLOT_WORDS`` ops."""

    CHUNK_WORDS = 1 << 14
    SLOT_WORDS = 32  # 128 bytes: a report and up to 24 ranks

    def __init__(self) -> None:
        self._chunks: list[torch.Tensor] = []
        self._next = self.CHUNK_WORDS
        self._lock = threading.Lock()

    def take(self, words: int) -> torch.Tensor:
        """``words`` zeroed int32 words of a slot nobody else ever gets."""
        if words > self.SLOT_WORDS:
            raise ValueError(f"an error report of {words} words: expected at most {self.SLOT_WORDS}")
        with self._lock:
            if self._next + self.SLOT_WORDS > self.CHUNK_WORDS:
                self._chunks.append(torch.zeros(self.CHUNK_WORDS, dtype=torch.int32, pin_memory=True))
                self._next = 0
            start, self._next = self._next, self._next + self.SLOT_WORDS
            return self._chunks[-1][start : start + words]


_REPORT_SLOTS = _ReportSlots()


class SpinGuard:
    """The pinned error report of one op: ``[code, stage, token, detail, rank 0 .. tp-1]``
    (the kernels' sticky device word lives in the op's stage state)."""

    def __init__(self, tp: int, timeout_ms: float | None, device: torch.device, rank: int = 0) -> None:
        self.tp = tp
        self.rank = rank
        self.timeout_ms = timeout_ms
        self.limit_ns = int(timeout_ms * 1e6) if timeout_ms else 0
        #: The side-stream hand-off bound: the producer's own wait, twice, and slack.
        self.handoff_limit_ns = 2 * self.limit_ns + int(HANDOFF_SLACK_MS * 1e6) if self.limit_ns else 0
        #: Whether publishes write, and collectives compare, every rank's M (the bound is on).
        self.checks_token_counts = bool(self.limit_ns) and tp > 1
        # Pinned host memory is mapped into the device's address space under UVA: the kernels
        # store into it at its host address. A slot of its own, never freed (``_REPORT_SLOTS``).
        self.flag = _REPORT_SLOTS.take(ERROR_RANKS + tp)
        self.address = self.flag.data_ptr()
        # Read through ctypes at that address: every index is a fresh load of host memory the
        # kernels write (no numpy needed; the tensor stays alive in the slot pool).
        self._words = (ctypes.c_int32 * self.flag.numel()).from_address(self.address)
        self.device = device
        self.failure: Exception | None = None

    def check(self) -> None:
        """Raise what a kernel reported. A failure (a code that poisons the op: a timeout, unequal
        M) wins over a route report, is never cleared and is raised again by every later call; a
        route report alone is raised once, then its words are cleared (the op stays usable)."""
        if self.failure is not None:
            # The same class and attributes (missing_ranks, peer_m ...), without calling __init__.
            again = type(self.failure).__new__(type(self.failure))
            again.__dict__.update(self.failure.__dict__)
            again.args = (f"{self.failure.args[0]} (reported earlier)",)
            raise again from self.failure
        if self._words[ERROR_CODE] == ERROR_NONE and self._words[ROUTE_CODE] == ERROR_NONE:
            return
        if torch.cuda.is_current_stream_capturing() or captures_in_progress():
            # No synchronise while a capture is in progress (it would invalidate the graph), so the
            # reporting kernel may still be writing its words: a failure (sticky on the device
            # whatever its details) is raised but not kept, and a route report is neither raised
            # nor cleared; the next check outside a capture synchronises and reads them whole.
            if self._words[ERROR_CODE] != ERROR_NONE:
                raise self._decode(int(self._words[ERROR_CODE]), [int(w) for w in self._words])
            return
        # The reporting kernel has finished waiting; let it finish writing the report.
        torch.cuda.synchronize(self.device)
        words = [int(w) for w in self._words]  # read after the sync: a failure may have come meanwhile
        route = self._route_error(words) if words[ROUTE_CODE] != ERROR_NONE else None
        if words[ERROR_CODE] != ERROR_NONE:
            failure = self._decode(words[ERROR_CODE], words)
            if route is not None:
                failure.args = (f"{failure.args[0]} (a route report was pending too: {route})",)
            self.failure = failure
            raise failure
        for word in range(ROUTE_CODE, ROUTE_INDEX + 1):
            self._words[word] = 0
        assert route is not None
        raise route

    def _route_error(self, words: list[int]) -> RouteIndexError:
        return RouteIndexError(
            f"expanded_idx_to_permuted_idx: token {words[ROUTE_TOKEN]}, route {words[ROUTE_INDEX]} "
            "held an index outside [-1, rows); that route was dropped"
        )

    def _decode(self, code: int, words: list[int]) -> Exception:
        rebuild = "the op is unusable: rebuild it on every rank"
        if code == ERROR_SPIN_TIMEOUT:
            missing = tuple(rank for rank in range(self.tp) if words[ERROR_RANKS + rank])
            return LamportTimeoutError(
                f"rank {self.rank}: Lamport collective timed out after {self.timeout_ms} ms waiting for generation "
                f"(stage) {words[ERROR_STAGE]}, token {words[ERROR_TOKEN]}: ranks {list(missing)} never published; "
                f"{rebuild}",
                stage=words[ERROR_STAGE],
                token=words[ERROR_TOKEN],
                missing_ranks=missing,
            )
        if code == ERROR_HANDOFF_TIMEOUT:
            return LamportTimeoutError(
                f"rank {self.rank}: the side-stream kernel timed out after {self.handoff_limit_ns / 1e6} ms waiting "
                f"for token {words[ERROR_TOKEN]}'s hand-off row (the main-stream kernel never wrote it); {rebuild}",
                stage=-1,
                token=words[ERROR_TOKEN],
                missing_ranks=(),
            )
        if code == ERROR_TOKEN_COUNT:
            m = words[ERROR_TOKEN]
            peers = {rank: words[ERROR_RANKS + rank] for rank in range(self.tp) if words[ERROR_RANKS + rank]}
            described = ", ".join(f"rank {rank} M = {peer}" for rank, peer in peers.items())
            return TokenCountError(
                f"rank {self.rank}: this call has M = {m} but {described} for the same call (generation "
                f"{words[ERROR_STAGE]}): every rank must pass the same M; {rebuild}",
                m=m,
                peer_m=peers,
            )
        if code == ERROR_CLOSED:
            return RuntimeError(f"rank {self.rank}: the op was closed: build a new op (collectively) to call it again")
        return RuntimeError(f"unknown device error code {code}; {rebuild}")
