"""The stages of the three GLM-5.3 boundary kernels, each written once.

``mhc_glm5.boundary`` (one token per cluster), ``mhc_glm5.grouped`` (2-4 tokens, CUDA cores)
and ``mhc_glm5.grouped_mma`` (8 or 16 tokens, tensor cores) run the same stages in the same
order; they differ in how a thread maps to tokens, streams and fragments, so each kernel's
``body`` wires these functions together and keeps only what its mapping needs.

Written for byte-identical PTX with the kernels they came from: a function traces inline, so
moving a stage here changes nothing as long as the operations keep their order and every dynamic
``if`` / loop sees the same variables (the DSL carries each name a region writes or calls a method
on through that region, and a kernel-level ``cute.Tensor`` rebuilt after a region reads its
iterator anew: see the notes at ``body`` in ``mhc_glm5.boundary``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from mhc_core.device import ptx

from .config import HC, MIX_INPUTS


# ------------------------------------------------------------------ prologue
@cute.jit
def stage_mix_inputs(
    post: cute.Pointer,
    comb: cute.Pointer,
    mix_inputs: cute.Pointer,
    first: Int32,
    last: Int32,
    tokens: cutlass.Constexpr[int],
    threads: cutlass.Constexpr[int],
    asynchronous: cutlass.Constexpr[bool],
) -> None:
    """Every token's post (4) and comb (16) mixes into ``mix_inputs`` (``[tokens, 20]`` FP32 in shared
    memory), one value per thread and trip; a short last group repeats its last token.

    ``asynchronous``: 4-byte ``cp.async`` copies (their rows are only 4-byte aligned), committed
    as one group that the caller waits for; else loads and shared stores (visible after a barrier).
    """
    tidx, _, _ = cute.arch.thread_idx()
    for trip in cutlass.range_constexpr(-(-(tokens * MIX_INPUTS) // threads)):
        index = tidx + trip * threads
        if index < Int32(tokens * MIX_INPUTS):
            t = index // MIX_INPUTS
            j = index % MIX_INPUTS
            row = Int64(cutlass.min(first + t, last))
            if cutlass.const_expr(asynchronous):
                address = comb.toint() + (row * (HC * HC) + Int64(j - HC)) * 4
                if j < Int32(HC):
                    address = post.toint() + (row * HC + Int64(j)) * 4
                ptx.copy_async_4(mix_inputs + index, address)
            else:
                value = Float32(0.0)
                if j < Int32(HC):
                    value = cute.arch.load((post + row * HC + Int64(j)).llvm_ptr, Float32)
                else:
                    value = cute.arch.load((comb + row * (HC * HC) + Int64(j - HC)).llvm_ptr, Float32)
                cute.arch.store((mix_inputs + index).llvm_ptr, value)
    if cutlass.const_expr(asynchronous):
        cute.arch.cp_async_commit_group()
