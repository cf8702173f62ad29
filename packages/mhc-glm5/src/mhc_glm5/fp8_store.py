"""The GLM-5.3 boundary kernels' FP8 layer input (issue #33): quantised in registers at the norm's store.

With an FP8 ``layer_input_format`` every boundary kernel computes its layer-input fragments as the
BF16 kernel does (``bf16(prenorm * inv_rms * weight)``, the same FP32 operations, so the same bits)
and, instead of storing them (or beside them, with ``layer_input_bf16``), quantises them: E4M3 codes
and one scale per group of 128 or 32 columns, in the format's layout, bit for bit
``mhc_core.fp8.quantize`` of those BF16 values (the math is ``mhc_core.device.quant``'s).

Group placement
---------------
A group is ``group / 8`` consecutive fragments of a token. ``config.check_layer_input`` requires a
CTA's fragments (``hidden / 8 / cluster_size``, consecutive) to hold whole groups: a group never
straddles the cluster's CTAs, so no group is reduced through DSMEM. Inside the CTA a warp holds
consecutive fragments, so a group is an aligned run of lanes of one warp, or of consecutive warps:

* CUDA-core kernels (``mhc_glm5.boundary``, ``mhc_glm5.grouped``): lane ``4 f + j`` holds fragment
  ``f`` of its warp's 8 (every ``j`` the same words after the collapse). A 32-column group (4
  fragments) is an aligned 16-lane segment: ``quant.segment_max`` over lanes 4 apart, 2 shuffles.
  A 128-column group (16 fragments) is two warps: each warp's maximum (3 shuffles) goes into a
  shared word per (token, warp); after one CTA barrier each lane takes the larger of its group's two.
* Tensor-core kernels (``mhc_glm5.grouped_mma``, ``mhc_glm5.persistent``): lane ``4 g + q`` holds
  fragment ``q`` of its warp's 4 for token ``g``. A 32-column group is the warp's 4 fragments: 2
  shuffles over the token's 4 lanes. A 128-column group is 4 warps: the same through shared
  memory (a word per (token, warp), one CTA barrier, the group's 4 words read).

The shared words (``config.layer_input_scratch_bytes``) are written after the squares' cluster
barrier, when every other scratch is settled, and read after one more CTA barrier, which every
thread reaches: every token's values are computed (a token past M reads its repeated or staged
inputs) and only tokens up to M are stored. The persistent boundary writes them again only after
its next group's CTA barriers. Maxima are taken on FP32 bits (non-negative, so ordered as integers):
exact, and a NaN wins.

Stores: the lane holding a fragment (lane ``j = 0`` of the CUDA-core kernels' four) stores its 8
codes in one 8-byte store; the one holding a group's first fragment stores its scale (4 bytes, or
1 plus the padding bytes after the last group in its word); after its tokens, every thread of the
grid takes its share of the scale padding rows (``quant.store_padding_rows``), so the host allocates
the scales with ``torch.empty``.

A poisoned op's layer input is NaN (``mhc_glm5.boundary``), so every code is NaN (0x7F) and every
scale is (FP32 NaN; UE8M0 0xFF); padding stays 0.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import VEC_BF16, WARP_SIZE
from mhc_core.device import ptx, quant

from .config import layer_input_scratch_bytes

#: The FP8 kernels' two outputs beside the BF16 signature (``boundary_signature``): the E4M3 codes
#: ``[M, hidden]`` and the scales' allocation (``mhc_core.fp8.Fp8Format``'s layout).
Fp8Outputs = namedtuple("Fp8Outputs", ["q", "scales"])


@dataclass(frozen=True)
class Fp8Store:
    """One kernel's FP8 layer-input store: the outputs' addresses, the shared words of the cross-warp
    maxima, and how the kernel's threads hold a token's fragments (compile time; see the module
    docstring). Frozen: the DSL passes it into a dynamic region read-only."""

    q: Int64
    scales: Int64
    #: ``[tokens, warps]`` FP32 bits of the warps' maxima (None: a group lies inside a warp).
    scratch: cute.Pointer | None
    layer_input: cute.Pointer
    layout: str
    hidden: int
    #: Fragments per group (4 or 16) and scales per token.
    group_fragments: int
    groups: int
    #: Fragments a warp holds per token, and lanes holding each (the same words in every one).
    fragments_per_warp: int
    lanes_per_fragment: int
    warps: int
    #: Store the BF16 layer input too.
    bf16: bool

    @staticmethod
    def create(
        config, fp8: Fp8Outputs, smem: cutlass.memory.SmemAllocator, layer_input: cute.Pointer, threads: int,
        tokens: int, fragments_per_warp: int, lanes_per_fragment: int,
    ) -> Fp8Store:  # fmt: skip
        """The store of a kernel of ``config`` (``BoundaryConfig``) with ``threads`` threads per CTA and
        ``tokens`` tokens per cluster (per group); allocates its shared words after the kernel's own."""
        group, layout = config.fp8_group, config.scale_layout
        scratch = None
        words = layer_input_scratch_bytes(config.layer_input_format, threads, tokens, fragments_per_warp) // 4
        if words:
            scratch = smem.allocate_array(Uint32, words, byte_alignment=4)
        return Fp8Store(
            fp8.q.toint(), fp8.scales.toint(), scratch, layer_input, layout, config.hidden, group // VEC_BF16,
            config.hidden // group, fragments_per_warp, lanes_per_fragment, threads // WARP_SIZE,
            config.layer_input_bf16,
        )  # fmt: skip

    @property
    def warps_per_group(self) -> int:
        return max(1, self.group_fragments // self.fragments_per_warp)

    @property
    def crosses_warps(self) -> bool:
        return self.warps_per_group > 1

    # ------------------------------------------------------------ values
    @cute.jit
    def fragment_words(
        self, prenorm_words: cute.TensorSSA, inv_rms: Float32, gamma_words: cute.TensorSSA
    ) -> cute.TensorSSA:
        """The BF16 layer input of a fragment as words, rounded as the BF16 kernels round it."""
        return ptx.f32x8_to_words(ptx.words_to_f32x8(prenorm_words) * inv_rms * ptx.words_to_f32x8(gamma_words))

    @cute.jit
    def store_bf16(self, token: Int32, fragment: Int32, words: cute.TensorSSA, holder: Boolean) -> None:
        """With ``layer_input_bf16``: the fragment's BF16 words into ``layer_input`` (its holder lane)."""
        if cutlass.const_expr(self.bf16):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
            if holder:
                element = Int64(token) * self.hidden + Int64(fragment) * VEC_BF16
                ptx.store_u32x4(self.layer_input.toint() + element * 2, words)

    # ------------------------------------------------------------ the group's absmax
    @cute.jit
    def warp_max(self, words: cute.TensorSSA) -> Uint32:
        """FP32 bits of the absmax over the group's fragments in this warp (all of them when the
        group lies inside the warp), in every lane holding one. Every lane of the warp calls it."""
        steps = min(self.group_fragments, self.fragments_per_warp).bit_length() - 1
        return quant.segment_max(quant.fragment_absmax_bits(words), self.lanes_per_fragment, steps)

    @cute.jit
    def share(self, t: Int32, warp: Int32, bits: Uint32, writer: Boolean) -> None:
        """Token ``t``'s warp maximum into its shared word (a group spanning warps); ``writer``: one
        lane per (token, warp)."""
        if cutlass.const_expr(self.crosses_warps):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
            if writer:
                cute.arch.store((self.scratch + t * self.warps + warp).llvm_ptr, bits)

    @cute.jit
    def exchange(self) -> None:
        """The CTA barrier between ``share`` and ``group_max`` (none when a group lies in a warp)."""
        if cutlass.const_expr(self.crosses_warps):
            cute.arch.barrier()

    @cute.jit
    def group_max(self, t: Int32, warp: Int32, bits: Uint32) -> Uint32:
        """Token ``t``'s group absmax (FP32 bits): ``bits`` itself, or the maximum of the shared words
        of the group's warps (consecutive, the first a multiple of ``warps_per_group``)."""
        if cutlass.const_expr(self.crosses_warps):
            first = self.scratch + t * self.warps + warp // self.warps_per_group * self.warps_per_group
            bits = cute.arch.load(first.llvm_ptr, Uint32)
            for w in cutlass.range_constexpr(1, self.warps_per_group):
                bits = cutlass.max(bits, cute.arch.load((first + w).llvm_ptr, Uint32))
        return bits

    # ------------------------------------------------------------ stores
    @cute.jit
    def store(
        self, token: Int32, fragment: Int32, m: Int32, words: cute.TensorSSA, absmax: Uint32, holder: Boolean
    ) -> None:
        """The holder lane: the fragment's 8 codes, and the group's scale from its first fragment."""
        if holder:
            scale = quant.group_scale(absmax)
            if cutlass.const_expr(self.layout == quant.ROW_MAJOR):
                low, high = quant.quantize_fragment_divide(words, scale)
                code = ptx.f32_to_bits(scale)
            else:
                code = quant.ue8m0_exponent(scale)
                low, high = quant.quantize_fragment_scaled(words, quant.ue8m0_reciprocal(code))
            element = Int64(token) * self.hidden + Int64(fragment) * VEC_BF16
            ptx.store_u32x2(self.q + element * quant.E4M3_BYTES, low, high)
            if fragment % self.group_fragments == 0:
                group = fragment // self.group_fragments
                quant.store_group_scale(self.layout, self.scales, token, group, m, self.groups, code)

    @cute.jit
    def store_padding(
        self, m: Int32, cluster_rank: Int32, tidx: Int32, threads: cutlass.Constexpr[int],
        cluster_size: cutlass.Constexpr[int],
    ) -> None:  # fmt: skip
        """The scale padding rows, shared by every thread of the grid's clusters (``cluster_size`` CTAs
        of ``threads``; the grid's x is the cluster): once per thread, after its tokens' stores
        (``quant.store_padding_rows``)."""
        cluster, _, _ = cute.arch.block_idx()
        clusters, _, _ = cute.arch.grid_dim()
        cluster_threads = threads * cluster_size
        thread = cluster * Int32(cluster_threads) + cluster_rank * Int32(threads) + tidx
        quant.store_padding_rows(self.layout, self.scales, m, thread, clusters * Int32(cluster_threads), self.groups)
