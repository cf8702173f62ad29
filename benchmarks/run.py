"""Run the benchmarks and print their tables (``nox -s bench`` wraps this).

    python3 -m benchmarks.run [--suite core spin-bound host fp8 <a model's suites>] [--out DIR]
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.run   # real tp 2
    python3 -m benchmarks.run --suite fp8 --dry-run   # no GPU: what the FP8 suite builds and checks
    python3 -m benchmarks.run --suite two-shot --m 1 8 16 32 64 128 256 512 1024   # loopback tp 4, 8

Under torchrun the suites run over a real NCCL group (unicast Lamport; NVLink
multicast stays off). Results go to DIR as JSON, a markdown table and PNG plots.

The suites here (core, spin-bound, host, fp8) run every registered model's benchmark case
(``mhc_core.bench.case``); a model's own suites, the ones a plain run includes and their tables are
what its registry entry declares (``Model.benchmark_suites``, ``benchmark_defaults``,
``benchmark_tables``), each run by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .checkout import ROOT, add_packages

add_packages()
for variable, value in (
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(variable, value)

import torch  # noqa: E402

from mhc_core import registry  # noqa: E402
from mhc_core.bench import SMALL_M  # noqa: E402
from mhc_core.bench.records import Context, Record  # noqa: E402
from mhc_core.bench.timing import copy_bandwidth_bytes_per_us, device_description  # noqa: E402

from . import fp8, report, suites, two_shot  # noqa: E402

DEFAULT_M = (1, 8, 64, 256, 1024)

Suite = Callable[[Context, list[int]], list[Record]]
#: The suites of no one model: each one's function of the context and the --m values.
GENERIC: dict[str, Suite] = {
    "core": suites.core_suite,
    "spin-bound": lambda ctx, ms: suites.spin_bound(ctx, [m for m in ms if m <= SMALL_M]),
    "host": lambda ctx, ms: suites.host_overhead(ctx, [1]),
    "fp8": fp8.fp8_suite,
    "two-shot": two_shot.two_shot_suite,
}


def _declared(field: str) -> dict[str, object]:
    """``(name, "module:object")`` pairs of one ``Model`` field over the registry, loaded, in key order; a
    generic suite's name stays the generic one."""
    found: dict[str, object] = {}
    for model in registry.models().values():
        for name, target in getattr(model, field):
            if name not in GENERIC:
                found.setdefault(name, registry.load_object(target))
    return found


#: Every suite by name: core, the models' own (``Model.benchmark_suites``), then the other generic ones.
RUNNERS: dict[str, Suite] = {"core": GENERIC["core"], **_declared("benchmark_suites"), **GENERIC}
SUITES = tuple(RUNNERS)
#: Suites a plain run (no --suite) does: core and what each model lists (``Model.benchmark_defaults``).
#: spin-bound and host are one process with loopback ranks; fp8 compiles some fifty kernels: asked for
#: by name.
DEFAULT_SUITES = ("core", *(name for model in registry.models().values() for name in model.benchmark_defaults))
#: Suites a plain run adds when not under torchrun.
SINGLE_PROCESS_SUITES = ("host",)
#: The table each suite prints (the generic one where not named; ``Model.benchmark_tables``).
TABLES = {
    "host": report.host_table,
    "fp8": report.fp8_table,
    "two-shot": report.two_shot_table,
    **_declared("benchmark_tables"),
}


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


def save(folder: Path, header: dict, records: list) -> None:
    """Write what has been measured so far (a run cut short keeps its finished suites)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {**header, "records": [record.as_dict() for record in records]}
    (folder / f"tp{header['tp']}.json").write_text(json.dumps(payload, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", nargs="+", choices=SUITES, default=None)
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    parser.add_argument("--out", type=Path, default=ROOT / ".out" / "bench")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    parser.add_argument(
        "--dry-run", action="store_true", help="--suite fp8 only, no GPU: presets, kernels to compile, quantiser checks"
    )
    options = parser.parse_args()
    if options.dry_run:
        if options.suite != ["fp8"]:
            parser.error("--dry-run: only --suite fp8 has one")
        print(report.fp8_table(fp8.dry_run(options.m)), flush=True)
        return 0

    group, tp, rank = None, 1, 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        group, tp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    bandwidth = copy_bandwidth_bytes_per_us()
    ctx = Context(tp=tp, rank=rank, group=group, bandwidth=bandwidth, compile_baselines=not options.no_compile)
    header = {
        "date": datetime.date.today().isoformat(),
        "gpu": device_description(),
        "commit": options.commit or commit(),
        "tp": tp,
        "copy_bandwidth_tb_s": bandwidth / 1e6,
    }
    if rank == 0:
        print(json.dumps(header), flush=True)
    records = []
    chosen = options.suite or [*DEFAULT_SUITES, *(SINGLE_PROCESS_SUITES if tp == 1 else ())]
    for suite in chosen:
        measured = RUNNERS[suite](ctx, options.m)
        records += measured
        if rank == 0:
            print(TABLES.get(suite, report.table)(measured), flush=True)
    if rank == 0:
        options.out.mkdir(parents=True, exist_ok=True)
        stem = f"tp{tp}"
        (options.out / f"{stem}.json").write_text(
            json.dumps({**header, "records": [r.as_dict() for r in records]}, indent=1)
        )
        report.plots(records, options.out, stem, header)
        print(f"results in {options.out}", flush=True)
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
