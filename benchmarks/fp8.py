"""The FP8 layer input (issue #33, ``--suite fp8``): the fused quantisation against a separate one.

For every registered model with a benchmark case (``mhc_core.bench.case``: its hidden size; the shipped
preset of this GPU at the run's tp, ``mhc_core.find_preset``), every format of ``mhc_core.fp8`` and
every M, CUDA-graph medians (``mhc_core.bench.records.Context.time``) of

* ``bf16 op``: the op as shipped (BF16 layer input);
* ``separate: ...``: the BF16 op, then a separate quantisation of its layer input: the torch.compile'd
  quantiser (``benchmarks.quantizers``) and vLLM's / SGLang's / FlashInfer's kernels where they import
  (each absence printed with its reason);
* ``fused fp8``: the op built with ``layer_input_format`` (``q`` and scales only);
* ``fused fp8 + bf16``: the same with ``layer_input_bf16=True`` (both from one launch).

A model's steps include its side-stream work (``BenchmarkCase.join`` inside the step); a separate
quantisation runs before the join, beside that work, where an engine would run it. Records: suite
``fp8-<model key>``, variant ``<format> | <what>`` (``bf16 op`` alone, once per M).

Checked before timing, at every M (``Record.note``, printed under the table): every separate
quantiser's output against ``mhc_core.fp8.quantize`` of the BF16 op's layer input (the compiled one
byte for byte, padding included; a library's by decoded values), and the fused op's ``q`` and scales
against ``quantize`` of its own BF16 copy from the same call (both-outputs mode, every byte). A
difference is reported, never hidden, and the figure is kept.

Byte floors (``Record.floor_us``, one per variant): the BF16 op's (``BenchmarkCase.bytes``); a separate
quantisation adds its read of the BF16 layer input and its writes (``q``, the scales' whole
allocation); the FP8-only op writes ``q`` and the scales in place of the BF16 layer input;
both-outputs mode writes them beside it.

Cost of a cold run (nothing cached): the FP8 ops' kernels ship in no package. Per model and format two
ops (FP8 only, both), each with its own collectives or boundary kernels (the two shipped models: 2 and
4, so 12 + 24 = 36 kernels), plus the BF16 ops' 12 where the packages' exported kernels are absent (a
full-DSL run). ``benchmarks.prewarm`` compiles them in
parallel first (one process per core). Then 30 inductor compiles (3 formats x 2 hidden sizes x 5 M:
static shapes) of about a second or two each, and 5 + 3 x (2 + libraries) x 5 timed steps per model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mhc_core import fp8
from mhc_core.bench.case import BenchmarkCase, call, cases
from mhc_core.bench.records import Context, Record, bf16

from . import prewarm, quantizers

FORMATS = tuple(fp8.FORMATS)
COMPILED = "torch.compile"
BF16_OP = "bf16 op"
FUSED = "fused fp8"
FUSED_BOTH = "fused fp8 + bf16"
SEPARATE = "separate: "
#: Issue #33's goal: the fused quantisation adds at most this over the BF16 op at M = 1 (us) ...
GOAL_ADDED_AT_1_US = 0.3
#: ... and at most this fraction of what the separate quantisation adds, at every M.
GOAL_FRACTION = 0.25


def call_then(case: BenchmarkCase, op: Any, x: torch.Tensor, args: tuple, after: Callable) -> None:
    """The op, then ``after(layer_input)`` before the join (beside the op's side-stream work)."""
    outputs = op(x, *args)
    after(outputs[-1])
    case.join(op)


# ------------------------------------------------------------------ floors
def fp8_bytes(name: str, m: int, hidden: int) -> int:
    """``q`` and the scales' whole allocation."""
    return m * hidden + fp8.get_format(name).scale_storage_bytes(m, hidden)


def floors_bytes(case: BenchmarkCase, name: str, m: int) -> dict[str, int]:
    """Bytes per variant (module docstring): what each must move through HBM at least once."""
    base, layer_input = case.bytes(m, case.hidden), 2 * m * case.hidden
    quantized = fp8_bytes(name, m, case.hidden)
    return {
        BF16_OP: base,
        SEPARATE: base + layer_input + quantized,
        FUSED: base - layer_input + quantized,
        FUSED_BOTH: base + quantized,
    }


# ------------------------------------------------------------------ the suite
def suite_name(case: BenchmarkCase) -> str:
    return f"fp8-{case.key}"


def preset_module(case: BenchmarkCase, ctx: Context, arch: str | None = None) -> Any:
    import mhc_core

    where = {"arch": arch} if arch is not None else {"device": torch.device("cuda", torch.cuda.current_device())}
    return mhc_core.find_preset(case.key, tp=ctx.tp, hidden=case.hidden, hc=case.hc, **where)


def layer_input_options() -> list[dict[str, Any]]:
    return [{}] + [{"layer_input_format": name, "layer_input_bf16": both} for name in FORMATS for both in (False, True)]


def fp8_suite(ctx: Context, ms: list[int]) -> list[Record]:
    from mhc_core import device_arch

    arch = device_arch(torch.cuda.current_device())
    modules = {case.key: (case, preset_module(case, ctx)) for case in cases()}
    specs = [spec for _, m in modules.values() for spec in prewarm.preset_specs(m.PRESET, arch, layer_input_options())]
    _say(prewarm.prewarm(specs, arch))
    records: list[Record] = []
    for case, module in modules.values():
        records += _model_suite(ctx, case, module, ms)
    return records


def _model_suite(ctx: Context, case: BenchmarkCase, module: Any, ms: list[int]) -> list[Record]:
    suite, hidden, capacity = suite_name(case), case.hidden, max(ms)
    started = time.perf_counter()
    op = module.build(capacity, "cuda", group=ctx.group)
    _say(f"[{suite}] preset {module.PRESET.name}, BF16 op built in {time.perf_counter() - started:.1f} s")
    inputs = {m: (bf16(m, hidden), case.inputs(m, hidden)) for m in ms}
    records = []
    for m, (x, args) in inputs.items():
        us = ctx.time(lambda x=x, args=args: call(case, op, x, args))
        records.append(Record(suite, ctx.tp, m, BF16_OP, us, case.bytes(m, hidden) / ctx.bandwidth))
    for name in FORMATS:
        records += _format_records(ctx, case, module, op, name, inputs)
    op.close()
    _say(f"[{suite}] done in {time.perf_counter() - started:.0f} s")
    return records


def _format_records(ctx: Context, case: BenchmarkCase, module: Any, op: Any, name: str, inputs: dict) -> list[Record]:
    suite, capacity = suite_name(case), max(inputs)
    separate: list[tuple[str, quantizers.Quantizer]] = [(COMPILED, quantizers.compiled_quantizer(name))]
    libraries, absent = quantizers.library_quantizers(name)
    separate += libraries
    for reason in absent:
        _say(f"[{suite} {name}] skipped: {reason}")
    started = time.perf_counter()
    try:
        fused = {
            both: module.build(capacity, "cuda", group=ctx.group, layer_input_format=name, layer_input_bf16=both)
            for both in (False, True)
        }
    except RuntimeError as error:  # no DSL compiler and nothing cached: the separate rows still run
        _say(f"[{suite} {name}] fused rows skipped: {error}")
        fused = {}
    _say(f"[{suite} {name}] FP8 ops built in {time.perf_counter() - started:.1f} s")
    records, first_calls = [], 0.0
    for m, (x, args) in inputs.items():
        floors = {key: nbytes / ctx.bandwidth for key, nbytes in floors_bytes(case, name, m).items()}
        layer_input = call(case, op, x, args)[-1].clone()
        for label, quantize in separate:
            try:
                started = time.perf_counter()
                q, scales = quantize(layer_input)  # compiles here, outside any timed graph
                first_calls += time.perf_counter() - started
                note = quantizers.compare(name, layer_input, q, scales, whole=label == COMPILED) or "bit-equal"
                us = ctx.time(lambda quantize=quantize, x=x, args=args: call_then(case, op, x, args, quantize))
            except Exception as error:  # a library kernel that refuses this shape or host: say so, go on
                _say(f"[{suite} {name} M={m}] {label} failed: {type(error).__name__}: {error}")
                continue
            records.append(Record(suite, ctx.tp, m, f"{name} | {SEPARATE}{label}", us, floors[SEPARATE], note=note))
        if not fused:
            continue
        outputs = call(case, fused[True], x, args)
        first = case.first_layer_output
        note = quantizers.compare(name, outputs[-1], outputs[first], outputs[first + 1], whole=True) or "bit-equal"
        for both, label in ((False, FUSED), (True, FUSED_BOTH)):
            us = ctx.time(lambda op=fused[both], x=x, args=args: call(case, op, x, args))
            records.append(Record(suite, ctx.tp, m, f"{name} | {label}", us, floors[label], note=note))
    for fused_op in fused.values():
        fused_op.close()
    _say(f"[{suite} {name}] separate quantisers' first calls (inductor compiles): {first_calls:.0f} s")
    return records


def _say(line: str) -> None:
    print(line, flush=True)


# ------------------------------------------------------------------ without a GPU
def dry_run(ms: list[int], tp: int = 1, arch: str = "sm_90a") -> list[Record]:
    """What the suite would do, on the CPU: each model's preset, the kernels a cold run compiles, the
    compiled quantisers checked against ``mhc_core.fp8.quantize`` at every M (inductor's CPU backend;
    random data with zero groups and -0), and the table built from records whose figures are the byte
    floors at a nominal 4.2 TB/s (no measurement)."""
    bandwidth = 4.2e6  # bytes per microsecond
    ctx = Context(tp=tp, rank=0, group=None, bandwidth=bandwidth)
    records = []
    generator = torch.Generator().manual_seed(33)
    for case in cases():
        module = preset_module(case, ctx, arch=arch)
        specs = prewarm.preset_specs(module.PRESET, arch, layer_input_options())
        _say(f"[{suite_name(case)}] preset {module.PRESET.name}: {len(specs)} kernels, "
             f"{len(prewarm.missing(specs, arch))} neither shipped nor cached")  # fmt: skip
        for m in ms:
            floor = case.bytes(m, case.hidden) / bandwidth
            records.append(Record(suite_name(case), tp, m, BF16_OP, floor, floor))
        for name in FORMATS:
            compiled = quantizers.compiled_quantizer(name)
            for m in ms:
                x = torch.randn(m, case.hidden, generator=generator).to(torch.bfloat16)
                x[:, :128] = 0.0
                x[:, 128:192] = -0.0
                note = quantizers.compare(name, x, *compiled(x), whole=True) or "bit-equal"
                _say(f"[{suite_name(case)} {name} M={m}] compiled quantiser on the CPU: {note}")
                for key, nbytes in floors_bytes(case, name, m).items():
                    if key == BF16_OP:
                        continue
                    label = f"{SEPARATE}{COMPILED}" if key == SEPARATE else key
                    us = nbytes / bandwidth
                    records.append(Record(suite_name(case), tp, m, f"{name} | {label}", us, us, note=note))
    return records
