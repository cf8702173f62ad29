"""Before / after device times of two or more trees, in alternating runs (what an A/B claim in
BENCHMARKS.md rests on):

    python3 -m benchmarks.ab --tree before=DIR --tree after=DIR [--runs 3] [--m 1 8 64 256] [--tp 1 4 8]

Each ``DIR`` holds a checkout's ``packages/`` (for example ``git worktree add DIR COMMIT``, or an
unpacked ``git archive COMMIT packages``). The trees run in turn, ``--runs`` rounds of one fresh
process each, so that a drift of the machine (clocks, other tenants) falls on every tree alike; the
figure of a tree is the median of its runs. One run measures every registered model's fused op at
each ``--tp`` (its benchmark case, ``mhc_core.bench.case``: preset, inputs and the call its own suite
times; tp > 1 in loopback, every rank's call on this GPU through ``run_ranks``, the op's own routing,
as an engine gets it) with ``mhc_core.bench.timing.graph_time_us`` (20 calls per CUDA graph, median
of 25 replays). The
case and timing modules are this checkout's, loaded from their files into the tree's process, so an
older tree without them measures the same way. The table gives each tree's median and its ratio to
the first tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .checkout import add_packages, load_file, module_file


def this_checkout() -> dict[str, Any]:
    """What a run loads from this checkout: the timing module's file and, per registered model with a
    benchmark case, its case's file and name; and the distributions whose ``src/`` a tree supplies."""
    add_packages()
    from mhc_core import registry

    cases = {}
    for key, model in registry.models().items():
        if model.benchmark_case is not None:
            module, _, name = model.benchmark_case.partition(":")
            cases[key] = (module_file(module), name)
    return {
        "timing": module_file("mhc_core.bench.timing"),
        "cases": cases,
        "distributions": ["mhc-core", *registry.distributions()],
    }


def measure(ms: list[int], tps: list[int], loaded: dict[str, Any]) -> dict[str, dict[int, float]]:
    """One run, in this process: the tree's packages are first on sys.path (``main`` sets it).
    Keyed ``<model> tp <tp>``."""
    import torch

    timing = load_file("_ab_timing", loaded["timing"])
    cases = {key: getattr(load_file(f"_ab_case_{key}", path), name) for key, (path, name) in loaded["cases"].items()}
    torch.manual_seed(0)
    result: dict[str, dict[int, float]] = {}
    for tp in tps:
        for key, case in cases.items():
            steps = _steps(case, tp, ms)
            result[f"{key} tp {tp}"] = {m: timing.graph_time_us(step) for m, step in steps.items()}
    return result


def _steps(case: Any, tp: int, ms: list[int]) -> dict[int, Any]:
    """Per M, the call a run times: the op's own at tp 1; every loopback rank's through ``run_ranks``."""
    import torch

    def bf16(m: int) -> torch.Tensor:
        return torch.randn(m, case.hidden, device="cuda").to(torch.bfloat16)

    if tp == 1:
        op = case.build(case.preset(1), max(ms), "cuda")
        return {m: case.step(op, bf16(m), case.inputs(m, case.hidden)) for m in ms}
    from mhc_core import LoopbackGroup, run_ranks

    ops = [case.build(case.preset(tp), max(ms), "cuda", rank) for rank in LoopbackGroup(tp, "cuda")]
    steps = {}
    for m in ms:
        args = [(bf16(m), *case.inputs(m, case.hidden)) for _ in ops]

        def step(args=args):
            run_ranks(ops, "call", args)
            for op in ops:
                case.join(op)

        steps[m] = step
    return steps


def table(runs: dict[str, list[dict[str, dict[int, float]]]]) -> str:
    tags = list(runs)
    lines = []
    for model in runs[tags[0]][0]:
        count = len(runs[tags[0]])
        lines.append(f"\n{model}: median us per call of {count} alternating runs (ratio to {tags[0]})")
        lines.append("| M | " + " | ".join(tags) + " |")
        lines.append("|---" * (len(tags) + 1) + "|")
        for m in runs[tags[0]][0][model]:
            first = statistics.median(run[model][m] for run in runs[tags[0]])
            cells = []
            for tag in tags:
                value = statistics.median(run[model][m] for run in runs[tag])
                cells.append(f"{value:.2f} ({value / first:.3f})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="TAG=DIR (DIR holds packages/); twice or more")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--m", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--tp", nargs="+", type=int, default=[1], help="1, or loopback ranks on this GPU")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    parser.add_argument("--one-run", default=None, help=argparse.SUPPRESS)  # a child process: this_checkout()
    options = parser.parse_args()
    if options.one_run is not None:
        print(json.dumps(measure(options.m, options.tp, json.loads(options.one_run))), flush=True)
        return 0
    trees = dict(spec.split("=", 1) for spec in options.tree)
    if len(trees) < 2 or any(not (Path(path) / "packages").is_dir() for path in trees.values()):
        parser.error("--tree: expected two or more TAG=DIR, each DIR holding packages/")
    runs: dict[str, list[dict[str, dict[int, float]]]] = {tag: [] for tag in trees}
    root = Path(__file__).resolve().parents[1]
    loaded = this_checkout()
    for _ in range(options.runs):
        for tag, path in trees.items():
            packages = Path(path).resolve() / "packages"
            sources = [str(packages / name / "src") for name in loaded["distributions"]]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sources, str(root), os.environ.get("PYTHONPATH", "")])}
            child = ["-m", "benchmarks.ab", "--one-run", json.dumps(loaded), "--m", *map(str, options.m)]
            child += ["--tp", *map(str, options.tp)]
            command = [sys.executable, *child]
            done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            runs[tag].append({model: {int(m): us for m, us in values.items()} for model, values in measured.items()})
            print(f"{tag}: {measured}", flush=True)
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "ab.json").write_text(json.dumps(runs, indent=1))
    print(table(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
