"""What a model's op declares to the core (``mhc_core.host.op.LamportOp``): its call, once.

The core's modules hold what every fused op shares (construction, the call forms, the eager call,
the two-phase form, warm-up, the op's lifetime) and name no model's attribute. A model's op, a
subclass of ``LamportOp``, implements the abstract hooks of ``ModelOp`` (``abc`` refuses to build
an op that lacks one, naming it) and may override its defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .programs import Launch, Source
from .rules import Rule, TensorRule


class OpPreset(Protocol):
    """What the core reads of a model's preset (``LamportOp._init_from_preset``): every model's preset
    has these fields; the rest is the model's."""

    @property
    def name(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def publish_threads(self) -> int: ...


class ModelOp(ABC):
    """The hooks a model's op implements; the core calls them while it builds the op's programs,
    warms it up, allocates a call's outputs and plans a call."""

    #: Attributes of the model's op holding device memory of its own (hand-off buffers, counters):
    #: ``close()`` drops them, and keeps them for the replays of a CUDA graph that captured the op
    #: (``mhc_core.host.lifetime``).
    model_device_state: tuple[str, ...] = ()

    @abstractmethod
    def _collect_rules(self) -> tuple[Rule, ...]:
        """The collective's per-call parameters (after the publish input), in check order."""

    @abstractmethod
    def _output_rules(self) -> tuple[TensorRule, ...]:
        """The outputs, in the order a call returns them."""

    @abstractmethod
    def _collect_launches(self, *, direct: bool, prefetch: Source, protocol: str = "one-shot") -> list[Launch]:
        """The collective's launches. ``direct``: tp = 1, the collective reads the parameter ``x``.
        ``protocol`` "two-shot": the launches that end a two-shot (``mhc_core.device.two_shot``): the
        kernels compiled for tp = 1, polling the gather mailbox (``_collective_fixed(protocol)``)."""

    @abstractmethod
    def _allocate(self, like: Any, values: tuple[Any, ...], m: int) -> tuple[torch.Tensor, ...]:
        """New outputs for a call whose publish input is ``like`` (x or the MoE shared output; None
        for a collect, then M is ``m``) and whose collect values are ``values``. Allocated by torch
        (``empty_like`` of an input of the same shape and dtype where there is one: the cheapest
        allocation torch offers from Python), so they are ordinary torch tensors."""

    @abstractmethod
    def _warmup_collects(self) -> Sequence[tuple[tuple[Any, ...], int]]:
        """``(collect values, variant)`` at M = 1 for each collective kernel, for the warm-up."""

    @abstractmethod
    def _plan_values(self, method: str, *args: Any, **kwargs: Any) -> tuple[object, tuple[Any, ...], Any]:
        """(publish input, collect values, out) of a ``method`` call's arguments (``LamportOp.plan``)."""

    def _model_fingerprint(self) -> dict[str, Any]:
        """A model's own fields of the ``config`` fingerprint (hc, geometry, epsilons ...)."""
        return {}

    def _returns(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        """What a call returns, given its outputs (the all-reduce returns its one tensor)."""
        return outputs

    def _side_tensors(self, values: Sequence[object], outputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """What the side kernel of a program with a side launch (``Program.has_side``) uses, possibly
        after the current stream has dropped it: the op's ``_side_work`` keeps it alive until the work
        is joined. An op with a side launch overrides it."""
        raise TypeError(f"{type(self).__name__} has a side launch: it must declare _side_tensors")
