"""DSV4.1 presets: the frozen configuration of one model target and its derived launch geometry.

Pure Python (no torch, no DSL): the code generator imports it to validate
the ``[dsv41.<name>]`` tables of the repository's ``presets.toml`` and to render the preset modules.

Geometry (the collective, ``mhc_dsv41.kernel``): one cluster of ``cluster_size``
CTAs of ``threads`` threads per token; ``rank_lanes`` consecutive threads share a
16-byte fragment (lane ``l`` polls ranks ``l, l + rank_lanes, ...``); a cluster
covers ``cluster_size * threads / rank_lanes`` fragments per trip and makes
``trips`` trips over the token's ``hidden / 8`` fragments (the last may be partial).

``default_geometry`` is the rule a plain ``AllReduceMHC(...)`` uses when the
caller gives no geometry, and the rule that fills a preset's omitted keys:
128 threads, one rank lane, and the smallest cluster (at most 8 CTAs) that
covers the token in one trip, else 8 CTAs and several trips.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mhc_core.constants import SUPPORTED_ARCHS, VEC_BF16, WARP_SIZE
from mhc_core.fp8_formats import BF16, LayerInputConfig, require_layer_input
from mhc_core.presets import (
    CTA_RESERVED_SHARED_BYTES,
    MAX_CLUSTER_SIZE,
    MAX_SHARED_BYTES,
    MAX_TOP_K,
    SM_REGISTERS,
    SM_SHARED_BYTES,
    SM_THREADS,
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

#: The collective's kernel class (``KernelSpec`` path: named without importing it or the DSL).
COLLECTIVE_KERNEL = "mhc_dsv41.kernel:LamportMHCKernel"

DEFAULT_THREADS = 128
DEFAULT_RANK_LANES = 1
#: Shared memory stages every trip's hc residual fragments, two tokens deep: bound them (at most
#: 64 KiB for 128 threads, so that several CTAs share an SM).
MAX_TRIP_STREAMS = 16


def check_layer_input(fmt: object, both: object, hidden: int, rank_lanes: int, groups_per_cta: int) -> None:
    """The layer-input option's rules for a geometry, each a ``PresetError`` naming the field: the
    core's (``mhc_core.fp8_formats.require_layer_input``), then the FP8 groups' placement
    (``mhc_dsv41.kernel``): a group of ``group`` columns is ``group / 8`` consecutive fragments of one
    trip, ``rank_lanes`` consecutive threads each, in one CTA (a CTA's ``groups_per_cta`` fragments
    of a trip start at a multiple of it); its absmax is reduced by shuffles, so those threads must
    lie in one warp. ``DSV41Preset`` applies it, and ``MHCConfig`` (its messages name the argument)."""
    group = require_layer_input(fmt, both, hidden)
    if not group:
        return
    fragments = group // VEC_BF16
    rule = (
        f"a group of {fmt!r} is {fragments} fragments of rank_lanes threads each, reduced inside one warp, "
        f"so at most {WARP_SIZE // fragments} rank lanes"
    )
    require(fragments * rank_lanes <= WARP_SIZE, "rank_lanes", rule, rank_lanes)
    rule = (
        f"a CTA's {groups_per_cta} fragments per trip must hold whole groups of {fragments} fragments "
        f"({fmt!r}: a group may not straddle the cluster's CTAs)"
    )
    require(groups_per_cta % fragments == 0, "threads", rule, groups_per_cta * rank_lanes)


def default_geometry(hidden: int, hc: int, tp: int) -> dict[str, int]:
    """``cluster_size``, ``threads`` and ``rank_lanes`` for a plain constructor (module docstring)."""
    fragments = hidden // VEC_BF16
    groups = DEFAULT_THREADS // DEFAULT_RANK_LANES
    cluster_size = min(MAX_CLUSTER_SIZE, max(1, -(-fragments // groups)))
    return {"cluster_size": cluster_size, "threads": DEFAULT_THREADS, "rank_lanes": DEFAULT_RANK_LANES}


#: Calls with at least this many tokens take the persistent collective (BENCHMARKS.md, eleventh and
#: twelfth runs, three runs in all on the H200: the one-token collective 3-6 % faster at M = 256
#: and 11 % at 320, the persistent one 3-5 % faster at 384, 2 % at 448 and 12 % at 512).
PERSISTENT_MIN_TOKENS = 384


@dataclass(frozen=True)
class CollectiveTarget:
    """A collective a call can take: the one-token one (a cluster per token) or the persistent one."""

    persistent: bool


def collective_routing(persistent_min_tokens: int) -> MRangeDispatch[CollectiveTarget]:
    """Which collective serves M tokens: the one-token one from 1, the persistent one from
    ``persistent_min_tokens`` (1: every call)."""
    return MRangeDispatch.of((1, CollectiveTarget(False)), (persistent_min_tokens, CollectiveTarget(True)))


#: Registers per thread the collective stays within (a CPU test compiles every preset's and checks):
#: what the default number of persistent clusters assumes.
COLLECTIVE_REGISTERS = 160


def resident_clusters(geometry: CollectiveGeometry, sms: int) -> int:
    """How many of the collective's clusters ``sms`` SMs hold at once (registers at
    ``COLLECTIVE_REGISTERS``, threads, shared memory with its per-CTA reserve): the grid beyond
    which a cluster loops over tokens."""
    per_sm = min(
        SM_THREADS // geometry.threads,
        SM_REGISTERS // (geometry.threads * COLLECTIVE_REGISTERS),
        SM_SHARED_BYTES // (geometry.shared_bytes + CTA_RESERVED_SHARED_BYTES),
    )
    return max(1, sms * max(1, per_sm) // geometry.cluster_size)


class CollectiveGeometry:
    """The collective's launch geometry, derived from ``hidden``, ``threads``, ``rank_lanes`` and
    ``cluster_size``: what a preset reports and the kernel's config compiles (one definition)."""

    __slots__ = ()
    hidden: int
    hc: int
    tp: int
    threads: int
    rank_lanes: int
    cluster_size: int

    @property
    def fragments(self) -> int:
        return self.hidden // VEC_BF16

    @property
    def groups_per_cta(self) -> int:
        return self.threads // self.rank_lanes

    @property
    def fragment_stride(self) -> int:
        return self.cluster_size * self.groups_per_cta

    @property
    def trips(self) -> int:
        return -(-self.fragments // self.fragment_stride)

    @property
    def warps(self) -> int:
        return self.threads // WARP_SIZE

    #: Tokens staged at once: the current one and ``staged_tokens - 1`` ahead (the preset's own
    #: dataclass has no such field: every preset stages the default).
    staged_tokens: int = 2

    @property
    def staged_mixes(self) -> int:
        """FP32 mixes staged per token: post (hc), pre (hc), comb (hc x hc)."""
        return self.hc * (self.hc + 2)

    @property
    def staged_stream_words(self) -> int:
        """u32 words of one token's staged residual fragments: [trips, hc, groups] x 16 bytes."""
        return self.trips * self.hc * self.groups_per_cta * 4

    @property
    def staged_x_words(self) -> int:
        """u32 words of one token's staged ``x`` (read directly at tp = 1 only; else one fragment)."""
        return self.trips * self.groups_per_cta * 4 if self.tp == 1 else 4

    #: Whether the collective loops over tokens (``staged_tokens`` staged at once); a one-token
    #: collective (one cluster per token, nothing staged) serves calls below ``PERSISTENT_MIN_TOKENS``.
    persistent: bool = False

    @property
    def shared_bytes(self) -> int:
        """Persistent: ``staged_tokens`` staging buffers (streams, x, mixes: each 16-byte aligned).
        Then the warp sums and two slots per cluster peer (one per token reduced at once) for the
        RMSNorm sum of squares."""
        staged = 0
        if self.persistent:
            depth = self.staged_tokens
            staged = depth * (self.staged_stream_words + self.staged_x_words) * 4
            staged += -(-depth * self.staged_mixes * 4 // 16) * 16
        return staged + (self.warps + 2 * self.cluster_size) * 4


@dataclass(frozen=True, slots=True)
class DSV41Preset(CollectiveGeometry):
    """One DSV4.1 target. Every value is validated; see the module docstring for the geometry."""

    name: str
    hidden: int
    hc: int
    tp: int
    top_k: int
    cluster_size: int
    threads: int
    rank_lanes: int
    norm_eps: float
    archs: tuple[str, ...]
    publish_threads: int = 128
    #: Whether the geometry was measured on the preset's own target (False: a rule or another
    #: host's values; building the op logs a warning).
    tuned: bool = False
    #: The layer input's format (``mhc_core.fp8_formats.LAYER_INPUT_FORMATS``; issue #33) and whether
    #: the BF16 copy is written beside an FP8 one: what an op built from the preset returns, and its
    #: collectives' configs.
    layer_input_format: str = BF16
    layer_input_bf16: bool = False
    #: Calls of at least this many tokens take the two-shot all-reduce (``mhc_core.protocols``); None:
    #: the one-shot for every M. Measured where the preset's host was lent, else the cost model's
    #: (codegen fills it: ``NVLINK_H200.crossover(tp, hidden)``).
    two_shot_min_tokens: int | None = None
    description: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return preset_repr(self)  # says what tuned=False means

    def __post_init__(self) -> None:
        require_name(self.name)
        require_two_shot_min_tokens(self.two_shot_min_tokens)
        require_hidden(self.hidden)
        require_int("hc", self.hc, minimum=1, maximum=16)
        require_tp(self.tp)
        require_int("top_k", self.top_k, minimum=1, maximum=MAX_TOP_K)
        require_int("cluster_size", self.cluster_size, minimum=1, maximum=MAX_CLUSTER_SIZE)
        require(self.rank_lanes in (1, 2, 4, 8), "rank_lanes", "must be 1, 2, 4 or 8", self.rank_lanes)
        require(self.tp % self.rank_lanes == 0, "rank_lanes", f"must divide tp ({self.tp})", self.rank_lanes)
        require_threads("threads", self.threads, multiple=self.rank_lanes)
        require_threads("publish_threads", self.publish_threads)
        require_positive_float("norm_eps", self.norm_eps)
        require_archs(self.archs)
        require(isinstance(self.tuned, bool), "tuned", "must be true or false", self.tuned)
        require(  # a bound for the presets shipped; a plain constructor's geometry needs only MHCConfig's
            self.name == CUSTOM or self.trips * self.hc <= MAX_TRIP_STREAMS,
            "cluster_size",
            f"trips x hc must be <= {MAX_TRIP_STREAMS} (each trip stages hc residual fragments in shared memory); "
            f"trips = {self.trips}, hc = {self.hc}",
            self.cluster_size,
        )
        check_layer_input(
            self.layer_input_format, self.layer_input_bf16, self.hidden, self.rank_lanes, self.groups_per_cta
        )

    # ------------------------------------------------------------ geometry (CollectiveGeometry)
    def geometry(self) -> dict[str, Any]:
        return {
            "grid": f"(M, {self.cluster_size}, 1)",
            "cluster": (1, self.cluster_size, 1),
            "threads": self.threads,
            "rank_lanes": self.rank_lanes,
            "fragments": self.fragments,
            "trips": self.trips,
            "last_trip_fragments": self.fragments - (self.trips - 1) * self.fragment_stride,
            "shared_bytes": self.shared_bytes,
            "persistent_min_tokens": PERSISTENT_MIN_TOKENS,
            "persistent_grid": f"(min(M, clusters), {self.cluster_size}, 1)",
            "persistent_shared_bytes": MHCConfig(**self.collective_config(persistent=True)).shared_bytes,
            "publish_grid": f"(M, {-(-self.fragments // self.publish_threads)}, 1)",
            "publish_threads": self.publish_threads,
        }

    # ----------------------------------------------------------- kernels
    def collective_config(
        self, persistent: bool = False, layer_input_format: str | None = None, layer_input_bf16: bool | None = None
    ) -> dict[str, Any]:
        """The collective's ``MHCConfig`` fields (all of them: a kernel's key is built from this dict);
        the layer-input fields are the preset's unless given."""
        if layer_input_format is None:
            layer_input_format = self.layer_input_format
            layer_input_bf16 = self.layer_input_bf16 if layer_input_bf16 is None else layer_input_bf16
        elif layer_input_bf16 is None:
            layer_input_bf16 = False
        return {
            "hidden": self.hidden,
            "hc": self.hc,
            "tp": self.tp,
            "cluster_size": self.cluster_size,
            "rank_lanes": self.rank_lanes,
            "threads": self.threads,
            "staged_tokens": self.staged_tokens,
            "persistent": persistent,
            "layer_input_format": layer_input_format,
            "layer_input_bf16": layer_input_bf16,
        }

    def kernel_specs(self, arch: str) -> dict[str, tuple[str, dict[str, Any]]]:
        """Every kernel an ``AllReduceMHC`` of this preset launches: class path and config.

        The unicast publish (the transport every lent host runs) and the
        multicast one (opt-in, compile-checked), the FP32-weight finalize, the
        one-token collective and the persistent one (from ``PERSISTENT_MIN_TOKENS``), both writing
        the preset's layer-input format. None depends on ``arch`` beyond the compile target.
        """
        publish = {"hidden": self.hidden, "tp": self.tp, "threads": self.publish_threads, "trigger": "after_stores"}
        return {
            "publish": ("mhc_core.device.publish:PublishKernel", {**publish, "store": "unicast", **PLAIN}),
            "publish_multicast": ("mhc_core.device.publish:PublishKernel", {**publish, "store": "multicast", **PLAIN}),
            "finalize": (
                "mhc_core.device.publish:FinalizePublishKernel",
                {**publish, "store": "unicast", "top_k": self.top_k, "weights": "float32", "scatter": False},
            ),
            "collective": (COLLECTIVE_KERNEL, self.collective_config()),
            "collective_persistent": (COLLECTIVE_KERNEL, self.collective_config(persistent=True)),
            **self._two_shot_specs(),
        }

    def _two_shot_specs(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """With a two-shot crossover: the core's two-shot kernels and the collectives that end it
        (``gather_config``: this preset's compiled for tp = 1)."""
        if self.two_shot_min_tokens is None:
            return {}
        specs = two_shot_kernel_specs(
            hidden=self.hidden, tp=self.tp, threads=self.publish_threads, trigger="after_stores", top_k=self.top_k,
            weights=("float32",),
        )  # fmt: skip
        gather = dataclasses.asdict(gather_config(MHCConfig(**self.collective_config())))
        specs["gather"] = (COLLECTIVE_KERNEL, gather)
        specs["gather_persistent"] = (COLLECTIVE_KERNEL, {**gather, "persistent": True})
        return specs


#: The name of the preset a plain ``AllReduceMHC(...)`` describes (``custom_preset``).
CUSTOM = "custom"


def custom_preset(
    *,
    tp: int,
    hidden: int,
    hc: int,
    top_k: int,
    norm_eps: float,
    publish_threads: int,
    layer_input_format: str,
    layer_input_bf16: bool,
    **geometry: int,
) -> DSV41Preset:
    """The preset a plain ``AllReduceMHC(...)`` describes (``name="custom"``; the first supported arch:
    no rule depends on it). ``geometry``: ``cluster_size``, ``threads``, ``rank_lanes``, any of them
    (the others ``default_geometry``'s). Checked by the collective's rules first (``MHCConfig``: its
    messages), then by a preset's: a ``ValueError`` naming the field."""
    geometry = {**default_geometry(hidden, hc, tp), **geometry}
    layer_input = {"layer_input_format": layer_input_format, "layer_input_bf16": layer_input_bf16}
    MHCConfig(hidden=hidden, hc=hc, tp=tp, **geometry, **layer_input)
    return argument_preset(
        DSV41Preset, name=CUSTOM, hidden=hidden, hc=hc, tp=tp, top_k=top_k, norm_eps=norm_eps,
        archs=SUPPORTED_ARCHS[:1], publish_threads=publish_threads, **geometry, **layer_input,
    )  # fmt: skip


def preset_with(preset: DSV41Preset, **changes: Any) -> DSV41Preset:
    """``preset`` with ``changes`` (an op's options over a generated preset), checked like
    ``custom_preset``."""
    return argument_preset(dataclasses.replace, preset, **changes)


@dataclass(frozen=True, slots=True, repr=False)
class MHCConfig(CollectiveGeometry, LayerInputConfig):
    """Compile-time constants of the collective (``mhc_dsv41.kernel``; the geometry rules above)."""

    hidden: int
    hc: int
    tp: int
    cluster_size: int
    rank_lanes: int
    threads: int
    staged_tokens: int = 2
    persistent: bool = False
    #: The layer input's format (``mhc_core.fp8_formats``; ``LayerInputConfig`` derives the rest): BF16,
    #: or FP8 E4M3 quantised in registers at the norm's store, with its scales (``mhc_core.device.quant``).
    layer_input_format: str = BF16
    #: With an FP8 format: store the BF16 layer input too (both from one call).
    layer_input_bf16: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.staged_tokens <= 4:
            raise ValueError(f"staged_tokens: expected 2..4, got {self.staged_tokens}")
        if self.hidden <= 0 or self.hidden % VEC_BF16:
            raise ValueError(f"hidden: expected a positive multiple of {VEC_BF16}, got {self.hidden}")
        if self.rank_lanes not in (1, 2, 4, 8) or self.tp % self.rank_lanes:
            raise ValueError(f"rank_lanes: expected 1, 2, 4 or 8 dividing tp = {self.tp}, got {self.rank_lanes}")
        if self.threads % WARP_SIZE or self.threads % self.rank_lanes or not 0 < self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 and of rank_lanes in [32, 1024], got {self.threads}")
        if not 1 <= self.cluster_size <= 8:
            raise ValueError(f"cluster_size: expected 1..8, got {self.cluster_size}")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(
                f"threads: {self.threads} threads x {self.trips} trips x hc = {self.hc} stage {self.shared_bytes} "
                f"bytes of shared memory, more than {MAX_SHARED_BYTES} (fewer threads or a larger cluster_size)"
            )
        self._check_layer_input()

    def _check_layer_input(self) -> None:
        """The layer-input fields (``check_layer_input``: the format, and the FP8 groups' placement)."""
        argument_preset(
            check_layer_input,
            self.layer_input_format, self.layer_input_bf16, self.hidden, self.rank_lanes, self.groups_per_cta,
        )  # fmt: skip


def gather_config(config: MHCConfig) -> MHCConfig:
    """The collective that ends a two-shot (``mhc_core.device.two_shot``): ``config`` compiled for
    tp = 1, polling the gather mailbox's one reduced row. One rank lane (a lane per rank is what the
    lanes are for), with the same fragments per CTA where the threads allow it (the same cluster
    layout and staging); else the tp = 1 default geometry."""
    lanes = config.rank_lanes
    if config.threads // lanes >= WARP_SIZE:
        try:
            return dataclasses.replace(config, tp=1, rank_lanes=1, threads=config.threads // lanes)
        except ValueError:
            pass
    geometry = default_geometry(config.hidden, config.hc, 1)
    return dataclasses.replace(config, tp=1, **geometry)
