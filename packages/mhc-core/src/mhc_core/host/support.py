"""Whether this host can run the ops: a probe an engine calls before building one, to fall back
without catching driver errors. Imports torch only (not the DSL)."""

from __future__ import annotations

import torch

from ..constants import ARCH_BY_CAPABILITY


def is_supported(device: torch.device | str | int | None = None) -> bool:
    """True if ``device`` (default: the current CUDA device) is a CUDA GPU of an arch the kernels
    target (H200 / H100 sm_90a, B200 sm_100a, GB300 sm_103a). Never raises: no driver, no GPU or
    a CPU-only torch give False."""
    try:
        if not torch.cuda.is_available():
            return False
        return tuple(torch.cuda.get_device_capability(device)) in ARCH_BY_CAPABILITY
    except (RuntimeError, AssertionError, ValueError):
        return False
