"""The op's per-call host path in C++ (``executor.cc``): finding, building and loading its library.

``library()`` returns the loaded TVM-FFI module. It looks, in order, for:

1. ``libmhc_host.so`` beside ``executor.cc`` (what a wheel ships and ``python3 -m
   mhc_core.host.native`` builds in a checkout), if it was built from this ``executor.cc``;
2. ``<cache>/native/libmhc_host-<digest>.so`` (``MHC_CACHE_DIR``, else the user's cache folder),
   if its sidecar (``.json``) records its size and sha256 and the file still has them;
3. else it builds (2) with the C++ compiler (``c++``, ``CXX`` overrides) and apache-tvm-ffi's
   headers: a few seconds, once per host and source (a lock file beside it: concurrent ranks
   build it once, the others wait, then load it).

The digest is a sha256 of the source and the build flags; the library reports the digest it
was built from (``source_digest``), so a stale library is never loaded. The cache follows
``mhc_core.host.cache_files``: private folders, files this user alone owns and can write, no
symbolic link followed, and the size and sha256 checked before the library is loaded (``dlopen``
runs its code). A cache that fails a check is not used (one warning says why): the library is then
built into a private temporary folder and loaded from there. The library beside ``executor.cc`` is
trusted as installed (it is in the install folder); it must still report this source's digest.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import cache_files

LOG = logging.getLogger("mhc")
SOURCE = Path(__file__).with_name("executor.cc")
#: What keeps the library loadable down to glibc 2.28 when built on a newer one (see its header).
FLOOR_SOURCE = Path(__file__).with_name("glibc_floor.cc")
PACKAGED = Path(__file__).with_name("libmhc_host.so")
#: libstdc++ linked in (its symbols kept private): the floor's (GCC 8's, GLIBCXX_3.4.25) is older
#: than what a newer compiler's headers ask for (3.4.29 with GCC 12). libgcc stays shared: of
#: libgcc_s.so.1 only old GCC_ versions are asked for, while a static unwinder of GCC >= 12 needs
#: glibc 2.35's _dl_find_object. --gc-sections keeps out the archive members nothing calls
#: (std::random_device's arc4random, GLIBC_2.36).
FLAGS = (
    "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-s",
    "-static-libstdc++", "-Wl,--exclude-libs,ALL", "-Wl,--gc-sections",
    "-Wl,--wrap=dlopen,--wrap=dlsym,--wrap=pthread_once",
)  # fmt: skip
#: Where glibc < 2.34 keeps dlopen, dlsym and pthread_once (glibc_floor.cc), needed by name even where
#: libc has them (2.34 and later keep both as empty stubs).
OLD_GLIBC_LIBS = ("-Wl,--push-state,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0", "-Wl,--pop-state")
CACHE_ENV = "MHC_CACHE_DIR"
_CACHE_NAME = "the host library cache"


def digest() -> str:
    """sha256 of the sources and the build flags: what a library must report to be loaded."""
    text = SOURCE.read_bytes() + b"\0" + FLOOR_SOURCE.read_bytes() + b"\0" + " ".join(FLAGS + OLD_GLIBC_LIBS).encode()
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
            compiler, *FLAGS, str(SOURCE), str(FLOOR_SOURCE), f'-DMHC_SOURCE_DIGEST="{source_digest}"',
            *(f"-I{path}" for path in sorted(includes)), str(library), *OLD_GLIBC_LIBS, "-o", str(partial),
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"mhc: building the host library failed:\n{' '.join(command)}\n{result.stderr}")
        os.chmod(partial, 0o755)  # never group-writable, whatever the umask (the cache would refuse it)
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
    if PACKAGED.exists():
        module = _load(PACKAGED)
        if module is not None:
            return module
    target = cached_path(digest())
    with contextlib.ExitStack() as stack:
        if _lock_cache(stack, target):
            module = _load_cached(target)
            if module is None:
                module = _load(_build_cached(target))
        else:
            module = _load(stack.enter_context(_private_build()))
    if module is None:
        raise RuntimeError("mhc: the host library just built reports another source digest")
    return module


def _lock_cache(stack: contextlib.ExitStack, target: Path) -> bool:
    """Take ``target``'s lock (``<target>.lock``) in a safe cache folder; False: the cache is not
    used (one warning says why)."""
    root = cache_root()
    lock = target.with_suffix(".lock")
    try:
        cache_files.private_folder(root, target.parent.name, create=True)
        stack.enter_context(cache_files.exclusive(lock))
        return True
    except cache_files.UnsafeCache as error:
        cache_files.warn_once(_CACHE_NAME, error.path, error.reason)
    except OSError as error:
        cache_files.warn_once(_CACHE_NAME, error.filename or root, error.strerror or str(error))
    return False


def _load_cached(target: Path) -> Any | None:
    """The cached library at ``target`` if its sidecar records this source's digest, its size and
    its sha256 and the file (this user's alone) still has them; checked before it is loaded."""
    sidecar = target.with_suffix(".json")
    try:
        entry = json.loads(cache_files.read_owned(sidecar))
        recorded = (entry["source_digest"], entry["size"], entry["sha256"])
    except FileNotFoundError:
        return None
    except cache_files.UnsafeCache as error:
        cache_files.warn_once(_CACHE_NAME, sidecar, error.reason)
        return None
    except Exception as error:  # JSON, a missing field, a wrong type: rebuilt and rewritten
        cache_files.warn_once(_CACHE_NAME, sidecar, f"it is corrupt or truncated ({type(error).__name__}: {error})")
        return None
    if recorded[0] != digest():
        return None  # another source's (the name holds 16 digits of the digest)
    problem = cache_files.library_problem(target, recorded[1], recorded[2])
    if problem is not None:
        cache_files.warn_once(_CACHE_NAME, target, problem)
        return None
    return _load(target)


def _build_cached(target: Path) -> Path:
    """Build ``target`` (its lock held) and record its size and sha256 beside it."""
    build(target)
    size, sha256 = cache_files.file_digest(target)
    entry = {"source_digest": digest(), "size": size, "sha256": sha256}
    cache_files.write_atomic(target.with_suffix(".json"), (json.dumps(entry, indent=1) + "\n").encode())
    return target


@contextlib.contextmanager
def _private_build() -> Iterator[Path]:
    """The library built into a private temporary folder, removed afterwards (a loaded library
    stays mapped): what a process does when the cache cannot be trusted."""
    with tempfile.TemporaryDirectory(prefix="mhc-native-") as scratch:
        yield build(Path(scratch, "libmhc_host.so"))


def main(argv: list[str] | None = None) -> int:
    """``python3 -m mhc_core.host.native [TARGET]``: build the library beside its source (what the
    wheel build and a GPU host without a compiler need), or into TARGET."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else PACKAGED
    print(build(target))
    return 0
