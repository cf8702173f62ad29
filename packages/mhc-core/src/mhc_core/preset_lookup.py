"""Finding a preset by what an engine knows: the model, the GPU (its arch, compute capability or
device), tp, hidden and hc. Pure Python: imports the model's preset registry and modules, which need
neither torch nor the DSL (a ``device`` is asked of torch).

``find_preset(model, arch="sm_90a", tp=2, hidden=5120)`` (``model``: a registered model's key,
``mhc_core.registry``) returns the preset's module (``PRESET``, ``build(...)``); where no shipped
preset matches, ``LookupError`` names the closest ones and what differs. Test presets
(``mhc_core.presets.is_test_preset``: only the tests have them) are never returned.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from .constants import ARCH_BY_CAPABILITY
from .presets import is_test_preset
from .registry import model as registered_model

#: How many near misses an error names.
CLOSEST = 3


class ModelPreset(Protocol):
    """What every model's preset dataclass has (``find_preset`` matches on these)."""

    name: str
    archs: tuple[str, ...]
    tp: int
    hidden: int
    hc: int


class PresetModule(Protocol):
    """What ``find_preset`` returns, for any registered model: a generated preset module (the model's
    own registry, ``<package>.presets.get``, types ``PRESET`` and ``build`` as that model's)."""

    NAME: str
    PRESET: ModelPreset
    GEOMETRY: dict[str, Any]

    def build(self, max_num_tokens: int, device: Any, group: Any = None, **options: Any) -> Any: ...


@dataclass(frozen=True)
class _Wanted:
    arch: str
    tp: int
    hidden: int
    hc: int | None

    def differences(self, preset: Any) -> list[str]:
        """What ``preset`` has that was not asked for, one phrase per field."""
        found = []
        if self.arch not in preset.archs:
            found.append(f"archs {', '.join(preset.archs)}, not {self.arch}")
        for field in ("tp", "hidden", "hc"):
            wanted = getattr(self, field)
            if wanted is not None and getattr(preset, field) != wanted:
                found.append(f"{field} {getattr(preset, field)}, not {wanted}")
        return found


def normalize_arch(arch: object) -> str:
    """The kernels' arch name (``SUPPORTED_ARCHS``) for an arch spelled as torch and engines spell it:
    ``"sm_90a"``, ``"sm_90"``, ``"90"``, ``"90a"``, ``"9.0"``, ``"compute_90a"`` (any case), the
    capability ``(9, 0)`` (``torch.cuda.get_device_capability``) or ``90``. The kernels of an arch are
    its arch-specific ("a") build: ``sm_90`` is ``sm_90a``."""
    if isinstance(arch, (tuple, list)) and len(arch) == 2 and all(_is_int(part) for part in arch):
        key = (int(arch[0]), int(arch[1]))
    elif _is_int(arch) or isinstance(arch, str):
        key = _capability_of(str(arch))
    else:
        raise TypeError(f"arch: expected a str such as 'sm_90a' or a capability such as (9, 0), got {arch!r}")
    if key is None or key not in ARCH_BY_CAPABILITY:
        spellings = ", ".join(f"{name} ({major}, {minor})" for (major, minor), name in ARCH_BY_CAPABILITY.items())
        raise ValueError(f"arch: expected one of {spellings} in any of their spellings, got {arch!r}")
    return ARCH_BY_CAPABILITY[key]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _capability_of(text: str) -> tuple[int, int] | None:
    """(major, minor) of ``"sm_90a"``, ``"compute_90"``, ``"90"``, ``"9.0"``; None if it is none of these."""
    name = text.strip().lower()
    for prefix in ("sm_", "compute_", "sm"):
        name = name.removeprefix(prefix)
    name = name.removesuffix("a")
    if "." in name:
        major, _, minor = name.partition(".")
        return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None
    if len(name) >= 2 and name.isdigit():
        return int(name[:-1]), int(name[-1])
    return None


def _arch(arch: object, capability: tuple[int, int] | None, device: Any) -> str:
    given = [
        name for name, value in (("arch", arch), ("capability", capability), ("device", device)) if value is not None
    ]
    if len(given) != 1:
        raise TypeError(f"find_preset: expected one of arch, capability or device; got {given or 'none'}")
    if arch is not None:
        return normalize_arch(arch)
    if capability is not None:
        key = (int(capability[0]), int(capability[1]))
        if key not in ARCH_BY_CAPABILITY:
            known = ", ".join(f"{major}.{minor}" for major, minor in ARCH_BY_CAPABILITY)
            raise ValueError(f"capability: expected one of {known}, got {key[0]}.{key[1]}")
        return ARCH_BY_CAPABILITY[key]
    from .host.binaries.compiler import device_arch

    return device_arch(device)


def shipped_presets(model: str) -> dict[str, ModuleType]:
    """name -> module of every shipped preset of ``model`` (test presets left out)."""
    registry = importlib.import_module(registered_model(model).presets_package)  # ValueError names the known
    return {name: registry.get(name) for name in registry.names() if not is_test_preset(name)}


def find_preset(
    model: str,
    *,
    tp: int,
    hidden: int,
    hc: int | None = None,
    arch: str | tuple[int, int] | None = None,
    capability: tuple[int, int] | None = None,
    device: Any = None,
) -> PresetModule:
    """The module of ``model``'s shipped preset for one GPU (``arch`` in any spelling ``normalize_arch``
    takes, ``capability`` or ``device``: exactly one), ``tp``, ``hidden`` and ``hc`` (None: any).
    Raises ``LookupError`` naming the closest presets and what differs when none matches."""
    wanted = _Wanted(_arch(arch, capability, device), tp, hidden, hc)
    presets = shipped_presets(model)
    ranked = sorted(presets.items(), key=lambda item: (len(wanted.differences(item[1].PRESET)), item[0]))
    matches = [(name, module) for name, module in ranked if not wanted.differences(module.PRESET)]
    if len(matches) == 1:
        found: PresetModule = matches[0][1]
        return found
    described = f"arch {wanted.arch}, tp {tp}, hidden {hidden}" + (f", hc {hc}" if hc is not None else "")
    if matches:
        names = ", ".join(name for name, _ in matches)
        raise LookupError(f"{model} presets for {described}: {names} all match; pass hc or pick one by name")
    closest = "; ".join(f"{name} ({', '.join(wanted.differences(module.PRESET))})" for name, module in ranked[:CLOSEST])
    raise LookupError(f"no {model} preset for {described}; closest: {closest}")
