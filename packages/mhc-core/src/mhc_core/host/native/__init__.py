"""The op's per-call host path in C++ (``executor.cc``): finding, building and loading its library.

``library()`` returns the loaded TVM-FFI module. It looks, in order, for:

1. ``libmhc_host.so`` beside ``executor.cc`` (what a wheel ships and ``python3 -m
   mhc_core.host.native`` builds in a checkout), if it was built from this ``executor.cc``;
2. ``<cache>/native/libmhc_host-<digest>.so`` (``MHC_CACHE_DIR``, else the user's cache folder);
3. else it builds (2) with the C++ compiler (``c++``, ``CXX`` overrides) and apache-tvm-ffi's
   headers: a few seconds, once per host and source.

The digest is a sha256 of the source and the build flags; the library reports the digest it
was built from (``source_digest``), so a stale library is never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOG = logging.getLogger("mhc")
SOURCE = Path(__file__).with_name("executor.cc")
PACKAGED = Path(__file__).with_name("libmhc_host.so")
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-s")
CACHE_ENV = "MHC_CACHE_DIR"


def digest() -> str:
    """sha256 of the source and the build flags: what a library must report to be loaded."""
    text = SOURCE.read_bytes() + b"\0" + " ".join(FLAGS).encode()
    return hashlib.sha256(text).hexdigest()


def cache_root() -> Path:
    """``MHC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mhc``, else ``~/.cache/mhc``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mhc"


def cached_path(source_digest: str) -> Path:
    return cache_root() / "native" / f"libmhc_host-{source_digest[:16]}.so"


def build(target: Path) -> Path:
    """Compile ``executor.cc`` into ``target`` (atomically: a concurrent process sees all or nothing)."""
    import tvm_ffi.libinfo

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError(
            "mhc: the host library (libmhc_host.so) is not installed and no C++ compiler was found to "
            "build it: install the mhc-core wheel, or set CXX"
        )
    includes = {tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()}
    library = Path(tvm_ffi.libinfo.find_libtvm_ffi())
    source_digest = digest()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mhc-native-", dir=target.parent) as scratch:
        partial = Path(scratch, target.name)
        command = [
            compiler, *FLAGS, str(SOURCE), f'-DMHC_SOURCE_DIGEST="{source_digest}"',
            *(f"-I{path}" for path in sorted(includes)), str(library), "-ldl", "-o", str(partial),
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"mhc: building the host library failed:\n{' '.join(command)}\n{result.stderr}")
        os.replace(partial, target)
    LOG.info("built the host library %s in %.1f s", target, time.perf_counter() - start)
    return target


def library_digest(path: Path) -> str:
    """The digest the library at ``path`` was built from."""
    import tvm_ffi

    return str(tvm_ffi.load_module(str(path))["source_digest"]())


def _load(path: Path) -> Any | None:
    """The module at ``path`` if it was built from this source, else None."""
    import tvm_ffi

    module = tvm_ffi.load_module(str(path))
    if module["source_digest"]() != digest():
        LOG.info("ignoring %s: built from another executor.cc", path)
        return None
    return module


@functools.cache
def library() -> Any:
    """The loaded host library (see the module docstring)."""
    source_digest = digest()
    for candidate in (PACKAGED, cached_path(source_digest)):
        if candidate.exists():
            module = _load(candidate)
            if module is not None:
                return module
    module = _load(build(cached_path(source_digest)))
    if module is None:
        raise RuntimeError("mhc: the host library just built reports another source digest")
    return module


def main(argv: list[str] | None = None) -> int:
    """``python3 -m mhc_core.host.native [TARGET]``: build the library beside its source (what the
    wheel build and a GPU host without a compiler need), or into TARGET."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else PACKAGED
    print(build(target))
    return 0
