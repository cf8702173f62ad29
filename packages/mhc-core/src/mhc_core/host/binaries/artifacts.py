"""Shipped kernels: the full key of a compiled kernel, the manifests naming the exported ones, and
loading one without compiling.

A kernel's **key** is everything its binary depends on: the kernel class (``package.module:Class``),
its config, the arch, the DSL release, the calling convention and a hash of the code of every
project module the kernel's module imports, transitively (parsed: nothing is imported). The hash
covers each module's normal form, its syntax tree without docstrings (``source_form``): comments,
docstrings and formatting do not change a key, so a harmless edit of an installed module keeps its
shipped kernels; any change of code does, and the warning (or the error of a host without the
compiler) names the modules whose code changed since the kernels were built (``changed_sources``).
Its **symbol**, ``mhc_<hash of the key>``, names it in the shared library it is exported to.

A kernel compiled on this host (a configuration no wheel ships) is exported the same way into the
on-disk cache, one library per key (``<cache>/kernels/<arch>/<symbol>.so``, with a sidecar
``<symbol>.json`` holding its key, signature, size and sha256), and the next process loads it. The
cache is ``MHC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mhc`` or ``~/.cache/mhc``
(``mhc_core.host.binaries.native.cache_root``); exporting needs a C compiler (``cc``) to link: without one
nothing is persisted.

The cache is one that eight ranks and a shared machine can trust (``mhc_core.host.binaries.cache_files``):
its folders are created 0700 and used only while this user owns them and nobody else can write
them or swap a folder above them, its files likewise and never through a symbolic link; every file
is written under a unique temporary name and renamed into place; a library's size and sha256 are
compared with its sidecar on the descriptor ``dlopen`` then maps (``mhc_core.host.binaries.verified``); a
lock per kernel (``<symbol>.lock``) lets the ranks that miss a kernel compile it once
(``compiler.compile_kernel``): the others wait, then load it; a holder stuck longer than
``MHC_CACHE_LOCK_TIMEOUT_S`` is named, and the waiter compiles for itself without persisting. A
corrupt, truncated or foreign sidecar or library is skipped with one warning naming it, then
compiled again and rewritten (without the compiler: an error naming it); an unsafe cache is not
used (one warning says why): kernels are then compiled in the process and not persisted.

``tools.export_kernels`` writes, per model package and arch, ``<package>/kernels/<arch>/`` with
one ``lib<package>_<arch>.so`` (every preset kernel of that arch, TVM-FFI entry points only) and a
``manifest.json`` listing each kernel's key, symbol and signature (what the host binds its
arguments by: ``mhc_core.device.signature.to_json``), the library's size and sha256 (checked once
per process, on the descriptor that is then loaded; a manifest without them, from before they
were recorded, loads nothing: its kernels are compiled), and per kernel module the modules its
source hash covers (``sources``: their names, each one's normal form's and raw text's sha256; a
process whose texts match them parses none).
``lookup`` finds a key in the manifests of the installed model packages; a manifest that does not
parse or validate, or of a format this mhc-core does not read, is skipped with one warning naming
it, and the other packages' manifests still count. ``load`` opens the library through
``tvm_ffi`` alone. Loading needs the DSL's runtime library (``libcute_dsl_runtime.so``, in
the DSL's libs package), which ``load`` maps first, and never the compiler. A different DSL
release, arch, convention or source is a different key: a stale or foreign library is never loaded.

DSL release: ``importlib.metadata`` of ``nvidia-cutlass-dsl``, else of the libs package that owns
the runtime library (``nvidia-cutlass-dsl-libs-cu13`` / ``-cu12``: what an unpacked bundle or a
runtime-only host has), else ``"unknown"`` (then nothing shipped matches).
"""

from __future__ import annotations

import ast
import contextlib
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

from ... import registry
from ...device.kernel import KernelSpec
from ...device.signature import Signature, from_json, to_json
from . import cache_files, verified
from .source_form import normal_form


def model_packages() -> tuple[str, ...]:
    """The model packages whose ``kernels/`` folders are searched: the registered ones (``mhc_core.registry``)."""
    return registry.packages()


def project_packages() -> tuple[str, ...]:
    """The packages whose modules enter a kernel's source hash: mhc-core and the model packages."""
    return ("mhc_core", *model_packages())


MANIFEST = "manifest.json"
#: 2: every kernel's entry carries its signature (1: keys only); the library's ``size`` and
#: ``sha256`` are fields of format 2 an older mhc-core ignores; this one loads nothing without them.
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
        text = json.dumps(self.as_dict(), sort_keys=True)
        return "mhc_" + hashlib.sha256(text.encode()).hexdigest()[:24]

    def as_dict(self) -> dict[str, str]:
        # dataclasses.asdict's answer for these str fields, without its deep copy: a manifest check
        # computes 72 symbols, and asdict was most of their time
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


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
def _module_source(module: str) -> tuple[bytes, tuple[str, ...], str] | None:
    """``module``'s normal form, project imports and raw text's sha256, read and parsed once per
    process (the kernels of one op share most of their device modules). None for an attribute
    imported from a module."""
    path = _module_file(module)
    if path is None:
        return None
    text = path.read_bytes()
    tree = ast.parse(text, str(path))
    imports = tuple(_imports(module, path, tree))
    return normal_form(tree), imports, hashlib.sha256(text).hexdigest()


def _imports(module: str, path: Path, tree: ast.AST) -> Iterator[str]:
    """The project modules ``module`` (parsed into ``tree``, from ``path``) imports when it runs, as
    absolute names (function-local imports included; ``if TYPE_CHECKING:`` blocks not)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
        project = project_packages()
        for name in names:
            if name.split(".")[0] in project:
                yield name


def hashed_sources(module: str) -> dict[str, bytes]:
    """``module`` and every project module it imports when it runs, transitively: name -> normal
    form (what its ``source_hash`` covers)."""
    seen: dict[str, bytes] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        found = _module_source(name)
        if found is None:
            continue
        seen[name], imports, _ = found
        pending.extend(imports)
    return seen


def _digest(forms: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(forms):
        digest.update(name.encode() + b"\0" + forms[name] + b"\0")
    return digest.hexdigest()


def _text_digests(modules: Iterable[str]) -> dict[str, str] | None:
    """The sha256 of the raw text of each of ``modules`` as it is now (None once one is gone): read,
    not parsed."""
    digests = {}
    for name in modules:
        path = _module_file(name)
        if path is None:
            return None
        try:
            digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return None
    return digests


@functools.cache
def source_hash(module: str) -> str:
    """sha256 over the normal form of ``module`` and of every project module it imports, transitively.

    A manifest records, per kernel module, the modules its hash covered and each one's raw text's
    sha256 (``sources``). Their texts alone decide which modules the walk reaches and what it
    hashes, so when every text is as recorded the walk would give the recorded digest: it is
    returned without parsing anything (parsing ~30 modules was most of a preset op's construction:
    0.1 s on the H200 host). A text that changed (a comment added, say) misses, and the walk runs:
    if only comments, docstrings or formatting changed, it gives the recorded digest all the same."""
    for recorded in _recorded_sources().get(module, ()):
        if recorded.texts and _text_digests(recorded.modules) == recorded.texts:
            return recorded.digest
    return _digest(hashed_sources(module))


def changed_sources(module: str) -> list[str]:
    """The project modules whose code changed since the installed kernels of kernel module ``module``
    were built, each with what happened (``changed``, ``new``, ``gone``); [] when their code is as
    recorded, or no manifest records it (comments, docstrings and formatting are no change)."""
    recorded = [entry for entry in _recorded_sources().get(module, ()) if entry.forms]
    if not recorded or any(entry.digest == source_hash(module) for entry in recorded):
        return []
    now = {name: hashlib.sha256(form).hexdigest() for name, form in hashed_sources(module).items()}
    then = recorded[0].forms
    changes = [f"{name} (changed)" for name in sorted(now.keys() & then.keys()) if now[name] != then[name]]
    changes += [f"{name} (new)" for name in sorted(now.keys() - then.keys())]
    changes += [f"{name} (gone)" for name in sorted(then.keys() - now.keys())]
    return changes


def kernel_key(kernel: Any, arch: str, convention: str) -> KernelKey:
    """The key of ``kernel`` (a ``KernelSpec``, or a ``DeviceKernel``: its class and config) on
    ``arch``, computed without importing the kernel's module."""
    spec = KernelSpec.of(kernel)
    module = spec.path.partition(":")[0]
    return KernelKey(spec.path, config_text(spec.config), arch, dsl_release(), convention, source_hash(module))


@dataclass(frozen=True)
class Found:
    """A kernel's library (shipped or cached), its signature, and the library's size and sha256 as
    recorded when it was written (None: a manifest from before they were recorded: not loaded).
    ``cached``: a file of the on-disk cache (this user's alone), else an installed one."""

    library: Path
    signature: Signature
    size: int | None = None
    sha256: str | None = None
    cached: bool = False


class _Invalid(ValueError):
    """A manifest or sidecar that parses but is not what this mhc-core writes."""


#: symbol -> the file skipped for it and why: named by the error of a host that cannot compile.
_SKIPPED: dict[str, str] = {}


def _skip(key: KernelKey, what: str, path: Path, reason: str) -> None:
    """One warning naming ``path`` and why it is not used; the kernel is then compiled."""
    cache_files.warn_once(what, path, reason)
    _SKIPPED[key.symbol] = f"{path} ({reason})"


def skipped(key: KernelKey) -> str | None:
    """The file this process skipped for ``key`` and why, if any."""
    return _SKIPPED.get(key.symbol)


def enabled() -> bool:
    """Shipped and cached kernels are used: ``MHC_PREBUILT`` unset or 1 (0: compile every kernel);
    any other value raises (``false`` or ``no`` would otherwise mean the opposite of what they say)."""
    raw = os.environ.get(PREBUILT_ENV, "").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"{PREBUILT_ENV}: expected 0 (compile every kernel) or 1 (the default), got {raw!r}")
    return raw == "1"


# ------------------------------------------------------------------ manifests
def write_manifest(
    folder: Path, package: str, arch: str, library: str, kernels: Iterable[tuple[KernelKey, Signature]]
) -> Path:
    """``folder/manifest.json`` for ``library`` (in ``folder``, linked already: its size and sha256
    are recorded and checked before it is loaded)."""
    entries = sorted(
        (key.as_dict() | {"symbol": key.symbol, "signature": to_json(signature)} for key, signature in kernels),
        key=lambda entry: entry["symbol"],
    )
    modules = sorted({entry["kernel"].partition(":")[0] for entry in entries})
    sources = {}
    for module in modules:
        forms = hashed_sources(module)
        sources[module] = {
            "digest": _digest(forms),
            "modules": sorted(forms),
            "forms": {name: hashlib.sha256(form).hexdigest() for name, form in sorted(forms.items())},
            "texts": _text_digests(sorted(forms)),
        }
    size, sha256 = cache_files.file_digest(folder / library)
    payload = {
        "format": FORMAT, "package": package, "arch": arch, "library": library, "size": size, "sha256": sha256,
        "kernels": entries, "sources": sources,
    }  # fmt: skip
    path = folder / MANIFEST
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def manifests() -> list[Path]:
    """Every ``kernels/<arch>/manifest.json`` of the importable model packages (none imported)."""
    found = []
    for package in model_packages():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            found.extend(sorted(Path(location, "kernels").glob(f"*/{MANIFEST}")))
    return found


def _check_manifest(path: Path, payload: Any) -> dict[str, Found]:
    """``payload``'s entries (symbol -> ``Found``), each signature parsed once; ValueError unless it
    (of this format) has what they and ``_recorded_sources`` read, each entry's symbol naming its key."""
    if not isinstance(payload.get("library"), str) or Path(payload["library"]).name != payload["library"]:
        raise _Invalid("its library is not a file name")
    size, sha256 = payload.get("size"), payload.get("sha256")
    if (size is None) != (sha256 is None) or (size is not None and not _is_digest(size, sha256)):
        raise _Invalid("its library's size and sha256 are malformed")
    if not isinstance(payload.get("kernels"), list):
        raise _Invalid("it has no list of kernels")
    library, entries = path.parent / payload["library"], {}
    for entry in payload["kernels"]:
        key = KernelKey(**{name: entry[name] for name in KernelKey.__dataclass_fields__})
        if entry["symbol"] != key.symbol:
            raise _Invalid(f"the entry {entry['symbol']!r} does not name its key")
        entries[key.symbol] = Found(library, from_json(entry["signature"]), size, sha256)
    sources = payload.get("sources", {})
    if not isinstance(sources, dict):
        raise _Invalid("its sources are not a mapping")
    projects = project_packages()
    is_module = functools.partial(_is_module, projects=projects)
    for module, source in sources.items():
        if not (is_module(module) and isinstance(source["digest"], str) and all(map(is_module, source["modules"]))):
            raise _Invalid(f"its sources of {module!r} are malformed")
        for field in ("forms", "texts"):  # optional: manifests before issue #34 have neither
            digests = source.get(field, {})
            if not (isinstance(digests, dict) and all(map(is_module, digests))):
                raise _Invalid(f"its sources' {field} of {module!r} are malformed")
            if not all(isinstance(value, str) and len(value) == 64 for value in digests.values()):
                raise _Invalid(f"its sources' {field} of {module!r} are malformed")
    return entries


def _is_digest(size: Any, sha256: Any) -> bool:
    return isinstance(size, int) and size >= 0 and isinstance(sha256, str) and len(sha256) == 64


def _is_module(name: Any, projects: tuple[str, ...]) -> bool:
    """A dotted name in one of ``projects`` (``project_packages()``: what a manifest's ``sources`` may name)."""
    parts = name.split(".") if isinstance(name, str) else []
    return bool(parts) and parts[0] in projects and all(part.isidentifier() for part in parts)


@dataclass(frozen=True)
class Manifest:
    """One valid manifest: what it holds, and its entries (symbol -> ``Found``)."""

    payload: dict[str, Any]
    entries: dict[str, Found]


def _read(path: Path) -> Manifest | None:
    """``path``'s manifest if it is one of this format (another format: None, as before);
    a corrupt, truncated or foreign one: None, with one warning naming it."""
    try:
        payload = json.loads(path.read_bytes())
        if not isinstance(payload, dict) or "format" not in payload:
            raise _Invalid("it is not a manifest")
        if payload["format"] != FORMAT:
            raise _Invalid(f"it has format {payload['format']!r}; this mhc-core reads format {FORMAT}")
        entries = _check_manifest(path, payload)
    except FileNotFoundError:
        return None
    except Exception as error:  # JSON, a missing field, a wrong type: skip this package's manifest alone
        cache_files.warn_once("the manifest", path, _reason(error))
        return None
    return Manifest(payload, entries)


def _reason(error: Exception) -> str:
    """Why a manifest or sidecar is skipped, for its warning."""
    if isinstance(error, _Invalid):
        return str(error)
    if isinstance(error, OSError):
        return f"it cannot be read ({error.strerror or error})"
    return f"it is corrupt or truncated ({type(error).__name__}: {error})"


@functools.cache
def _manifests() -> tuple[Manifest, ...]:
    """Every valid manifest of this format, read and checked once per process (a broken one is
    skipped with a warning: another package's still count)."""
    read = (_read(path) for path in manifests())
    return tuple(manifest for manifest in read if manifest is not None)


def read_manifest(path: Path) -> dict[str, Found]:
    """symbol -> library and signature of one manifest ({} for another format or a broken one)."""
    manifest = _read(path)
    return manifest.entries if manifest is not None else {}


@functools.cache
def _index() -> dict[str, Found]:
    """symbol -> library and signature over every manifest."""
    index: dict[str, Found] = {}
    for manifest in _manifests():
        index.update(manifest.entries)
    return index


@dataclass(frozen=True)
class RecordedSources:
    """What a manifest recorded of one kernel module's source hash: the digest, the modules it
    covered, and per module the sha256 of its normal form (``forms``) and raw text (``texts``)."""

    digest: str
    modules: tuple[str, ...]
    forms: dict[str, str]
    texts: dict[str, str]


@functools.cache
def _recorded_sources() -> dict[str, list[RecordedSources]]:
    """kernel module -> what each manifest that records it recorded (``RecordedSources``)."""
    recorded: dict[str, list[RecordedSources]] = {}
    for manifest in _manifests():
        for module, source in manifest.payload.get("sources", {}).items():
            entry = RecordedSources(
                source["digest"], tuple(source["modules"]), dict(source.get("forms", {})), dict(source.get("texts", {}))
            )
            if entry not in recorded.setdefault(module, []):
                recorded[module].append(entry)
    return recorded


def lookup(key: KernelKey) -> Found | None:
    """The library that exports ``key``'s kernel (and its signature), or None (then it is compiled).
    The library is checked against its manifest's size and sha256 (once per process: ``verified``)."""
    if not enabled():
        return None
    found = _index().get(key.symbol)
    if found is None:
        return None
    if found.size is None or found.sha256 is None:
        reason = "its manifest records no size and sha256 of it (export the kernels again): it is not loaded"
        _skip(key, "the shipped kernels", found.library, reason)
        return None
    try:
        verified.checked(found.library, found.size, found.sha256, owned=False)
    except cache_files.UnsafeCache as error:
        _skip(key, "the shipped kernels", found.library, error.reason)
        return None
    return found


# ------------------------------------------------------------------ the on-disk cache
#: A cache entry's sidecar (``<symbol>.json``). 3: records the library's size and sha256.
CACHE_FORMAT = 3
_CACHE_NAME = "the kernel cache"


def cache_dir() -> Path | None:
    """The on-disk kernel cache, or None: off (``MHC_PREBUILT=0``)."""
    if not enabled():
        return None
    from .native import cache_root

    return cache_root() / "kernels"


def _folder(arch: str, *, create: bool) -> Path | None:
    """``<cache>/kernels/<arch>`` once every folder down to it is this user's alone (made 0700 where
    ``create``), else None: off, missing (not ``create``), or not safe to use (one warning says why)."""
    root = cache_dir()
    if root is None:
        return None
    try:
        return cache_files.private_folder(root.parent, root.name, arch, create=create)
    except FileNotFoundError:
        return None
    except cache_files.UnsafeCache as error:
        cache_files.warn_once(_CACHE_NAME, error.path, error.reason)
    except OSError as error:
        cache_files.warn_once(_CACHE_NAME, root, error.strerror or str(error))
    return None


class _Stale(Exception):
    """A sidecar of another format: an older mhc-core's, rewritten without a warning."""


def cached(key: KernelKey) -> Found | None:
    """The on-disk cache's library for ``key``, if a process on this host compiled it before and
    it is still what that process wrote. Anything else (a corrupt, truncated or foreign sidecar or
    library, a file someone else owns or can write, a link): one warning, None (then it is compiled
    and the entry rewritten)."""
    folder = _folder(key.arch, create=False)
    if folder is None:
        return None
    library = folder / f"{key.symbol}.so"
    sidecar = library.with_suffix(".json")
    try:
        found = _sidecar_entry(key, library, json.loads(cache_files.read_owned(sidecar)))
    except FileNotFoundError:
        return None
    except cache_files.UnsafeCache as error:
        _skip(key, _CACHE_NAME, sidecar, error.reason)
        return None
    except _Stale as stale:
        LOG.info("recompiling %s: %s was written by another mhc-core (%s)", key.kernel, sidecar, stale)
        return None
    except Exception as error:  # JSON, a missing field, a wrong type
        _skip(key, _CACHE_NAME, sidecar, _reason(error))
        return None
    try:
        verified.checked(library, found.size, found.sha256, owned=True)
    except cache_files.UnsafeCache as error:
        _skip(key, _CACHE_NAME, library, error.reason)
        return None
    return found


def _sidecar_entry(key: KernelKey, library: Path, entry: Any) -> Found:
    """The ``Found`` a sidecar describes, once it is one of this format for ``key``."""
    if not isinstance(entry, dict):
        raise _Invalid("it is not a cache entry")
    if isinstance(entry.get("format"), int) and entry["format"] != CACHE_FORMAT:
        raise _Stale(f"format {entry['format']}")
    if entry.get("format") != CACHE_FORMAT or entry.get("symbol") != key.symbol:
        raise _Invalid(f"it is not the cache entry of {key.symbol} (format {CACHE_FORMAT})")
    if any(entry.get(name) != value for name, value in key.as_dict().items()):
        raise _Invalid(f"it records another key than {key.symbol}'s")
    if not _is_digest(entry.get("size"), entry.get("sha256")):
        raise _Invalid("it records no size and sha256 of its library")
    return Found(library, from_json(entry["signature"]), entry["size"], entry["sha256"], cached=True)


@contextlib.contextmanager
def cache_lock(key: KernelKey) -> Iterator[bool]:
    """Hold ``key``'s lock in the cache (``<symbol>.lock``): the processes of one host that miss a
    kernel compile it one at a time, and each after the first finds it persisted. Yields whether
    it is held: False where nothing can be persisted (the cache is off or unsafe, no ``cc``), and
    then every process compiles for itself, as without a cache."""
    import shutil

    folder = _folder(key.arch, create=True) if shutil.which("cc") else None
    with contextlib.ExitStack() as stack:
        held = False
        if folder is not None:
            lock = folder / f"{key.symbol}.lock"
            try:
                stack.enter_context(cache_files.exclusive(lock))
                held = True
            except cache_files.UnsafeCache as error:
                cache_files.warn_once(_CACHE_NAME, error.path, error.reason)
            except OSError as error:
                cache_files.warn_once(_CACHE_NAME, lock, error.strerror or str(error))
        yield held


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


#: libc needed by name: a kernel calls nothing in it, and a library that names no libc is one
#: auditwheel cannot place on a platform (it warns and guesses the build host's).
NEEDS_LIBC = ("-Wl,--push-state,--no-as-needed", "-lc", "-Wl,--pop-state")


def link(objects: list[str], target: Path) -> None:
    """Link exported objects into the shared library ``target`` (``cc``)."""
    import subprocess

    command = ["cc", "-shared", "-o", str(target), *objects, *link_flags(), *NEEDS_LIBC]
    subprocess.run(command, check=True, capture_output=True)


@functools.cache
def load_runtime_globally() -> None:
    """Exporting JIT-links the object in this process; on a cross-compile no engine loaded the DSL's
    runtime, so it is loaded globally first (docs/aot-export.md). Needs the DSL compiler."""
    from cutlass.runtime import find_runtime_libraries

    for path in find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def persist(key: KernelKey, compiled: Any, signature: Signature) -> Path | None:
    """Export a kernel compiled here into the on-disk cache (its caller holds ``cache_lock``): the
    library through a private scratch folder, renamed into place, then its sidecar with its key,
    signature, size and sha256 (last: a library without one is never loaded). Its path, or None
    where it cannot be (no ``cc``, an unsafe or read-only cache, ``MHC_PREBUILT=0``)."""
    import shutil

    folder = _folder(key.arch, create=True)
    if folder is None or shutil.which("cc") is None:
        return None
    target = folder / f"{key.symbol}.so"
    try:
        load_runtime_globally()
        with cache_files.scratch(folder, "mhc-cache-") as scratch:  # a unique name, 0700, with our pid
            obj = str(Path(scratch, f"{key.symbol}.o"))
            compiled.export_to_c(obj, function_name=key.symbol, export_only_tvm_ffi_symbols=True)
            partial = Path(scratch, f"{key.symbol}.so")
            link([obj], partial)
            os.chmod(partial, 0o700)  # under a umask of 002 it would be group-writable: never loaded
            size, sha256 = cache_files.file_digest(partial)
            cache_files.clear_way(target)  # a folder there would refuse every rename, for good
            os.replace(partial, target)  # atomic: a concurrent process sees all of it or nothing
        entry = key.as_dict() | {
            "format": CACHE_FORMAT, "symbol": key.symbol, "signature": to_json(signature), "size": size,
            "sha256": sha256,
        }  # fmt: skip
        text = json.dumps(entry, indent=1, sort_keys=True) + "\n"
        cache_files.write_atomic(target.with_suffix(".json"), text.encode())
        return target
    except Exception as error:  # the DSL's export errors share no base class; caching is optional
        LOG.warning("could not cache %s in %s: %s", key.kernel, folder, error)
        return None


#: The DSL runtime's CUDA flavours, newest first, with the CUDA major each needs of the driver.
RUNTIME_FLAVOURS = (("cu13", 13), ("cu12", 12))


class MissingRuntime(RuntimeError):
    """No DSL runtime library this driver can run is installed."""


def driver_cuda_major() -> int | None:
    """The CUDA major version the installed driver supports (``cuDriverGetVersion``), or None where
    there is no driver to ask (a CPU host: then every flavour counts)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if driver.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000


def runtime_libraries() -> dict[str, Path]:
    """flavour -> the DSL's runtime library of every installed flavour, found without importing the DSL."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    found: dict[str, Path] = {}
    for flavour, _ in RUNTIME_FLAVOURS:
        for location in locations:
            path = Path(location, flavour, "lib", "libcute_dsl_runtime.so")
            if path.exists() and flavour not in found:
                found[flavour] = path
    return found


def runtime_library(driver_major: int | None = None) -> Path | None:
    """The DSL's runtime library to load: the newest installed flavour the driver runs (a CUDA 13
    runtime needs a CUDA 13 driver; with cu12 and cu13 both installed a CUDA 12 driver gets cu12).
    ``driver_major`` None: asked of the driver; where none answers, the newest installed."""
    installed = runtime_libraries()
    driver_major = driver_cuda_major() if driver_major is None else driver_major
    for flavour, needs in RUNTIME_FLAVOURS:
        if flavour in installed and (driver_major is None or driver_major >= needs):
            return installed[flavour]
    return None


def missing_runtime_message(driver_major: int | None = None) -> str:
    """What to install when ``runtime_library`` finds none."""
    installed = ", ".join(runtime_libraries()) or "none"
    driver = f"a CUDA {driver_major} driver" if driver_major is not None else "this host"
    extra = "cu13" if driver_major is None or driver_major >= 13 else "cu12"
    return (
        f"the CuTe DSL runtime library (libcute_dsl_runtime.so) that shipped kernels need is not installed "
        f"for {driver} (installed flavours: {installed}): pip install 'mhc-core[{extra}]' "
        "([cu13] for a CUDA 13 driver, [cu12] for a CUDA 12 one)"
    )


@functools.cache
def _module(library: Path, size: int | None = None, sha256: str | None = None, cached: bool = False) -> Any:
    driver_major = driver_cuda_major()
    runtime = runtime_library(driver_major)
    if runtime is None:
        raise MissingRuntime(missing_runtime_message(driver_major))
    # Satisfies the library's NEEDED entry by soname; libtvm_ffi is global once tvm_ffi is imported.
    ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
    import tvm_ffi  # noqa: F401  (its import makes libtvm_ffi global)

    # The descriptor ``lookup`` or ``cached`` checked: what is mapped is what was hashed.
    return verified.load(library, size, sha256, owned=cached)


def load(key: KernelKey, found: Found) -> Any:
    """``key``'s TVM-FFI entry point from ``found``'s library (no compile, no DSL compiler import),
    once its size and sha256 are the recorded ones (see ``verified``)."""
    return _module(found.library, found.size, found.sha256, found.cached)[key.symbol]
