"""Export every preset kernel into one shared library per model package and arch, with its manifest.

    python3 -m tools.export_kernels [--model KEY] [--arch A ...] [--preset NAME ...] [--out DIR]

For each registered model package (``mhc_core.registry``) and each arch its presets list: compile
every kernel (TVM-FFI, no GPU needed; a kernel met again is compiled once), export it as an object
file whose one visible symbol is its TVM-FFI entry point ``__tvm_ffi_<symbol>``
(``mhc_core.host.binaries.artifacts``: the symbol is a hash of the kernel's full key), link the objects into
``<package>/kernels/<arch>/lib<package>_<arch>.so`` against the DSL runtime and TVM-FFI, and write
``manifest.json`` beside it. ``--out`` writes ``<out>/<package>/kernels/...`` instead of into the
checkout's sources (which hatch then packs into the wheels; ``nox -s build`` runs this).

One line per preset with its elapsed time, then a table of the libraries and their sizes. One
library per package and arch: one file to load per process (~ms), and each wheel carries only its
own kernels; per-preset libraries would mean as many files for a few kB each.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.compile_presets import ensure_importable, jobs_for, model_keys, select_presets


def package_folder(package: str) -> Path:
    """Where ``package`` is imported from (the checkout's ``src/<package>`` once ``ensure_importable`` ran)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: cannot find the package {package}")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="only this registered model's presets (its key)")
    parser.add_argument("--arch", action="append", default=[], help="only this arch (repeatable)")
    parser.add_argument("--preset", action="append", default=[], help="only this preset (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>/<package>/kernels/ (default: the sources)")
    args = parser.parse_args(argv)
    for line in ensure_importable():
        print(line, flush=True)

    from mhc_core import registry
    from mhc_core.host.binaries import artifacts
    from mhc_core.host.binaries.compiler import CALLING_CONVENTION, KernelSpec, compile_kernel

    if args.model is not None and args.model not in model_keys():
        parser.error(f"--model: expected one of {', '.join(model_keys())}; got {args.model!r}")
    artifacts.load_runtime_globally()
    models = [args.model] if args.model else model_keys()
    libraries = []
    start = time.perf_counter()
    # An unknown name is an error, for any model; the test presets' kernels stay out of the wheels.
    chosen = select_presets(models, args.preset, shipped_only=True)
    for model in models:
        package = registry.model(model).package
        jobs = jobs_for([preset for preset in chosen if preset[0] == model], args.arch)
        if not jobs:
            continue
        base = (args.out / package) if args.out else package_folder(package)
        for arch in dict.fromkeys(job.arch for job in jobs):
            folder = base / "kernels" / arch
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            keys: dict[str, tuple[artifacts.KernelKey, Any]] = {}
            with tempfile.TemporaryDirectory(prefix="mhc-export-") as scratch:
                objects = []
                for preset in dict.fromkeys(job.preset for job in jobs if job.arch == arch):
                    began = time.perf_counter()
                    for job in (j for j in jobs if j.arch == arch and j.preset == preset):
                        spec = KernelSpec(job.path, job.config)
                        key = artifacts.kernel_key(spec, arch, CALLING_CONVENTION)
                        if key.symbol in keys:
                            continue
                        compiled = compile_kernel(spec, arch, prebuilt=False)
                        target = Path(scratch, f"{key.symbol}.o")
                        compiled.compiled.export_to_c(
                            str(target), function_name=key.symbol, export_only_tvm_ffi_symbols=True
                        )
                        objects.append(str(target))
                        keys[key.symbol] = (key, compiled.signature)
                    print(f"{model}.{preset} {arch}: exported in {time.perf_counter() - began:.1f} s", flush=True)
                library = f"lib{package}_{arch}.so"
                artifacts.link(objects, folder / library)
            artifacts.write_manifest(folder, package, arch, library, keys.values())
            libraries.append((package, arch, len(keys), (folder / library).stat().st_size))
    print("\npackage     arch     kernels  library bytes")
    for package, arch, count, size in libraries:
        print(f"{package:<11} {arch:<8} {count:>7}  {size:>13}")
    total = sum(count for _, _, count, _ in libraries)
    print(f"\n{total} kernels in {len(libraries)} libraries, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
