"""The models codegen knows: where their presets come from and where their modules go."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The repository this codegen lives in (its packages provide the preset dataclasses).
REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("mhc-core", "mhc-dsv41", "mhc-glm5")


@dataclass(frozen=True)
class Model:
    """One model package: its ``[<key>.<name>]`` tables in presets.toml and its ``presets/`` output."""

    key: str
    title: str
    distribution: str
    package: str
    preset_class: str
    op_class: str
    #: Name of a ``config`` function ``(hidden, hc, tp) -> {key: value}`` filling omitted keys, if any.
    defaults: str | None = None

    @property
    def config_module(self) -> str:
        return f"{self.package}.config"

    @property
    def op_module(self) -> str:
        return f"{self.package}.op"

    @property
    def presets_package(self) -> str:
        return f"{self.package}.presets"

    @property
    def test_presets_package(self) -> str:
        return f"tests.presets.{self.key}"

    def output_dir(self, root: Path) -> Path:
        return root / "packages" / self.distribution / "src" / self.package / "presets"

    def test_output_dir(self, root: Path) -> Path:
        """Where the test presets' modules go (``mhc_core.presets.is_test_preset``): the tests', not the package's."""
        return root / "tests" / "presets" / self.key

    def output_dirs(self, root: Path) -> tuple[Path, Path]:
        return self.output_dir(root), self.test_output_dir(root)

    def preset_type(self) -> type:
        return getattr(importlib.import_module(self.config_module), self.preset_class)

    def defaults_function(self) -> Any:
        if self.defaults is None:
            return None
        return getattr(importlib.import_module(self.config_module), self.defaults)


MODELS: dict[str, Model] = {
    model.key: model
    for model in (
        Model(
            key="dsv41",
            title="DSV4.1",
            distribution="mhc-dsv41",
            package="mhc_dsv41",
            preset_class="DSV41Preset",
            op_class="AllReduceMHC",
            defaults="default_geometry",
        ),
        Model(
            key="glm5",
            title="GLM-5.3-Flash",
            distribution="mhc-glm5",
            package="mhc_glm5",
            preset_class="GLM5Preset",
            op_class="AllReduceMhcBoundary",
        ),
    )
}


def ensure_importable() -> None:
    """Put the repo's ``packages/*/src`` on ``sys.path`` for the packages that are not installed."""
    for distribution in DISTRIBUTIONS:
        package = distribution.replace("-", "_")
        src = REPO / "packages" / distribution / "src"
        if importlib.util.find_spec(package) is None and str(src) not in sys.path:
            sys.path.insert(0, str(src))
