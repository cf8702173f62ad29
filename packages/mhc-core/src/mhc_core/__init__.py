"""mhc-core: the Lamport one-shot all-reduce protocol and what the fused mHC ops share.

Importing the package is cheap: the CuTe DSL and torch load when a kernel-facing
name is first used (``mhc_core.LamportAllReduce``, ...), so pure-Python parts
(``mhc_core.constants``, ``mhc_core.presets``) import without them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.3.0"

_EXPORTS = {
    "LamportAllReduce": "allreduce",
    "lamport_all_reduce": "allreduce",
    "LamportMailbox": "mailbox",
    "LoopbackGroup": "groups",
    "LoopbackRank": "groups",
    "run_ranks": "groups",
    "MoEOutput": "moe",
    "LamportOp": "op",
    "Plan": "op",
    "LamportTimeoutError": "spin",
    "RouteIndexError": "spin",
    "TokenCountError": "spin",
    "SpinGuard": "spin",
    "compile_kernel": "compiler",
    "device_arch": "compiler",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mhc_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
