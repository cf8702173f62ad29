"""The CUDA runtime library torch already loaded, through ``ctypes``: the few runtime calls torch has
no Python API for (CUDA IPC, a stream outside torch's pool), with no extension to build.

Not ``cuda.bindings``: importing its runtime module takes ~0.1 s, which a GLM op's construction
paid for its side stream wherever torch had not imported it already (a cold preset op is <= 0.05 s,
issue #52). The library is the one
torch's CUDA build links (found in ``/proc/self/maps``), so the current device torch sets is the
one these calls use, and a stream created here is valid for ``torch.cuda.ExternalStream``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

#: ``cudaStreamNonBlocking``: no implicit ordering with the legacy default stream.
STREAM_NON_BLOCKING = 1


def _loaded_runtime() -> str | None:
    """The path of the ``libcudart`` this process has mapped (torch's), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rpartition(" ")[2]
        if "/libcudart.so" in path:
            return path
    return None


@functools.cache
def runtime() -> ctypes.CDLL:
    """The CUDA runtime library, with the prototypes of the calls mhc makes through it declared
    (a caller declares its own further ones, as ``mhc_core.host.ranks.cuda_ipc`` does)."""
    torch.cuda.init()
    path = _loaded_runtime()
    candidates = [path] if path else []
    candidates += [f"libcudart.so.{major}" for major in (13, 12)] + ["libcudart.so"]
    errors = []
    for candidate in candidates:
        try:
            library = ctypes.CDLL(candidate)
            break
        except OSError as error:
            errors.append(f"{candidate}: {error}")
    else:
        raise RuntimeError("no CUDA runtime library found (" + "; ".join(errors) + ")")
    library.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    library.cudaStreamCreateWithFlags.restype = ctypes.c_int
    library.cudaGetErrorString.argtypes = [ctypes.c_int]
    library.cudaGetErrorString.restype = ctypes.c_char_p
    return library


def error_text(status: int) -> str:
    """``cudaGetErrorString`` of ``status``."""
    return runtime().cudaGetErrorString(status).decode(errors="replace")


def create_non_blocking_stream(device: torch.device) -> int:
    """The raw handle of a new non-blocking stream on ``device`` (never destroyed by mhc: see
    ``mhc_core.host.calls.streams.DedicatedStreams``)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        status = runtime().cudaStreamCreateWithFlags(ctypes.byref(handle), STREAM_NON_BLOCKING)
    if status:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed on {device}: CUDA error {status} ({error_text(status)})")
    return int(handle.value or 0)
