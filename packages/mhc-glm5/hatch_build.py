"""Build hook. The wheel: the exported kernels (``src/mhc_glm5/kernels/``, written by
``python3 -m tools.export_kernels``, git-ignored) go into the wheel, which is then tagged for this
platform (the libraries are x86-64 ELF; they need no particular Python ABI: py3-none-<platform>;
``nox -s build`` then retags it with the manylinux tag auditwheel finds its libraries satisfy).
Without exported kernels the wheel stays pure and every kernel is compiled where the op is built.

The sdist carries the package's presets as ``presets.toml``: its [glm5.<name>] tables, copied out of
the repository's root ``presets.toml`` by ``codegen/extract.py`` (comments kept), from which
``python3 -m codegen --presets presets.toml`` renders ``src/mhc_glm5/presets/`` again. An
sdist built from an unpacked sdist (no checkout around it) includes the copy it already holds."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: The model's key: its tables in the root presets.toml are [glm5.<name>].
KEY = "glm5"
KERNELS = Path("src") / "mhc_glm5" / "kernels"


class KernelsHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "sdist":
            self._copy_presets()
            return
        if self.target_name != "wheel":
            return
        libraries = sorted((Path(self.root) / KERNELS).glob("*/*.so"))
        if not libraries:
            return
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["artifacts"].append(f"{KERNELS.as_posix()}/**")

    def _copy_presets(self) -> None:
        """Write the copy beside pyproject.toml for the sdist's ``include`` to pick up (hatchling's sdist
        takes no file from a hook's build data); ``finalize`` removes it again."""
        repository = Path(self.root).resolve().parents[1]
        presets, extract = repository / "presets.toml", repository / "codegen" / "extract.py"
        if not (presets.is_file() and extract.is_file()):
            return  # not in a checkout: an unpacked sdist's own presets.toml is included as it is
        spec = importlib.util.spec_from_file_location("_mhc_codegen_extract", extract)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        copy = Path(self.root) / "presets.toml"
        if copy.exists():
            raise FileExistsError(f"{copy}: in a checkout the model's tables are in {presets}; remove this file")
        copy.write_text(module.model_tables(presets.read_text(encoding="utf-8"), KEY), encoding="utf-8")
        self._copy = copy

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        copy = getattr(self, "_copy", None)
        if copy is not None:
            copy.unlink(missing_ok=True)
