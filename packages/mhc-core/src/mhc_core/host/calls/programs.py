"""Native programs: one call form of an op (its rules, outputs and launches), bound once into the
C++ executor (``mhc_core.host.binaries.native``), then called with the per-call values alone.

A ``Launch`` names, for every parameter of a kernel's signature, where its value comes from:
``Fixed(value)`` (bound at construction: a persistent buffer, an address, a constant),
``Pointer(name)`` (the data pointer of the call's parameter or output ``name``), ``DIM_M`` /
``DIM_ROWS``, ``Scalar(name)`` (a float parameter), ``AFTER_PUBLISH`` (the per-call flag); the
stream parameter is the launch's stream. A launch with several kernels picks one by the token
count (``min_tokens``), as GLM's boundary picks its tokens-per-cluster kernel.

``Program.native`` is what an op's hot path calls:
``native(flags, m, variant, join_event, side_event, *values, *outputs)``: ``m`` the pending
publish's M or -1, ``variant`` a forced kernel or -1, the events raw handles or 0, ``outputs``
allocated by the op (torch tensors; ``None`` each for a check-only call, ``CHECK_ONLY``). It returns
M. A call it rejects raises ``ValueError("mhc-invalid ...")`` before any launch; the op then raises
the precise error (``mhc_core.host.calls.rules.check_call``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import tvm_ffi

from ...device.signature import Buffer, Ptr, Signature, Stream
from ..binaries import native
from .rules import ROWS, Aligned, Dim, M, Rule, ScalarRule, TensorRule

#: ``flags`` bits (``executor.cc``).
CHECK_ONLY = 1
AFTER_PUBLISH_FLAG = 2
JOIN_EXTERNAL = 4
RECORD_DONE = 8
#: The op allocated the call's outputs: the native check skips their overlap test (they overlap nothing).
FRESH_OUTPUTS = 16

#: DLPack (type code, bits) of every dtype a rule may name (``dlpack.h``: kDLInt 0, kDLUInt 1,
#: kDLFloat 2, kDLBfloat 4, kDLFloat8_e4m3fn 10; torch exports float8_e4m3fn as 10 from 2.11 on).
_DLPACK_DTYPES = {
    torch.bfloat16: (4, 16),
    torch.float16: (2, 16),
    torch.float32: (2, 32),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.uint8: (1, 8),
    torch.float8_e4m3fn: (10, 8),
}
#: A dimension's base in the executor's encoding (``executor.cc``, ``Dim``): a literal, M, the rows.
_BASES = {M: 1, ROWS: 2}


@dataclass(frozen=True)
class Fixed:
    value: Any


@dataclass(frozen=True)
class Pointer:
    name: str


@dataclass(frozen=True)
class Scalar:
    name: str


@dataclass(frozen=True)
class _Marker:
    source: int
    index: int


def pointers(*names: str) -> dict[str, Pointer]:
    """``{name: Pointer(name)}``: kernel parameters named like the call's parameters they point to."""
    return {name: Pointer(name) for name in names}


DIM_M = _Marker(2, 0)
DIM_ROWS = _Marker(2, 1)
AFTER_PUBLISH = _Marker(4, 0)
Source = Fixed | Pointer | Scalar | _Marker


@dataclass(frozen=True)
class Launch:
    """Kernels (TVM-FFI entry points) of one signature, and every parameter's source. ``side``:
    launched on the op's side stream. ``forks_side``: the side stream forks off the current one right
    before this launch, so a later side launch waits for what precedes it, not for it (GLM's mixes
    kernel runs alongside the boundary it polls); without such a launch the fork is right before the
    first side launch."""

    functions: Sequence[Any]
    signature: Signature
    sources: Mapping[str, Source]
    min_tokens: Sequence[int] = (1,)
    side: bool = False
    forks_side: bool = False
    #: Per variant: whether it launches at all (empty: every one does). A launch of one protocol is
    #: skipped for the token counts the other protocol serves (``mhc_core.host.calls.call_forms``).
    enabled: Sequence[bool] = ()


def _dtype(dtype: torch.dtype) -> list[int]:
    return list(_DLPACK_DTYPES[dtype])


def _dim(dim: Dim) -> list[int]:
    """``[base, to, times]``: the extent ``times`` (base 0), or ``align(M or rows, to) * times``."""
    if isinstance(dim, Aligned):
        return [_BASES[dim.base], dim.to, dim.times]
    if isinstance(dim, str):
        return [_BASES[dim], 1, 1]
    return [0, 1, int(dim)]


def _shape(shape: Sequence[Dim]) -> list[int]:
    """A shape (or strides) as the executor takes it: each dimension's three numbers, flat."""
    return [number for dim in shape for number in _dim(dim)]


def _encode_output(output: TensorRule, aliases: list[int]) -> list[Any]:
    strides = [] if output.strides is None else _shape(output.strides)
    storage = [] if output.storage is None else _dim(output.storage)
    return [_dtype(output.dtypes[0]), _shape(output.shapes[0]), aliases, strides, storage]


def _encode_rule(rule: Rule) -> list[Any]:
    if isinstance(rule, ScalarRule):
        return [False, 0, False, False, [], []]
    return [
        True, rule.align, rule.binds_m, rule.binds_rows,
        [_dtype(dtype) for dtype in rule.dtypes], [_shape(shape) for shape in rule.shapes],
    ]  # fmt: skip


def _fixed_value(kind: Any, value: Any) -> Any:
    """A bound value as the kernel's TVM-FFI entry point takes it."""
    if isinstance(kind, Buffer):
        return tvm_ffi.from_dlpack(value.reshape(-1))
    if isinstance(kind, Ptr) and isinstance(value, torch.Tensor):
        return value.data_ptr()
    return value


@dataclass
class Program:
    """One call form of an op, bound into the native executor (see the module docstring)."""

    rules: Sequence[Rule]
    outputs: Sequence[TensorRule]
    launches: Sequence[Launch]
    device: torch.device
    capacity: int
    side_stream: int = 0
    fork_event: int = 0
    #: Recorded on the current stream after an eager call's launches (``RECORD_DONE``).
    done_event: int = 0
    #: The buffers behind ``Fixed`` values (a bound address does not keep its tensor alive).
    _held: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        forks = [index for index, launch in enumerate(self.launches) if launch.forks_side]
        sides = [index for index, launch in enumerate(self.launches) if launch.side]
        # Several forks_side launches only as alternatives (each protocol's boundary): the first one
        # that launches forks the side stream.
        if forks and (
            not sides or forks[-1] > sides[0] or any(self.launches[index].side for index in forks)
            or (len(forks) > 1 and any(not self.launches[index].enabled for index in forks))
        ):  # fmt: skip
            raise ValueError(
                "launches: expected forks_side launches (more than one only as alternatives, each with an "
                "enabled mask) on the current stream and before the first side launch; got forks_side at "
                f"{forks}, side launches at {sides}"
            )
        names = [rule.name for rule in self.rules] + [rule.name for rule in self.outputs]
        launches = [self._encode_launch(launch, names) for launch in self.launches]
        device = [2 if self.device.type == "cuda" else 1, self.device.index or 0]
        self.native = native.library()["make_program"](
            [_encode_rule(rule) for rule in self.rules],
            [_encode_output(rule, self._aliases(rule)) for rule in self.outputs],
            launches,
            device,
            self.capacity,
            [self.side_stream, self.fork_event, self.done_event],
        )
        #: ``None`` for every output: the program allocates them.
        self.no_outputs = (None,) * len(self.outputs)
        #: Outputs whose storage a given ``out=`` tensor must hold past its view (``calls.check_storage``).
        self.sized_outputs = tuple((index, rule) for index, rule in enumerate(self.outputs) if rule.storage is not None)
        #: Whether a launch runs on the side stream (the op then passes its join and side events).
        self.has_side = any(launch.side for launch in self.launches)

    def _aliases(self, output: TensorRule) -> list[int]:
        """The indices of the parameters ``output`` may be exactly (in place), among this program's."""
        names = [rule.name for rule in self.rules]
        return [names.index(name) for name in output.aliases if name in names]

    def _encode_launch(self, launch: Launch, names: list[str]) -> list[Any]:
        unknown = set(launch.sources) - {param.name for param in launch.signature}
        if unknown:
            raise TypeError(f"sources for parameters not in the signature: {sorted(unknown)}")
        scalars = [rule.name for rule in self.rules]
        args: list[list[Any]] = []
        for param in launch.signature:
            if isinstance(param.kind, Stream):
                args.append([5, 0, None])
                continue
            source = launch.sources.get(param.name)
            if source is None:
                raise TypeError(f"no source for kernel parameter {param.name!r}")
            if isinstance(source, Fixed):
                self._held.append(source.value)
                args.append([0, 0, _fixed_value(param.kind, source.value)])
            elif isinstance(source, Pointer):
                args.append([1, names.index(source.name), None])
            elif isinstance(source, Scalar):
                args.append([3, scalars.index(source.name), None])
            else:
                args.append([source.source, source.index, None])
        enabled = [int(bool(flag)) for flag in launch.enabled]
        if enabled and len(enabled) != len(launch.functions):
            raise ValueError(f"enabled: expected one flag per variant ({len(launch.functions)}), got {len(enabled)}")
        return [
            int(launch.side), int(launch.forks_side), list(launch.min_tokens), list(launch.functions), args, enabled,
        ]  # fmt: skip
