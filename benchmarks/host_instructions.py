"""Host instructions per eager call, without a GPU: a deterministic A/B of the ops' host path.

    python3 -m benchmarks.host_instructions [--tree DIR ...] [--calls N]

Each tree (default: this checkout; another commit: ``git worktree add`` or ``git archive`` it) runs
in its own ``valgrind --tool=callgrind`` process, which counts the instructions of ``--calls`` calls
of each path at M = 1 (after a warm-up; ``CALLGRIND_START/STOP_INSTRUMENTATION`` around the loop
through a small C library built here). The paths are every registered model's (its benchmark case's
``instructions`` module, this checkout's, loaded from its file: ``paths`` and ``CUSTOM_OPS``). The ops
are the tree's own CPU ops with recorder kernels (``tests/core/test_launch_wiring_cpu.py``: real
rules, native programs, allocation and bookkeeping; no-op kernels) with a real ``CallOrder`` and
``SideWork`` whose CUDA streams and events are Python stand-ins; the custom-op paths have their
implementations registered for CPU tensors here.

What it answers: how many host instructions a change adds to a path, reproducibly (hash seed and
malloc settings fixed), on a CPU-only machine. What it does not: CUDA launches, the caching
allocator and the driver are not in it, so it is no host time; ``--suite host`` on a GPU is.
Needs gcc, valgrind and its ``valgrind/callgrind.h``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .checkout import ROOT, add_packages, load_file, module_file

CLIENT_REQUESTS = """
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(const char* name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""


# ---------------------------------------------------------------------- the worker (under valgrind)
def _stand_in_streams(streams) -> None:
    """CUDA streams and events the real CallOrder / SideWork use, as Python objects (CPU programs
    record no events); the C accessors stay C calls, as torch's are."""

    class Stream:
        def __init__(self, handle: int = 0) -> None:
            self.cuda_stream = handle

        def wait_event(self, event: object) -> None:
            pass

    class Event:
        cuda_event = 0

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

    main = Stream(0)
    cuda = SimpleNamespace(
        Event=Event, current_stream=lambda device=None: main,
        current_device=lambda: 0, is_current_stream_capturing=lambda: False,
    )  # fmt: skip
    import torch

    streams.torch = SimpleNamespace(cuda=cuda, _C=torch._C, Tensor=torch.Tensor)
    streams.SIDE_STREAMS = SimpleNamespace(acquire=lambda device: Stream(9), release=lambda stream: None)
    streams._is_capturing = bool  # a C builtin returning False
    streams.current_stream_handle = abs  # a C builtin: abs(0) is the stand-in stream's handle


def _cpu_kernels(module: Any, names: list[str]) -> None:
    """The custom ops ``module`` defines, their implementations registered for CPU tensors too (either
    registration)."""
    import torch

    cpu = torch.library.Library("mhc", "IMPL")
    _KEEP.append(cpu)  # the registrations live as long as it
    for name in names:
        defined = getattr(module, name)
        if hasattr(defined, "register_kernel"):  # torch.library.custom_op (before issue #34 part 8)
            defined.register_kernel("cpu")(defined._init_fn)
        else:
            cpu.impl(name, defined.implementation, "CPU")


_KEEP: list[Any] = []


def plan() -> dict[str, Any]:
    """What a worker loads from this checkout: per registered model whose benchmark case names an
    ``instructions`` module, that module's file and the model's custom-op module; and the
    distributions whose ``src/`` a tree supplies."""
    add_packages()
    from mhc_core import registry

    models = []
    for key, model in registry.models().items():
        case = registry.load_object(model.benchmark_case) if model.benchmark_case is not None else None
        if getattr(case, "instructions", None) is not None:
            models.append({"key": key, "file": module_file(case.instructions), "custom_ops": model.custom_ops})
    return {"models": models, "distributions": ["mhc-core", *registry.distributions()]}


def worker(tree: Path, library: Path, calls: int, planned: dict[str, Any]) -> None:
    """Every path's loop between the client requests (outside valgrind they do nothing)."""
    for package in planned["distributions"]:
        sys.path.insert(0, str(tree / "packages" / package / "src"))
    sys.path.insert(0, str(tree))
    import torch
    import tvm_ffi

    torch.set_num_threads(1)
    requests = ctypes.CDLL(str(library))
    requests.cg_stop.argtypes = [ctypes.c_char_p]
    from mhc_core.host import library as core_library
    from mhc_core.host.calls import streams

    _stand_in_streams(streams)
    wiring = __import__("tests.core.test_launch_wiring_cpu", fromlist=["Kernels"])
    noop = tvm_ffi.convert(lambda *args: None)
    wiring.Kernels.compiled = lambda self, name, kernel: SimpleNamespace(
        function=noop, kernel=kernel, signature=kernel.signature()
    )
    x = torch.randn(1, wiring.HIDDEN).to(torch.bfloat16)
    steps: dict[str, Callable[[], object]] = {}
    releases = []
    for entry in planned["models"]:
        paths = load_file(f"_instructions_{entry['key']}", entry["file"])
        if paths.CUSTOM_OPS:
            _cpu_kernels(importlib.import_module(entry["custom_ops"]), list(paths.CUSTOM_OPS))
        found, release = paths.paths(wiring, x, streams, core_library)
        steps.update(found)
        releases.append(release)
    for name, step in steps.items():
        for _ in range(200):
            step()
        requests.cg_start()
        for _ in range(calls):
            step()
        requests.cg_stop(name.encode())
    for release in releases:
        release()


# ---------------------------------------------------------------------- the driver
def client_requests(folder: Path) -> Path:
    """The C library the worker calls around each loop."""
    source, library = folder / "requests.c", folder / "librequests.so"
    source.write_text(CLIENT_REQUESTS)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def _dump_number(dump: Path) -> int:
    suffix = dump.name.rsplit(".", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def totals(folder: Path, calls: int) -> dict[str, float]:
    """Instructions per call of each path, from callgrind's dumps (one per path), in the worker's order."""
    result: dict[str, float] = {}
    for dump in sorted(folder.glob("callgrind.*.*"), key=_dump_number):
        text = dump.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.MULTILINE)
        total = re.search(r"^totals: (\d+)", text, re.MULTILINE)
        if name and total:
            result[name.group(1)] = int(total.group(1)) / calls
    return result


def measure(tree: Path, calls: int, folder: Path, library: Path, planned: dict[str, Any]) -> dict[str, float]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "GLIBC_TUNABLES": "glibc.malloc.mxfast=0"}
    env["MHC_CACHE_DIR"] = str(folder / "cache")  # the tree's own host library
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.%p",
        sys.executable, "-m", "benchmarks.host_instructions", "--worker", str(tree), str(library), str(calls),
        json.dumps(planned),
    ]  # fmt: skip
    subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True)
    return totals(folder, calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="a source tree (repeatable; default: this one)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per path inside the counted loop")
    parser.add_argument("--worker", nargs=4, metavar=("TREE", "LIBRARY", "CALLS", "PLAN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        tree, library, calls, planned = args.worker
        worker(Path(tree), Path(library), int(calls), json.loads(planned))
        return
    trees = [Path(tree).resolve() for tree in args.tree] or [ROOT]
    planned = plan()
    with tempfile.TemporaryDirectory() as scratch:
        library = client_requests(Path(scratch))
        columns = []
        for index, tree in enumerate(trees):
            folder = Path(scratch) / f"tree{index}"
            folder.mkdir()
            columns.append(measure(tree, args.calls, folder, library, planned))
    header = "| path | " + " | ".join(str(tree) for tree in trees) + (" | last - first |" if len(trees) > 1 else " |")
    print("\nhost instructions per call (callgrind, M = 1, CPU ops with no-op kernels)")
    print(header)
    print("|---" * (len(trees) + 1 + (len(trees) > 1)) + "|")
    for path in dict.fromkeys(name for column in columns for name in column):
        counts = [column.get(path, float("nan")) for column in columns]
        cells = " | ".join(f"{count:,.0f}" for count in counts)
        delta = f" | {counts[-1] - counts[0]:+,.0f}" if len(trees) > 1 else ""
        print(f"| {path} | {cells}{delta} |")


if __name__ == "__main__":
    main()
