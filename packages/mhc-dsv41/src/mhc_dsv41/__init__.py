"""mhc-dsv41: DeepSeek-V4.1's TP all-reduce fused with the mHC sublayer boundary.

``AllReduceMHC`` (plain and MoE-finalize input, any TP, unicast or multicast) and
one generated module per preset (``mhc_dsv41.presets``). Importing the package
checks the installed mhc-core against this package's pin; the DSL and torch load
when ``AllReduceMHC`` is first used.
"""

from __future__ import annotations

from typing import Any

from mhc_core.compat import check_core_version

__version__ = "0.2.0"
#: The mhc-core releases this package works with (compatible-release pin).
CORE_REQUIREMENT = "~=0.3.0"

check_core_version(CORE_REQUIREMENT, __name__)

__all__ = ["CORE_REQUIREMENT", "AllReduceMHC", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "AllReduceMHC":
        from .op import AllReduceMHC

        globals()[name] = AllReduceMHC
        return AllReduceMHC
    raise AttributeError(f"module 'mhc_dsv41' has no attribute {name!r}")
