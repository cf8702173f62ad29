"""The host-overhead suite (``--suite host``): eager cost per call of every op, next to torch's.

Each figure: bursts of back-to-back eager calls after a warm-up, outputs allocated by the op
(no ``out=``), M = 1. *host* is the time the host thread spends per call (the launches are
queued, nothing synchronises); *wall* adds the wait for the device at the end, per call. In
the same run: ``F.rms_norm``, ``x.add_(1)`` and ``torch.empty_like`` for scale, and the launch
floor, a one-warp DSL kernel with one pointer launched through its bare TVM-FFI entry point,
through ``BoundKernel`` and through a native program (``mhc_core.host.programs``: the ops' own
per-call path, with nothing to check or allocate). Loopback tp 2: both ranks' calls through
``run_ranks``, per rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Signature, Stream

from .suites import bf16, dsv41_inputs, glm5_inputs


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


@dataclass(frozen=True)
class Step:
    """One measured path: ``step`` makes ``per_step`` calls (loopback ranks: one per rank)."""

    label: str
    tp: int
    step: Callable[[], object]
    launches: int
    per_step: int = 1


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


def _dsv_args(m: int, hidden: int = 5120) -> tuple:
    return (bf16(m, hidden), *dsv41_inputs(m, hidden))


def _glm_args(m: int, hidden: int = 4096) -> tuple:
    return (bf16(m, hidden), *glm5_inputs(m, hidden))


def _moe_args(m: int, top_k: int, hidden: int = 5120) -> tuple:
    rows = m * top_k
    return (
        bf16(rows, hidden), torch.rand(m, top_k, device="cuda"),
        torch.randperm(rows, device="cuda").to(torch.int32).view(m, top_k), bf16(m, hidden),
    )  # fmt: skip


def rows(m: int = 1) -> list[tuple[str, int, float, float, float, int]]:
    """``(label, tp, host us, best host us, wall us, launches)`` of every measured step
    (``interleaved_us``: medians and the best of the rounds)."""
    from mhc_core import LoopbackGroup, run_ranks
    from mhc_core.host.calls import M, tensor
    from mhc_core.host.compiler import compile_kernel, device_arch
    from mhc_core.host.launch import BoundKernel, current_stream_handle
    from mhc_core.host.programs import Launch, Pointer, Program
    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

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

    dsv = AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=max(m, 8), device=device)
    args = _dsv_args(m)
    steps.append(Step("AllReduceMHC.__call__", 1, lambda: dsv(*args), 1))
    moe = _moe_args(m, dsv.top_k)
    steps.append(Step("AllReduceMHC.finalize", 1, lambda: dsv.finalize(*moe, *args[1:]), 2))
    glm = AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=max(m, 8), device=device)
    glm_args = _glm_args(m)

    def glm_step() -> None:
        glm(*glm_args)
        glm.join()

    steps.append(Step("AllReduceMhcBoundary.__call__ + join()", 1, glm_step, 2))
    # With the caller's outputs (an engine's preallocated buffers): the same calls without torch's
    # output allocations, i.e. everything the op itself costs.
    dsv_out = dsv(*args)
    steps.append(Step("AllReduceMHC.__call__(out=...)", 1, lambda: dsv(*args, out=dsv_out), 1))
    glm_out = glm(*glm_args)
    glm.join()

    def glm_step_out() -> None:
        glm(*glm_args, out=glm_out)
        glm.join()

    steps.append(Step("AllReduceMhcBoundary.__call__(out=...) + join()", 1, glm_step_out, 2))

    # The custom-op path: the typed wrappers (eager: the op's own call, ``mhc_core.host.library.eager``)
    # and the torch.ops.mhc ops called by hand (the dispatcher's one Python kernel).
    from mhc_dsv41 import library as dsv_library
    from mhc_glm5 import library as glm_library

    steps.append(Step("mhc_dsv41.library.boundary", 1, lambda: dsv_library.boundary(dsv, *args), 1))
    ops_args = (dsv.state, dsv.handle, *args)  # args end with the norm eps
    steps.append(Step("torch.ops.mhc.dsv41_boundary", 1, lambda: torch.ops.mhc.dsv41_boundary(*ops_args), 1))

    def glm_library_step() -> None:
        fused = glm_library.boundary(glm, *glm_args)
        glm_library.join(glm, fused[0])

    steps.append(Step("mhc_glm5.library.boundary + join", 1, glm_library_step, 2))

    def glm_ops_step() -> None:
        fused = torch.ops.mhc.glm5_boundary(glm.state, glm.handle, *glm_args)
        torch.ops.mhc.glm5_join(glm.state, glm.handle, fused[0])

    steps.append(Step("torch.ops.mhc.glm5_boundary + glm5_join", 1, glm_ops_step, 2))

    group = LoopbackGroup(2, device)
    dsv2 = [AllReduceMHC.from_preset("h200-tp2-h5120", max_num_tokens=8, device=device, group=r) for r in group]
    dsv2_args = [_dsv_args(m) for _ in group]
    steps.append(Step("AllReduceMHC.__call__, per rank", 2, lambda: run_ranks(dsv2, "call", dsv2_args), 2, 2))
    glm2 = [AllReduceMhcBoundary.from_preset("h200-tp2-h4096", max_num_tokens=8, device=device, group=r) for r in group]
    glm2_args = [_glm_args(m) for _ in group]

    def glm2_step() -> None:
        run_ranks(glm2, "call", glm2_args)
        for op in glm2:
            op.join()

    steps.append(Step("AllReduceMhcBoundary.__call__ + join(), per rank", 2, glm2_step, 3, 2))
    measured = interleaved_us(steps)
    return [(s.label, s.tp, *measured[s.label], s.launches) for s in steps]
