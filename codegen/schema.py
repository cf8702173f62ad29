"""What a preset table must agree with beyond its dataclass's own rules: the target its name encodes,
and the values the kernels derive from its keys.

* **The name** (``<gpu>-tp<tp>-h<hidden>``, e.g. ``h200-tp4-h6144``; ``test-hc8-h5120``): each part
  it has is checked against the table's key (``NAME_PARTS``): the GPU against ``archs`` (its own arch
  must be among them), ``tp<N>`` against ``tp``, ``h<N>`` against ``hidden``, ``hc<N>`` against ``hc``.
  A part the name leaves out is not checked; an unknown first part (``test``) is no GPU.
* **Derived values**: a preset class may declare ``DERIVED = {key: rule}``, values its kernels compute
  from the fields (GLM's ``threads``). A table may write one; it must then equal what the rule gives.

Each broken rule is a ``PresetError`` naming the table's key at fault, as the dataclasses' are.
Adding a name part or a derived value is one entry in ``NAME_PARTS`` or the class's ``DERIVED``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: The GPUs a preset name may start with, and the arch each runs natively.
GPU_ARCHS = {
    "h100": "sm_90a",
    "h200": "sm_90a",
    "b200": "sm_100a",
    "gb200": "sm_100a",
    "b300": "sm_103a",
    "gb300": "sm_103a",
}


@dataclass(frozen=True)
class NamePart:
    """One part of a preset name that encodes a key: ``pattern`` matches the part, its group the value."""

    key: str
    pattern: re.Pattern[str]
    #: The part's group -> what the key must agree with (None: nothing to check).
    convert: Callable[[str], Any]
    #: (the key's value, the converted part) -> whether they agree.
    agrees: Callable[[Any, Any], bool]
    #: The rule, stated for the error: ``{part}`` is the name's part, ``{wanted}`` its value.
    rule: str
    #: Whether the part is the name's first (the GPU) rather than one of the others.
    first: bool = False


def _equal(value: Any, wanted: Any) -> bool:
    return bool(value == wanted)


def _among(archs: Any, arch: Any) -> bool:
    return arch in archs


NAME_PARTS: tuple[NamePart, ...] = (
    NamePart(
        "archs",
        re.compile(r"([a-z]+\d+)"),
        GPU_ARCHS.get,
        _among,
        "the name's GPU ({part}) runs {wanted}, which must be among archs",
        first=True,
    ),
    NamePart("tp", re.compile(r"tp(\d+)"), int, _equal, "the name says {part}: tp = {wanted}"),
    NamePart("hidden", re.compile(r"h(\d+)"), int, _equal, "the name says {part}: hidden = {wanted}"),
    NamePart("hc", re.compile(r"hc(\d+)"), int, _equal, "the name says {part}: hc = {wanted}"),
)


def check_name(name: str, value: Any) -> None:
    """Every part of ``name`` that encodes a key agrees with the preset ``value``'s key."""
    from mhc_core.presets import PresetError

    parts = name.split("-")
    for index, part in enumerate(parts):
        for rule in NAME_PARTS:
            match = rule.pattern.fullmatch(part)
            if match is None or rule.first != (index == 0):
                continue
            wanted = rule.convert(match.group(1))
            if wanted is None:  # not a GPU this table knows (``test``, a custom prefix)
                continue
            actual = getattr(value, rule.key)
            if not rule.agrees(actual, wanted):
                raise PresetError(rule.key, rule.rule.format(part=part, wanted=wanted), actual)


def derived_rules(preset_type: type) -> Mapping[str, str]:
    """The preset class's derived values: key -> the rule, as the module and errors state it."""
    rules: Mapping[str, str] = getattr(preset_type, "DERIVED", {})
    return rules


def check_derived(preset_type: type, written: Mapping[str, Any], value: Any, source: str) -> dict[str, str]:
    """Each derived value the table wrote (``written``) must equal what its rule gives for ``value``.
    Returns a provenance line per derived value: its value, its rule and whether the table (in the
    file ``source``) wrote it."""
    from mhc_core.presets import PresetError

    lines = {}
    for key, rule in derived_rules(preset_type).items():
        derived = getattr(value, key)
        if key in written and (written[key] != derived or type(written[key]) is not type(derived)):
            raise PresetError(key, f"is derived: {rule} = {derived!r} for this table; write that or leave it out",
                              written[key])  # fmt: skip
        where = f"written in {source}, checked" if key in written else f"not in {source}"
        lines[key] = f"{key} = {derived!r}: derived, {rule} ({where})"
    return lines
