"""Compile every preset's kernels for each of its archs, without a GPU, and tabulate ptxas's report.

    python3 -m tools.compile_presets [--arch A ...] [--preset NAME ...] [--model KEY] [--ptx-digest FILE]

The models are the registered ones (``mhc_core.registry``). The kernels come from the generated
preset modules (``<package>.presets``,
``kernels(arch)``); ``mhc_core.host.binaries.compiler.compile_kernel(kernel, arch, inspect=True)``
passes ``--gpu-arch`` so no GPU is needed. A kernel config met again on the same
arch is compiled once; its later rows say "same as" the first. A kernel class that
does not exist yet is reported once ("not implemented yet") and gets no row.

Exits non-zero on any compile failure and on any spill or local memory use. ``--ptx-digest FILE``
writes the sha256 of every distinct kernel's PTX (JSON, keyed ``model.preset kernel arch``): two trees'
files compared tell whether a host or refactoring change left the device code byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def ensure_importable() -> list[str]:
    """Put the checkout's ``packages/*/src`` first on ``sys.path`` (its sources win over an
    installed wheel: this tool checks the tree it ships in); one line per package saying which
    copy is imported (the registry's models, then any it found elsewhere)."""
    lines = []
    if str(ROOT) not in sys.path:  # tests.presets: the test presets' registries
        sys.path.append(str(ROOT))
    sources = sorted(path.parent for path in (ROOT / "packages").glob("*/src"))
    for distribution in sources:
        src = distribution / "src"
        if str(src) in sys.path:
            sys.path.remove(str(src))
        sys.path.insert(0, str(src))
    from mhc_core import registry

    registry.refresh()
    for package in ("mhc_core", *registry.packages()):
        spec = importlib.util.find_spec(package)
        origin = Path(spec.origin).parent if spec is not None and spec.origin else None
        where = (
            "the checkout" if origin is not None and origin.is_relative_to(ROOT / "packages") else "not the checkout"
        )
        lines.append(f"{package}: {origin} ({where})")
    return lines


@dataclass(frozen=True)
class Job:
    """One kernel of one preset on one arch."""

    model: str
    preset: str
    kernel: str
    arch: str
    path: str  # "package.module:Class"
    config: dict[str, Any]
    dynamic_shared: int | None
    module: ModuleType = field(compare=False, repr=False)  # the generated preset module

    @property
    def label(self) -> str:
        return f"{self.model}.{self.preset}"

    @property
    def key(self) -> tuple:
        """Identical kernels: same class, same config, same arch."""
        return (self.path, repr(sorted(self.config.items())), self.arch)


@dataclass
class Row:
    job: Job
    report: Any  # mhc_core.host.binaries.compiler.CompileReport
    same_as: Job | None = None


def dynamic_shared(model: str, kernel: str, geometry: dict[str, Any]) -> int | None:
    """The kernel's dynamic shared memory where the preset's GEOMETRY states it (ptxas sees only
    static): the model's registry entry says which key holds it."""
    from mhc_core import registry

    return registry.model(model).dynamic_shared(kernel, geometry)


def model_keys() -> list[str]:
    from mhc_core import registry

    return list(registry.models())


def missing_class(path: str) -> bool:
    """True when the kernel class (or its module) does not exist yet; a module that fails otherwise raises."""
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        parts = module_name.split(".")
        prefixes = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if error.name in prefixes:
            return True
        raise
    return not hasattr(module, class_name)


def registries(model: str, shipped_only: bool) -> list[ModuleType]:
    """``model``'s shipped preset registry and, unless ``shipped_only``, the tests' own (the test
    presets: codegen renders them under ``tests/presets/``, out of the packages)."""
    from mhc_core import registry

    found = [importlib.import_module(registry.model(model).presets_package)]
    if not shipped_only and importlib.util.find_spec(f"tests.presets.{model}") is not None:
        found.append(importlib.import_module(f"tests.presets.{model}"))
    return found


def select_presets(
    models: list[str], wanted: list[str], *, shipped_only: bool = False
) -> list[tuple[str, str, ModuleType]]:
    """(model, preset name, generated module) for the chosen presets, in registry order;
    ``shipped_only``: without the test presets (their kernels stay out of the wheels' libraries)."""
    chosen = []
    found = set()
    for model in models:
        for registry in registries(model, shipped_only):
            for name in registry.names():
                if wanted and name not in wanted and f"{model}.{name}" not in wanted:
                    continue
                found.update({name, f"{model}.{name}"})
                chosen.append((model, name, registry.get(name)))
    unknown = [name for name in wanted if name not in found]
    if unknown:
        raise SystemExit(f"error: unknown preset(s) {', '.join(unknown)} (models: {', '.join(models)})")
    return chosen


def jobs_for(presets: list[tuple[str, str, ModuleType]], archs: list[str]) -> list[Job]:
    jobs = []
    for model, name, module in presets:
        for arch in module.PRESET.archs:
            if archs and arch not in archs:
                continue
            for kernel, (path, config) in module.KERNELS[arch].items():
                shared = dynamic_shared(model, kernel, module.GEOMETRY)
                jobs.append(Job(model, name, kernel, arch, path, config, shared, module))
    return jobs


def format_table(rows: list[Row]) -> str:
    header = ("preset", "kernel", "arch", "regs", "spill st/ld B", "stack B", "smem B", "compile s", "note")
    lines = []
    for row in rows:
        job, report = row.job, row.report
        if job.dynamic_shared is not None:
            static = f" + {report.shared_bytes} static" if report.shared_bytes else ""
            shared = f"{job.dynamic_shared} dyn{static}"
        else:
            shared = f"{report.shared_bytes} static"
        note = f"same as {row.same_as.label} {row.same_as.kernel}" if row.same_as else ""
        seconds = "-" if row.same_as else f"{report.seconds:.2f}"
        lines.append(
            (
                job.label,
                job.kernel,
                job.arch,
                str(report.registers),
                f"{report.spill_stores}/{report.spill_loads}",
                str(report.stack_bytes),
                shared,
                seconds,
                note,
            )
        )
    widths = [max(len(cells[i]) for cells in (header, *lines)) for i in range(len(header))]
    numeric = {3, 4, 5, 7}

    def render(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([render(header).rstrip(), rule, *(render(cells).rstrip() for cells in lines)])


def problems_of(report: Any) -> list[str]:
    if report.registers is None or report.spill_stores is None or report.stack_bytes is None:
        return ["no ptxas report (registers / spills unknown)"]
    problems = []
    if report.spill_stores or report.spill_loads:
        problems.append(f"spills {report.spill_stores} B stored / {report.spill_loads} B loaded")
    if report.stack_bytes:
        problems.append(f"{report.stack_bytes} B of stack (local memory)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.compile_presets", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", default=[], help="only this arch (repeatable)")
    parser.add_argument(
        "--preset", action="append", default=[], help="only this preset, NAME or MODEL.NAME (repeatable)"
    )
    parser.add_argument("--model", help="only this registered model's presets (its key)")
    parser.add_argument("--ptx-digest", metavar="FILE", help="write the sha256 of every distinct kernel's PTX here")
    args = parser.parse_args(argv)
    for line in ensure_importable():
        print(line, flush=True)

    from mhc_core.constants import SUPPORTED_ARCHS
    from mhc_core.host.binaries.compiler import compile_kernel

    unknown_archs = [arch for arch in args.arch if arch not in SUPPORTED_ARCHS]
    if unknown_archs:
        parser.error(f"--arch: expected among {', '.join(SUPPORTED_ARCHS)}; got {', '.join(unknown_archs)}")
    if args.model is not None and args.model not in model_keys():
        parser.error(f"--model: expected one of {', '.join(model_keys())}; got {args.model!r}")
    models = [args.model] if args.model else model_keys()
    jobs = jobs_for(select_presets(models, args.preset), args.arch)
    if not jobs:
        print("no kernels to compile for that selection", file=sys.stderr)
        return 1

    rows: list[Row] = []
    digests: dict[str, str] = {}
    first: dict[tuple, Row] = {}
    missing: dict[str, bool] = {}
    failures: list[str] = []
    start = time.perf_counter()
    for index, job in enumerate(jobs, start=1):
        prefix = f"[{index}/{len(jobs)}] {job.label} {job.kernel} {job.arch}"
        if job.key in first:
            rows.append(Row(job, first[job.key].report, same_as=first[job.key].job))
            print(f"{prefix}: same as {first[job.key].job.label} {first[job.key].job.kernel}", flush=True)
            continue
        try:
            if job.path not in missing:
                missing[job.path] = missing_class(job.path)
                if missing[job.path]:
                    print(f"not implemented yet: {job.path}", flush=True)
            if missing[job.path]:
                continue
            kernel = job.module.kernels(job.arch, [job.kernel])[job.kernel]
            compiled_kernel = compile_kernel(kernel, job.arch, inspect=True)
            report = compiled_kernel.report
            digests[f"{job.label} {job.kernel} {job.arch}"] = hashlib.sha256(
                (compiled_kernel.ptx or "").encode()
            ).hexdigest()
        except Exception as error:  # report every failure, then go on with the rest
            message = f"{prefix}: compile failed: {type(error).__name__}: {error}"
            failures.append(message)
            print(message, flush=True)
            traceback.print_exc(limit=-3, file=sys.stdout)
            continue
        row = Row(job, report)
        rows.append(row)
        first[job.key] = row
        print(f"{prefix}: {report.registers} registers, {report.seconds:.2f} s", flush=True)
        failures.extend(f"{prefix}: {problem}" for problem in problems_of(report))

    compiled = len(first)
    if args.ptx_digest:
        Path(args.ptx_digest).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print()
    if rows:
        print(format_table(rows))
        print()
    not_implemented = sorted(path for path, absent in missing.items() if absent)
    print(
        f"{compiled} distinct kernels compiled for {len(rows)} preset kernels "
        f"in {time.perf_counter() - start:.1f} s; {len(not_implemented)} kernel class(es) not implemented yet"
    )
    if failures:
        print(f"\n{len(failures)} problem(s):", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
