"""What the model packages' ``__init__`` takes from the core, pure Python: the guard against an installed
mhc-core outside their pin, and their lazy exports (the op, the presets, the core's names)."""

from __future__ import annotations

import importlib
import re
from typing import Any

#: The core's names a user of a model package needs, re-exported by it (``model_attribute``).
CORE_EXPORTS = ("MoEOutput", "LoopbackGroup", "LamportTimeoutError", "TokenCountError", "RouteIndexError")

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def parse_version(version: str) -> tuple[int, int, int]:
    match = _VERSION.match(version)
    if not match:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part) for part in match.groups())  # type: ignore[return-value]


def satisfies_compatible_release(version: str, requirement: str) -> bool:
    """``version`` meets ``~=X.Y.Z``: ``>= X.Y.Z`` and ``== X.Y.*``."""
    if not requirement.startswith("~="):
        raise ValueError(f"expected a compatible-release requirement '~=X.Y.Z', got {requirement!r}")
    floor = parse_version(requirement[2:].strip())
    current = parse_version(version)
    return current[:2] == floor[:2] and current >= floor


def check_core_version(requirement: str, package: str, version: str | None = None) -> None:
    """Raise ImportError naming both versions when mhc-core does not satisfy ``requirement``."""
    if version is None:
        from .version import __version__ as version
    if not satisfies_compatible_release(version, requirement):
        raise ImportError(
            f"{package} needs mhc-core {requirement}, but mhc-core {version} is installed; "
            f"install a matching mhc-core (pip install 'mhc-core{requirement}')"
        )


def model_attribute(package: str, namespace: dict[str, Any], name: str, op_class: str) -> Any:
    """A model package's ``__getattr__``: ``op_class`` (from ``<package>.op``), ``presets`` or one of
    ``CORE_EXPORTS``, loaded on first use and kept in ``namespace`` (the DSL and torch load only then)."""
    if name == op_class:
        value = getattr(importlib.import_module(f"{package}.op"), op_class)
    elif name == "presets":
        value = importlib.import_module(f"{package}.presets")
    elif name in CORE_EXPORTS:
        value = getattr(importlib.import_module("mhc_core"), name)
    else:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    namespace[name] = value
    return value
