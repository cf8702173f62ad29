"""Kernel signatures: described once, turned into compile-time fakes and run-time arguments.

Every kernel class lists its ``@cute.jit __call__`` parameters as a tuple of
``Param``s. The compiler builds the fakes from it (no positional fake lists at
compile sites), and ``BoundKernel`` converts persistent buffers once and only the
per-call values on each launch:

* ``Ptr``: a per-call tensor, passed as a bare aligned pointer (under a microsecond
  of host work, against several for a DLPack conversion). The op validates the
  tensor's shape, dtype, contiguity and alignment before any launch.
* ``Buffer``: a persistent 1-D tensor (mailbox, stage state, peer table), static or
  with a dynamic extent of known divisibility; converted once through DLPack.
* ``Scalar`` and ``Stream``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream, make_ptr


@dataclass(frozen=True)
class Ptr:
    """A per-call tensor passed as a pointer to its first element."""

    dtype: type
    align: int = 16

    def fake(self) -> Any:
        return make_ptr(self.dtype, 0, cute.AddressSpace.gmem, assumed_align=self.align)

    def convert(self, tensor: torch.Tensor) -> Any:
        return make_ptr(self.dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=self.align)


@dataclass(frozen=True)
class Buffer:
    """A persistent 1-D tensor: ``extent`` elements, or dynamic with ``divisibility``."""

    dtype: type
    extent: int | None = None
    divisibility: int = 1
    align: int = 16

    def fake(self) -> Any:
        extent = self.extent if self.extent is not None else cute.sym_int(divisibility=self.divisibility)
        return make_fake_compact_tensor(self.dtype, (extent,), assumed_align=self.align)

    def convert(self, tensor: torch.Tensor) -> Any:
        flat = tensor.reshape(-1)
        converted = from_dlpack(flat, assumed_align=self.align)
        if self.extent is None:
            converted = converted.mark_compact_shape_dynamic(mode=0, divisibility=self.divisibility)
        return converted


@dataclass(frozen=True)
class Scalar:
    dtype: type

    def fake(self) -> Any:
        return self.dtype(0)

    def convert(self, value: Any) -> Any:
        return self.dtype(value)


@dataclass(frozen=True)
class Stream:
    def fake(self) -> Any:
        return make_fake_stream()

    def convert(self, stream: torch.cuda.Stream | None) -> Any:
        return cuda.CUstream(stream.cuda_stream if stream is not None else torch.cuda.current_stream().cuda_stream)


Kind = Ptr | Buffer | Scalar | Stream


@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind


Signature = tuple[Param, ...]


def fake_arguments(signature: Signature) -> list[Any]:
    """Compile-time stand-ins for every parameter, in order."""
    return [param.kind.fake() for param in signature]


def current_stream() -> Any:
    """torch's current CUDA stream as the DSL's stream type."""
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class BoundKernel:
    """A compiled kernel with its persistent arguments converted once.

    ``bound(**per_call)`` converts only the per-call arguments (pointers, scalars,
    the current stream) and launches on the current stream.
    """

    def __init__(self, compiled: Any, signature: Signature, fixed: Mapping[str, Any]) -> None:
        unknown = set(fixed) - {param.name for param in signature}
        if unknown:
            raise TypeError(f"fixed arguments not in the signature: {sorted(unknown)}")
        self._compiled = compiled
        self._template: list[Any] = [None] * len(signature)
        self._per_call: list[tuple[int, Param]] = []
        for index, param in enumerate(signature):
            if param.name in fixed:
                self._template[index] = param.kind.convert(fixed[param.name])
            elif not isinstance(param.kind, Stream):
                self._per_call.append((index, param))
        self._stream_index = next((i for i, param in enumerate(signature) if isinstance(param.kind, Stream)), None)
        self.per_call_names: Sequence[str] = tuple(param.name for _, param in self._per_call)

    def __call__(self, **values: Any) -> None:
        args = list(self._template)
        for index, param in self._per_call:
            args[index] = param.kind.convert(values[param.name])
        if self._stream_index is not None:
            args[self._stream_index] = current_stream()
        self._compiled(*args)
