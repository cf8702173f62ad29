"""The host-overhead suite (``--suite host``): eager cost per call of every op, next to torch's.

Each figure: bursts of back-to-back eager calls after a warm-up, outputs allocated by the op
(no ``out=``), M = 1. *host* is the time the host thread spends per call (the launches are
queued, nothing synchronises); *wall* adds the wait for the device at the end, per call. In
the same run: ``F.rms_norm``, ``x.add_(1)`` and ``torch.empty_like`` for scale, and the launch
floor, a one-warp DSL kernel with one pointer launched through its bare TVM-FFI entry point,
through ``BoundKernel`` and through a native program (``mhc_core.host.calls.programs``: the ops' own
per-call path, with nothing to check or allocate). Each registered model gives its own paths
(``BenchmarkCase.host_steps``: its calls, custom ops and loopback tp 2, both ranks' calls through
``run_ranks``, per rank), measured after those.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from mhc_core.bench.case import cases
from mhc_core.bench.host import Step
from mhc_core.bench.records import bf16
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Signature, Stream


@dataclass(frozen=True)
class TouchConfig:
    """No constants: the floor kernel is the same everywhere."""


class TouchKernel(DeviceKernel):
    """One warp that does nothing: what a launch costs on the host, apart from any kernel's work."""

    name = "touch"
    config_type = TouchConfig

    def signature(self) -> Signature:
        return (Param("flag", Ptr(Int32, 4)), Param("stream", Stream()))

    @cute.jit
    def __call__(self, flag: cute.Pointer, stream) -> None:
        self.kernel(flag).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, flag: cute.Pointer) -> None:
        cute.arch.thread_idx()


def interleaved_us(steps: list[Step], rounds: int = 40, burst: int = 100) -> dict[str, tuple[float, float, float]]:
    """``{label: (median host, best host, median wall)}`` microseconds per call. Every round runs a
    burst of each step in turn, so a shared host's slow spells fall on all paths alike (one path's
    1000 calls in a row can land wholly in one); the median and the best of the rounds' means are
    what an A/B of two trees compares, each beside ``F.rms_norm`` of the same rounds."""
    for s in steps:
        for _ in range(burst):
            s.step()
    torch.cuda.synchronize()
    host: dict[str, list[float]] = {s.label: [] for s in steps}
    wall: dict[str, list[float]] = {s.label: [] for s in steps}
    for _ in range(rounds):
        for s in steps:
            start = time.perf_counter()
            for _ in range(burst):
                s.step()
            queued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            calls = burst * s.per_step
            host[s.label].append((queued - start) * 1e6 / calls)
            wall[s.label].append((done - start) * 1e6 / calls)
    median = statistics.median
    return {s.label: (median(host[s.label]), min(host[s.label]), median(wall[s.label])) for s in steps}


def rows(m: int = 1) -> list[tuple[str, int, float, float, float, int]]:
    """``(label, tp, host us, best host us, wall us, launches)`` of every measured step
    (``interleaved_us``: medians and the best of the rounds)."""
    from mhc_core.host.binaries.compiler import compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel, current_stream_handle
    from mhc_core.host.calls.programs import Launch, Pointer, Program
    from mhc_core.host.calls.rules import M, tensor

    device = torch.device("cuda", torch.cuda.current_device())
    steps: list[Step] = []
    flag = torch.zeros(4, dtype=torch.int32, device=device)
    touch = compile_kernel(TouchKernel(TouchConfig()), device_arch(device))
    bound = BoundKernel(touch.function, touch.signature, {}, device)
    entry, address, stream = touch.function, flag.data_ptr(), current_stream_handle(device.index)
    steps.append(Step("launch floor: bare TVM-FFI entry point", 1, lambda: entry(address, stream), 1))
    steps.append(Step("launch floor: BoundKernel", 1, lambda: bound(flag=flag), 1))
    # One tensor parameter (what gives a program its stream): checked, then its pointer launched.
    floor = Program(
        (tensor("flag", (M,), dtype=torch.int32, align=4),),
        (),
        [Launch([entry], touch.signature, {"flag": Pointer("flag")})],
        device,
        4,
    )
    native = floor.native
    steps.append(Step("launch floor: native program", 1, lambda: native(0, -1, -1, 0, 0, flag), 1))
    x, weight = bf16(m, 4096), bf16(4096)
    steps.append(Step("torch F.rms_norm", 1, lambda: torch.nn.functional.rms_norm(x, (4096,), weight, 1e-6), 1))
    steps.append(Step("torch x.add_(1)", 1, lambda: x.add_(1), 1))
    steps.append(Step("torch.empty_like (no launch)", 1, lambda: torch.empty_like(x), 0))

    for case in cases():
        steps += case.host_steps(m, device)
    measured = interleaved_us(steps)
    return [(s.label, s.tp, *measured[s.label], s.launches) for s in steps]
