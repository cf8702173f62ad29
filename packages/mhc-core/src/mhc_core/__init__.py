"""mhc-core: the Lamport all-reduce protocols (one-shot and two-shot) and what the fused mHC ops share.

Layers: ``mhc_core.device`` (what runs in a kernel: primitives, protocol, reductions, the
publish kernels, and each protocol's own kernels in ``one_shot/`` and ``two_shot/``) and
``mhc_core.host`` (what builds, launches and orders them: the ops on ``calls/``, ``ranks/`` and
``binaries/``); pure-Python modules beside them (``constants``, ``presets``, ``compat``) and the
torch references (``reference``).

Importing the package is cheap: the CuTe DSL and torch load when a kernel-facing
name is first used (``mhc_core.LamportAllReduce``, ...), so pure-Python parts
(``mhc_core.constants``, ``mhc_core.presets``) import without them.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from .version import __version__

# A library's logger: silent unless the application configures logging (no "No handlers" fallback).
logging.getLogger("mhc").addHandler(logging.NullHandler())

_EXPORTS = {
    "LamportAllReduce": "host.allreduce",
    "lamport_all_reduce": "host.allreduce",
    "close_lamport_all_reduce": "host.allreduce",
    "LamportMailbox": "host.ranks.mailbox",
    "LoopbackGroup": "host.ranks.groups",
    "LoopbackRank": "host.ranks.groups",
    "run_ranks": "host.ranks.groups",
    "MoEOutput": "host.calls.moe",
    "LamportOp": "host.op",
    "OpPoisonedError": "host.op",
    "Plan": "host.op",
    "LamportTimeoutError": "host.calls.spin",
    "RouteIndexError": "host.calls.spin",
    "TokenCountError": "host.calls.spin",
    "SpinGuard": "host.calls.spin",
    "compile_kernel": "host.binaries.compiler",
    "device_arch": "host.binaries.compiler",
    "is_supported": "host.binaries.support",
    "device_problem": "host.binaries.support",
    "FusedSupport": "host.ranks.fallback",
    "check_fused_support": "host.ranks.fallback",
    "find_preset": "preset_lookup",
}

#: Spelled out (not built from ``_EXPORTS``): what linters and type checkers read.
__all__ = [
    "FusedSupport",
    "LamportAllReduce",
    "LamportMailbox",
    "LamportOp",
    "LamportTimeoutError",
    "LoopbackGroup",
    "LoopbackRank",
    "MoEOutput",
    "OpPoisonedError",
    "Plan",
    "RouteIndexError",
    "SpinGuard",
    "TokenCountError",
    "__version__",
    "check_fused_support",
    "close_lamport_all_reduce",
    "compile_kernel",
    "device_arch",
    "device_problem",
    "find_preset",
    "is_supported",
    "lamport_all_reduce",
    "run_ranks",
]

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads each on first use
    from .host.allreduce import LamportAllReduce, close_lamport_all_reduce, lamport_all_reduce
    from .host.binaries.compiler import compile_kernel, device_arch
    from .host.binaries.support import device_problem, is_supported
    from .host.calls.moe import MoEOutput
    from .host.calls.spin import LamportTimeoutError, RouteIndexError, SpinGuard, TokenCountError
    from .host.op import LamportOp, OpPoisonedError, Plan
    from .host.ranks.fallback import FusedSupport, check_fused_support
    from .host.ranks.groups import LoopbackGroup, LoopbackRank, run_ranks
    from .host.ranks.mailbox import LamportMailbox
    from .preset_lookup import find_preset


if not TYPE_CHECKING:  # hidden from type checkers: a module __getattr__ would make every name Any

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'mhc_core' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(__all__)
