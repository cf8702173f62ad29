"""Loading a shared library as the very bytes whose size and sha256 were checked.

Checking a file by its path and then handing the path to ``dlopen`` leaves a window: the file can
be replaced in between, and the replacement's constructor runs. So the file is opened once (a
cache file never through a symbolic link), its size and sha256 are computed from that descriptor,
and the loader is given ``/proc/self/fd/N``: the same open file, whatever the path names by then.

The descriptor stays open for the life of the process: the dynamic loader answers a ``dlopen`` of a
name it has loaded before with that library, so a number reused for another file would load the
first one again. A successful check is remembered per process and file (path, size, sha256): a
large shipped library is hashed once per process, as before, and loading it later reuses the
descriptor. A writer of that very file (its owner: the user, for the cache) could still change it
in place; nobody else can.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from . import cache_files

#: (path, size, sha256, owned) -> the descriptor that was checked, kept open (see the docstring).
_CHECKED: dict[tuple[str, int, str, bool], int] = {}
#: descriptor -> its loaded TVM-FFI module (kept alive, as ``tvm_ffi.load_module`` keeps its own).
_LOADED: dict[int, Any] = {}
_LOCK = threading.Lock()


def checked(path: Path, size: int | None, sha256: str | None, *, owned: bool) -> int:
    """A descriptor of ``path`` whose bytes are ``size`` long and hash to ``sha256``; raises
    ``cache_files.UnsafeCache`` naming why not (no record at all included). ``owned``: a cache file
    (this user's alone, no link followed), else an installed one."""
    if size is None or sha256 is None:
        raise cache_files.UnsafeCache(path, "no size and sha256 of it were recorded: it is not loaded")
    key = (str(path), size, sha256, owned)
    with _LOCK:
        descriptor = _CHECKED.get(key)
        if descriptor is not None:
            return descriptor
        try:
            descriptor = cache_files.open_checked(path, owned=owned)
        except OSError as error:
            raise cache_files.UnsafeCache(path, f"it cannot be read ({error.strerror or error})") from None
        try:
            problem = cache_files.digest_problem(cache_files.digest_of(descriptor), size, sha256)
        except OSError as error:
            problem = f"it cannot be read ({error.strerror or error})"
        if problem is not None:
            os.close(descriptor)
            raise cache_files.UnsafeCache(path, problem)
        _CHECKED[key] = descriptor
        return descriptor


def load(path: Path, size: int | None, sha256: str | None, *, owned: bool) -> Any:
    """The TVM-FFI module of the library at ``path``, loaded from the descriptor ``checked`` vouches
    for (``tvm_ffi.load_module`` takes a name ending in ``.so``: its loader for that format is
    called with ``/proc/self/fd/N`` directly)."""
    descriptor = checked(path, size, sha256, owned=owned)
    with _LOCK:
        module = _LOADED.get(descriptor)
        if module is None:
            import tvm_ffi

            loader = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")
            module = _LOADED[descriptor] = loader(f"/proc/self/fd/{descriptor}", "so")
    return module
