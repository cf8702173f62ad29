"""The FP8 layer input (issue #33, ``--suite fp8``): the fused quantisation against a separate one.

For both models (DSV4.1 ``AllReduceMHC``, hidden 5120; GLM-5.3 ``AllReduceMhcBoundary``, hidden 4096; the
shipped preset of this GPU at the run's tp, ``mhc_core.find_preset``), every format of ``mhc_core.fp8``
and every M, CUDA-graph medians (``suites.Context.time``) of

* ``bf16 op``: the op as shipped (BF16 layer input);
* ``separate: ...``: the BF16 op, then a separate quantisation of its layer input: the torch.compile'd
  quantiser (``benchmarks.quantizers``) and vLLM's / SGLang's / FlashInfer's kernels where they import
  (each absence printed with its reason);
* ``fused fp8``: the op built with ``layer_input_format`` (``q`` and scales only);
* ``fused fp8 + bf16``: the same with ``layer_input_bf16=True`` (both from one launch).

GLM's steps include the side-stream mixes (``join()`` inside the step); its separate quantisation runs
before the join, beside the mixes, where an engine would run it. Records: suite ``fp8-<model>``,
variant ``<format> | <what>`` (``bf16 op`` alone, once per M).

Checked before timing, at every M (``Record.note``, printed under the table): every separate
quantiser's output against ``mhc_core.fp8.quantize`` of the BF16 op's layer input (the compiled one
byte for byte, padding included; a library's by decoded values), and the fused op's ``q`` and scales
against ``quantize`` of its own BF16 copy from the same call (both-outputs mode, every byte). A
difference is reported, never hidden, and the figure is kept.

Byte floors (``Record.floor_us``, one per variant): the BF16 op's (``suites.dsv41_bytes`` /
``glm5_bytes``); a separate quantisation adds its read of the BF16 layer input and its writes (``q``,
the scales' whole allocation); the FP8-only op writes ``q`` and the scales in place of the BF16 layer
input; both-outputs mode writes them beside it.

Cost of a cold run (nothing cached): the FP8 ops' kernels ship in no package. Per model and format two
ops (FP8 only, both), each with its own collectives (DSV: one-token and persistent, 2) or boundary
kernels (GLM: one-token, x8, x16, persistent, 4): 12 + 24 = 36 kernels, plus the BF16 ops' 12 where
the packages' exported kernels are absent (a full-DSL run). ``benchmarks.prewarm`` compiles them in
parallel first (one process per core). Then 30 inductor compiles (3 formats x 2 hidden sizes x 5 M:
static shapes) of about a second or two each, and 5 + 3 x (2 + libraries) x 5 timed steps per model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mhc_core import fp8

from . import prewarm, quantizers, suites
from .suites import HC, Context, Record

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


@dataclass(frozen=True)
class Model:
    """What the suite needs of one model: its preset lookup, inputs, call and bytes."""

    name: str
    hidden: int
    #: Outputs before the layer input's (``(residual_out, ...)``): where ``q`` sits in an FP8 call's.
    first_layer_output: int
    inputs: Callable[[int, int], tuple]
    bytes: Callable[[int, int], int]

    def call(self, op: Any, x: torch.Tensor, args: tuple) -> tuple:
        outputs = op(x, *args)
        if self.name == "glm5":
            op.join()
        return outputs

    def call_then(self, op: Any, x: torch.Tensor, args: tuple, after: Callable) -> None:
        """The op, then ``after(layer_input)``: for GLM before the join (beside the side-stream mixes)."""
        outputs = op(x, *args)
        after(outputs[-1])
        if self.name == "glm5":
            op.join()


MODELS = (
    Model("dsv41", 5120, 1, suites.dsv41_inputs, suites.dsv41_bytes),
    Model("glm5", 4096, 3, suites.glm5_inputs, suites.glm5_bytes),
)


# ------------------------------------------------------------------ floors
def fp8_bytes(name: str, m: int, hidden: int) -> int:
    """``q`` and the scales' whole allocation."""
    return m * hidden + fp8.get_format(name).scale_storage_bytes(m, hidden)


def floors_bytes(model: Model, name: str, m: int) -> dict[str, int]:
    """Bytes per variant (module docstring): what each must move through HBM at least once."""
    base, layer_input = model.bytes(m, model.hidden), 2 * m * model.hidden
    quantized = fp8_bytes(name, m, model.hidden)
    return {
        BF16_OP: base,
        SEPARATE: base + layer_input + quantized,
        FUSED: base - layer_input + quantized,
        FUSED_BOTH: base + quantized,
    }


# ------------------------------------------------------------------ the suite
def suite_name(model: Model) -> str:
    return f"fp8-{model.name}"


def preset_module(model: Model, ctx: Context, arch: str | None = None) -> Any:
    import mhc_core

    where = {"arch": arch} if arch is not None else {"device": torch.device("cuda", torch.cuda.current_device())}
    return mhc_core.find_preset(model.name, tp=ctx.tp, hidden=model.hidden, hc=HC, **where)


def layer_input_options() -> list[dict[str, Any]]:
    return [{}] + [{"layer_input_format": name, "layer_input_bf16": both} for name in FORMATS for both in (False, True)]


def fp8_suite(ctx: Context, ms: list[int]) -> list[Record]:
    from mhc_core import device_arch

    arch = device_arch(torch.cuda.current_device())
    modules = {model.name: preset_module(model, ctx) for model in MODELS}
    specs = [spec for m in modules.values() for spec in prewarm.preset_specs(m.PRESET, arch, layer_input_options())]
    _say(prewarm.prewarm(specs, arch))
    records: list[Record] = []
    for model in MODELS:
        records += _model_suite(ctx, model, modules[model.name], ms)
    return records


def _model_suite(ctx: Context, model: Model, module: Any, ms: list[int]) -> list[Record]:
    suite, hidden, capacity = suite_name(model), model.hidden, max(ms)
    started = time.perf_counter()
    op = module.build(capacity, "cuda", group=ctx.group)
    _say(f"[{suite}] preset {module.PRESET.name}, BF16 op built in {time.perf_counter() - started:.1f} s")
    cases = {m: (suites.bf16(m, hidden), model.inputs(m, hidden)) for m in ms}
    records = []
    for m, (x, args) in cases.items():
        us = ctx.time(lambda x=x, args=args: model.call(op, x, args))
        records.append(Record(suite, ctx.tp, m, BF16_OP, us, model.bytes(m, hidden) / ctx.bandwidth))
    for name in FORMATS:
        records += _format_records(ctx, model, module, op, name, cases)
    op.close()
    _say(f"[{suite}] done in {time.perf_counter() - started:.0f} s")
    return records


def _format_records(ctx: Context, model: Model, module: Any, op: Any, name: str, cases: dict) -> list[Record]:
    suite, capacity = suite_name(model), max(cases)
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
    for m, (x, args) in cases.items():
        floors = {key: nbytes / ctx.bandwidth for key, nbytes in floors_bytes(model, name, m).items()}
        layer_input = model.call(op, x, args)[-1].clone()
        for label, quantize in separate:
            try:
                started = time.perf_counter()
                q, scales = quantize(layer_input)  # compiles here, outside any timed graph
                first_calls += time.perf_counter() - started
                note = quantizers.compare(name, layer_input, q, scales, whole=label == COMPILED) or "bit-equal"
                us = ctx.time(lambda quantize=quantize, x=x, args=args: model.call_then(op, x, args, quantize))
            except Exception as error:  # a library kernel that refuses this shape or host: say so, go on
                _say(f"[{suite} {name} M={m}] {label} failed: {type(error).__name__}: {error}")
                continue
            records.append(Record(suite, ctx.tp, m, f"{name} | {SEPARATE}{label}", us, floors[SEPARATE], note=note))
        if not fused:
            continue
        outputs = model.call(fused[True], x, args)
        first = model.first_layer_output
        note = quantizers.compare(name, outputs[-1], outputs[first], outputs[first + 1], whole=True) or "bit-equal"
        for both, label in ((False, FUSED), (True, FUSED_BOTH)):
            us = ctx.time(lambda op=fused[both], x=x, args=args: model.call(op, x, args))
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
    for model in MODELS:
        module = preset_module(model, ctx, arch=arch)
        specs = prewarm.preset_specs(module.PRESET, arch, layer_input_options())
        _say(f"[{suite_name(model)}] preset {module.PRESET.name}: {len(specs)} kernels, "
             f"{len(prewarm.missing(specs, arch))} neither shipped nor cached")  # fmt: skip
        for m in ms:
            floor = model.bytes(m, model.hidden) / bandwidth
            records.append(Record(suite_name(model), tp, m, BF16_OP, floor, floor))
        for name in FORMATS:
            compiled = quantizers.compiled_quantizer(name)
            for m in ms:
                x = torch.randn(m, model.hidden, generator=generator).to(torch.bfloat16)
                x[:, :128] = 0.0
                x[:, 128:192] = -0.0
                note = quantizers.compare(name, x, *compiled(x), whole=True) or "bit-equal"
                _say(f"[{suite_name(model)} {name} M={m}] compiled quantiser on the CPU: {note}")
                for key, nbytes in floors_bytes(model, name, m).items():
                    if key == BF16_OP:
                        continue
                    label = f"{SEPARATE}{COMPILED}" if key == SEPARATE else key
                    us = nbytes / bandwidth
                    records.append(Record(suite_name(model), tp, m, f"{name} | {label}", us, us, note=note))
    return records
