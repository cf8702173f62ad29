"""The compile-time constants of mhc-core's kernels, in plain Python (no DSL): what the host builds a
kernel's key from and checks before anything compiles, and what the kernel modules compile.

``PublishConfig`` (the publish kernels, ``mhc_core.device.publish``), ``CollectiveConfig`` (the plain
collective, ``mhc_core.device.one_shot.collective``), the publish's destination kinds and PDL triggers, and
the kernel classes' paths (``module:Class``) that ``mhc_core.device.kernel.KernelSpec`` names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import VEC_BF16

#: Destination kinds of a publish: peer pointers, the multicast address, or the
#: multicast addressing with a plain store to the local mailbox (a debug variant
#: that checks the multicast path's addresses on hosts where multicast must not run).
STORE_UNICAST = "unicast"
STORE_MULTICAST = "multicast"
STORE_MULTICAST_LOCAL = "multicast_local"
STORE_KINDS = (STORE_UNICAST, STORE_MULTICAST, STORE_MULTICAST_LOCAL)

TRIGGER_AFTER_WAIT = "after_wait"
TRIGGER_AFTER_STORES = "after_stores"
TRIGGERS = (TRIGGER_AFTER_WAIT, TRIGGER_AFTER_STORES)
WEIGHT_DTYPES = ("float32", "bfloat16")

PUBLISH_KERNEL = "mhc_core.device.publish:PublishKernel"
FINALIZE_PUBLISH_KERNEL = "mhc_core.device.publish:FinalizePublishKernel"
COLLECTIVE_KERNEL = "mhc_core.device.one_shot.collective:CollectiveKernel"
REDUCE_KERNEL = "mhc_core.device.two_shot.reduce:ReduceKernel"


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """Compile-time constants of a publish kernel (plain when ``top_k`` is 0)."""

    hidden: int
    tp: int
    threads: int = 128
    trigger: str = TRIGGER_AFTER_STORES
    store: str = STORE_UNICAST
    top_k: int = 0
    weights: str = "float32"
    #: Two-shot stage 1 (reduce-scatter): fragment slice ``j`` of the row goes to rank ``j`` alone,
    #: into its ``[3, tp, capacity, hidden / tp]`` reduce-scatter mailbox (``mhc_core.device.two_shot``).
    scatter: bool = False

    def __post_init__(self) -> None:
        if self.hidden <= 0 or self.hidden % VEC_BF16:
            raise ValueError(f"hidden: expected a positive multiple of {VEC_BF16}, got {self.hidden}")
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"tp: expected 1, 2, 4 or 8, got {self.tp}")
        if self.threads <= 0 or self.threads % 32 or self.threads > 1024:
            raise ValueError(f"threads: expected a multiple of 32 in [32, 1024], got {self.threads}")
        if self.scatter:
            if self.tp < 2 or self.hidden % (VEC_BF16 * self.tp):
                raise ValueError(
                    f"scatter: expected tp >= 2 and hidden a multiple of {VEC_BF16} * tp, got tp = {self.tp}, "
                    f"hidden = {self.hidden}"
                )
            if self.store != STORE_UNICAST:
                raise ValueError(f"scatter: expected store {STORE_UNICAST!r} (point to point), got {self.store!r}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger: expected one of {TRIGGERS}, got {self.trigger!r}")
        if self.store not in STORE_KINDS:
            raise ValueError(f"store: expected one of {STORE_KINDS}, got {self.store!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0, got {self.top_k}")
        if self.weights not in WEIGHT_DTYPES:
            raise ValueError(f"weights: expected one of {WEIGHT_DTYPES}, got {self.weights!r}")

    @property
    def fragments(self) -> int:
        return self.hidden // VEC_BF16

    @property
    def ctas_per_token(self) -> int:
        return -(-self.fragments // self.threads)

    @property
    def destinations(self) -> int:
        """Entries of the destination table: every peer, or one multicast address."""
        return self.tp if self.store == STORE_UNICAST else 1

    @property
    def slot_hidden(self) -> int:
        """Columns of one mailbox slot: the row, or (scatter) one rank's slice of it."""
        return self.hidden // self.tp if self.scatter else self.hidden


@dataclass(frozen=True, slots=True)
class CollectiveConfig:
    hidden: int
    tp: int
    threads: int = 128
    lanes: int = 1

    def __post_init__(self) -> None:
        if self.hidden <= 0 or self.hidden % VEC_BF16:
            raise ValueError(f"hidden: expected a positive multiple of {VEC_BF16}, got {self.hidden}")
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"tp: expected 1, 2, 4 or 8, got {self.tp}")
        if self.lanes not in (1, 2, 4, 8):
            raise ValueError(f"lanes: expected 1, 2, 4 or 8, got {self.lanes}")
        if self.threads <= 0 or self.threads % 32 or self.threads > 1024:
            raise ValueError(f"threads: expected a multiple of 32 in [32, 1024], got {self.threads}")

    @property
    def fragments(self) -> int:
        return self.hidden // VEC_BF16

    @property
    def groups_per_cta(self) -> int:
        return self.threads // self.lanes

    @property
    def ctas_per_token(self) -> int:
        return -(-self.fragments // self.groups_per_cta)


@dataclass(frozen=True, slots=True)
class ReduceConfig:
    """Compile-time constants of the two-shot reduce (``mhc_core.device.two_shot.reduce.ReduceKernel``): the
    full row's ``hidden``, of which this rank reduces ``hidden / tp`` columns; ``lanes`` threads per
    fragment share the ranks, as in the one-shot collective (the same FP32 tree for the same lanes)."""

    hidden: int
    tp: int
    threads: int = 128
    lanes: int = 1

    def __post_init__(self) -> None:
        if self.tp not in (2, 4, 8):
            raise ValueError(f"tp: expected 2, 4 or 8 (a two-shot has peers), got {self.tp}")
        if self.hidden <= 0 or self.hidden % (VEC_BF16 * self.tp):
            raise ValueError(
                f"hidden: expected a positive multiple of {VEC_BF16} * tp = {VEC_BF16 * self.tp}, got {self.hidden}"
            )
        if self.lanes not in (1, 2, 4, 8) or self.tp % self.lanes:
            raise ValueError(f"lanes: expected 1, 2, 4 or 8 dividing tp = {self.tp}, got {self.lanes}")
        if self.threads <= 0 or self.threads % 32 or self.threads > 1024:
            raise ValueError(f"threads: expected a multiple of 32 in [32, 1024], got {self.threads}")

    @property
    def slice_hidden(self) -> int:
        return self.hidden // self.tp

    @property
    def slice_fragments(self) -> int:
        return self.slice_hidden // VEC_BF16

    @property
    def groups_per_cta(self) -> int:
        return self.threads // self.lanes

    @property
    def ctas_per_token(self) -> int:
        return -(-self.slice_fragments // self.groups_per_cta)
