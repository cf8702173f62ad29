"""GLM-5.3-Flash presets: the frozen configuration of one target and its derived launch geometry.

Pure Python (no torch, no DSL): the code generator imports it to validate
the ``[glm5.<name>]`` tables of the repository's ``presets.toml`` and to render the preset modules.

Geometry: one cluster of ``cluster_size`` CTAs per token (or per group of tokens,
``cluster_tokens``). A CTA holds ``hidden / 8 / cluster_size`` fragment groups of 4
lanes: lane ``j`` polls ranks ``j, j + 4, ...`` and then owns residual stream ``j``,
so ``threads = hidden / 8 / cluster_size * 4``. The cluster reductions send one
(value, peer) pair per thread: 25 values (24 mixes and the sum of squares).

``cluster_tokens`` is a list of ``(min_tokens, tokens_per_cluster)`` thresholds:
a call with M tokens uses the entry with the largest ``min_tokens <= M`` (one
token per cluster below the first). 2-4 tokens per cluster run the CUDA-core
grouped kernel (``mhc_glm5.grouped``), 8 or 16 the tensor-core one
(``mhc_glm5.grouped_mma``: a warp per 4 fragments, ``mma_threads``). From
``persistent_min_tokens`` (0: never) the persistent tensor-core boundary takes over:
as many clusters as the device holds at once (``persistent_clusters``), each looping
over groups of ``PERSISTENT_TOKENS`` tokens with ``fn`` staged once, the next group's
streams copied and the group before collapsed while the current one computes.

The layer input (issue #33) is BF16, or FP8 E4M3 with one scale per group of 128 or 32 columns
(``layer_input_format``; ``layer_input_bf16`` keeps the BF16 copy beside it), quantised at the
norm's store (``mhc_glm5.fp8_store``). A group's fragments lie in one CTA (``hidden`` a multiple of
``group x cluster_size``): a 32-column group is reduced inside a warp, a 128-column one over the
CTA's warps that hold it, through ``layer_input_scratch_bytes`` of shared memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mhc_core.constants import SUPPORTED_ARCHS, VEC_BF16, WARP_SIZE
from mhc_core.fp8_formats import BF16, layer_input_group, require_layer_input
from mhc_core.presets import (
    MAX_CLUSTER_SIZE,
    MAX_SHARED_BYTES,
    MAX_TOP_K,
    SM_SHARED_BYTES,
    PresetError,
    argument_preset,
    preset_repr,
    require,
    require_archs,
    require_hidden,
    require_int,
    require_name,
    require_positive_float,
    require_threads,
    require_tp,
    require_two_shot_min_tokens,
)
from mhc_core.protocols import two_shot_kernel_specs
from mhc_core.routing import MRangeDispatch

#: A plain publish's finalize fields (every config here lists every field: the dict is what a
#: kernel's key is built from, so it must equal the config dataclass's ``asdict``).
PLAIN = {"top_k": 0, "weights": "float32", "scatter": False}

HC = 4
MIX = 24
#: Values each cluster reduction carries per token: 24 mixes and the sum of squares.
VALUES = MIX + 1
#: Per token, the grouped kernel stages post (4) and comb (16) in shared memory.
MIX_INPUTS = HC + HC * HC
#: The CUDA-core grouped kernel (``mhc_glm5.grouped``) keeps every token's fragment words in
#: registers next to the 24 fn rows; from 8 tokens the GEMV is the bottleneck and
#: ``mhc_glm5.grouped_mma`` (tensor cores, 8 tokens per warp) takes over.
MAX_FFMA_TOKENS = 4
#: Tokens per cluster of the tensor-core kernel: one or two halves of 8 tokens per warp.
MMA_TOKENS = (8, 16)
#: Tokens per group of the persistent boundary: one MMA half, so that three groups' residual
#: streams fit in shared memory beside ``fn``.
PERSISTENT_TOKENS = MMA_TOKENS[0]
#: Its buffers of streams: the group post-mixed, the group before (collapsed meanwhile) and the next
#: (copied meanwhile); of mix inputs: the group post-mixed and the next.
PERSISTENT_BUFFERS = 3
PERSISTENT_MIX_BUFFERS = 2
#: With more than 2 tokens per cluster the CUDA-core grouped kernel needs ~250 registers per
#: thread: ptxas spills it at 288 threads (hidden 4608, cluster 8), not at 256.
GROUPED_MAX_THREADS = 256


#: Fragments of a warp: the CUDA-core kernels give a fragment 4 lanes (8 a warp), the tensor-core
#: ones a lane per fragment and token (4 a warp, ``MMA_FRAGMENTS_PER_WARP``).
CUDA_CORE_FRAGMENTS_PER_WARP = WARP_SIZE // 4


def layer_input_scratch_bytes(layer_input_format: str, threads: int, tokens: int, fragments_per_warp: int) -> int:
    """Shared memory of the FP8 store's cross-warp maxima: a word per (token, warp) when a group is
    more fragments than a warp holds (128 columns), none otherwise (BF16; 32 columns)."""
    if layer_input_group(layer_input_format) // VEC_BF16 <= fragments_per_warp:
        return 0
    return tokens * (threads // WARP_SIZE) * 4


def check_layer_input(hidden: int, cluster_size: int, layer_input_format: object, layer_input_bf16: object) -> None:
    """The option's rules, each a ``PresetError`` naming the field: the core's
    (``mhc_core.fp8_formats.require_layer_input``), then the groups' placement. A group of ``group``
    columns is ``group / 8`` consecutive fragments; a CTA's fragments must hold whole groups, so
    that no group straddles the cluster's CTAs (``mhc_glm5.fp8_store``)."""
    group = require_layer_input(layer_input_format, layer_input_bf16, hidden)
    if not group:
        return
    per_cta = hidden // VEC_BF16 // cluster_size
    require(
        per_cta % (group // VEC_BF16) == 0,
        "cluster_size",
        f"a CTA's {per_cta} fragments (hidden / 8 / cluster_size) must hold whole groups of {group // VEC_BF16} "
        f"fragments ({layer_input_format!r}: a group may not straddle the cluster's CTAs)",
        cluster_size,
    )


#: ``fn`` staged in shared memory (``mhc_glm5.fn_stage``): one chunk per (row, stream) of the
#: CTA's columns, chunks padded so that consecutive ones rotate across the 32 banks. The
#: one-token kernel reads chunks ``4 r + j`` (``j`` = 0..3) at 2 consecutive fragments per
#: quarter-warp: stride = 8 words (mod 32); the tensor-core kernel reads 8 consecutive chunks at
#: one fragment: stride = 4 (mod 32).
FN_CHUNKS = MIX * HC
FN_ROTATION_STREAMS = 8
FN_ROTATION_ROWS = 4
#: The staged slice's alignment (bulk copies need 16 bytes) and its mbarrier.
FN_STAGE_ALIGN = 128
FN_BARRIER_BYTES = 8


def fn_chunk_words(fragments: int, rotation: int) -> int:
    """Words from one staged chunk to the next: 4 a fragment, padded to ``rotation`` mod 32."""
    words = fragments * 4
    return words + (rotation - words) % 32


def fn_stage_bytes(fragments: int, rotation: int) -> int:
    """Shared memory of the staged ``fn`` slice, its mbarrier and the alignment slack."""
    return FN_CHUNKS * fn_chunk_words(fragments, rotation) * 4 + FN_BARRIER_BYTES + FN_STAGE_ALIGN


def boundary_threads(hidden: int, cluster_size: int) -> int:
    return hidden // VEC_BF16 // cluster_size * HC


#: A CTA that asks for at least this much runs alone on its SM.
ALONE_ON_SM_BYTES = SM_SHARED_BYTES // 2


def boundary_launch_shared_bytes(hidden: int, cluster_size: int, layer_input_format: str = BF16) -> int:
    """What the one-token kernel asks for: its own needs, and at least ``ALONE_ON_SM_BYTES``.

    Why: measured on the H200 (hidden 4096, M = 8), the scheduler placed some clusters' CTAs
    (103 KB each) two to an SM; their fn copies and GEMVs shared it, and their raw mixes were
    handed off 1.4 us after the other clusters', so the side-stream mixes waited for them.
    """
    return max(boundary_shared_bytes(hidden, cluster_size, layer_input_format), ALONE_ON_SM_BYTES)


def boundary_shared_bytes(hidden: int, cluster_size: int, layer_input_format: str = BF16) -> int:
    """One-token kernel: the staged ``fn``, the 25-value reduction (warp sums, peer slots, totals),
    then the 1-value one (and the FP8 store's scratch)."""
    threads = boundary_threads(hidden, cluster_size)
    warps = threads // WARP_SIZE
    first = (warps + cluster_size + 1) * VALUES
    second = warps + cluster_size
    fragments = hidden // VEC_BF16 // cluster_size
    scratch = layer_input_scratch_bytes(layer_input_format, threads, 1, CUDA_CORE_FRAGMENTS_PER_WARP)
    return fn_stage_bytes(fragments, FN_ROTATION_STREAMS) + (first + second) * 4 + scratch


def grouped_shared_bytes(hidden: int, cluster_size: int, tokens: int, layer_input_format: str = BF16) -> int:
    """Grouped kernel: every token's 4 residual fragments per group, its 20 mix inputs and reductions
    (and the FP8 store's scratch)."""
    groups = hidden // VEC_BF16 // cluster_size
    warps = groups * HC // WARP_SIZE
    staged = tokens * HC * groups * 16
    floats = tokens * (MIX_INPUTS + (warps + cluster_size + 1) * VALUES + warps + cluster_size)
    scratch = layer_input_scratch_bytes(layer_input_format, groups * HC, tokens, CUDA_CORE_FRAGMENTS_PER_WARP)
    return staged + floats * 4 + scratch


#: Fragments per warp of the tensor-core kernel: one per stream lane outside the MMA.
MMA_FRAGMENTS_PER_WARP = HC


def mma_threads(hidden: int, cluster_size: int) -> int:
    """Tensor-core kernel: one warp per 4 fragments of the CTA (2x the other kernels' threads)."""
    return hidden // VEC_BF16 // cluster_size // MMA_FRAGMENTS_PER_WARP * WARP_SIZE


def mma_shared_bytes(hidden: int, cluster_size: int, tokens: int, layer_input_format: str = BF16) -> int:
    """Tensor-core kernel: the staged ``fn``, the residual streams (one row per token and source,
    padded like the ``fn`` rows) and their mbarrier, mix inputs, reductions (and the FP8 store's
    scratch)."""
    fragments = hidden // VEC_BF16 // cluster_size
    threads = mma_threads(hidden, cluster_size)
    warps = threads // WARP_SIZE
    staged = FN_BARRIER_BYTES + tokens * HC * fn_chunk_words(fragments, FN_ROTATION_ROWS) * 4
    floats = tokens * (MIX_INPUTS + (warps + cluster_size + 1) * VALUES + warps + cluster_size)
    scratch = layer_input_scratch_bytes(layer_input_format, threads, tokens, MMA_FRAGMENTS_PER_WARP)
    return fn_stage_bytes(fragments, FN_ROTATION_ROWS) + staged + floats * 4 + scratch


def persistent_shared_bytes(hidden: int, cluster_size: int, layer_input_format: str = BF16) -> int:
    """The persistent boundary: the staged ``fn``, ``PERSISTENT_BUFFERS`` groups' streams with their
    mbarriers, ``PERSISTENT_MIX_BUFFERS`` groups' mix inputs, reductions with two halves of the
    peers' slots (``ClusterSums.half``) (and the FP8 store's scratch)."""
    fragments = hidden // VEC_BF16 // cluster_size
    threads = mma_threads(hidden, cluster_size)
    warps = threads // WARP_SIZE
    tokens = PERSISTENT_TOKENS
    staged = PERSISTENT_BUFFERS * (FN_BARRIER_BYTES + tokens * HC * fn_chunk_words(fragments, FN_ROTATION_ROWS) * 4)
    mixes = PERSISTENT_MIX_BUFFERS * MIX_INPUTS
    floats = tokens * (mixes + (warps + 2 * cluster_size + 1) * VALUES + warps + 2 * cluster_size)
    scratch = layer_input_scratch_bytes(layer_input_format, threads, tokens, MMA_FRAGMENTS_PER_WARP)
    return fn_stage_bytes(fragments, FN_ROTATION_ROWS) + staged + floats * 4 + scratch


def persistent_clusters(sms: int, cluster_size: int) -> int:
    """Clusters of the persistent boundary that the device holds at once: a CTA needs more than half
    an SM's shared memory, so one per SM, and one cluster fewer than SMs / cluster_size, as a cluster
    must fit in one GPC (measured on the H200, 132 SMs: 16 clusters of 8 did not all fit, and the
    last ran after the others, 105 us at M = 1024 against 66 with 15; BENCHMARKS.md, twelfth run).
    The grid is correct with any count."""
    return max(1, sms // cluster_size - 1)


def persistent_fits(hidden: int, cluster_size: int, layer_input_format: str = BF16) -> str | None:
    """Why the persistent boundary cannot serve this shape, or None when it can."""
    if (hidden // VEC_BF16 // cluster_size) % MMA_FRAGMENTS_PER_WARP:
        return f"hidden / 8 / cluster_size = {hidden // VEC_BF16 // cluster_size} must be a multiple of 4"
    if mma_threads(hidden, cluster_size) > 1024:
        return f"one warp per 4 fragments needs {mma_threads(hidden, cluster_size)} threads > 1024"
    shared = persistent_shared_bytes(hidden, cluster_size, layer_input_format)
    if shared > MAX_SHARED_BYTES:
        return f"its buffered groups need {shared} bytes of shared memory, more than {MAX_SHARED_BYTES}"
    return None


def grouped_kernel_shared_bytes(hidden: int, cluster_size: int, tokens: int, layer_input_format: str = BF16) -> int:
    """Shared memory of the kernel that serves ``tokens`` (> 1) tokens per cluster."""
    if tokens in MMA_TOKENS:
        return mma_shared_bytes(hidden, cluster_size, tokens, layer_input_format)
    return grouped_shared_bytes(hidden, cluster_size, tokens, layer_input_format)


#: The tensor-core kernel, and the persistent boundary built on its stages.
MMA_KERNEL = "mhc_glm5.grouped_mma:MmaGroupBoundaryKernel"
PERSISTENT_KERNEL = "mhc_glm5.persistent:PersistentBoundaryKernel"


@dataclass(frozen=True)
class BoundaryTarget:
    """A boundary kernel a call can take: ``tokens`` tokens per cluster, or the persistent boundary
    (``PERSISTENT_TOKENS`` tokens per group, its clusters looping over the groups)."""

    tokens: int
    persistent: bool = False

    @property
    def kernel_name(self) -> str:
        """Its name among a preset's kernels (``GLM5Preset.kernel_specs``, the shipped symbols)."""
        if self.persistent:
            return "boundary_persistent"
        return "boundary" if self.tokens == 1 else f"boundary_x{self.tokens}"


#: The persistent boundary's target.
PERSISTENT = BoundaryTarget(PERSISTENT_TOKENS, persistent=True)


def boundary_routing(
    cluster_tokens: tuple[tuple[int, int], ...], persistent_min_tokens: int
) -> MRangeDispatch[BoundaryTarget]:
    """Which boundary serves M tokens: one token per cluster from 1, each ``cluster_tokens`` entry's
    from its threshold, the persistent boundary from ``persistent_min_tokens`` (0: never)."""
    # A threshold of 1 replaces the one-token kernel (``MRangeDispatch.of``).
    pairs = [(1, BoundaryTarget(1))] + [(threshold, BoundaryTarget(tokens)) for threshold, tokens in cluster_tokens]
    if persistent_min_tokens:
        pairs.append((persistent_min_tokens, PERSISTENT))
    return MRangeDispatch.of(*pairs)


def grouped_kernel_path(tokens: int) -> str:
    """``module:Class`` of the kernel serving ``tokens`` (> 1) tokens per cluster."""
    if tokens in MMA_TOKENS:
        return MMA_KERNEL
    return "mhc_glm5.grouped:GroupBoundaryKernel"


def thresholds_from_mapping(mapping: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    """Convert the reference's exact ``{M: tokens}`` mapping into thresholds.

    Each listed M starts a range that lasts until the next listed M, so an
    unlisted M between two tuned ones takes the lower one's value instead of
    falling back to one token per cluster.
    """
    return tuple(sorted((int(m), int(tokens)) for m, tokens in mapping.items()))


def check_cluster_tokens(value: object) -> tuple[tuple[int, int], ...]:
    """Validate thresholds: pairs of ints, thresholds >= 1 and strictly increasing, tokens >= 1."""
    key = "cluster_tokens"
    require(isinstance(value, (list, tuple)), key, "must be a list of [min_tokens, tokens_per_cluster] pairs", value)
    pairs = []
    for entry in value:
        require(
            isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(v, int) for v in entry),
            key,
            "each entry must be a [min_tokens, tokens_per_cluster] pair of integers",
            entry,
        )
        threshold, tokens = entry
        require(threshold >= 1, key, "min_tokens must be >= 1", entry)
        require(
            1 <= tokens <= MAX_FFMA_TOKENS or tokens in MMA_TOKENS,
            key,
            f"tokens_per_cluster must be in 1..{MAX_FFMA_TOKENS} (CUDA-core GEMV) or one of {MMA_TOKENS} "
            "(tensor cores)",
            entry,
        )
        pairs.append((threshold, tokens))
    thresholds = [threshold for threshold, _ in pairs]
    require(thresholds == sorted(set(thresholds)), key, "min_tokens must be strictly increasing", value)
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class GLM5Preset:
    """One GLM-5.3-Flash target. Every value is validated; see the module docstring."""

    name: str
    hidden: int
    hc: int
    tp: int
    top_k: int
    cluster_size: int
    cluster_tokens: tuple[tuple[int, int], ...]
    rms_eps: float
    hc_eps: float
    post_mult: float
    sinkhorn_repeat: int
    norm_eps: float
    archs: tuple[str, ...]
    publish_threads: int = 128
    mixes_threads: int = 128
    #: Calls with at least this many tokens take the persistent boundary (0: never); above every
    #: ``cluster_tokens`` threshold.
    persistent_min_tokens: int = 0
    #: Whether the geometry was measured on the preset's own target (False: a rule or another
    #: host's values; building the op logs a warning).
    tuned: bool = False
    #: The layer input's format (``mhc_core.fp8_formats.LAYER_INPUT_FORMATS``): BF16, or FP8 E4M3 with its scales,
    #: quantised at the norm's store; ``layer_input_bf16``: the BF16 copy beside the FP8 one.
    layer_input_format: str = BF16
    layer_input_bf16: bool = False
    #: Calls of at least this many tokens take the two-shot all-reduce (``mhc_core.protocols``); None:
    #: the one-shot for every M. Measured where the preset's host was lent, else the cost model's
    #: (codegen fills it: ``NVLINK_H200.crossover(tp, hidden)``).
    two_shot_min_tokens: int | None = None
    description: str = field(default="", compare=False)

    #: Values the kernels derive from the fields (properties, not fields): a presets table may write
    #: one, and codegen refuses it unless it equals the rule's value (``codegen.schema``).
    DERIVED: ClassVar[dict[str, str]] = {"threads": "hidden / 8 / cluster_size * 4"}

    def __repr__(self) -> str:
        return preset_repr(self)  # says what tuned=False means

    def __post_init__(self) -> None:
        require_name(self.name)
        require_two_shot_min_tokens(self.two_shot_min_tokens)
        require_hidden(self.hidden)
        require(self.hc == HC, "hc", f"must be {HC} (one lane per residual stream in the GLM kernels)", self.hc)
        require_tp(self.tp)
        require_int("top_k", self.top_k, minimum=1, maximum=MAX_TOP_K)
        require_int("cluster_size", self.cluster_size, minimum=1, maximum=MAX_CLUSTER_SIZE)
        # The layer input before the geometry's rules: a hidden size its groups do not divide is named as such.
        check_layer_input(self.hidden, self.cluster_size, self.layer_input_format, self.layer_input_bf16)
        fragments = self.hidden // VEC_BF16
        require(
            fragments % self.cluster_size == 0,
            "cluster_size",
            f"must divide the {fragments} fragments of hidden = {self.hidden} evenly",
            self.cluster_size,
        )
        threads = self.threads
        require(
            threads % WARP_SIZE == 0 and threads <= 1024,
            "cluster_size",
            f"threads = hidden / 8 / cluster_size * 4 = {threads} must be a multiple of 32 and <= 1024",
            self.cluster_size,
        )
        require(
            threads >= VALUES * self.cluster_size,
            "cluster_size",
            f"threads = {threads} must be >= 25 x cluster_size (one thread per reduced value and peer)",
            self.cluster_size,
        )
        object.__setattr__(self, "cluster_tokens", check_cluster_tokens(self.cluster_tokens))
        fmt = self.layer_input_format
        # Every kernel has >= 25 x cluster_size threads, so one thread per (token, peer) of the second
        # reduction (tokens <= 16) always exists.
        for _, tokens in self.cluster_tokens:
            require(
                tokens not in MMA_TOKENS or mma_threads(self.hidden, self.cluster_size) <= 1024,
                "cluster_tokens",
                f"{tokens} tokens per cluster use the tensor-core kernel, one warp per 4 fragments: "
                f"{mma_threads(self.hidden, self.cluster_size)} threads > 1024 (raise cluster_size)",
                tokens,
            )
            require(
                tokens <= 2 or tokens in MMA_TOKENS or threads <= GROUPED_MAX_THREADS,
                "cluster_tokens",
                f"more than 2 tokens per cluster need threads <= {GROUPED_MAX_THREADS} (above that ptxas "
                f"spills the grouped kernel's registers); threads = {threads}",
                tokens,
            )
            shared = grouped_kernel_shared_bytes(self.hidden, self.cluster_size, tokens, fmt)
            require(
                shared <= MAX_SHARED_BYTES,
                "cluster_tokens",
                f"{tokens} tokens per cluster need {shared} bytes of shared memory, more than {MAX_SHARED_BYTES}",
                tokens,
            )
        shared = boundary_shared_bytes(self.hidden, self.cluster_size, fmt)
        require(
            shared <= MAX_SHARED_BYTES,
            "cluster_size",
            f"the one-token kernel stages its fn slice in shared memory: {shared} bytes, more than "
            f"{MAX_SHARED_BYTES} (raise cluster_size)",
            self.cluster_size,
        )
        require_int("persistent_min_tokens", self.persistent_min_tokens, minimum=0)
        if self.persistent_min_tokens:
            last = max((threshold for threshold, _ in self.cluster_tokens), default=0)
            require(
                self.persistent_min_tokens > last,
                "persistent_min_tokens",
                f"must be above every cluster_tokens threshold (the last is {last}), or 0",
                self.persistent_min_tokens,
            )
            unfit = persistent_fits(self.hidden, self.cluster_size, fmt)
            require(unfit is None, "persistent_min_tokens", f"the persistent boundary does not fit: {unfit}; use 0",
                    self.persistent_min_tokens)  # fmt: skip
        self.routing  # noqa: B018  (builds the routing: an invalid one raises here, with the preset)
        require_positive_float("rms_eps", self.rms_eps)
        require_positive_float("hc_eps", self.hc_eps)
        require_positive_float("post_mult", self.post_mult)
        require_positive_float("norm_eps", self.norm_eps)
        require_int("sinkhorn_repeat", self.sinkhorn_repeat, minimum=1, maximum=100)
        require_threads("publish_threads", self.publish_threads)
        require_threads("mixes_threads", self.mixes_threads)
        require_archs(self.archs)
        require(isinstance(self.tuned, bool), "tuned", "must be true or false", self.tuned)

    # ------------------------------------------------------------ geometry
    @property
    def fragments(self) -> int:
        return self.hidden // VEC_BF16

    @property
    def threads(self) -> int:
        return boundary_threads(self.hidden, self.cluster_size)

    @property
    def grouped_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({tokens for _, tokens in self.cluster_tokens if tokens > 1}))

    @property
    def routing(self) -> MRangeDispatch[BoundaryTarget]:
        """Which boundary serves M tokens (``boundary_routing``; validated with the preset)."""
        return boundary_routing(self.cluster_tokens, self.persistent_min_tokens)

    def tokens_per_cluster(self, m: int) -> int:
        """Tokens per cluster of the one-token or grouped boundary serving M tokens (persistent or not:
        its ``cluster_tokens`` entry)."""
        return boundary_routing(self.cluster_tokens, 0).select(m).tokens

    def geometry(self) -> dict[str, Any]:
        return {
            "grid": f"(ceil(M / tokens_per_cluster), {self.cluster_size}, 1)",
            "cluster": (1, self.cluster_size, 1),
            "threads": self.threads,
            "fragment_groups_per_cta": self.fragments // self.cluster_size,
            "shared_bytes": boundary_launch_shared_bytes(self.hidden, self.cluster_size, self.layer_input_format),
            "grouped_shared_bytes": {
                tokens: grouped_kernel_shared_bytes(self.hidden, self.cluster_size, tokens, self.layer_input_format)
                for tokens in self.grouped_sizes
            },
            **(
                {
                    "persistent_min_tokens": self.persistent_min_tokens,
                    "persistent_grid": f"(min(ceil(M / {PERSISTENT_TOKENS}), clusters), {self.cluster_size}, 1)",
                    "persistent_threads": mma_threads(self.hidden, self.cluster_size),
                    "persistent_shared_bytes": persistent_shared_bytes(
                        self.hidden, self.cluster_size, self.layer_input_format
                    ),
                }
                if self.persistent_min_tokens
                else {}
            ),
            "publish_grid": f"(M, {-(-self.fragments // self.publish_threads)}, 1)",
            "publish_threads": self.publish_threads,
            "mixes_grid": f"(ceil(M / {self.mixes_threads}), 1, 1)",
            "mixes_threads": self.mixes_threads,
        }

    # ----------------------------------------------------------- kernels
    def boundary_config(self, arch: str) -> dict[str, Any]:
        return {
            "hidden": self.hidden,
            "tp": self.tp,
            "cluster_size": self.cluster_size,
            "rms_eps": self.rms_eps,
            "hc_eps": self.hc_eps,
            "norm_eps": self.norm_eps,
            "mixed_fma": arch != "sm_90a",
            "tokens": 1,
            "persistent": False,
            "layer_input_format": self.layer_input_format,
            "layer_input_bf16": self.layer_input_bf16,
        }

    def kernel_specs(self, arch: str) -> dict[str, tuple[str, dict[str, Any]]]:
        """Every kernel an ``AllReduceMhcBoundary`` of this preset launches on ``arch``.

        The GEMV's mixed-precision dot depends on the arch (``fma.rn.f32.bf16`` from
        sm_100 on), so the boundary configs carry it.
        """
        publish = {"hidden": self.hidden, "tp": self.tp, "threads": self.publish_threads, "trigger": "after_wait"}
        specs: dict[str, tuple[str, dict[str, Any]]] = {
            "publish": ("mhc_core.device.publish:PublishKernel", {**publish, "store": "unicast", **PLAIN}),
            "publish_multicast": ("mhc_core.device.publish:PublishKernel", {**publish, "store": "multicast", **PLAIN}),
        }
        for weights in ("float32", "bfloat16"):
            specs[f"finalize_{weights}"] = (
                "mhc_core.device.publish:FinalizePublishKernel",
                {**publish, "store": "unicast", "top_k": self.top_k, "weights": weights, "scatter": False},
            )
        specs[BoundaryTarget(1).kernel_name] = ("mhc_glm5.boundary:BoundaryKernel", self.boundary_config(arch))
        for tokens in self.grouped_sizes:
            specs[BoundaryTarget(tokens).kernel_name] = (
                grouped_kernel_path(tokens),
                {**self.boundary_config(arch), "tokens": tokens},
            )
        if self.persistent_min_tokens:
            specs[PERSISTENT.kernel_name] = (
                PERSISTENT_KERNEL,
                {**self.boundary_config(arch), "tokens": PERSISTENT_TOKENS, "persistent": True},
            )
        if self.two_shot_min_tokens is not None:
            # The core's two-shot kernels, and every boundary compiled for tp = 1 (what ends a two-shot).
            boundaries = [name for name in specs if name == "boundary" or name.startswith("boundary_")]
            specs.update(
                two_shot_kernel_specs(
                    hidden=self.hidden, tp=self.tp, threads=self.publish_threads, trigger="after_wait",
                    top_k=self.top_k, weights=("float32", "bfloat16"),
                )
            )  # fmt: skip
            for name in boundaries:
                path, config = specs[name]
                specs[f"gather_{name}"] = (path, {**config, "tp": 1})
        specs["mixes"] = (
            "mhc_glm5.mixes:MixesKernel",
            {
                "hc_eps": self.hc_eps,
                "post_mult": self.post_mult,
                "sinkhorn_repeat": self.sinkhorn_repeat,
                "threads": self.mixes_threads,
            },
        )
        return specs


def custom_preset(
    *,
    tp: int,
    hidden: int,
    top_k: int,
    cluster_size: int,
    cluster_tokens: Any,
    rms_eps: float,
    hc_eps: float,
    post_mult: float,
    sinkhorn_repeat: int,
    norm_eps: float,
    publish_threads: int,
    mixes_threads: int,
    persistent_min_tokens: int | None,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> GLM5Preset:
    """The preset a plain ``AllReduceMhcBoundary(...)`` describes (``name="custom"``; the first supported
    arch: no rule depends on it), checked by every rule a preset obeys: a ``ValueError`` naming the
    field. ``cluster_tokens`` may be the reference's ``{M: tokens}`` mapping; entries of any length
    pass through (the preset's rule names a malformed one)."""
    if isinstance(cluster_tokens, Mapping):
        cluster_tokens = thresholds_from_mapping(cluster_tokens)
    return argument_preset(
        GLM5Preset,
        name="custom",
        hidden=hidden,
        hc=HC,
        tp=tp,
        top_k=top_k,
        cluster_size=cluster_size,
        cluster_tokens=tuple(tuple(entry) for entry in (cluster_tokens or ())),
        rms_eps=rms_eps,
        hc_eps=hc_eps,
        post_mult=post_mult,
        sinkhorn_repeat=sinkhorn_repeat,
        norm_eps=norm_eps,
        archs=SUPPORTED_ARCHS[:1],
        publish_threads=publish_threads,
        mixes_threads=mixes_threads,
        persistent_min_tokens=0 if persistent_min_tokens is None else persistent_min_tokens,
        layer_input_format=layer_input_format,
        layer_input_bf16=layer_input_bf16,
    )


def preset_with(preset: GLM5Preset, **changes: Any) -> GLM5Preset:
    """``preset`` with ``changes`` (an op's options over a generated preset), checked like
    ``custom_preset``."""
    return argument_preset(dataclasses.replace, preset, **changes)


__all__ = [
    "HC",
    "MIX",
    "VALUES",
    "BoundaryTarget",
    "GLM5Preset",
    "PresetError",
    "boundary_routing",
    "custom_preset",
    "preset_with",
    "thresholds_from_mapping",
]
