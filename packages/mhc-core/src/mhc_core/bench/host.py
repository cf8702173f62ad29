"""One measured path of the host-overhead suite (``--suite host``); a model's ``host_steps`` gives its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One measured path: ``step`` makes ``per_step`` calls (loopback ranks: one per rank)."""

    label: str
    tp: int
    step: Callable[[], object]
    launches: int
    per_step: int = 1
