"""Timing in CUDA graphs, and the device's copy bandwidth for the byte floors.

A measurement captures ``calls`` back-to-back calls of a step into one graph and
replays it ``repeats`` times, each replay timed with CUDA events; the figure is the
median replay time divided by ``calls`` (launch gaps inside the graph included,
host overhead excluded).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(
    step: Callable[[], object],
    *,
    calls: int = 20,
    repeats: int = 25,
    warmup: int = 3,
    before_replay: Callable[[], None] | None = None,
) -> float:
    """Median per-call time of ``step`` in microseconds, replayed from a CUDA graph.

    ``before_replay`` runs before each timed replay (multi-GPU: a barrier, so every
    rank's replay starts together).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if before_replay is not None:
            before_replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth_bytes_per_us(nbytes: int = 1 << 28) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written.

    256 MiB: 5x the H200's L2, about the working set of the largest benchmark call. A 1 GiB
    copy measured only 2.7 TB/s on the same GPUs (4.2 TB/s at 256 MiB), which made every
    byte floor 1.5x too lenient.
    """
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    time_us = graph_time_us(lambda: target.copy_(source), calls=5, repeats=15)
    return 2 * nbytes / time_us


def floor_us(nbytes: float, bandwidth: float) -> float:
    return nbytes / bandwidth


def device_description() -> str:
    properties = torch.cuda.get_device_properties(0)
    return f"{properties.name} ({properties.multi_processor_count} SMs), torch {torch.__version__}"
