"""``mhc_core.host.calls.streams.SideWork``'s bookkeeping without a GPU: which event each call's native
program waits on and records, when a join waits, and how long the side kernel's tensors are kept.
CUDA streams and events are stand-ins that log the waits; the logic under test is the real class.
(The GPU tests run the same sequences on real streams: tests/lifecycle, tests/core/test_misuse_gpu.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from mhc_core.host.calls import streams


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.cuda_stream = name, log, id(self)

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "waits", event.name))


class FakeEvent:
    count = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        FakeEvent.count += 1
        self.name = f"event{FakeEvent.count}"
        self.cuda_event = 1000 + FakeEvent.count

    def record(self, stream: object = None) -> None:
        pass


@pytest.fixture
def side(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    log: list = []
    main = FakeStream("main", log)
    cuda = SimpleNamespace(Event=FakeEvent, current_stream=lambda device=None: main)
    monkeypatch.setattr(streams, "torch", SimpleNamespace(cuda=cuda))
    acquire = lambda device: FakeStream("side", log)  # noqa: E731
    monkeypatch.setattr(streams, "SIDE_STREAMS", SimpleNamespace(acquire=acquire, release=lambda stream: None))
    work = streams.SideWork(torch.device("cpu"))
    yield SimpleNamespace(work=work, main=main, other=FakeStream("other", log), log=log)
    work._eager_held = ()  # its __del__ would record them on the stand-in stream


def tensors(count: int = 2) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(1) for _ in range(count))


def test_the_first_eager_launch_waits_for_nothing_and_records_the_side_event(side) -> None:
    held = tensors()
    join, event = side.work.launching(side.main, 0, held)
    assert (join, event) == (0, side.work.eager_handle)
    side.work.launched(0, held, side.main)
    assert not side.work.idle and side.work._eager_held == held


def test_a_join_on_the_launching_stream_waits_once_and_lets_the_tensors_go(side) -> None:
    held = tensors()
    side.work.launching(side.main, 0, held)
    side.work.launched(0, held, side.main)
    side.work.join(side.main, 0)
    assert side.log == [("main", "waits", side.work._eager_event.name)]
    assert side.work.idle and side.work._eager_held == ()
    side.work.join(side.main, 0)
    assert len(side.log) == 1, "a second join has nothing to wait for"


def test_a_launch_before_the_previous_side_work_was_joined_waits_for_it(side) -> None:
    first, second = tensors(), tensors()
    side.work.launching(side.main, 0, first)
    side.work.launched(0, first, side.main)
    join, _ = side.work.launching(side.main, 0, second)
    assert join == side.work.eager_handle
    assert side.work._eager_held == first + second, "kept together until the launch is known to have run"
    side.work.launched(0, second, side.main)
    assert side.work._eager_held == second, "the native program waited for the first side work"


def test_another_stream_waits_for_side_work_its_join_does_not_end(side) -> None:
    held = tensors()
    side.work.launching(side.main, 0, held)
    side.work.launched(0, held, side.main)
    side.work.join(side.main, 0)
    side.work.join(side.other, 0)  # joined on main, not yet on other
    assert side.log[-1] == ("other", "waits", side.work._eager_event.name)
    join, _ = side.work.launching(side.other, 0, tensors())
    assert join == side.work.eager_handle, "a call on another stream waits for side work launched elsewhere"


def test_an_interrupted_call_leaves_its_side_tensors_kept_until_a_join(side) -> None:
    held = tensors()
    side.work.launching(side.main, 0, held)  # the launch may have run; launched() never came
    assert not side.work.idle and side.work._eager_held == held
    side.work.join(side.main, 0)
    assert side.work.idle and side.work._eager_held == ()


def test_inside_a_capture_the_join_is_a_graph_edge_and_the_program_gets_no_events(side) -> None:
    held = tensors()
    assert side.work.launching(side.main, 7, held) == (0, 0)
    side.work.launched(7, held, side.main)
    captured = side.work._captured
    assert captured is not None and captured.held == list(held)
    side.work.join(side.main, 7)
    assert side.log == [("main", "waits", captured.event.name)] and side.work._captured is None


def test_a_capture_waits_on_eager_side_work_recorded_outside_it(side) -> None:
    held = tensors()
    side.work.launching(side.main, 0, held)
    side.work.launched(0, held, side.main)
    side.work.join(side.main, 3)
    assert side.log == [("main", "waits", side.work._eager_event.name)]
    assert not side.work.idle, "only an eager join on the launching stream ends eager side work"


def test_side_work_of_an_ended_capture_is_forgotten(side) -> None:
    held = tensors()
    side.work.launching(side.main, 7, held)
    side.work.launched(7, held, side.main)
    side.work.join(side.main, 8)  # another capture: that one ended or failed
    assert side.work._captured is None and side.log == []


# ----------------------------------------------------- the side stream: mhc's own, not torch's pool
class FakeExternalStream:
    def __init__(self, handle: int, device: torch.device) -> None:
        self.cuda_stream, self.device = handle, device


@pytest.fixture
def dedicated(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A real ``DedicatedStreams`` whose CUDA streams are numbers (``created`` logs each creation)."""
    created: list[tuple[torch.device, int]] = []

    def create(device: torch.device) -> int:
        created.append((device, 100 + len(created)))
        return created[-1][1]

    cuda = SimpleNamespace(Event=FakeEvent, ExternalStream=FakeExternalStream, current_stream=lambda device=None: None)
    monkeypatch.setattr(streams, "torch", SimpleNamespace(cuda=cuda))
    pool = streams.DedicatedStreams(create)
    monkeypatch.setattr(streams, "SIDE_STREAMS", pool)
    return SimpleNamespace(pool=pool, created=created)


def test_live_side_works_never_share_a_stream_and_a_dropped_ones_is_reused(dedicated) -> None:
    """torch.cuda.Stream() would hand the 33rd caller the first one's stream again (a pool of 32):
    each live SideWork here has a stream of its own, however many there are; a dropped one's
    stream goes to the next SideWork instead of a new stream being created."""
    cpu = torch.device("cpu")
    works = [streams.SideWork(cpu) for _ in range(40)]
    handles = [work.handle for work in works]
    assert len(set(handles)) == 40 and len(dedicated.created) == 40
    dropped = works.pop(7).handle  # SideWork.__del__ releases its stream
    assert streams.SideWork(cpu).handle == dropped and len(dedicated.created) == 40


def test_streams_are_kept_apart_by_device(dedicated) -> None:
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)
    first = dedicated.pool.acquire(zero)
    dedicated.pool.release(first)
    on_one = dedicated.pool.acquire(one)
    assert on_one.cuda_stream != first.cuda_stream and on_one.device == one
    assert dedicated.pool.acquire(zero).cuda_stream == first.cuda_stream
    assert [device for device, _ in dedicated.created] == [zero, one]


def test_a_side_work_dropped_inside_acquire_does_not_deadlock(dedicated) -> None:
    """A garbage collection can run inside ``acquire`` (it allocates) and drop a SideWork, whose
    __del__ releases its stream to the same pool on the same thread: the pool's lock is re-entrant."""
    import threading

    cpu = torch.device("cpu")
    victims = [streams.SideWork(cpu)]
    create = dedicated.pool._create

    def create_while_collecting(device: torch.device) -> int:
        victims.clear()  # what a collection inside the allocation would do
        return create(device)

    dedicated.pool._create = create_while_collecting
    worker = threading.Thread(target=lambda: streams.SideWork(cpu), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "acquire deadlocked on its own lock"


# ------------------------------------------- the stream's creation: torch's libcudart, not cuda.bindings
class FakeRuntime:
    """``cudaStreamCreateWithFlags`` and ``cudaGetErrorString`` of a stand-in libcudart."""

    def __init__(self, status: int) -> None:
        self.status, self.flags = status, []

    def cudaStreamCreateWithFlags(self, handle: object, flags: int) -> int:
        self.flags.append(flags)
        handle._obj.value = 0x5EED  # type: ignore[attr-defined]  (a ctypes byref)
        return self.status

    def cudaGetErrorString(self, status: int) -> bytes:
        return b"out of memory"


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    import contextlib

    from mhc_core.host.binaries import cuda_runtime

    fake = FakeRuntime(0)
    monkeypatch.setattr(cuda_runtime, "runtime", lambda: fake)
    monkeypatch.setattr(cuda_runtime.torch.cuda, "device", lambda device: contextlib.nullcontext())
    yield fake


def test_a_side_stream_is_created_non_blocking_through_torchs_libcudart(fake_cudart) -> None:
    """The default ``DedicatedStreams`` creates each stream with ``cudaStreamNonBlocking`` through the
    CUDA runtime torch loaded (``mhc_core.host.binaries.cuda_runtime``), not through ``cuda.bindings``
    (whose runtime module takes ~0.1 s to import: twice a cold op's 0.05 s)."""
    from mhc_core.host.binaries import cuda_runtime

    device = torch.device("cuda", 3)
    assert streams.DedicatedStreams()._create is cuda_runtime.create_non_blocking_stream
    assert cuda_runtime.create_non_blocking_stream(device) == 0x5EED
    assert fake_cudart.flags == [cuda_runtime.STREAM_NON_BLOCKING] == [1]


def test_a_stream_that_cannot_be_created_names_the_device_and_the_cuda_error(fake_cudart) -> None:
    from mhc_core.host.binaries import cuda_runtime

    fake_cudart.status = 2
    with pytest.raises(
        RuntimeError, match=r"cudaStreamCreateWithFlags failed on cuda:3: CUDA error 2 \(out of memory\)"
    ):
        cuda_runtime.create_non_blocking_stream(torch.device("cuda", 3))
