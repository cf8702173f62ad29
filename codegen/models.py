"""The models codegen knows, from the model registry (``mhc_core.registry``): where their presets
come from (the repository's root ``presets.toml``, or a model's own file) and where their modules go."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The repository this codegen lives in (its packages provide the preset dataclasses).
REPO = Path(__file__).resolve().parents[1]
#: The in-repo models' presets file, at the repository's root.
ROOT_PRESETS = "presets.toml"
CORE_SRC = REPO / "packages" / "mhc-core" / "src"


@dataclass(frozen=True)
class Model:
    """One registered model package: its ``[<key>.<name>]`` tables and its ``presets/`` output."""

    entry: Any  # mhc_core.registry.Model

    def __getattr__(self, name: str) -> Any:
        """The entry's fields: ``key``, ``title``, ``config_module``, ``preset_class``, ``op_module``,
        ``op_class``, ``presets_package``..."""
        if name == "entry":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.entry, name)

    @property
    def defaults(self) -> str | None:
        """The defaults rule's name (it fills omitted keys), as the generated modules quote it."""
        return None if self.entry.defaults is None else str(self.entry.defaults).partition(":")[2]

    @property
    def test_presets_package(self) -> str:
        return f"tests.presets.{self.key}"

    @property
    def in_checkout(self) -> bool:
        """Whether the model is one of this checkout's packages (``packages/<distribution>``; an
        installed one counts: codegen renders into the checkout), not a folder found elsewhere."""
        from mhc_core.registry import checkout_packages

        source = self.entry.source
        return source is None or source.parent == checkout_packages()

    def distribution_dir(self, root: Path) -> Path:
        """The distribution folder: ``root``'s ``packages/<distribution>`` for this checkout's packages,
        else the folder the model was found in."""
        if self.in_checkout:
            return root / "packages" / self.entry.distribution
        source: Path = self.entry.source
        return source

    @property
    def presets_path(self) -> Path | None:
        """The model's own presets file (``presets_file`` in its distribution folder), if it declares one;
        None: its tables are in the repository's root ``presets.toml`` (``root_presets()``)."""
        if self.entry.presets_file is None:
            return None
        return self.distribution_dir(REPO) / self.entry.presets_file

    @property
    def presets_source(self) -> str:
        """The file holding the model's tables as the generated modules name it: the root
        ``presets.toml`` for a model without its own file; its own file from the repository's root for
        this checkout's packages, else from its distribution folder (where they are generated)."""
        if self.entry.presets_file is None:
            return ROOT_PRESETS
        if self.in_checkout:
            return f"packages/{self.entry.distribution}/{self.entry.presets_file}"
        return str(self.entry.presets_file)

    def output_dir(self, root: Path) -> Path:
        """``<package>/presets`` in the distribution folder (``distribution_dir``)."""
        return self.distribution_dir(root) / "src" / self.entry.package / "presets"

    def test_output_dir(self, root: Path) -> Path:
        """Where the test presets' modules go (``mhc_core.presets.is_test_preset``): the tests', not the package's."""
        return root / "tests" / "presets" / self.key

    def output_dirs(self, root: Path) -> tuple[Path, Path]:
        return self.output_dir(root), self.test_output_dir(root)

    def preset_type(self) -> type:
        loaded: type = self.entry.load_preset_type()
        return loaded

    def defaults_function(self) -> Any:
        return self.entry.load_defaults()


def root_presets() -> Path:
    """The repository's root presets file (``REPO`` read when called: the tests point it at a copy)."""
    return REPO / ROOT_PRESETS


def models() -> dict[str, Model]:
    """Every registered model by key."""
    from mhc_core import registry

    return {key: Model(entry) for key, entry in registry.models().items()}


def ensure_importable() -> None:
    """Put the repo's mhc-core on ``sys.path`` when it is not installed (the registry finds the rest)."""
    if importlib.util.find_spec("mhc_core") is None and str(CORE_SRC) not in sys.path:
        sys.path.insert(0, str(CORE_SRC))
