"""The model packages' guard against an installed mhc-core outside their pin (pure Python)."""

from __future__ import annotations

import re

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
        import mhc_core

        version = mhc_core.__version__
    if not satisfies_compatible_release(version, requirement):
        raise ImportError(
            f"{package} needs mhc-core {requirement}, but mhc-core {version} is installed; "
            f"install a matching mhc-core (pip install 'mhc-core{requirement}')"
        )
