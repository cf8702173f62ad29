"""Before / after device times of two or more trees, in alternating runs (what an A/B claim in
BENCHMARKS.md rests on):

    python3 -m benchmarks.ab --tree before=DIR --tree after=DIR [--runs 3] [--m 1 8 64 256]

Each ``DIR`` holds a checkout's ``packages/`` (for example ``git worktree add DIR COMMIT``, or an
unpacked ``git archive COMMIT packages``). The trees run in turn, ``--runs`` rounds of one fresh
process each, so that a drift of the machine (clocks, other tenants) falls on every tree alike; the
figure of a tree is the median of its runs. One run measures the fused DSV and GLM ops at tp 1 with
the same method as ``benchmarks.harness.graph_time_us`` (20 calls per CUDA graph, median of 25
replays), from this file, whatever the tree's own benchmarks look like. The table gives each tree's
median and its ratio to the first tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PACKAGES = ("mhc-core", "mhc-dsv41", "mhc-glm5")


def measure(ms: list[int]) -> dict[str, dict[int, float]]:
    """One run, in this process: the tree's packages are first on sys.path (``main`` sets it)."""
    import torch

    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    from .harness import graph_time_us
    from .suites import bf16, dsv41_inputs, glm5_inputs

    torch.manual_seed(0)
    dsv = AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=max(ms), device="cuda")
    glm = AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=max(ms), device="cuda")
    result: dict[str, dict[int, float]] = {"dsv41": {}, "glm5": {}}
    for m in ms:
        x, dsv_args = bf16(m, 5120), dsv41_inputs(m, 5120)
        out = (torch.empty_like(dsv_args[0]), torch.empty_like(x))
        result["dsv41"][m] = graph_time_us(lambda x=x, dsv_args=dsv_args, out=out: dsv(x, *dsv_args, out=out))
        y, args = bf16(m, 4096), glm5_inputs(m, 4096)

        def glm_step(y: torch.Tensor = y, args: tuple = args) -> None:
            glm(y, *args)
            glm.join()  # the fused time includes the side-stream mixes

        result["glm5"][m] = graph_time_us(glm_step)
    return result


def table(runs: dict[str, list[dict[str, dict[int, float]]]]) -> str:
    tags = list(runs)
    lines = []
    for model in ("dsv41", "glm5"):
        count = len(runs[tags[0]])
        lines.append(f"\n{model}, tp 1: median us per call of {count} alternating runs (ratio to {tags[0]})")
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
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # a child process
    options = parser.parse_args()
    if options.one_run:
        print(json.dumps(measure(options.m)), flush=True)
        return 0
    trees = dict(spec.split("=", 1) for spec in options.tree)
    if len(trees) < 2 or any(not (Path(path) / "packages").is_dir() for path in trees.values()):
        parser.error("--tree: expected two or more TAG=DIR, each DIR holding packages/")
    runs: dict[str, list[dict[str, dict[int, float]]]] = {tag: [] for tag in trees}
    root = Path(__file__).resolve().parents[1]
    for _ in range(options.runs):
        for tag, path in trees.items():
            sources = [str(Path(path).resolve() / "packages" / package / "src") for package in PACKAGES]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sources, str(root), os.environ.get("PYTHONPATH", "")])}
            command = [sys.executable, "-m", "benchmarks.ab", "--one-run", "--m", *map(str, options.m)]
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
