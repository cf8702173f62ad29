"""Compile a suite's kernels ahead, in parallel, into the on-disk kernel cache (``mhc_core.host.binaries.artifacts``).

An op compiles the kernels no package ships one after another when it is built (several seconds each
on the H200 host, one core each); the FP8 suite builds 2 x 3 x 2 such ops. ``prewarm`` compiles them
first in worker processes (one kernel each, ``compile_kernel(..., persist=True)``: the same call an op
makes), so that building the ops then loads them from the cache. Nothing depends on it: where the
cache is off (``MHC_PREBUILT=0``, an unsafe cache folder) or a worker fails, it says so and the ops
compile what is missing themselves.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

#: Kernels an op never builds on the lent hosts (NVLink multicast stays off there).
SKIPPED = ("publish_multicast",)


def preset_specs(preset: Any, arch: str, options: Iterable[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(class path, config)`` of every kernel an op of ``preset`` with each of ``options`` (preset
    fields replaced: ``layer_input_format``, ``layer_input_bf16``) builds, each once."""
    import dataclasses

    specs: dict[str, tuple[str, dict[str, Any]]] = {}
    for fields in options:
        for name, (path, config) in dataclasses.replace(preset, **fields).kernel_specs(arch).items():
            if name not in SKIPPED:
                specs.setdefault(repr((path, sorted(config.items()))), (path, config))
    return list(specs.values())


def missing(specs: list[tuple[str, dict[str, Any]]], arch: str) -> list[tuple[str, dict[str, Any]]]:
    """The specs neither a package ships nor the cache holds (what an op would compile)."""
    from mhc_core.host.binaries import artifacts
    from mhc_core.host.binaries.compiler import CALLING_CONVENTION, KernelSpec

    if not artifacts.enabled():
        return list(specs)
    absent = []
    for path, config in specs:
        key = artifacts.kernel_key(KernelSpec(path, config), arch, CALLING_CONVENTION)
        if artifacts.lookup(key) is None and artifacts.cached(key) is None:
            absent.append((path, config))
    return absent


def _compile_one(path: str, config: dict[str, Any], arch: str) -> float:
    """In a worker: compile and persist one kernel; its compile seconds."""
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel

    return compile_kernel(KernelSpec(path, config), arch, persist=True).report.seconds


def prewarm(specs: list[tuple[str, dict[str, Any]]], arch: str, jobs: int | None = None) -> str:
    """Compile the ``missing`` specs in ``jobs`` processes (default: one per core, at most one per
    kernel) into the cache; a line saying what was done."""
    from mhc_core.host.binaries import artifacts

    todo = missing(specs, arch)
    if not todo:
        return f"prewarm: all {len(specs)} kernels shipped or cached"
    if not artifacts.enabled() or artifacts.cache_dir() is None:
        return f"prewarm: skipped, the kernel cache is off or unsafe: the ops compile {len(todo)} kernels themselves"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = max(1, min(jobs or cores, len(todo)))
    start = time.perf_counter()
    failures, seconds = [], 0.0
    # spawn: the workers touch no CUDA and inherit no CUDA state from this process.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_compile_one, path, config, arch) for path, config in todo]
        for (path, _), future in zip(todo, futures, strict=True):
            try:
                seconds += future.result()
            except Exception as error:  # the op compiles it again and raises there if it must
                failures.append(f"{path}: {type(error).__name__}: {error}")
    line = (
        f"prewarm: {len(todo) - len(failures)} of {len(todo)} kernels compiled into the cache in "
        f"{time.perf_counter() - start:.0f} s by {jobs} processes ({seconds:.0f} s of compiling)"
    )
    return line + "".join(f"\n  failed: {failure}" for failure in failures)
