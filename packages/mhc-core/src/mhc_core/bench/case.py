"""What the generic suites (``--suite fp8``, ``host``, ``spin-bound``; ``benchmarks.ab``) need of one
model: its ``BenchmarkCase``, named by ``Model.benchmark_case`` (``module:name``) in the registry.

A case's module imports torch and its own package's op only, and those when called:
``benchmarks.ab`` loads this checkout's case file into a process whose packages are another tree's
(an older commit's, without any ``bench`` module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from .host import Step


class BenchmarkCase(Protocol):
    #: The registry key: suite and variant names (``fp8-<key>``), ``find_preset(key, ...)``.
    key: str
    #: The hidden size and stream count its suites measure (the ``h200-tp<tp>-h<hidden>`` presets).
    hidden: int
    hc: int
    #: The outputs before the layer input's (``(residual_out, ...)``): where ``q`` sits in an FP8 call's.
    first_layer_output: int
    #: The module of its paths of ``benchmarks.host_instructions`` (``paths``, ``CUSTOM_OPS``), or None.
    instructions: str | None

    def preset(self, tp: int) -> str:
        """The shipped preset its suites build at ``tp``."""
        ...

    def build(self, preset: str, capacity: int, device: Any, group: Any = None, **options: Any) -> Any:
        """The op of a preset (``from_preset``), ``options`` passed through."""
        ...

    def inputs(self, m: int, hidden: int) -> tuple:
        """Fresh arguments of a call after ``x``, in the ranges the model produces."""
        ...

    def bytes(self, m: int, hidden: int) -> int:
        """What one call must move through HBM at least once (the byte floor's numerator)."""
        ...

    def join(self, op: Any) -> None:
        """What a call's time includes after the call itself (side-stream work), if anything."""
        ...

    def step(self, op: Any, x: torch.Tensor, args: tuple) -> Callable[[], object]:
        """The call its own suite times on these inputs (outputs given where the op takes them)."""
        ...

    def host_steps(self, m: int, device: torch.device) -> list[Step]:
        """The host suite's paths of this model (eager calls, custom ops, loopback ranks)."""
        ...


def call(case: BenchmarkCase, op: Any, x: torch.Tensor, args: tuple) -> Any:
    """The op on ``(x, *args)``, joined: its outputs."""
    outputs = op(x, *args)
    case.join(op)
    return outputs


def cases() -> list[BenchmarkCase]:
    """Every registered model's case, in key order (models that declare none left out)."""
    from ..registry import load_object, models

    found = []
    for model in models().values():
        if model.benchmark_case is not None:
            found.append(load_object(model.benchmark_case))
    return found
