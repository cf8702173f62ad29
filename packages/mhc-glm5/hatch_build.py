"""Wheel build hook: the exported kernels (``src/mhc_glm5/kernels/``, written by
``python3 -m tools.export_kernels``, git-ignored) go into the wheel, which is then tagged for this
platform (the libraries are x86-64 ELF; they need no particular Python ABI: py3-none-<platform>;
``nox -s build`` then retags it with the manylinux tag auditwheel finds its libraries satisfy).
Without exported kernels the wheel stays pure and every kernel is compiled where the op is built."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

KERNELS = Path("src") / "mhc_glm5" / "kernels"


class KernelsHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        libraries = sorted((Path(self.root) / KERNELS).glob("*/*.so"))
        if not libraries:
            return
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["artifacts"].append(f"{KERNELS.as_posix()}/**")
