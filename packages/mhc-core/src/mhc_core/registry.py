"""The model registry: every model package declares itself once, and the host iterates what it finds.

A model package (``mhc_dsv41``, ``mhc_glm5``, a third one) holds one ``Model`` (conventionally
``<package>.model:MODEL``) and names it in its ``pyproject.toml``::

    [project.entry-points."mhc_kernels.models"]
    dsv41 = "mhc_dsv41.model:MODEL"

Codegen, ``tools.compile_presets`` / ``tools.export_kernels``, the shipped-kernel lookup
(``mhc_core.host.binaries.artifacts``), the noxfile, the benchmarks and the import-layer test iterate
``models()``: no file outside a model package names a model.

Discovery (``models()``), first found wins per key, in this order:

1. the distribution folders on ``MHC_MODEL_PATH`` (``os.pathsep``-separated; each a folder with a
   ``pyproject.toml`` and its package under ``src/``): a package kept anywhere, unregistered;
2. the source checkout this ``mhc_core`` is imported from: ``packages/*/pyproject.toml`` beside
   ``packages/mhc-core`` (tests and tools run from a checkout with ``PYTHONPATH``, not installed
   distributions, so ``importlib.metadata`` alone would not see the packages);
3. installed distributions' entry points (as ``importlib.metadata`` finds them, read by
   ``mhc_core.entry_points``), e.g. wheels or ``pip install -e``.

A model found in a folder (1, 2) whose package is not importable gets that folder's ``src/`` appended
to ``sys.path``. Two distributions declaring one key raise ``ValueError``; so does ``model(key)`` for
an unknown key, naming the known ones. Loading a ``Model`` imports only its ``model`` module, which
imports nothing heavy (this module): the preset type, op type and the rest are ``module:name``
strings, imported when asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhc_core import entry_points

#: The entry-point group a model package declares its ``Model`` in.
GROUP = "mhc_kernels.models"
#: Extra distribution folders to look in (``os.pathsep``-separated).
PATH_ENV = "MHC_MODEL_PATH"

#: ``(kernel name, the preset's GEOMETRY) -> dynamic shared bytes or None`` (ptxas sees static only).
DynamicShared = Callable[[str, Mapping[str, Any]], "int | None"]


def _no_dynamic_shared(kernel: str, geometry: Mapping[str, Any]) -> int | None:
    return None


def _split(target: str) -> tuple[str, str]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"expected 'package.module:name', got {target!r}")
    return module, name


def load_object(target: str) -> Any:
    """The object a ``package.module:name`` string names (imported now)."""
    module, name = _split(target)
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, slots=True)
class Model:
    """One model package, as it declares itself; ``module:name`` strings are imported when asked for."""

    #: Short key: the presets files' ``[<key>.<name>]`` tables, ``tests/<key>/``, ``find_preset(key, ...)``.
    key: str
    #: Human name, for generated docstrings and reports ("DSV4.1").
    title: str
    #: The distribution (``mhc-dsv41``) and its import package (``mhc_dsv41``).
    distribution: str
    package: str
    #: The preset dataclass (``kernel_specs(arch)`` gives the kernel specs per preset and arch).
    preset_type: str
    #: The op class a preset builds.
    op_type: str
    #: ``(hidden, hc, tp) -> {key: value}`` filling keys a presets table left out, if any.
    defaults: str | None = None
    #: The model's torch reference module (rounds where the kernels round).
    reference: str | None = None
    #: The module registering the model's torch custom ops (``torch.ops.mhc.*``), if any.
    custom_ops: str | None = None
    #: Benchmark suites, as (name, ``module:function`` ``(ctx, ms) -> records``) pairs.
    benchmark_suites: tuple[tuple[str, str], ...] = ()
    #: The names of ``benchmark_suites`` a plain ``python3 -m benchmarks.run`` (no ``--suite``) runs.
    benchmark_defaults: tuple[str, ...] = ()
    #: Suites printed by a table of their own, as (name, ``module:function`` ``records -> str``) pairs.
    benchmark_tables: tuple[tuple[str, str], ...] = ()
    #: What the generic suites (fp8, host, spin-bound, A/B) need of the model, ``module:name`` of a
    #: ``mhc_core.bench.case.BenchmarkCase``; None: they leave the model out.
    benchmark_case: str | None = None
    #: The modules of device code (the import-layer test keeps host imports out of them).
    device_modules: tuple[str, ...] = ()
    #: The model's own presets file, relative to its distribution folder (codegen reads it): a model
    #: kept outside the repository ships its tables so. None: its tables are in the repository's
    #: root ``presets.toml`` (the in-repo models), or it has no presets.
    presets_file: str | None = None
    dynamic_shared: DynamicShared = _no_dynamic_shared
    #: The distribution folder it was found in (``MHC_MODEL_PATH`` or the checkout), else None.
    source: Path | None = None

    def __post_init__(self) -> None:
        if not self.key.isidentifier():
            raise ValueError(f"Model.key: expected an identifier, got {self.key!r}")
        if not self.package.isidentifier():
            raise ValueError(f"Model.package: expected an identifier, got {self.package!r}")
        for name in ("preset_type", "op_type", "defaults", "benchmark_case"):
            value = getattr(self, name)
            if value is not None:
                _split(value)

    @property
    def config_module(self) -> str:
        return _split(self.preset_type)[0]

    @property
    def preset_class(self) -> str:
        return _split(self.preset_type)[1]

    @property
    def op_module(self) -> str:
        return _split(self.op_type)[0]

    @property
    def op_class(self) -> str:
        return _split(self.op_type)[1]

    @property
    def presets_package(self) -> str:
        """The generated registry of the model's shipped presets."""
        return f"{self.package}.presets"

    @property
    def presets_path(self) -> Path | None:
        """The model's own presets file where it was found in a folder and declares one."""
        if self.source is None or self.presets_file is None:
            return None
        return self.source / self.presets_file

    def load_preset_type(self) -> type:
        loaded: type = load_object(self.preset_type)
        return loaded

    def load_op_type(self) -> type:
        loaded: type = load_object(self.op_type)
        return loaded

    def load_defaults(self) -> Callable[..., dict[str, Any]] | None:
        return None if self.defaults is None else load_object(self.defaults)


def checkout_packages() -> Path | None:
    """``packages/`` of the source checkout this module is imported from (``packages/mhc-core/src/mhc_core``),
    None for an installed mhc-core."""
    here = Path(__file__).resolve().parent
    distribution = here.parents[1]
    if here.parent.name == "src" and (distribution / "pyproject.toml").is_file():
        return distribution.parent
    return None


def _declared(pyproject: Path) -> dict[str, str]:
    """The ``mhc_kernels.models`` entry points a distribution folder's pyproject.toml declares."""
    try:
        with pyproject.open("rb") as stream:
            document = tomllib.load(stream)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{pyproject}: cannot read its entry points: {error}") from None
    table = document.get("project", {}).get("entry-points", {}).get(GROUP, {})
    return {str(key): str(value) for key, value in table.items()}


def _folders() -> Iterator[Path]:
    for entry in os.environ.get(PATH_ENV, "").split(os.pathsep):
        if entry:
            yield Path(entry).resolve()
    packages = checkout_packages()
    if packages is not None:
        yield from sorted(path.parent for path in packages.glob("*/pyproject.toml"))


def _load(key: str, target: str, source: Path | None) -> Model:
    if source is not None:
        top = _split(target)[0].split(".")[0]
        src = source / "src" if (source / "src").is_dir() else source
        if importlib.util.find_spec(top) is None and str(src) not in sys.path:
            sys.path.append(str(src))
    declared = load_object(target)
    if not isinstance(declared, Model):
        raise ValueError(f"entry point {key} = {target!r} ({GROUP}): expected a mhc_core.registry.Model")
    if declared.key != key:
        raise ValueError(f"entry point {key} = {target!r} ({GROUP}): its Model's key is {declared.key!r}")
    return dataclasses.replace(declared, source=source)


@functools.cache
def _discover() -> dict[str, Model]:
    found: dict[str, Model] = {}
    origins: dict[str, str] = {}

    def add(key: str, target: str, origin: str, source: Path | None) -> None:
        if key in found:
            if target != origins[key].partition(" ")[0]:
                raise ValueError(f"model {key!r} declared twice: {origins[key]} and {target} ({origin})")
            return
        found[key] = _load(key, target, source)
        origins[key] = f"{target} ({origin})"

    for folder in _folders():
        for key, target in _declared(folder / "pyproject.toml").items():
            add(key, target, str(folder), folder)
    for entry in entry_points.of_group(GROUP):
        add(entry.name, entry.value, f"installed {entry.dist.name if entry.dist else '?'}", None)
    return dict(sorted(found.items()))


def refresh() -> None:
    """Forget what was discovered (after ``MHC_MODEL_PATH`` or the installed packages changed)."""
    _discover.cache_clear()


def models() -> dict[str, Model]:
    """Every registered model by key, sorted by key."""
    return dict(_discover())


def model(key: str) -> Model:
    """The model registered as ``key``; ValueError names the known ones."""
    known = _discover()
    try:
        return known[key]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; known: {', '.join(known) or 'none'}") from None


def packages() -> tuple[str, ...]:
    """The model packages' import names, in key order."""
    return tuple(entry.package for entry in _discover().values())


def distributions() -> tuple[str, ...]:
    """The model packages' distribution names, in key order."""
    return tuple(entry.distribution for entry in _discover().values())
