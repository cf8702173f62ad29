"""Launching a compiled kernel: its persistent arguments converted once, the per-call ones on each launch.

What each parameter kind becomes at run time (``mhc_core.device.signature`` describes them):
a ``Ptr`` an aligned DSL pointer to the tensor's first element, a ``Buffer`` a DLPack tensor
(1-D, its extent static or marked dynamic), a ``Scalar`` the DSL scalar, a ``Stream`` torch's
current stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack, make_ptr

from ..device.signature import Buffer, Kind, Param, Ptr, Scalar, Signature, Stream


def convert(kind: Kind, value: Any) -> Any:
    """``value`` as the compiled function takes a parameter of ``kind``."""
    if isinstance(kind, Ptr):
        return make_ptr(kind.dtype, value.data_ptr(), cute.AddressSpace.gmem, assumed_align=kind.align)
    if isinstance(kind, Buffer):
        converted = from_dlpack(value.reshape(-1), assumed_align=kind.align)
        if kind.extent is None:
            converted = converted.mark_compact_shape_dynamic(mode=0, divisibility=kind.divisibility)
        return converted
    if isinstance(kind, Scalar):
        return kind.dtype(value)
    assert isinstance(kind, Stream)
    return cuda.CUstream(value.cuda_stream if value is not None else torch.cuda.current_stream().cuda_stream)


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
                self._template[index] = convert(param.kind, fixed[param.name])
            elif not isinstance(param.kind, Stream):
                self._per_call.append((index, param))
        self._stream_index = next((i for i, param in enumerate(signature) if isinstance(param.kind, Stream)), None)
        self.per_call_names: Sequence[str] = tuple(param.name for _, param in self._per_call)

    def __call__(self, **values: Any) -> None:
        args = list(self._template)
        for index, param in self._per_call:
            args[index] = convert(param.kind, values[param.name])
        if self._stream_index is not None:
            args[self._stream_index] = current_stream()
        self._compiled(*args)
