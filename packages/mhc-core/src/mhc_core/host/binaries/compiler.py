"""Compiling kernels: target arch, a cache keyed by everything that changes the binary, ptxas reports.

Kernel classes derive from ``mhc_core.device.kernel.DeviceKernel``: a frozen ``config``
dataclass (all compile-time constants, the arch included where the code depends on it), a
``signature`` (``mhc_core.device.signature``) and a ``@cute.jit __call__``. Compiling
needs no GPU: ``--gpu-arch`` picks the target.

Calling convention: every kernel is compiled for TVM-FFI (``--enable-tvm-ffi``, package
apache-tvm-ffi), whose C entry point checks and packs the arguments and launches; a launch
then costs a few microseconds of host time against 12-19 for the DSL's default path
(BENCHMARKS.md). The kernel's PTX is the same either way: only the host wrapper differs.

An op names its kernels by ``KernelSpec`` (the class's ``module:Class`` path and its config,
plain data): a kernel whose full key an installed model package ships, or an earlier process
cached, is loaded without importing its class or the DSL (``mhc_core.host.binaries.artifacts``); only
another one imports its class and compiles (the DSL compiler, ``mhc-core[jit]``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...constants import ARCH_BY_CAPABILITY, SUPPORTED_ARCHS
from ...device.kernel import DeviceKernel, KernelSpec

__all__ = ["CompileReport", "CompiledKernel", "KernelSpec", "compile_kernel", "device_arch", "kernel_from_spec"]
from ...device.signature import Signature

#: Part of every compile key: how the host calls the compiled function (``mhc_core.host.binaries.launch``).
CALLING_CONVENTION = "tvm-ffi"
COMPILE_OPTIONS = "--enable-tvm-ffi"

#: The project's logger: compile times at INFO, construction (transport, mailbox) at INFO.
LOG = logging.getLogger("mhc")


def device_arch(device: torch.device | int | str | None = None) -> str:
    """The arch string this project compiles for on ``device``. A CPU-only torch, no visible GPU
    or an unsupported arch raise RuntimeError saying which (``mhc_core.host.binaries.support``): an op asks
    this before it touches the device."""
    from .support import require_device

    require_device(device)
    return ARCH_BY_CAPABILITY[tuple(torch.cuda.get_device_capability(device))]


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    return arch


def arch_has_mixed_bf16_fma(arch: str) -> bool:
    """``fma.rn.f32.bf16`` exists from sm_100 on (ptxas rejects it for sm_90a)."""
    return check_arch(arch) != "sm_90a"


def kernel_from_spec(path: str, config: dict[str, Any]) -> DeviceKernel:
    """Instantiate ``"package.module:KernelClass"`` with its config built from ``config``.

    Preset modules list their kernels this way (pure data), so they import
    without the DSL until something is compiled.
    """
    return KernelSpec(path, config).instantiate()


@dataclass(frozen=True)
class CompileReport:
    """ptxas's account of one kernel, for ``nox -s build`` and the PTX tests."""

    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    seconds: float = 0.0


@dataclass
class CompiledKernel:
    """A kernel ready to launch: ``function`` is its TVM-FFI entry point (positional arguments only,
    as ``mhc_core.host.calls.programs`` binds them; None where it cannot run in this process: compiled for
    another arch than the DSL's target, a cross-compile), ``signature`` its parameters. ``kernel``
    and ``compiled`` (the DSL's object) exist for a kernel compiled here, not for one loaded."""

    spec: KernelSpec
    arch: str
    signature: Signature
    compiled: Any = None
    kernel: DeviceKernel | None = None
    ptx: str | None = None
    report: CompileReport = field(default_factory=CompileReport)
    function: Any = None

    def __post_init__(self) -> None:
        if self.function is None:
            # The bare tvm_ffi.Function: the DSL's wrapper adds a keyword-argument layer per call.
            entry = getattr(self.compiled, "__tvm_ffi_object__", None)
            self.function = entry() if entry is not None else None

    def __call__(self, *args: Any) -> None:
        if self.function is None:
            raise RuntimeError(f"{self.spec} was compiled for {self.arch}, which this process cannot launch")
        self.function(*args)


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame,\s+(\d+) bytes spill\s+stores,\s+(\d+) bytes spill\s+loads")
_SHARED = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(text: str, seconds: float) -> CompileReport:
    """Registers, spills, stack and static shared memory from ptxas -v output."""
    registers = _REGISTERS.search(text)
    spills = _SPILLS.search(text)
    shared = _SHARED.search(text)
    return CompileReport(
        registers=int(registers.group(1)) if registers else None,
        stack_bytes=int(spills.group(1)) if spills else None,
        spill_stores=int(spills.group(2)) if spills else None,
        spill_loads=int(spills.group(3)) if spills else None,
        shared_bytes=int(shared.group(1)) if shared else 0 if registers else None,
        seconds=seconds,
    )


_CACHE: dict[tuple, CompiledKernel] = {}


def compile_kernel(
    kernel: DeviceKernel | KernelSpec,
    arch: str,
    *,
    inspect: bool = False,
    prebuilt: bool = True,
    persist: bool = False,
) -> CompiledKernel:
    """``kernel`` (an instance, or a ``KernelSpec``) ready to launch on ``arch``: loaded from an
    installed model package's exported kernels or the on-disk cache when its full key is there
    (``mhc_core.host.binaries.artifacts``; ``prebuilt=False`` or ``MHC_PREBUILT=0`` always compiles), else
    compiled (cached per process). ``persist=True`` (what the ops pass) exports a kernel compiled
    here into the on-disk cache for the next process, holding the kernel's lock there: the ranks
    of a host that miss it compile it once, the others wait, then load it.

    ``inspect=True`` also keeps the PTX and ptxas's register/spill report (always compiled); the
    key includes it, the arch and the DSL release, so a plain build is never served an inspected
    one's options or another target's binary.
    """
    from . import artifacts

    check_arch(arch)
    spec = KernelSpec.of(kernel)
    key = (spec.path, artifacts.config_text(spec.config), arch, artifacts.dsl_release(), CALLING_CONVENTION)
    key += (inspect, prebuilt)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    instance = kernel if isinstance(kernel, DeviceKernel) else None
    compiled = None
    if prebuilt and not inspect and artifacts.enabled():
        compiled = _load_shipped(spec, arch)
        if compiled is None and persist:
            compiled = _compile_once(instance, spec, arch)
    if compiled is None:
        compiled = _compile(instance, spec, arch, inspect)
    _CACHE[key] = compiled
    if compiled.kernel is not None:  # compiled here, not loaded
        LOG.info("compiled %s for %s in %.2f s", spec, arch, compiled.report.seconds)
    return compiled


def _compile_once(kernel: DeviceKernel | None, spec: KernelSpec, arch: str) -> CompiledKernel:
    """Compile and persist holding the kernel's cache lock: the ranks of a host that all miss it
    compile it once; each other waits for the lock, then loads what the first persisted."""
    from . import artifacts

    full_key = artifacts.kernel_key(spec, arch, CALLING_CONVENTION)
    with artifacts.cache_lock(full_key) as held:
        loaded = _load_shipped(spec, arch) if held else None  # persisted while this process waited
        if loaded is not None:
            return loaded
        compiled = _compile(kernel, spec, arch, False)
        if held:
            artifacts.persist(full_key, compiled.compiled, compiled.signature)
    return compiled


def _compile(kernel: DeviceKernel | None, spec: KernelSpec, arch: str, inspect: bool) -> CompiledKernel:
    """Compile with the DSL (imported here: only a kernel no library ships needs the compiler).
    ``kernel`` None: instantiated from ``spec`` once the DSL is known to be there (its module
    imports the DSL)."""
    try:
        import cutlass.cute as cute
    except ImportError as error:
        raise RuntimeError(
            f"{spec} for {arch}: no installed package ships this kernel and compiling it needs the DSL "
            "compiler, which is not importable: pip install 'mhc-core[jit]' (or use a preset's configuration)"
            + _skipped_note(spec, arch)
        ) from error
    if kernel is None:
        kernel = spec.instantiate()

    from ...device.signature import fake_arguments

    options = f"--gpu-arch {arch} {COMPILE_OPTIONS}"
    signature = kernel.signature()
    fakes = fake_arguments(signature)
    start = time.perf_counter()
    if not inspect:
        function = cute.compile(kernel.entry(), *fakes, options=options)
        seconds = time.perf_counter() - start
        return CompiledKernel(spec, arch, signature, function, kernel, report=CompileReport(seconds=seconds))
    with tempfile.TemporaryDirectory(prefix="mhc-ptx-") as dump:
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            function = cute.compile(
                kernel.entry(), *fakes, options=f"{options} --keep-ptx --dump-dir {dump} remarks{{ptx}}"
            )
        report = parse_ptxas_report(captured.getvalue(), time.perf_counter() - start)
        return CompiledKernel(spec, arch, signature, function, kernel, ptx=function.__ptx__, report=report)


def _skipped_note(spec: KernelSpec, arch: str) -> str:
    """Names the shipped or cached file this process skipped for the kernel, if one was, and the
    modules whose code changed since the installed kernels were built, if any did."""
    from . import artifacts

    if not artifacts.enabled():
        return ""
    skipped = artifacts.skipped(artifacts.kernel_key(spec, arch, CALLING_CONVENTION))
    note = f"; the file that had it was skipped: {skipped}" if skipped else ""
    changed = artifacts.changed_sources(spec.path.partition(":")[0])
    if changed:
        note += f"; the installed kernels were built from other code: {', '.join(changed)}"
    return note


_WARNED_CHANGED: set[str] = set()


def _warn_changed_sources(spec: KernelSpec) -> None:
    """Once per kernel module: the installed kernels do not match its code, and which modules changed."""
    from . import artifacts

    module = spec.path.partition(":")[0]
    if module in _WARNED_CHANGED:
        return
    _WARNED_CHANGED.add(module)
    changed = artifacts.changed_sources(module)
    if changed:
        LOG.warning(
            "the installed kernels of %s were built from other code than this installation's: %s "
            "(comments, docstrings and formatting do not count); its kernels are compiled instead",
            module,
            ", ".join(changed),
        )


def _load_shipped(spec: KernelSpec, arch: str) -> CompiledKernel | None:
    """``spec``'s kernel from the exported libraries or the cache, or None (then it is compiled)."""
    from . import artifacts

    full_key = artifacts.kernel_key(spec, arch, CALLING_CONVENTION)
    found = artifacts.lookup(full_key) or artifacts.cached(full_key)
    if found is None:
        _warn_changed_sources(spec)
        return None
    start = time.perf_counter()
    try:
        function = artifacts.load(full_key, found)
    except artifacts.MissingRuntime:
        raise  # no runtime means no DSL either (the compiler's package brings one): nothing to fall back on
    except Exception as error:  # a broken install: say so, and compile instead
        LOG.warning("could not load %s from %s (%s): compiling it", spec, found.library, error)
        return None
    seconds = time.perf_counter() - start
    LOG.info("loaded %s for %s from %s in %.3f s", spec, arch, found.library, seconds)
    return CompiledKernel(spec, arch, found.signature, function=function, report=CompileReport(seconds=seconds))
