"""mhc-dsv41: DeepSeek-V4.1's TP all-reduce fused with the mHC sublayer boundary.

``AllReduceMHC`` (plain and MoE-finalize input, any TP, unicast or multicast) and
one generated module per preset (``mhc_dsv41.presets``). Importing the package
checks the installed mhc-core against this package's pin; the DSL and torch load
when ``AllReduceMHC`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mhc_core.compat import check_core_version, model_attribute

__version__ = "0.5.2"
#: The mhc-core releases this package works with (compatible-release pin).
CORE_REQUIREMENT = "~=0.6.0"

check_core_version(CORE_REQUIREMENT, __name__)

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


if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads each on first use (compat.CORE_EXPORTS)
    from mhc_core import LamportTimeoutError, LoopbackGroup, MoEOutput, RouteIndexError, TokenCountError

    from . import presets
    from .op import AllReduceMHC


if not TYPE_CHECKING:  # hidden from type checkers: a module __getattr__ would make every name Any

    def __getattr__(name: str) -> Any:
        return model_attribute(__name__, globals(), name, "AllReduceMHC")
