"""CUDA IPC through the CUDA runtime library torch already loaded
(``mhc_core.host.binaries.cuda_runtime``: ``ctypes``, no extension to build).

A rank allocates plain device memory (``cudaMalloc``, outside torch's caching allocator, so its
lifetime is the op's and no allocator setting such as expandable segments changes how it is
shared), exports a 64-byte handle, and every peer process maps it (``cudaIpcOpenMemHandle``).
This works between processes on one GPU, which torch symmetric memory refuses, and between GPUs
of one node with peer access. A process cannot open its own handle: its own rank uses the pointer.

The runtime is the one torch's CUDA build links, so the current device torch sets is the one these
calls use.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import torch

from ..binaries import cuda_runtime

#: ``cudaIpcMemLazyEnablePeerAccess``: enable peer access between two GPUs when needed.
_LAZY_PEER_ACCESS = 1
HANDLE_BYTES = 64


class IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, the same in every process."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@functools.cache
def runtime() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (``mhc_core.host.binaries.cuda_runtime``), with the IPC
    functions' prototypes declared."""
    try:
        library = cuda_runtime.runtime()
    except RuntimeError as error:
        raise RuntimeError(f"mailbox_allocation='ipc': {error}") from None
    pointer, size, handle_p = ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(IpcHandle)
    prototypes: dict[str, tuple[Any, ...]] = {
        "cudaMalloc": (pointer, size),
        "cudaFree": (ctypes.c_void_p,),
        "cudaIpcGetMemHandle": (handle_p, ctypes.c_void_p),
        "cudaIpcOpenMemHandle": (pointer, IpcHandle, ctypes.c_uint),
        "cudaIpcCloseMemHandle": (ctypes.c_void_p,),
    }
    for name, arguments in prototypes.items():
        function = getattr(library, name)
        function.argtypes = list(arguments)
        function.restype = ctypes.c_int
    return library


def _check(status: int, what: str) -> None:
    if status:
        message = cuda_runtime.error_text(status)
        raise RuntimeError(f"mailbox_allocation='ipc': {what} failed: CUDA error {status} ({message})")


class DeviceAllocation:
    """``nbytes`` of device memory from ``cudaMalloc`` on ``device``, freed when the object (and so
    every tensor viewing it: ``tensor`` keeps it alive) is collected."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cuda = runtime()
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(cuda.cudaMalloc(ctypes.byref(pointer), nbytes), f"cudaMalloc of {nbytes} bytes on {device}")
        self.pointer = int(pointer.value or 0)
        self.nbytes = nbytes
        self.device = device
        weakref.finalize(self, _free, self.pointer, device)

    def handle(self) -> bytes:
        """The IPC handle every peer process maps this allocation by."""
        handle = IpcHandle()
        with torch.cuda.device(self.device):
            _check(runtime().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(self.pointer)), "export")
        return bytes(handle)  # the raw 64 bytes (``.reserved`` would stop at the first NUL)

    def tensor(self, dtype: torch.dtype, elements: int) -> torch.Tensor:
        """A torch view of the allocation (it holds this object, so the memory outlives every view)."""
        return _view(self, self.pointer, elements, dtype, self.device)


class PeerMapping:
    """A peer's allocation mapped into this process (``cudaIpcOpenMemHandle``); unmapped when collected."""

    def __init__(self, handle: bytes, device: torch.device) -> None:
        if len(handle) != HANDLE_BYTES:
            raise ValueError(f"IPC handle: expected {HANDLE_BYTES} bytes, got {len(handle)}")
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device):
            status = runtime().cudaIpcOpenMemHandle(
                ctypes.byref(pointer), IpcHandle.from_buffer_copy(handle), _LAZY_PEER_ACCESS
            )
        _check(status, f"mapping a peer's mailbox on {device}")
        self.pointer = int(pointer.value or 0)
        self.device = device
        weakref.finalize(self, _close, self.pointer, device)
        #: The bytes mapped from ``pointer`` on: the peer's whole allocation, whatever it voted.
        self.nbytes = _mapped_bytes(self.pointer, device)


def _mapped_bytes(pointer: int, device: torch.device) -> int:
    """The bytes of the allocation ``pointer`` lies in, from ``pointer`` to its end (the driver's
    ``cuMemGetAddressRange``: what a mapping really spans)."""
    from cuda.bindings import driver

    with torch.cuda.device(device):
        error, base, size = driver.cuMemGetAddressRange(pointer)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"mailbox_allocation='ipc': the size of a peer's mapped mailbox is unknown ({error})")
    return int(base) + int(size) - pointer


def _free(pointer: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        runtime().cudaFree(ctypes.c_void_p(pointer))


def _close(pointer: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        runtime().cudaIpcCloseMemHandle(ctypes.c_void_p(pointer))


#: ``__cuda_array_interface__`` type strings of the dtypes a view is made of.
_TYPESTRS = {torch.int16: "<i2", torch.int32: "<i4", torch.uint8: "|u1"}


class _ArrayInterface:
    """What ``torch.as_tensor`` reads a device pointer through (``__cuda_array_interface__``)."""

    def __init__(self, owner: object, pointer: int, elements: int, dtype: torch.dtype) -> None:
        self.owner = owner  # the tensor holds this object, and through it the allocation
        self.__cuda_array_interface__ = {
            "shape": (elements,), "typestr": _TYPESTRS[dtype], "data": (pointer, False), "version": 3,
            "strides": None,
        }  # fmt: skip


def _view(owner: object, pointer: int, elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype == torch.bfloat16:  # no typestr for bfloat16: view 16-bit integers as it
        return _view(owner, pointer, elements, torch.int16, device).view(torch.bfloat16)
    return torch.as_tensor(_ArrayInterface(owner, pointer, elements, dtype), device=device)
