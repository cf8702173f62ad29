"""Where a loopback call's time goes, kernel by kernel: ``python3 -m benchmarks.kernel_split``.

The two-shot suite times a whole call of all tp ranks. This splits it: eager calls under the torch
profiler, every kernel of a call attributed to its kind (publish, reduce, boundary) by name, each
kernel charged with the time from the previous kernel's end to its own end (PDL overlaps a kernel's
start with its predecessor's tail, so its own start-to-end would count that tail twice). Beside it,
the tp = 1 op at the same M from a CUDA graph: the two-shot's boundary is that kernel on the gathered
row, so what the two-shot costs above tp times it is its publish and reduce.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from mhc_core.bench.case import cases
from mhc_core.bench.records import bf16
from mhc_core.bench.timing import graph_time_us
from mhc_core.protocols import ONE_SHOT, TWO_SHOT

KINDS = ("finalize", "publish", "reduce")  # by name; any other kernel is the boundary


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind in KINDS if kind in lowered), "boundary")


def split_us(step, calls: int) -> dict[str, float]:
    """Per-kind µs per call: the mean over ``calls`` eager calls of each kernel's increment."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels = [
        (event.name, event.time_range.start, event.time_range.end)
        for event in profile.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    return {kind: us / calls for kind, us in charge(kernels).items()}


def charge(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """µs per kind of ``(name, start, end)`` kernels: each from the latest end before it (or its own
    start, if later) to its own end, so overlapping kernels (PDL) count their overlap once."""
    totals: dict[str, float] = defaultdict(float)
    previous_end = None
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        began = start if previous_end is None else max(start, previous_end)
        totals[kind_of(name)] += max(end - began, 0.0)
        previous_end = end if previous_end is None else max(previous_end, end)
    return dict(totals)


def main() -> None:
    from mhc_core import LoopbackGroup, run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--m", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    capacity = max(args.m)
    rows = []
    for case in cases():
        single = case.build(case.preset(1), capacity, "cuda")
        for m in args.m:
            x, rest = bf16(m, case.hidden), case.inputs(m, case.hidden)

            def alone(x=x, rest=rest, op=single, case=case):
                op(x, *rest)
                case.join(op)

            tp1 = graph_time_us(alone)
            for tp in args.tp:
                for protocol in (ONE_SHOT, TWO_SHOT):
                    group = LoopbackGroup(tp, "cuda")
                    ops = [case.build(case.preset(tp), capacity, "cuda", r, protocol=protocol) for r in group]
                    inputs = [(bf16(m, case.hidden), *case.inputs(m, case.hidden)) for _ in ops]

                    def step(ops=ops, inputs=inputs, case=case):
                        run_ranks(ops, "call", inputs)
                        for op in ops:
                            case.join(op)

                    graph = graph_time_us(step)
                    kinds = split_us(step, args.calls)
                    rows.append((case.key, tp, protocol, m, graph, tp * tp1, kinds))
                    for op in ops:
                        op.close()
        single.close()
    print("| model | tp | protocol | M | graph µs | tp x tp-1 op | publish | reduce | boundary | eager sum |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, tp, protocol, m, graph, tp1, kinds in rows:
        publish = kinds.get("publish", 0.0) + kinds.get("finalize", 0.0)
        cells = [publish, kinds.get("reduce", 0.0), kinds.get("boundary", 0.0), sum(kinds.values())]
        print(f"| {key} | {tp} | {protocol} | {m} | {graph:.1f} | {tp1:.1f} | " + " | ".join(f"{c:.1f}" for c in cells))


if __name__ == "__main__":
    main()
