"""Host-side ordering of an op's work across streams and CUDA-graph captures.

Every call of an op moves its mailbox generation on, so the op's calls must run on the
device in the order they were issued, whatever stream each was issued on:

* ``CallOrder``: a call issued on another stream than the op's previous call waits for
  that call first (a change of stream is legal; overlapping calls are serialised, never
  interleaved). Inside a capture the wait becomes a graph dependency: an edge to an earlier
  call of the same capture, or an external event-wait node on the last eager call (a
  non-captured event may only be waited on from a capture that way). Graph replays are not
  seen by the host: replay a graph on the stream the op's eager calls use, or order the two
  yourself, as for any tensor a graph and eager work share.
* ``SideWork``: work an op forks onto its own side stream (GLM's mixes kernel; a stream of
  mhc's own, never one of torch's pooled streams: ``DedicatedStreams``). The main
  stream waits for it before the op's next call and at ``join``; the tensors it uses stay
  alive until then: ``record_stream`` in eager mode, a reference held until the join inside
  a capture (where a dropped output's memory would otherwise go to the next allocation of
  the same capture, racing the side kernel on every replay). Eager side work counts as joined
  only once the stream of the call that launched it has waited for it: a join or a call on any
  other stream (another thread's, say) waits for it too.

No event is queried or synchronised here: both are illegal while any stream captures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..binaries import cuda_runtime
from ..binaries.launch import current_stream_handle

#: Whether the current stream captures: torch's C accessor (what is_current_stream_capturing calls).
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


def current_capture(stream: torch.cuda.Stream) -> int:
    """0 when ``stream`` (the current stream) is not capturing, else its capture's process-unique id."""
    if not _is_capturing():
        return 0
    from cuda.bindings import runtime

    result = runtime.cudaStreamGetCaptureInfo(stream.cuda_stream)
    if result[0] != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamGetCaptureInfo failed: {result[0]}")
    return int(result[2])


#: Raw handle -> stream of every stream an op's call was captured on (``CallOrder.begin``): what
#: ``captures_in_progress`` asks about (a stream that ends its capture is forgotten then).
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def captures_in_progress() -> list[torch.cuda.Stream]:
    """The streams, of any thread, that captured an op's call and are capturing still. A device-wide
    synchronise while one captures would invalidate its graph (``close()`` asks first). A capture
    that has captured no op's call yet is not known here."""
    if not _CAPTURE_STREAMS:
        return []
    from cuda.bindings import runtime

    active = runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    busy = []
    for handle, stream in list(_CAPTURE_STREAMS.items()):
        error, status = runtime.cudaStreamIsCapturing(handle)
        if error == runtime.cudaError_t.cudaSuccess and status == active:
            busy.append(stream)
        else:
            _CAPTURE_STREAMS.pop(handle, None)
    return busy


class DedicatedStreams:
    """CUDA streams of mhc's own, one per live ``SideWork``. ``torch.cuda.Stream()`` hands out 32
    pooled streams per device round-robin: after 32 more, an op's side stream would be the caller's
    capture stream, another op's side stream or an engine's own, and the mixes kernel would wait
    for the boundary (or the engine's work for the mixes). A released stream goes to the next
    ``SideWork``, never destroyed: the caching allocator records an event on every stream a tensor
    was ``record_stream``-ed on when that tensor is freed, which may be after its op is gone."""

    def __init__(self, create: Callable[[torch.device], int] | None = None) -> None:
        self._create = create or cuda_runtime.create_non_blocking_stream
        self._free: dict[torch.device, list[int]] = {}
        # Re-entrant: a garbage collection inside ``acquire`` may drop a SideWork, whose __del__ releases.
        self._lock = threading.RLock()

    def acquire(self, device: torch.device) -> torch.cuda.Stream:
        """A stream on ``device`` no live ``SideWork`` and no torch pool hands out."""
        with self._lock:
            free = self._free.setdefault(device, [])
            handle = free.pop() if free else self._create(device)
        return torch.cuda.ExternalStream(handle, device=device)

    def release(self, stream: torch.cuda.Stream) -> None:
        """``stream`` (from ``acquire``) may go to the next ``SideWork``; later work there follows its own."""
        with self._lock:
            self._free.setdefault(stream.device, []).append(stream.cuda_stream)


#: Where every ``SideWork`` takes its stream from.
SIDE_STREAMS = DedicatedStreams()


@dataclass
class _Recorded:
    stream: torch.cuda.Stream
    event: torch.cuda.Event
    capture: int = 0
    held: list[torch.Tensor] = field(default_factory=list)


class CallOrder:
    """The device order of one op's calls (see the module docstring).

    The eager fast path costs two host queries: a call on the stream of the op's previous eager
    call, not capturing, orders nothing. The native program records ``done_handle`` at the end of
    every eager call (``mhc_core.host.calls.programs.RECORD_DONE``); a call on another stream waits for it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The op's persistent buffers (``own``): a stream that uses them is recorded on them, so
        # that their memory outlives that stream's work when the op is dropped.
        self._owned: list[torch.Tensor] = []
        self._streams: set[int] = set()
        self._eager_event = torch.cuda.Event(external=True)
        self._eager_event.record(torch.cuda.current_stream(device))  # creates it: its handle exists
        #: The raw handle native programs record at the end of an eager call.
        self.done_handle: int = self._eager_event.cuda_event
        self._eager: torch.cuda.Stream | None = None
        self._eager_handle = 0
        self._captured: _Recorded | None = None
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        #: The stream and capture id of the call in progress (between ``begin`` and ``end``).
        self.stream: torch.cuda.Stream | None = None
        self.capture = 0
        self.in_call = False
        #: Called once, at the op's first call inside a capture (the op then outlives its graphs).
        self.on_first_capture: Callable[[], None] | None = None

    def own(self, *tensors: torch.Tensor) -> None:
        self._owned.extend(tensors)

    def keep_owned(self, *tensors: torch.Tensor) -> None:
        """Own only ``tensors`` from now on (a closed op lets the rest go)."""
        self._owned = [tensor for tensor in self._owned if any(tensor is kept for kept in tensors)]

    def current(self) -> tuple[torch.cuda.Stream, int]:
        """The current stream and its capture id; the previous eager call's stream object when it
        is that one (torch's ``current_stream`` costs microseconds)."""
        eager = self._eager
        if eager is not None and not _is_capturing() and current_stream_handle(self._index) == self._eager_handle:
            return eager, 0
        stream = torch.cuda.current_stream(self.device)
        return stream, current_capture(stream)

    def begin(self) -> int:
        """Before a call's first launch: order it after the previous call; returns the capture id
        (0: eager)."""
        self.in_call = True
        stream, capture = self.current()
        if not capture and stream is self._eager:
            # The common eager case, a call on the stream of the previous one: nothing to order.
            self.stream, self.capture = stream, 0
            return 0
        if capture:
            _CAPTURE_STREAMS[stream.cuda_stream] = stream
        if capture and self.on_first_capture is not None:
            hook, self.on_first_capture = self.on_first_capture, None
            hook()
        captured = self._captured
        if capture and captured is not None and captured.capture == capture:
            if captured.stream != stream:
                stream.wait_event(captured.event)  # an edge within the capture
        elif self._eager is not None and self._eager != stream:
            # Inside a capture: an external event-wait node (the event was recorded outside).
            stream.wait_event(self._eager_event)
        if not capture:
            if stream.cuda_stream not in self._streams:
                self._streams.add(stream.cuda_stream)
                for tensor in self._owned:
                    tensor.record_stream(stream)
            self._eager, self._eager_handle = stream, stream.cuda_stream
        self.stream, self.capture = stream, capture
        return capture

    def end(self) -> None:
        """After a call's last launch on its stream (an eager call's native program recorded the
        done event; a captured call's is recorded here, a fresh one per call)."""
        self.in_call = False
        if self.capture:
            assert self.stream is not None, "CallOrder.end() without begin()"
            event = torch.cuda.Event()
            event.record(self.stream)
            self._captured = _Recorded(self.stream, event, self.capture)

    def cancel(self) -> None:
        """A call that launched nothing (its arguments were rejected)."""
        self.in_call = False

    def follow(self) -> None:
        """The current stream waits for the op's last eager call (no host wait: legal while another
        thread captures)."""
        stream = torch.cuda.current_stream(self.device)
        if self._eager is not None and self._eager != stream:
            stream.wait_event(self._eager_event)


class SideWork:
    """A side stream an op forks work onto, and the joins back (see the module docstring).

    Eager calls hand the native program the events to use (``launching``): it waits for the
    previous side work, forks and records the side event itself. Inside a capture the joins and
    records are made here, with a fresh event per call.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = SIDE_STREAMS.acquire(device)
        #: The raw handle of ``stream``, for launches onto it.
        self.handle: int = self.stream.cuda_stream
        current = torch.cuda.current_stream(device)
        # Events are created by their first record: record each once, so their handles exist.
        self._fork_event = torch.cuda.Event()
        self._fork_event.record(current)
        self._eager_event = torch.cuda.Event(external=True)
        self._eager_event.record(self.stream)
        #: Raw handles the native program records and waits on.
        self.fork_handle: int = self._fork_event.cuda_event
        self.eager_handle: int = self._eager_event.cuda_event
        self._eager_pending = False
        #: The stream of the call that made the last eager side launch (None: none yet). Only its
        #: join ends ``_eager_pending``; every other stream waits for the side work at its join or call.
        self._eager_stream: torch.cuda.Stream | None = None
        # The last eager side launch's tensors, kept until the work is joined (their memory then
        # goes back to the current stream, whose later work follows the join).
        self._eager_held: tuple[torch.Tensor, ...] = ()
        self._captured: _Recorded | None = None

    def own(self, *tensors: torch.Tensor) -> None:
        """Persistent buffers the side work uses: freed only after the side work enqueued so far."""
        for tensor in tensors:
            tensor.record_stream(self.stream)

    @property
    def idle(self) -> bool:
        """Nothing forked since the last join: a join has nothing to wait for."""
        return not self._eager_pending and self._captured is None

    def launching(
        self, stream: torch.cuda.Stream | None, capture: int, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[int, int]:
        """Before a side launch from ``stream``: the (join event, side event) for the call's native
        program. Eager, the pending side work's event (or 0) and the event to record; ``tensors`` are
        kept too until the next join, which now waits, whatever interrupts the call after its launch
        (``launched`` then keeps only these; a call rejected after this costs only a join that waits
        for earlier side work). Inside a capture the join happens here and the program gets (0, 0)."""
        if capture:
            assert stream is not None
            self.join(stream, capture)
            return 0, 0
        self._captured = None  # a capture that never joined its side work failed: nothing to wait for
        eager = self._eager_stream
        # Wait for side work not yet joined, or launched from another stream than this call's.
        waits = self._eager_pending or (eager is not None and stream is not eager and stream != eager)
        self._eager_held += tensors
        self._eager_pending = True
        self._eager_stream = stream
        handle = self.eager_handle
        return (handle if waits else 0), handle

    def launched(self, capture: int, tensors: tuple[torch.Tensor, ...], stream: torch.cuda.Stream | None) -> None:
        """After the side launch from ``stream`` (``launching`` came first): remember it for the next
        join; keep ``tensors`` alive until then."""
        if capture:
            event = torch.cuda.Event()
            event.record(self.stream)
            self._captured = _Recorded(self.stream, event, capture, list(tensors))
            return
        # The native program waited for the previous side work before this launch.
        self._eager_held = tensors

    def join(self, stream: torch.cuda.Stream, capture: int) -> None:
        """``stream`` waits for the last side work (of this capture, or the last eager one)."""
        captured = self._captured
        if captured is not None:
            if captured.capture == capture:
                stream.wait_event(captured.event)
                self._captured = None  # the wait orders every later use of its tensors after the side kernel
                return
            self._captured = None  # from another capture (that one ended or failed)
        if capture:
            if self._eager_pending:
                stream.wait_event(self._eager_event)  # an external event-wait node (recorded outside)
            return
        eager = self._eager_stream
        elsewhere = eager is not None and stream is not eager and stream != eager
        if self._eager_pending or elsewhere:
            stream.wait_event(self._eager_event)
            if not elsewhere:
                # The launching call's stream: its outputs' memory now follows the side work.
                self._eager_pending = False
                self._eager_held = ()

    def __del__(self) -> None:
        # Dropped with side work never joined: its tensors' memory must wait for the side stream.
        for tensor in getattr(self, "_eager_held", ()):
            tensor.record_stream(self.stream)
        if hasattr(self, "stream"):
            SIDE_STREAMS.release(self.stream)
