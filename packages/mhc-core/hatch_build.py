"""Wheel build hook: the host library (``src/mhc_core/host/binaries/native/libmhc_host.so``, the ops' per-call
path in C++) is built from ``executor.cc`` and packed with its record (``libmhc_host.json``: the
source digest, size and sha256 checked before it is loaded), and the wheel is tagged for this platform (an
x86-64 ELF library that needs no particular Python ABI: py3-none-<platform>; ``nox -s build`` then
retags it with the manylinux tag auditwheel finds its library satisfies). Building needs a C++
compiler and apache-tvm-ffi's headers (a build requirement). Editable installs build nothing: the
library is then built on first use into the user's cache (``mhc_core.host.binaries.native``)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("src") / "mhc_core" / "host" / "binaries" / "native"


class NativeHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        sys.path.insert(0, str(Path(self.root) / "src"))
        try:
            from mhc_core.host.binaries import native
        finally:
            sys.path.pop(0)
        target = Path(self.root) / NATIVE / "libmhc_host.so"
        # Its record (libmhc_host.json: source digest, size, sha256) ships beside it: a library
        # truncated or replaced after install is refused before dlopen maps it.
        if native.recorded_digest(target) != native.digest():
            native.record(native.build(target))
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["artifacts"] += [f"{NATIVE.as_posix()}/libmhc_host.so", f"{NATIVE.as_posix()}/libmhc_host.json"]
