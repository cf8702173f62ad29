"""Preset validation shared by the model packages (pure Python: no torch, no DSL).

A model's preset is a frozen, slotted dataclass validated in ``__post_init__``;
each broken rule raises ``PresetError`` naming the key, the rule and the value.
The code generator adds the file and the preset's name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

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
#: The most routes per token a MoE input may have (``top_k``). The finalize publish unrolls its
#: routes and keeps each one's fragment, weight and index in registers. Compiled here (sm_90a,
#: hidden 7168, 128 publish threads): top_k 8 takes 84 registers and 0.3 s, 28 all 255 registers
#: without a spill, 64 spills 584 bytes a thread and compiles in 1.1 s, 128 in 2.6 s; at 512 the
#: H200 host took 66 s. 64 is the bound both model packages' presets already had, eight times the
#: top_k of the models they target (8) and five times the largest public one's (12).
MAX_TOP_K = 64
#: FP32's smallest normal and largest finite value. A float a kernel computes with in FP32 (an
#: epsilon, a multiplier) must lie between them: below, it reaches the kernel as a subnormal or
#: zero (an epsilon of 1e-50 is no epsilon at all); above, as inf.
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = (2.0 - 2.0**-23) * 2.0**127


class PresetError(ValueError):
    """A preset value breaks a rule the kernels rely on."""

    def __init__(self, key: str, rule: str, value: object) -> None:
        super().__init__(f"key {key!r}: {rule}; got {value!r}")
        self.key = key
        self.rule = rule
        self.value = value


class PresetTypeError(PresetError, TypeError):
    """A preset value of the wrong type (an op's argument: a ``TypeError``)."""


P = TypeVar("P")


def argument_preset(build: Callable[..., P], *args: Any, **fields: Any) -> P:
    """``build(*args, **fields)`` (a preset class, or ``dataclasses.replace``) from an op's arguments:
    a broken rule raises a ``ValueError`` named by field, as an argument's error is (not a
    ``PresetError`` naming a file's key; a ``TypeError`` for a value of the wrong type)."""
    try:
        return build(*args, **fields)
    except PresetError as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"{error.key}: {error.rule}; got {error.value!r}") from None


def require(condition: bool, key: str, rule: str, value: object) -> None:
    if not condition:
        raise PresetError(key, rule, value)


def require_type(condition: bool, key: str, rule: str, value: object) -> None:
    if not condition:
        raise PresetTypeError(key, rule, value)


def require_two_shot_min_tokens(value: object) -> None:
    """A preset's two-shot crossover (``mhc_core.protocols``): the first M the two-shot serves, or None
    (the one-shot for every M)."""
    if value is not None:
        require_int("two_shot_min_tokens", value, minimum=1, maximum=2**30 - 1)


def require_int(key: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
    require(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer", value)
    if minimum is not None:
        require(value >= minimum, key, f"must be >= {minimum}", value)
    if maximum is not None:
        require(value <= maximum, key, f"must be <= {maximum}", value)


def require_positive_float(key: str, value: object) -> None:
    """A float the kernels compute with in FP32: finite, > 0 and a normal FP32 value."""
    require(
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and FP32_MIN_NORMAL <= value <= FP32_MAX,  # nan compares false
        key,
        f"must be a finite number > 0 in FP32's normal range [{FP32_MIN_NORMAL:.9g}, {FP32_MAX:.9g}]",
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


#: A test preset's name starts so: a shape only the tests run (codegen renders it under ``tests/presets/``,
#: not into the package: it is neither shipped nor found by ``mhc_core.find_preset``).
TEST_PREFIX = "test-"


def is_test_preset(preset_name: str) -> bool:
    return preset_name.startswith(TEST_PREFIX)


def module_name(preset_name: str) -> str:
    """The generated module's name for a preset name: ``h200-tp2-h4096`` -> ``h200_tp2_h4096``."""
    return preset_name.replace("-", "_")


#: What ``tuned=False`` means and how to tune: the warning and an untuned preset's repr say it.
UNTUNED = (
    "untuned: its geometry was not measured on its target (a rule, the seed's values or another host's "
    "measurements): the op is correct, its speed there is unmeasured; to tune it, time its cases on the "
    "target (python3 -m benchmarks.run), set the faster geometry and tuned = true in its model's "
    "presets.toml and regenerate (python3 -m codegen)"
)


def preset_repr(preset: Any) -> str:
    """A preset dataclass's repr, with what ``tuned=False`` means after it as a comment (``eval``
    still reads it)."""
    shown = [field.name for field in dataclasses.fields(preset) if field.repr]
    fields = ", ".join(f"{name}={getattr(preset, name)!r}" for name in shown)
    text = f"{type(preset).__name__}({fields})"
    return text if getattr(preset, "tuned", True) else f"{text}  # {UNTUNED}"


def warn_if_untuned(preset: object) -> bool:
    """Log a warning (logger ``mhc``) when ``preset`` is not marked ``tuned``: its geometry comes from
    a rule, the seed's values or another host's measurements, so it is correct but its speed on its
    target was never measured. Returns whether it warned."""
    if getattr(preset, "tuned", False):
        return False
    logging.getLogger("mhc").warning(
        "preset %r is %s (%s; presets.toml says where its values come from)",
        getattr(preset, "name", preset),
        UNTUNED,
        getattr(preset, "description", ""),
    )
    return True
