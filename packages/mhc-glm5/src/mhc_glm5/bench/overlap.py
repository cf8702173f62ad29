"""The GLM side-stream overlap inside a compiled graph (``--suite glm5-overlap``).

``mhc::glm5_boundary`` returns ``(residual_out, layer_input)`` with the mixes kernel still running on
the op's side stream; ``mhc::glm5_join`` makes the current stream wait for it. What a compiled graph
runs between the two overlaps the mixes kernel. Four functions, each under ``torch.compile`` (default
mode, fullgraph, static shapes) and timed like every suite (CUDA-graph replays of the compiled
function):

* (a) boundary, join;
* (b) the next sublayer's first GEMM alone: the attention's QKV projection of the GLM-5.3-style demo
  decoder (``demo.config.GLM5``: 32 query and 8 KV heads of 128; ``ATTENTION`` here, as the package
  cannot import the repository's ``demo``), ``[M, 4096] x [4096, 6144 / tp]`` BF16;
* (c) boundary, the GEMM on its ``layer_input``, join: the mixes kernel runs beside the GEMM;
* (d) boundary, join, the GEMM: nothing runs beside the mixes kernel.

Overlap shows as (c) < (d) ~ (a) + (b); (d) - (c) is what the GEMM hid. Inductor may reorder nodes
that share no data (the GEMM and the join), so each function's generated code is checked to make
its calls in the order its name says before it is timed. ``floor_us`` of every record is the byte
floor of (c) and (d): the boundary's bytes plus the GEMM's (weight, input and output once).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mhc_core.bench import SMALL_M
from mhc_core.bench.records import Context, Record, bf16
from mhc_glm5 import library  # the torch.ops.mhc ops (no DSL)

from .case import call_bytes, inputs

HIDDEN = 4096  # the demo decoder's: the h200-tp*-h4096 presets
#: The demo decoder's attention (``demo.config.GLM5.attention``): query heads, KV heads, head size.
ATTENTION = (32, 8, 128)
SUITE = "glm5-overlap"


def projection_shape(tp: int) -> tuple[int, int]:
    """``(in, out)`` of the QKV projection a rank holds: column-parallel, heads split over ranks."""
    heads, kv_heads, head_dim = ATTENTION
    out = (heads + 2 * kv_heads) * head_dim
    if out % tp:
        raise ValueError(f"tp: the projection's {out} columns do not split over {tp} ranks")
    return HIDDEN, out // tp


def gemm_bytes(m: int, tp: int) -> int:
    """BF16 bytes the projection moves once: its weight, the input and the output."""
    k, n = projection_shape(tp)
    return 2 * (k * n + m * k + m * n)


# ----------------------------------------------------------------- the variants
# Each takes (op, projection weight [out, in], x, residual, post, comb, fn, scale, base, norm_weight).
def boundary_join(op, projection, x, *inputs):
    residual, hidden = library.boundary(op, x, *inputs)
    post, comb = library.join(op, residual)
    return residual, post, comb, hidden


def gemm(op, projection, x, *inputs):
    return F.linear(x, projection)


def boundary_gemm_join(op, projection, x, *inputs):
    residual, hidden = library.boundary(op, x, *inputs)
    qkv = F.linear(hidden, projection)  # on the main stream, beside the side-stream mixes
    post, comb = library.join(op, residual)
    return residual, post, comb, qkv


def boundary_join_gemm(op, projection, x, *inputs):
    residual, hidden = library.boundary(op, x, *inputs)
    post, comb = library.join(op, residual)
    return residual, post, comb, F.linear(hidden, projection)


#: label -> (function, the calls its compiled code must make, in order).
VARIANTS = {
    "(a) boundary + join": (boundary_join, ("boundary", "join")),
    "(b) qkv gemm": (gemm, ("gemm",)),
    "(c) boundary, gemm, join": (boundary_gemm_join, ("boundary", "gemm", "join")),
    "(d) boundary, join, gemm": (boundary_join_gemm, ("boundary", "join", "gemm")),
}

#: How inductor's generated code names each call (a custom op by its name, the GEMM as an mm).
CALL_PATTERNS = {
    "boundary": re.compile(r"\bmhc\.glm5_boundary\b"),
    "join": re.compile(r"\bmhc\.glm5_join\b"),
    "gemm": re.compile(r"\b(?:mm|addmm)\("),
}


def call_order(code: str) -> tuple[str, ...]:
    """The calls ``code`` (inductor's generated module) makes, in the order of their first call;
    only the ``call`` function's body is read (kernel definitions and comments stay out)."""
    body = code[code.find("def call(") :]
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines)
    first = {name: match.start() for name, pattern in CALL_PATTERNS.items() if (match := pattern.search(text))}
    return tuple(sorted(first, key=first.__getitem__))


def compiled_in_order(label: str, arguments: tuple) -> Callable[..., object]:
    """``torch.compile`` of a variant, compiled now, its generated code's call order checked."""
    from torch._inductor.utils import run_and_get_code

    function, expected = VARIANTS[label]
    compiled = torch.compile(function, fullgraph=True, dynamic=False)
    _, sources = run_and_get_code(compiled, *arguments)
    order = call_order("\n".join(sources))
    if order != expected:
        raise RuntimeError(f"{SUITE} {label}: the compiled code calls {order}, not {expected}")
    return compiled


def overlap_suite(ctx: Context, ms: list[int]) -> list[Record]:
    """``--suite glm5-overlap``: ``glm5_overlap`` at the --m values up to ``SMALL_M``."""
    return glm5_overlap(ctx, [m for m in ms if m <= SMALL_M])


def glm5_overlap(ctx: Context, ms: list[int]) -> list[Record]:
    from mhc_glm5 import AllReduceMhcBoundary

    preset = f"h200-tp{ctx.tp}-h{HIDDEN}"
    op = AllReduceMhcBoundary.from_preset(preset, max_num_tokens=max(ms), device="cuda", group=ctx.group)
    k, n = projection_shape(ctx.tp)
    projection = bf16(n, k) * k**-0.5
    records = []
    for m in ms:
        arguments = (op, projection, bf16(m, HIDDEN), *inputs(m, HIDDEN))
        floor = (call_bytes(m, HIDDEN) + gemm_bytes(m, ctx.tp)) / ctx.bandwidth
        for label in VARIANTS:
            compiled = compiled_in_order(label, arguments)

            def step(compiled=compiled, arguments=arguments):
                return compiled(*arguments)

            records.append(Record(SUITE, ctx.tp, m, label, ctx.time(step), floor))
    return records


def overlap_table(records: list[Record]) -> str:
    """(a)-(d) per M, beside (a) + (b), what (d) should take, and (d) - (c), the microseconds the
    GEMM hid of the side-stream mixes."""
    lines = ["\nglm5-overlap (median us per call of the compiled function, CUDA-graph replays)"]
    lines.append("| tp | M | (a) boundary + join | (b) gemm | (a) + (b) | (c) boundary, gemm, join "
                 "| (d) boundary, join, gemm | hidden: (d) - (c) |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|")
    times = {(r.tp, r.m, r.variant[:3]): r.us for r in records}
    for tp, m in sorted({(r.tp, r.m) for r in records}):
        a, b, c, d = (times.get((tp, m, key), float("nan")) for key in ("(a)", "(b)", "(c)", "(d)"))
        lines.append(f"| {tp} | {m} | {a:.2f} | {b:.2f} | {a + b:.2f} | {c:.2f} | {d:.2f} | {d - c:.2f} |")
    return "\n".join(lines)
