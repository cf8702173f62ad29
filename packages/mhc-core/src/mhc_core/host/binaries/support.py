"""Whether this process can run the ops on a device: a probe an engine calls before building one, to
fall back without catching driver errors, and the error an op raises when it cannot. Imports torch
only (not the DSL).

Three things stop the ops on a device, checked in this order and named by what they say: a torch
built without CUDA (a CPU-only wheel), no CUDA GPU visible to the process (no driver, none
installed, ``CUDA_VISIBLE_DEVICES`` empty, or an index past the last one), and a GPU of an arch the
kernels do not target. For a whole TP group (peer access, one node, tp, multicast) see
``mhc_core.host.ranks.fallback``.
"""

from __future__ import annotations

import os

import torch

from ...constants import ARCH_BY_CAPABILITY, SUPPORTED_ARCHS

#: What ``torch.device(...)`` accepts for a device.
DeviceLike = torch.device | str | int


def as_device(device: DeviceLike | None) -> torch.device:
    """``device`` as a torch.device: None is the current CUDA device, an int a CUDA index (torch reads
    an int as an accelerator's, which a CPU-only build refuses)."""
    if device is None:
        return torch.device("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _cpu_only_build() -> str:
    return (
        f"this torch ({torch.__version__}) is a CPU-only build, not compiled with CUDA: the ops need a "
        "CUDA build of torch (install the one that matches your driver)"
    )


def require_cuda_build(device: DeviceLike | None) -> None:
    """Before anything else a preset's ``build`` checks (issue #49): a CUDA ``device`` however spelled
    (``"cuda"``, ``"cuda:0"``, ``0``, a ``torch.device``) on a CPU-only torch raises RuntimeError saying
    so, instead of whichever argument check would come first. Another device is left to the op."""
    try:
        target = as_device(device)
    except (RuntimeError, TypeError, ValueError):
        return  # the op names the argument
    if target.type == "cuda" and not torch.backends.cuda.is_built():
        raise RuntimeError(_cpu_only_build())


def device_problem(device: DeviceLike | None = None) -> str | None:
    """Why the ops cannot run on ``device`` (default: the current CUDA device), or None when they can.
    Never raises: an argument that names no CUDA device is a problem too."""
    try:
        target = as_device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        return f"device: expected a CUDA device, got {device!r} ({error})"
    if target.type != "cuda":
        return f"device: expected a CUDA device, got {target}"
    if not torch.backends.cuda.is_built():
        return _cpu_only_build()
    try:
        count = torch.cuda.device_count()
    except RuntimeError as error:  # a driver that fails to initialise
        return f"no CUDA GPU is visible: the driver did not initialise ({error})"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no CUDA GPU is visible to this process{hint}: torch.cuda.device_count() is 0"
    index = target.index
    if index is not None and not 0 <= index < count:
        return f"device: {target} is not visible: this process sees {count} CUDA GPU(s), cuda:0 .. cuda:{count - 1}"
    try:
        capability = tuple(torch.cuda.get_device_capability(target))
    except (RuntimeError, AssertionError) as error:
        return f"device: {target} cannot be queried ({error})"
    if capability not in ARCH_BY_CAPABILITY:
        name = _device_name(target)
        return (
            f"unsupported GPU{name}: compute capability {capability[0]}.{capability[1]}; the kernels target "
            f"{', '.join(SUPPORTED_ARCHS)} (compute capability "
            f"{', '.join(f'{major}.{minor}' for major, minor in ARCH_BY_CAPABILITY)})"
        )
    return None


def _device_name(device: torch.device) -> str:
    try:
        return f" {torch.cuda.get_device_name(device)!r}"
    except (RuntimeError, AssertionError):
        return ""


def require_device(device: DeviceLike | None = None) -> None:
    """Raise RuntimeError saying why the ops cannot run on ``device`` (see ``device_problem``)."""
    problem = device_problem(device)
    if problem is not None:
        raise RuntimeError(problem)


def is_supported(device: DeviceLike | None = None) -> bool:
    """True if ``device`` (default: the current CUDA device) is a CUDA GPU of an arch the kernels
    target (H200 / H100 sm_90a, B200 sm_100a, GB300 sm_103a). Never raises: no driver, no GPU or
    a CPU-only torch give False (``device_problem`` says which)."""
    return device_problem(device) is None
