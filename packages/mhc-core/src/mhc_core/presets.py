"""Preset validation shared by the model packages (pure Python: no torch, no DSL).

A model's preset is a frozen, slotted dataclass validated in ``__post_init__``;
each broken rule raises ``PresetError`` naming the key, the rule and the value.
The code generator adds the file and the preset's name.
"""

from __future__ import annotations

import logging
import math

from .constants import SUPPORTED_ARCHS, VEC_BF16

SUPPORTED_TP = (1, 2, 4, 8)
#: Largest dynamic shared memory a CTA may opt into on sm_90 / sm_100 (227 KiB).
MAX_SHARED_BYTES = 232448
#: One SM of sm_90 / sm_100: shared memory (228 KiB; each resident CTA also reserves
#: ``CTA_RESERVED_SHARED_BYTES``), registers and threads (what occupancy estimates count with).
SM_SHARED_BYTES = 233472
CTA_RESERVED_SHARED_BYTES = 1024
SM_REGISTERS = 65536
SM_THREADS = 2048
MAX_CLUSTER_SIZE = 8


class PresetError(ValueError):
    """A preset value breaks a rule the kernels rely on."""

    def __init__(self, key: str, rule: str, value: object) -> None:
        super().__init__(f"key {key!r}: {rule}; got {value!r}")
        self.key = key
        self.rule = rule
        self.value = value


def require(condition: bool, key: str, rule: str, value: object) -> None:
    if not condition:
        raise PresetError(key, rule, value)


def require_int(key: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
    require(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer", value)
    if minimum is not None:
        require(value >= minimum, key, f"must be >= {minimum}", value)
    if maximum is not None:
        require(value <= maximum, key, f"must be <= {maximum}", value)


def require_positive_float(key: str, value: object) -> None:
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
        key,
        "must be a finite number > 0",
        value,
    )


def require_hidden(value: object) -> None:
    require_int("hidden", value, minimum=VEC_BF16)
    require(value % VEC_BF16 == 0, "hidden", f"must be a multiple of {VEC_BF16} (16-byte fragments)", value)


def require_tp(value: object) -> None:
    require(value in SUPPORTED_TP and not isinstance(value, bool), "tp", f"must be one of {SUPPORTED_TP}", value)


def require_threads(key: str, value: object, multiple: int = 32) -> None:
    require_int(key, value, minimum=32, maximum=1024)
    require(value % 32 == 0, key, "must be a multiple of 32 (whole warps)", value)
    require(value % multiple == 0, key, f"must be a multiple of {multiple}", value)


def require_archs(value: object) -> None:
    require(
        isinstance(value, tuple) and len(value) > 0 and all(isinstance(a, str) for a in value),
        "archs",
        "must be a non-empty list of arch names",
        value,
    )
    unknown = [arch for arch in value if arch not in SUPPORTED_ARCHS]
    require(not unknown, "archs", f"must be among {SUPPORTED_ARCHS}", value)
    require(len(set(value)) == len(value), "archs", "must not repeat an arch", value)


def require_name(value: object) -> None:
    require(
        isinstance(value, str) and value != "" and all(c.isalnum() or c == "-" for c in value) and value[0].isalpha(),
        "name",
        "must be letters, digits and '-', starting with a letter",
        value,
    )


def module_name(preset_name: str) -> str:
    """The generated module's name for a preset name: ``h200-tp2-h4096`` -> ``h200_tp2_h4096``."""
    return preset_name.replace("-", "_")


def warn_if_untuned(preset: object) -> bool:
    """Log a warning (logger ``mhc``) when ``preset`` is not marked ``tuned``: its geometry comes from
    a rule, the seed's values or another host's measurements, so it is correct but its speed on its
    target was never measured. Returns whether it warned."""
    if getattr(preset, "tuned", False):
        return False
    logging.getLogger("mhc").warning(
        "preset %r is untuned: its geometry was not measured on its target (%s); the op is correct, its "
        "speed there is unmeasured (presets.toml says where the values come from)",
        getattr(preset, "name", preset),
        getattr(preset, "description", ""),
    )
    return True
