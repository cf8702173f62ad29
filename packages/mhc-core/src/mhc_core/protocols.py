"""Which all-reduce protocol a boundary uses: one-shot or two-shot, chosen by the token count M.

* one-shot: every rank stores its whole BF16 partial into every peer's mailbox and sums tp rows;
  one Lamport round trip, ``(tp - 1) M H 2`` bytes received per rank.
* two-shot: reduce-scatter, then all-gather of the reduced rows (``mhc_core.device.two_shot``);
  two round trips and one more kernel, ``2 (tp - 1) / tp M H 2`` bytes received per rank.

The one-shot wins at small M (latency), the two-shot past a crossover (bytes). An op routes calls
of at least ``two_shot_min_tokens`` tokens to the two-shot: from its preset (measured, or the cost
model's), from the ``two_shot_min_tokens`` argument, or from the cost model below. ``protocol=``
(or ``MHC_PROTOCOL``) forces either: ``"one-shot"``, ``"two-shot"``, or ``"auto"`` (the default).

Pure Python (no torch, no DSL): the presets, codegen and the benchmarks use it too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

ONE_SHOT = "one-shot"
TWO_SHOT = "two-shot"
AUTO = "auto"
PROTOCOLS = (AUTO, ONE_SHOT, TWO_SHOT)
PROTOCOL_ENV = "MHC_PROTOCOL"
#: BF16 elements per 16-byte fragment (each rank's slice is whole fragments).
_FRAGMENT = 8


def requested_protocol(protocol: str | None) -> tuple[str, str]:
    """(the protocol asked for: the argument, else ``MHC_PROTOCOL``, else "auto"; where it came from)."""
    source = "protocol"
    if protocol is None:
        protocol, source = os.environ.get(PROTOCOL_ENV, AUTO).strip() or AUTO, PROTOCOL_ENV
    if not isinstance(protocol, str) or protocol not in PROTOCOLS:
        raise ValueError(f"{source}: expected one of {PROTOCOLS}, got {protocol!r}")
    return protocol, source


def two_shot_unavailable(tp: int, hidden: int, transport: str) -> str | None:
    """Why a two-shot cannot serve this op (None: it can)."""
    if tp < 2:
        return "tp = 1 has nothing to all-reduce"
    if hidden % (_FRAGMENT * tp):
        return f"hidden = {hidden} is not a multiple of {_FRAGMENT} * tp = {_FRAGMENT * tp} (whole 16-byte slices)"
    if transport == "multicast":
        return "transport 'multicast' stores one row to every rank; the reduce-scatter stores point to point"
    return None


@dataclass(frozen=True)
class LinkModel:
    """The cost model's parameters (per rank, per call).

    ``link_gbps``: bytes a rank receives from its peers per ns (GB/s), effective, as measured through
    the one-shot: real tp 2 on 2 x H200 took 81.6 - 37.6 = 44 us more than tp 1 for 1024 x 5120 BF16
    received (BENCHMARKS.md, 2026-12-04), 238 GB/s. ``memory_gbps``: the mailbox's own reads and
    re-arms (HBM; 4.1 TB/s measured copy). ``round_trip_us``: what the two-shot adds before any byte
    counts: its second Lamport round trip and its third kernel in the PDL chain.
    """

    link_gbps: float = 238.0
    memory_gbps: float = 4100.0
    round_trip_us: float = 3.0

    def one_shot_us(self, tp: int, hidden: int, m: int) -> float:
        """The one-shot's byte time: receive tp - 1 rows, read and re-arm tp rows."""
        row = m * hidden * 2
        return ((tp - 1) * row / self.link_gbps + 2 * tp * row / self.memory_gbps) / 1e3

    def two_shot_us(self, tp: int, hidden: int, m: int) -> float:
        """The two-shot's byte time and its extra round trip: receive 2 (tp - 1) / tp rows, read and
        re-arm one row in each mailbox."""
        row = m * hidden * 2
        return self.round_trip_us + (2 * (tp - 1) / tp * row / self.link_gbps + 4 * row / self.memory_gbps) / 1e3

    def crossover(self, tp: int, hidden: int) -> int | None:
        """The smallest M from which the two-shot is predicted faster (None: never, as at tp 2, where it
        receives as many bytes as the one-shot)."""
        per_token = self.one_shot_us(tp, hidden, 1) - self.two_shot_us(tp, hidden, 1) + self.round_trip_us
        if per_token <= 0:
            return None
        return max(1, math.ceil(self.round_trip_us / per_token))


#: The parameters presets use where no crossover was measured (real NVLink; see ``LinkModel``).
NVLINK_H200 = LinkModel()


@dataclass(frozen=True)
class ProtocolChoice:
    """An op's protocol routing: calls of at least ``two_shot_from`` tokens take the two-shot (None:
    never), and the token capacity each protocol's mailbox holds."""

    requested: str
    two_shot_from: int | None
    capacity: int

    @property
    def one_shot_capacity(self) -> int:
        """One-shot calls have fewer than ``two_shot_from`` tokens (at least one slot: its kernels are
        built and warmed up whatever the routing)."""
        if self.two_shot_from is None:
            return self.capacity
        return max(1, min(self.capacity, self.two_shot_from - 1))

    @property
    def two_shot_capacity(self) -> int:
        return 0 if self.two_shot_from is None else self.capacity

    def protocol(self, m: int) -> str:
        return TWO_SHOT if self.two_shot_from is not None and m >= self.two_shot_from else ONE_SHOT


def choose_protocol(
    protocol: str | None,
    *,
    tp: int,
    hidden: int,
    transport: str,
    capacity: int,
    two_shot_min_tokens: int | None = None,
    model: LinkModel = NVLINK_H200,
) -> ProtocolChoice:
    """Resolve ``protocol`` (see the module docstring) into the op's routing. "two-shot" where it is
    unavailable raises, naming why; "auto" then keeps the one-shot."""
    requested, source = requested_protocol(protocol)
    if two_shot_min_tokens is not None and (
        isinstance(two_shot_min_tokens, bool) or not isinstance(two_shot_min_tokens, int) or two_shot_min_tokens < 1
    ):
        raise ValueError(f"two_shot_min_tokens: expected a positive int or None, got {two_shot_min_tokens!r}")
    unavailable = two_shot_unavailable(tp, hidden, transport)
    if requested == ONE_SHOT or (unavailable is not None and tp == 1):
        return ProtocolChoice(requested, None, capacity)
    if unavailable is not None:
        if requested == TWO_SHOT:
            raise ValueError(f"{source}: 'two-shot' is unavailable for this op: {unavailable}")
        return ProtocolChoice(requested, None, capacity)
    if requested == TWO_SHOT:
        return ProtocolChoice(requested, 1, capacity)
    start = two_shot_min_tokens if two_shot_min_tokens is not None else model.crossover(tp, hidden)
    if start is None or start > capacity:
        return ProtocolChoice(requested, None, capacity)
    return ProtocolChoice(requested, start, capacity)


def mailbox_traffic_bytes(protocol: str, tp: int, hidden: int, m: int) -> int:
    """Bytes one rank's call moves through its GPU's memory for the all-reduce (what loopback, where
    every rank is on one GPU, measures the ratio of): the one-shot writes tp rows into the mailboxes,
    reads and re-arms tp rows; the two-shot scatters one row, reads, re-arms and gathers one row of
    slices, then reads and re-arms the gathered row: six rows whatever tp."""
    row = m * hidden * 2
    return 3 * tp * row if protocol == ONE_SHOT else 6 * row


def two_shot_kernel_specs(
    *, hidden: int, tp: int, threads: int, trigger: str, top_k: int, weights: tuple[str, ...]
) -> dict[str, tuple[str, dict]]:
    """The core's kernels a preset's op launches for its two-shot (named as ``kernel_specs`` names
    kernels: class path and config fields, so the wheels ship them): the scatter publish, the
    scatter finalize per routing-weight dtype, the reduce. A model adds its boundaries for tp = 1."""
    from .device.configs import FINALIZE_PUBLISH_KERNEL, PUBLISH_KERNEL, REDUCE_KERNEL

    publish = {"hidden": hidden, "tp": tp, "threads": threads, "trigger": trigger, "store": "unicast"}
    specs: dict[str, tuple[str, dict]] = {
        "publish_scatter": (PUBLISH_KERNEL, {**publish, "top_k": 0, "weights": "float32", "scatter": True}),
    }
    for weight in weights:
        specs[f"finalize_scatter_{weight}"] = (
            FINALIZE_PUBLISH_KERNEL,
            {**publish, "top_k": top_k, "weights": weight, "scatter": True},
        )
    specs["reduce"] = (REDUCE_KERNEL, {"hidden": hidden, "tp": tp, "threads": 128, "lanes": 1})
    return specs


def link_bytes(protocol: str, tp: int, hidden: int, m: int) -> float:
    """Bytes one rank receives from its peers (over NVLink on real GPUs)."""
    row = m * hidden * 2
    return (tp - 1) * row if protocol == ONE_SHOT else 2 * (tp - 1) / tp * row
