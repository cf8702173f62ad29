"""mhc-dsv41: DeepSeek-V4.1's TP all-reduce fused with the mHC sublayer boundary.

``AllReduceMHC`` (plain and MoE-finalize input, any TP, unicast or multicast) and
one generated module per preset (``mhc_dsv41.presets``). Importing the package
checks the installed mhc-core against this package's pin; the DSL and torch load
when ``AllReduceMHC`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mhc_core.compat import check_core_version

__version__ = "0.2.0"
#: The mhc-core releases this package works with (compatible-release pin).
CORE_REQUIREMENT = "~=0.3.0"

check_core_version(CORE_REQUIREMENT, __name__)

#: The core's names a user of this package needs, re-exported (loaded on first use, like the op).
_CORE_EXPORTS = ("MoEOutput", "LoopbackGroup", "LamportTimeoutError", "TokenCountError", "RouteIndexError")

__all__ = [
    "CORE_REQUIREMENT",
    "AllReduceMHC",
    "LamportTimeoutError",
    "LoopbackGroup",
    "MoEOutput",
    "RouteIndexError",
    "TokenCountError",
    "__version__",
    "presets",
]


if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads each on first use
    from mhc_core import LamportTimeoutError, LoopbackGroup, MoEOutput, RouteIndexError, TokenCountError

    from . import presets
    from .op import AllReduceMHC


def __getattr__(name: str) -> Any:
    value: Any
    if name == "AllReduceMHC":
        from . import op

        value = op.AllReduceMHC
    elif name == "presets":
        import importlib

        value = importlib.import_module(f"{__name__}.presets")
    elif name in _CORE_EXPORTS:
        import mhc_core

        value = getattr(mhc_core, name)
    else:
        raise AttributeError(f"module 'mhc_dsv41' has no attribute {name!r}")
    globals()[name] = value
    return value
