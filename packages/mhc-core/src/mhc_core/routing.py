"""Which kernel serves a call of M tokens: one typed rule, written once.

An op whose kernels differ by token count (GLM's tokens-per-cluster boundaries and persistent
boundary, DSV's one-token and persistent collectives) holds an ``MRangeDispatch``: routes by
ascending ``min_tokens``, the first from 1; a call of M tokens takes the last route whose
``min_tokens <= M``. The preset (or the op's constructor) builds and validates it, the op selects
with it (``select``), and the native program receives it as data: ``thresholds`` beside the kernels
of ``targets``, in the same order (``mhc_core.host.calls.programs.Launch.min_tokens``; ``executor.cc``
picks the same route). Targets are the model's own typed values (``mhc_glm5.config.BoundaryTarget``,
``mhc_dsv41.config.CollectiveTarget``), never kernel-name strings.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

Target = TypeVar("Target")


@dataclass(frozen=True)
class Route(Generic[Target]):
    """Calls of at least ``min_tokens`` tokens (up to the next route's) take ``target``."""

    min_tokens: int
    target: Target


@dataclass(frozen=True)
class MRangeDispatch(Generic[Target]):
    """Routes by ascending ``min_tokens`` (see the module docstring)."""

    routes: tuple[Route[Target], ...]

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("routes: expected at least one route, got none")
        thresholds = [route.min_tokens for route in self.routes]
        for threshold in thresholds:
            if type(threshold) is not int:
                raise TypeError(f"routes: expected int min_tokens, got {threshold!r}")
        if thresholds[0] != 1:
            raise ValueError(f"routes: the first route must start at 1 token, got min_tokens = {thresholds[0]}")
        if any(later <= earlier for earlier, later in itertools.pairwise(thresholds)):
            raise ValueError(
                f"routes: min_tokens must increase strictly (a later route shadows an earlier one), got {thresholds}"
            )

    @classmethod
    def of(cls, *pairs: tuple[int, Target]) -> MRangeDispatch[Target]:
        """From ``(min_tokens, target)`` pairs by ascending ``min_tokens``, where a pair replaces an
        earlier one of the same ``min_tokens`` (a default first route a setting overrides)."""
        routes: list[Route[Target]] = []
        for min_tokens, target in pairs:
            if routes and routes[-1].min_tokens == min_tokens:
                routes.pop()
            routes.append(Route(min_tokens, target))
        return cls(tuple(routes))

    @property
    def thresholds(self) -> tuple[int, ...]:
        """Each route's ``min_tokens``, in order: what the native program receives."""
        return tuple(route.min_tokens for route in self.routes)

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(route.target for route in self.routes)

    def index(self, m: int) -> int:
        """The route serving M (>= 1) tokens."""
        if m < 1:
            raise ValueError(f"m: expected at least 1 token, got {m}")
        return bisect.bisect_right(self.thresholds, m) - 1

    def select(self, m: int) -> Target:
        """The target serving M (>= 1) tokens."""
        return self.routes[self.index(m)].target

    def __iter__(self) -> Iterator[Route[Target]]:
        return iter(self.routes)

    def __len__(self) -> int:
        return len(self.routes)
