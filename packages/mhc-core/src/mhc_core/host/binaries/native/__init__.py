"""The op's per-call host path in C++ (``executor.cc``): finding, building and loading its library.

``library()`` returns the loaded TVM-FFI module. It looks, in order, for:

1. ``libmhc_host.so`` beside ``executor.cc`` (what a wheel ships and ``python3 -m
   mhc_core.host.binaries.native`` builds in a checkout), if its record beside it (``libmhc_host.json``,
   written by that build) names this ``executor.cc``'s digest and the file still has the size and
   sha256 recorded;
2. ``<cache>/native/libmhc_host-<digest>.so`` (``MHC_CACHE_DIR``, else the user's cache folder),
   if its sidecar (``.json``) records its size and sha256 and the file still has them;
3. else it builds (2) with the C++ compiler (``c++``, ``CXX`` overrides) and apache-tvm-ffi's
   headers: a few seconds, once per host and source (a lock file beside it: concurrent ranks
   build it once, the others wait, then load it; a holder stuck past ``MHC_CACHE_LOCK_TIMEOUT_S``
   is named, and the waiter builds privately).

The digest is a sha256 of the source and the build flags; the library reports the digest it
was built from (``source_digest``), so a stale library is never loaded. Every library is loaded
from the descriptor whose size and sha256 were checked (``mhc_core.host.binaries.verified``): ``dlopen``
runs its code, and a truncated one mapped is a SIGBUS. The cache follows
``mhc_core.host.binaries.cache_files``: private folders, files this user alone owns and can write, no
symbolic link followed. A cache that fails a check is not used (one warning says why): the library
is then built into a private temporary folder and loaded from there. The installed library is
trusted as installed (it is in the install folder) once it matches its record; one that does not,
has none, or fails to load is skipped with one warning naming it, then the cache or a build serve.
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

from .. import cache_files, verified

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
_INSTALLED_NAME = "the installed host library"


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
    with cache_files.scratch(target.parent, "mhc-native-") as scratch:  # with our pid: a crash's is removed later
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
        cache_files.clear_way(target)  # a folder there would refuse every rename, for good
        os.replace(partial, target)
    LOG.info("built the host library %s in %.1f s", target, time.perf_counter() - start)
    return target


def record(target: Path) -> tuple[Path, int, str]:
    """Write ``target``'s record beside it (``.json``: this source's digest, the library's size and
    sha256: what is checked before it is loaded). ``target``, its size and sha256."""
    size, sha256 = cache_files.file_digest(target)
    entry = {"source_digest": digest(), "size": size, "sha256": sha256}
    cache_files.write_atomic(target.with_suffix(".json"), (json.dumps(entry, indent=1) + "\n").encode())
    return target, size, sha256


def recorded_digest(path: Path) -> str | None:
    """The source digest ``path``'s record names, if it has one that is this library's (the wheel
    build asks whether the library beside the source is current)."""
    try:
        entry = json.loads(path.with_suffix(".json").read_bytes())
        if cache_files.digest_problem(cache_files.file_digest(path), entry["size"], entry["sha256"]):
            return None
        return str(entry["source_digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load(path: Path, size: int | None, sha256: str | None, *, owned: bool = True) -> Any | None:
    """The module at ``path`` (loaded from the descriptor checked to be ``size`` bytes with
    ``sha256``) if it was built from this source, else None."""
    module = verified.load(path, size, sha256, owned=owned)
    if module["source_digest"]() != digest():
        LOG.info("ignoring %s: built from another executor.cc", path)
        return None
    return module


@functools.cache
def library() -> Any:
    """The loaded host library (see the module docstring)."""
    module = _load_installed()
    if module is not None:
        return module
    target = cached_path(digest())
    with contextlib.ExitStack() as stack:
        if _lock_cache(stack, target):
            module = _load_cached(target)
            if module is None:
                module = _load(*_build_cached(target))
        else:
            module = _load(*stack.enter_context(_private_build()))
    if module is None:
        raise RuntimeError("mhc: the host library just built reports another source digest")
    return module


def _load_installed() -> Any | None:
    """The library beside ``executor.cc`` if its record names this source and it still has the
    recorded size and sha256; anything else that is there is skipped with one warning naming it
    (a truncated file would be a SIGBUS, a foreign one would run its constructor)."""
    if not os.path.lexists(PACKAGED):
        return None
    record_path = PACKAGED.with_suffix(".json")  # written by ``record``
    try:
        entry = json.loads(record_path.read_bytes())
        recorded = (entry["source_digest"], entry["size"], entry["sha256"])
    except FileNotFoundError:
        reason = f"no record of its size and sha256 is beside it ({record_path.name}): rebuild it "
        reason += "(python3 -m mhc_core.host.binaries.native)"
        cache_files.warn_once(_INSTALLED_NAME, PACKAGED, reason)
        return None
    except Exception as error:  # JSON, a missing field, a wrong type
        reason = f"its record {record_path.name} is corrupt or truncated ({type(error).__name__}: {error})"
        cache_files.warn_once(_INSTALLED_NAME, PACKAGED, reason)
        return None
    if recorded[0] != digest():
        LOG.info("ignoring %s: built from another executor.cc", PACKAGED)
        return None
    try:
        return _load(PACKAGED, recorded[1], recorded[2], owned=False)
    except cache_files.UnsafeCache as error:
        cache_files.warn_once(_INSTALLED_NAME, PACKAGED, error.reason)
    except Exception as error:  # it matched its record, yet fails to load or to answer
        cache_files.warn_once(_INSTALLED_NAME, PACKAGED, f"it failed to load ({type(error).__name__}: {error})")
    return None


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
    try:
        return _load(target, recorded[1], recorded[2])
    except cache_files.UnsafeCache as error:
        cache_files.warn_once(_CACHE_NAME, target, error.reason)
    except Exception as error:  # it matched its sidecar, yet fails to load: rebuilt and rewritten
        cache_files.warn_once(_CACHE_NAME, target, f"it failed to load ({type(error).__name__}: {error})")
    return None


def _build_cached(target: Path) -> tuple[Path, int, str]:
    """Build ``target`` (its lock held) and record its size and sha256 beside it."""
    cache_files.clear_way(target)  # a folder planted at the name would refuse the build's rename for good
    build(target)
    return record(target)


@contextlib.contextmanager
def _private_build() -> Iterator[tuple[Path, int, str]]:
    """The library built into a private temporary folder, removed afterwards (a loaded library
    stays mapped): what a process does when the cache cannot be trusted."""
    with tempfile.TemporaryDirectory(prefix="mhc-native-") as scratch:
        built = build(Path(scratch, "libmhc_host.so"))
        yield (built, *cache_files.file_digest(built))


def main(argv: list[str] | None = None) -> int:
    """``python3 -m mhc_core.host.binaries.native [TARGET]``: build the library beside its source (what the
    wheel build and a GPU host without a compiler need), or into TARGET, with its record."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else PACKAGED
    print(record(build(target))[0])
    return 0
