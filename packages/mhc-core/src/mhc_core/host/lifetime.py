"""An op's lifetime: whether it may be called (closed, poisoned, peers missing), poisoning, ``check``
and ``close``, and what a CUDA graph that captured it keeps after ``close()``.

Exceptions: a call the native checks reject (``TypeError`` / ``ValueError`` before any launch), or
that fails before its launch, changes nothing. Any other exception from the moment a call enters
its launch until its bookkeeping is done leaves the op unable to say whether the call ran on the
device; the op poisons itself on the host (``OpPoisonedError``). See ``mhc_core.host.op``.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from ..constants import ERROR_CLOSED, ERROR_COPY, ERROR_WORD
from . import library
from .calls.streams import captures_in_progress
from .ranks.mailbox import LamportMailbox

#: Ops a CUDA graph captured, by id, kept alive until ``close()``: a graph may replay them any time.
_CAPTURED: dict[int, Any] = {}
#: What closed ops that a graph captured leave to their replays (``Lifetime._replay_state``), kept for
#: the life of the process: a few small buffers per op.
_RETIRED: list[tuple[Any, ...]] = []


class OpPoisonedError(RuntimeError):
    """An exception interrupted a call of the op after its kernels may have launched: the host no
    longer knows whether the call ran, so every later call raises this (rebuild the op on every rank)."""


class Lifetime:
    """Usability, poisoning and ``close()`` (a mixin of ``LamportOp``)."""

    # Set by ``LamportOp.__init__``; declared for type checkers (a mixin's first assignment fixes them).
    _poisoned: str | None
    _peers_ready: bool
    #: The steps of ``close()`` done so far (``_release``): a failed close() resumes after them.
    _close_done: set[str]

    def _call_failed(self, error: BaseException) -> None:
        """A call path raised. Before its launch (rejected by the native checks, or failed earlier)
        nothing changed; from its launch on, the op poisons itself (see the module docstring)."""
        if self._in_launch:
            self._poison(error)
        self._order.cancel()

    def _poison(self, error: BaseException) -> None:
        """Make every later call (and ``check()``) raise ``OpPoisonedError`` saying why. Only the
        message is kept: the exception's traceback would keep the call's tensors alive."""
        what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self._poisoned = (
            f"{type(self).__name__} (rank {self.rank}) is unusable: a call raised {what} after its kernels may "
            "have launched, so this process cannot tell whether the call ran on the device (the mailbox "
            "generation, a pending publish or side work may be ahead of what the host knows); rebuild the op "
            "on every rank"
        )

    def _ensure_usable(self) -> None:
        """The hot paths' check: ``_check_usable`` only when something may be wrong."""
        if self._closed or self._poisoned is not None or not self._peers_ready:
            self._check_usable()

    # --------------------------------------------------------------- public API
    @property
    def state(self) -> torch.Tensor:
        """The int32 stage state the kernels advance (and poison): what the ``torch.ops.mhc`` custom
        ops declare mutated, so a compiled graph keeps every call, in order (``mhc_core.host.library``)."""
        assert self.mailbox is not None, "the op is not built yet"
        return self.mailbox.stage_state

    def check(self) -> None:
        """Raise any error a kernel reported (spin timeout, bad route index), or the op's poisoning."""
        with self._lock:
            self.spin.check()
            if self._poisoned is not None:
                raise OpPoisonedError(self._poisoned)

    @property
    def ready(self) -> bool:
        """Whether every rank of the op's group has built it (only loopback ranks can lag)."""
        return not self.group.missing_peers(self)

    def close(self) -> None:
        """Free the mailbox (symmetric memory for a process group) and the op's buffers, once no
        kernel can still use them; idempotent, and every later call raises. Collective over the
        group, like construction: every rank closes (a rank's peers store into its mailbox).

        CUDA graphs that captured the op may outlive it: close() first poisons the op on the device
        (its stage state's error word), so a later replay runs kernels that touch no mailbox and
        write NaN outputs, then frees the mailbox and keeps, for the life of the process, the few
        small buffers such a replay still touches (stage state, destination table, error report,
        events, the model's own ``model_device_state``). An op a graph captured is kept alive until close(), whatever
        references the caller drops: garbage collection never frees memory a replay could write.

        A release that raises (a capture in progress on another thread: the device cannot be
        synchronised; a peer gone: the barrier fails) leaves the op closed on the host and poisoned
        on the device, holding what it has not released yet; the next close() retries from there."""
        with self._lock:  # a call in flight on another thread finishes first
            if "released" in self._close_done:
                return
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("close(): not inside a CUDA-graph capture (it synchronises the device)")
            self._closed = True
            self._release()

    #: The core's attributes holding device memory (or programs bound to it, or streams recorded on
    #: it) that ``close()`` drops; a model's op lists its own in ``model_device_state``
    #: (``mhc_core.host.calls.contract.ModelOp``).
    _device_state: tuple[str, ...] = (
        "mailbox", "_programs", "_publish_kernel", "_finalize_kernels", "_order", "_side_work",
    )  # fmt: skip

    def _outlive_graphs(self) -> None:
        """The op's first call inside a CUDA-graph capture: keep the op alive until ``close()``."""
        _CAPTURED[id(self)] = self

    def _release(self) -> None:
        """Drop every reference to device memory once the device (and, for a process group, every
        rank) is done with it, in steps a failed close() resumes (``_close_done``): poison the op
        on the device first (before anything that can fail), wait for the device (never while a
        capture is in progress: ``captures_in_progress``), the barrier, then the references. A
        loopback group keeps its ranks' mailboxes until it is dropped. An op a graph captured
        leaves what its replays touch in ``_RETIRED``."""
        done, mailbox = self._close_done, self.mailbox
        if "poisoned" not in done:
            if mailbox is not None:
                self._poison_replays(mailbox.stage_state)
            done.add("poisoned")
        if "synchronised" not in done:
            busy = captures_in_progress()
            if busy:
                raise RuntimeError(
                    f"close(): a CUDA-graph capture is in progress on stream(s) "
                    f"{[hex(stream.cuda_stream) for stream in busy]} (another thread): close() must synchronise the "
                    "device, which would invalidate it. The op is closed and poisoned on the device (a graph that "
                    "captured it replays NaN) but still holds its mailbox: call close() again once the capture ends"
                )
            torch.cuda.synchronize(self.device)
            done.add("synchronised")
        if "barrier" not in done:
            try:
                self.group.barrier()
            except Exception as error:
                error.add_note(
                    f"close() of {type(self).__name__} (rank {self.rank}): the ranks' barrier failed; the op is "
                    "closed and poisoned but keeps its mailbox (a peer may still store into it): call close() "
                    "again to retry the barrier"
                )
                raise
            done.add("barrier")
        captured = _CAPTURED.pop(id(self), None) is not None
        library.unregister(self.handle)
        if captured and mailbox is not None:
            _RETIRED.append(self._replay_state(mailbox))
        for name in (*self._device_state, *self.model_device_state):
            if hasattr(self, name):
                setattr(self, name, None)
        done.add("released")

    def _poison_replays(self, stage_state: torch.Tensor) -> None:
        """Set both copies of the op's device error word: every kernel launched or replayed from now
        on is poisoned (it polls, re-arms and stores into no mailbox, and writes NaN). On the current
        stream, after the op's last eager call, with no host wait (legal while another thread
        captures): the device synchronise that follows orders it before the barrier."""
        self._order.follow()
        for word in (ERROR_WORD, ERROR_COPY):
            stage_state.narrow(0, word, 1).fill_(ERROR_CLOSED)

    def _replay_state(self, mailbox: LamportMailbox) -> tuple[Any, ...]:
        """What a poisoned replay of this op's kernels still reads or writes: everything but the
        mailbox's memory (the order keeps only the stage state and destination table recorded)."""
        self._order.keep_owned(mailbox.stage_state, mailbox.destinations)
        names = (*self._device_state, *self.model_device_state)
        kept = (name for name in names if name not in ("mailbox", "_programs"))
        return (mailbox.stage_state, mailbox.destinations, self.spin, *(getattr(self, name, None) for name in kept))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed: build a new op (collectively) to call it again")
        self.spin.check()
        if self._poisoned is not None:
            raise OpPoisonedError(self._poisoned)
        missing = self.group.missing_peers(self)
        if missing:
            raise RuntimeError(
                f"loopback rank {self.rank}: this op is unusable until every rank of its LoopbackGroup "
                f"has built the same op; ranks {missing} have not"
            )
        self._peers_ready = True  # ranks never leave a group: no need to ask again
