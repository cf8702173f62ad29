"""Preset code generation: each model package's ``presets.toml`` -> one module per preset in the package.

``python3 -m codegen`` validates every table of every registered model's own
presets file (``Model.presets_file``, e.g. ``packages/mhc-dsv41/presets.toml``)
by building the model's preset dataclass (``Model.preset_type``), then renders
``templates/preset.py.j2`` into ``packages/<model>/src/<package>/presets/<module>.py``
and ``templates/registry.py.j2`` into that folder's ``__init__.py`` (the test
presets, names starting ``test-``, into ``tests/presets/<key>/`` instead), writing
only files whose text changed and removing modules no preset renders any more.
``--check`` writes nothing and fails naming each stale, missing or orphaned file.
A bad preset stops the run before anything is written.

Needs jinja2 and the packages' pure-Python configs (neither torch nor the DSL).
"""

from __future__ import annotations

from .cli import main
from .load import CodegenError, load_presets

__all__ = ["CodegenError", "load_presets", "main"]
