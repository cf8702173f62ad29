"""mhc-core: the Lamport one-shot all-reduce protocol and what the fused mHC ops share.

Layers: ``mhc_core.device`` (what runs in a kernel: primitives, protocol, reductions, the
publish and collective kernels) and ``mhc_core.host`` (what builds, launches and orders them:
ops, groups, mailbox, compiler, launch); pure-Python modules beside them (``constants``,
``presets``, ``compat``) and the torch references (``reference``).

Importing the package is cheap: the CuTe DSL and torch load when a kernel-facing
name is first used (``mhc_core.LamportAllReduce``, ...), so pure-Python parts
(``mhc_core.constants``, ``mhc_core.presets``) import without them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.6.0"

_EXPORTS = {
    "LamportAllReduce": "host.allreduce",
    "lamport_all_reduce": "host.allreduce",
    "close_lamport_all_reduce": "host.allreduce",
    "LamportMailbox": "host.mailbox",
    "LoopbackGroup": "host.groups",
    "LoopbackRank": "host.groups",
    "run_ranks": "host.groups",
    "MoEOutput": "host.moe",
    "LamportOp": "host.op",
    "OpPoisonedError": "host.op",
    "Plan": "host.op",
    "LamportTimeoutError": "host.spin",
    "RouteIndexError": "host.spin",
    "TokenCountError": "host.spin",
    "SpinGuard": "host.spin",
    "compile_kernel": "host.compiler",
    "device_arch": "host.compiler",
    "is_supported": "host.support",
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
