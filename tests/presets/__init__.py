"""The presets the tests run: every shipped one (``<package>.presets``) and the test presets (names
starting ``test-``: shapes only the tests run), which ``python3 -m codegen`` renders into
``tests/presets/<model>/`` instead of the packages, so they are neither shipped nor found by
``mhc_core.find_preset``. ``names(model)`` and ``get(model, name)`` cover both."""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

from mhc_core import registry as model_registry


def registries(model: str) -> list[ModuleType]:
    """The shipped registry, then the tests' own (where the model has test presets)."""
    found = [importlib.import_module(model_registry.model(model).presets_package)]
    with contextlib.suppress(ModuleNotFoundError):  # a model without test presets has no registry here
        found.append(importlib.import_module(f"{__name__}.{model}"))
    return found


def names(model: str) -> tuple[str, ...]:
    """Every preset of ``model`` the tests may run, shipped and test, sorted."""
    return tuple(sorted(name for registry in registries(model) for name in registry.names()))


def get(model: str, name: str) -> Any:
    """The module of ``model``'s preset ``name``, shipped or test (as ``<package>.presets.get``)."""
    for registry in registries(model):
        if name in registry.names():
            return registry.get(name)
    raise KeyError(f"unknown {model} preset {name!r}; known: {', '.join(names(model))}")
