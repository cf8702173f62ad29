"""Launching a compiled kernel through its TVM-FFI entry point (``mhc_core.host.binaries.compiler``):
persistent arguments converted once, the per-call ones on each launch.

What each parameter kind becomes at run time (``mhc_core.device.signature`` describes them):

* ``Ptr``: the tensor's data pointer, an int. The op has validated the tensor's shape,
  dtype, device, contiguity and alignment before any launch.
* ``Buffer``: a ``tvm_ffi.Tensor`` made once through DLPack; the entry point checks its
  extent, dtype, device and alignment on every call, in C.
* ``Scalar``: the Python int or float (the entry point range-checks it).
* ``Stream``: the raw handle of the op device's current CUDA stream, an int.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import tvm_ffi

from ...device.signature import Buffer, Kind, Ptr, Signature, Stream


def _raw_stream_getter() -> Callable[[int], int]:
    """``index -> raw handle`` of device ``index``'s current stream: torch's C accessor (what
    torch.compile's generated code calls; ~0.1 us), else the public path (~1 us)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter  # type: ignore[no-any-return]
    return lambda index: torch.cuda.current_stream(index).cuda_stream


current_stream_handle = _raw_stream_getter()


def convert(kind: Kind, value: Any) -> Any:
    """``value`` as the TVM-FFI entry point takes a parameter of ``kind``."""
    if isinstance(kind, Ptr):
        return value.data_ptr()
    if isinstance(kind, Buffer):
        return tvm_ffi.from_dlpack(value.reshape(-1))
    return value  # a Scalar (a Stream is never converted: the launcher passes the raw handle)


class BoundKernel:
    """A compiled kernel with its persistent arguments converted once: one launch per call.

    ``bound(**per_call)`` launches on the current stream of ``device`` (default: the current
    device), or on ``stream=`` (a raw handle). The per-call path is one generated function
    (``source`` shows it) that passes each tensor's data pointer, each scalar and the stream
    straight to the TVM-FFI entry point: no per-call loop, dict or list (~0.5 us over the bare
    entry point, against ~4 us for a generic loop; BENCHMARKS.md).
    """

    def __init__(
        self, function: Any, signature: Signature, fixed: Mapping[str, Any], device: torch.device | None = None
    ) -> None:
        unknown = set(fixed) - {param.name for param in signature}
        if unknown:
            raise TypeError(f"fixed arguments not in the signature: {sorted(unknown)}")
        if function is None:
            raise RuntimeError("this kernel was compiled for another arch than this process can launch")
        names: list[str] = []
        passed: list[str] = []
        namespace: dict[str, Any] = {"_entry": function, "_stream_of": current_stream_handle}
        for index, param in enumerate(signature):
            if isinstance(param.kind, Stream):
                passed.append("stream")
            elif param.name in fixed:
                namespace[f"_fixed{index}"] = convert(param.kind, fixed[param.name])
                passed.append(f"_fixed{index}")
            else:
                if not param.name.isidentifier():
                    raise ValueError(f"parameter name {param.name!r} is not an identifier")
                names.append(param.name)
                passed.append(f"{param.name}.data_ptr()" if isinstance(param.kind, Ptr) else param.name)
        if device is not None and device.index is not None:
            current = str(device.index)
        else:
            namespace["_current_device"] = torch.cuda.current_device
            current = "_current_device()"
        keywords = "".join(f", {name}" for name in names)
        self.source = (
            f"def launch(*, stream=None{keywords}):\n"
            f"    if stream is None:\n"
            f"        stream = _stream_of({current})\n"
            f"    _entry({', '.join(passed)})\n"
        )
        exec(compile(self.source, f"<launch {len(signature)} args>", "exec"), namespace)
        #: ``launch(*, stream=None, **per_call)``: the generated function itself (what ``__call__``
        #: forwards to; the ops' hot paths call it directly).
        self.launch: Callable[..., None] = namespace["launch"]
        # A fixed Ptr is a bare address: holding its tensor keeps the memory as long as the launcher.
        self._fixed = dict(fixed)
        self.per_call_names: Sequence[str] = tuple(names)

    def __call__(self, *, stream: int | None = None, **values: Any) -> None:
        """Launch with the per-call ``values``, on ``stream`` (a raw handle) or the current stream."""
        self.launch(stream=stream, **values)
