"""The second byte floor at tp > 1: the mailbox traffic the Lamport protocol adds to one GPU's memory.

Byte floors count what a call must move once through HBM (inputs read and outputs written, weights
once per call; the mailbox traffic not counted) divided by the copy bandwidth measured in the same run.
"""

from __future__ import annotations

from typing import Any


def mailbox_bytes(m: int, hidden: int, tp: int) -> int:
    """What the Lamport protocol adds to one GPU's memory traffic per call at tp > 1: every rank's
    BF16 slot of each token written into this GPU's mailbox, read by its collective and re-armed
    with -0 (3 x tp x M x hidden x 2 bytes; the token-count headers, 16 bytes per rank, left out).
    The (tp - 1) x M x hidden x 2 bytes each rank sends over NVLink are another link's, not counted."""
    from ..protocols import ONE_SHOT, mailbox_traffic_bytes

    return mailbox_traffic_bytes(ONE_SHOT, tp, hidden, m) if tp > 1 else 0


def mailbox_floor(ctx: Any, floor_bytes: int, m: int, hidden: int) -> float | None:
    """The second floor at tp > 1 (``Record.mailbox_floor_us``); ``ctx``: a ``records.Context``."""
    return (floor_bytes + mailbox_bytes(m, hidden, ctx.tp)) / ctx.bandwidth if ctx.tp > 1 else None
