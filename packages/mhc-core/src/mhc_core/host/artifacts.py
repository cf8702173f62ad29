"""Shipped kernels: the full key of a compiled kernel, the manifests naming the exported ones, and
loading one without compiling.

A kernel's **key** is everything its binary depends on: the kernel class (``package.module:Class``),
its config, the arch, the DSL release, the calling convention and a hash of the source of every
project module the kernel's module imports, transitively (read as text: nothing is imported).
Its **symbol**, ``mhc_<hash of the key>``, names it in the shared library it is exported to.

A kernel compiled on this host (a configuration no wheel ships) is exported the same way into the
on-disk cache, one library per key (``<cache>/kernels/<arch>/<symbol>.so`` with its key and
signature beside it), and the next process loads it. The cache is ``MHC_CACHE_DIR``, else
``$XDG_CACHE_HOME/mhc`` or ``~/.cache/mhc`` (``mhc_core.host.native.cache_root``); exporting
needs a C compiler (``cc``) to link: without one nothing is persisted.

``tools.export_kernels`` writes, per model package and arch, ``<package>/kernels/<arch>/`` with
one ``lib<package>_<arch>.so`` (every preset kernel of that arch, TVM-FFI entry points only) and a
``manifest.json`` listing each kernel's key, symbol and signature (what the host binds its
arguments by: ``mhc_core.device.signature.to_json``), and per kernel module the modules its source
hash covers (``sources``: a process whose sources match them hashes texts, parses none).
``lookup`` finds a key in the manifests of the installed model packages; ``load`` opens the library
through ``tvm_ffi`` alone. Loading needs the DSL's runtime library (``libcute_dsl_runtime.so``, in
the DSL's libs package), which ``load`` maps first, and never the compiler. A different DSL
release, arch, convention or source is a different key: a stale or foreign library is never loaded.

DSL release: ``importlib.metadata`` of ``nvidia-cutlass-dsl``, else of the libs package that owns
the runtime library (``nvidia-cutlass-dsl-libs-cu13`` / ``-cu12``: what an unpacked bundle or a
runtime-only host has), else ``"unknown"`` (then nothing shipped matches).
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..device.kernel import KernelSpec
from ..device.signature import Signature, from_json, to_json

#: The packages whose modules enter a kernel's source hash.
PROJECT_PACKAGES = ("mhc_core", "mhc_dsv41", "mhc_glm5")
#: The model packages whose ``kernels/`` folders are searched.
MODEL_PACKAGES = ("mhc_dsv41", "mhc_glm5")
MANIFEST = "manifest.json"
#: 2: every kernel's entry carries its signature (1: keys only).
FORMAT = 2
#: Set to 0 to ignore shipped and cached kernels (every kernel is then compiled, nothing persisted).
PREBUILT_ENV = "MHC_PREBUILT"
LOG = logging.getLogger("mhc")
_DSL_DISTRIBUTIONS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12")


@functools.cache
def dsl_release() -> str:
    """The DSL release (see the module docstring)."""
    for distribution in _DSL_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@dataclass(frozen=True)
class KernelKey:
    kernel: str
    config: str
    arch: str
    dsl: str
    convention: str
    source: str

    @property
    def symbol(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return "mhc_" + hashlib.sha256(text.encode()).hexdigest()[:24]

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def config_text(config: Any) -> str:
    """A config dataclass (or a dict, or a plain value: a test kernel's) as canonical JSON (tuples as lists)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return json.dumps(dataclasses.asdict(config), sort_keys=True)
    return json.dumps(dict(config) if isinstance(config, dict) else config, sort_keys=True, default=repr)


def _module_file(module: str) -> Path | None:
    """The source file of ``module``, found without executing any module (a kernel module imports
    the DSL: hashing its source must not). None for an attribute imported from a module."""
    import importlib.machinery

    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return None  # ``part`` names something inside a module, not a module
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks: never run, so never part of a kernel (a
    model package's ``__init__`` names its op there, and through it the whole host side)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for statement in node.body:
                skipped.update(id(inner) for inner in ast.walk(statement))
    return skipped


@functools.cache
def _module_source(module: str) -> tuple[bytes, tuple[str, ...]] | None:
    """``module``'s text and project imports, read and parsed once per process (the kernels of one
    op share most of their device modules). None for an attribute imported from a module."""
    path = _module_file(module)
    if path is None:
        return None
    text = path.read_bytes()
    return text, tuple(_imports(module, path, text))


def _imports(module: str, path: Path, text: bytes) -> Iterator[str]:
    """The project modules ``module`` (``text``, at ``path``) imports when it runs, as absolute
    names (function-local imports included; ``if TYPE_CHECKING:`` blocks not)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(text, str(path))
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PROJECT_PACKAGES:
                yield name


def hashed_sources(module: str) -> dict[str, bytes]:
    """``module`` and every project module it imports when it runs, transitively: name -> text
    (what its ``source_hash`` covers)."""
    seen: dict[str, bytes] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        found = _module_source(name)
        if found is None:
            continue
        seen[name], imports = found
        pending.extend(imports)
    return seen


def _digest(texts: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(texts):
        digest.update(name.encode() + b"\0" + texts[name] + b"\0")
    return digest.hexdigest()


def _texts(modules: Iterable[str]) -> dict[str, bytes] | None:
    """The texts of ``modules`` as they are now (None once one is gone): read, not parsed."""
    texts = {}
    for name in modules:
        path = _module_file(name)
        if path is None:
            return None
        texts[name] = path.read_bytes()
    return texts


@functools.cache
def source_hash(module: str) -> str:
    """sha256 over the text of ``module`` and every project module it imports, transitively.

    A manifest records, per kernel module, the modules its hash covered (``sources``). Their texts
    alone decide which modules the walk reaches (each module's imports are read from its own
    text), so when those texts hash to the recorded digest the walk would reach the same modules
    and give that digest: it is returned without parsing anything (parsing ~30 modules was most of
    a preset op's construction: 0.1 s on the H200 host). Any changed text misses, and the walk runs."""
    for modules, recorded in _recorded_sources().get(module, ()):
        texts = _texts(modules)
        if texts is not None and _digest(texts) == recorded:
            return recorded
    return _digest(hashed_sources(module))


def kernel_key(kernel: Any, arch: str, convention: str) -> KernelKey:
    """The key of ``kernel`` (a ``KernelSpec``, or a ``DeviceKernel``: its class and config) on
    ``arch``, computed without importing the kernel's module."""
    spec = KernelSpec.of(kernel)
    module = spec.path.partition(":")[0]
    return KernelKey(spec.path, config_text(spec.config), arch, dsl_release(), convention, source_hash(module))


@dataclass(frozen=True)
class Found:
    """A kernel's library (shipped or cached) and its signature."""

    library: Path
    signature: Signature


# ------------------------------------------------------------------ manifests
def write_manifest(
    folder: Path, package: str, arch: str, library: str, kernels: Iterable[tuple[KernelKey, Signature]]
) -> Path:
    entries = sorted(
        (key.as_dict() | {"symbol": key.symbol, "signature": to_json(signature)} for key, signature in kernels),
        key=lambda entry: entry["symbol"],
    )
    modules = sorted({entry["kernel"].partition(":")[0] for entry in entries})
    sources = {}
    for module in modules:
        texts = hashed_sources(module)
        sources[module] = {"digest": _digest(texts), "modules": sorted(texts)}
    payload = {
        "format": FORMAT, "package": package, "arch": arch, "library": library, "kernels": entries, "sources": sources
    }  # fmt: skip
    path = folder / MANIFEST
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def manifests() -> list[Path]:
    """Every ``kernels/<arch>/manifest.json`` of the importable model packages (none imported)."""
    found = []
    for package in MODEL_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            found.extend(sorted(Path(location, "kernels").glob(f"*/{MANIFEST}")))
    return found


@functools.cache
def _payloads() -> tuple[tuple[Path, dict[str, Any]], ...]:
    """Every manifest of this format, read once per process."""
    read = ((path, json.loads(path.read_text())) for path in manifests())
    return tuple((path, payload) for path, payload in read if payload.get("format") == FORMAT)


def read_manifest(path: Path) -> dict[str, Found]:
    """symbol -> library and signature of one manifest ({} for another format)."""
    payload = json.loads(path.read_text())
    return _entries(path, payload) if payload.get("format") == FORMAT else {}


def _entries(path: Path, payload: dict[str, Any]) -> dict[str, Found]:
    library = path.parent / payload["library"]
    return {entry["symbol"]: Found(library, from_json(entry["signature"])) for entry in payload["kernels"]}


@functools.cache
def _index() -> dict[str, Found]:
    """symbol -> library and signature over every manifest."""
    index: dict[str, Found] = {}
    for path, payload in _payloads():
        index.update(_entries(path, payload))
    return index


@functools.cache
def _recorded_sources() -> dict[str, list[tuple[tuple[str, ...], str]]]:
    """kernel module -> (modules its hash covered, digest), from every manifest that records them."""
    recorded: dict[str, list[tuple[tuple[str, ...], str]]] = {}
    for _, payload in _payloads():
        for module, source in payload.get("sources", {}).items():
            entry = (tuple(source["modules"]), source["digest"])
            if entry not in recorded.setdefault(module, []):
                recorded[module].append(entry)
    return recorded


def lookup(key: KernelKey) -> Found | None:
    """The library that exports ``key``'s kernel (and its signature), or None (then it is compiled)."""
    if os.environ.get(PREBUILT_ENV, "1") == "0":
        return None
    return _index().get(key.symbol)


def cache_dir() -> Path | None:
    """The on-disk kernel cache, or None: off (``MHC_PREBUILT=0``)."""
    if os.environ.get(PREBUILT_ENV, "1") == "0":
        return None
    from .native import cache_root

    return cache_root() / "kernels"


def cached(key: KernelKey) -> Found | None:
    """The on-disk cache's library for ``key``, if a process on this host compiled it before."""
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / key.arch / f"{key.symbol}.so"
    sidecar = path.with_suffix(".json")
    if not (path.exists() and sidecar.exists()):
        return None
    entry = json.loads(sidecar.read_text())
    if entry.get("format") != FORMAT or entry.get("symbol") != key.symbol:
        return None
    return Found(path, from_json(entry["signature"]))


@functools.cache
def link_flags() -> tuple[str, ...]:
    """What exported objects link against: the DSL runtime (and its TVM-FFI glue), then TVM-FFI.
    Asked once per process: each query is a Python process that imports the DSL (seconds)."""
    import subprocess
    import sys

    dsl = [sys.executable, "-m", "cutlass.cute.export.aot_config", "--ldflags", "--libs", "--with-tvm-ffi"]
    tvm = [sys.executable, "-m", "tvm_ffi.config", "--ldflags", "--libs"]
    flags = subprocess.run(dsl, capture_output=True, text=True, check=True).stdout.split()
    flags += subprocess.run(tvm, capture_output=True, text=True, check=True).stdout.split()
    return tuple(dict.fromkeys(flags))


def link(objects: list[str], target: Path) -> None:
    """Link exported objects into the shared library ``target`` (``cc``)."""
    import subprocess

    subprocess.run(["cc", "-shared", "-o", str(target), *objects, *link_flags()], check=True, capture_output=True)


@functools.cache
def load_runtime_globally() -> None:
    """Exporting JIT-links the object in this process; on a cross-compile no engine loaded the DSL's
    runtime, so it is loaded globally first (docs/aot-export.md). Needs the DSL compiler."""
    from cutlass.runtime import find_runtime_libraries

    for path in find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def persist(key: KernelKey, compiled: Any, signature: Signature) -> Path | None:
    """Export a kernel compiled here into the on-disk cache; the library's path, or None where it
    cannot be (no ``cc``, a read-only cache, ``MHC_PREBUILT=0``)."""
    import shutil
    import tempfile

    root = cache_dir()
    if root is None or shutil.which("cc") is None:
        return None
    folder = root / key.arch
    try:
        load_runtime_globally()
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="mhc-cache-", dir=folder) as scratch:
            obj = str(Path(scratch, f"{key.symbol}.o"))
            compiled.export_to_c(obj, function_name=key.symbol, export_only_tvm_ffi_symbols=True)
            partial = Path(scratch, f"{key.symbol}.so")
            link([obj], partial)
            target = folder / f"{key.symbol}.so"
            os.replace(partial, target)  # atomic: a concurrent process sees all of it or nothing
        entry = key.as_dict() | {"format": FORMAT, "symbol": key.symbol, "signature": to_json(signature)}
        sidecar = Path(str(target.with_suffix(".json")) + ".partial")
        sidecar.write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
        os.replace(sidecar, target.with_suffix(".json"))  # last: a library without it is never loaded
        return target
    except Exception as error:  # the DSL's export errors share no base class; caching is optional
        LOG.warning("could not cache %s in %s: %s", key.kernel, folder, error)
        return None


def runtime_library() -> Path | None:
    """The DSL's runtime library, located without importing the DSL (the newest CUDA flavour)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for flavour in ("cu13", "cu12"):
        for location in spec.submodule_search_locations:
            path = Path(location, flavour, "lib", "libcute_dsl_runtime.so")
            if path.exists():
                return path
    return None


@functools.cache
def _module(library: Path) -> Any:
    runtime = runtime_library()
    if runtime is not None:
        # Satisfies the library's NEEDED entry by soname; libtvm_ffi is global once tvm_ffi is imported.
        ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
    import tvm_ffi

    return tvm_ffi.load_module(str(library))


def load(key: KernelKey, library: Path) -> Any:
    """``key``'s TVM-FFI entry point from ``library`` (no compile, no DSL compiler import)."""
    return _module(library)[key.symbol]
