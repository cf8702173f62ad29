"""``python3 -m demo``: a decoder on the fused ops, end to end, against the unfused one (``nox -s demo``).

    python3 -m demo [--stack dsv41 glm5] [--m 1 8 64] [--steps 32] [--layers N] [--compile MODE] [--out DIR]
                    [--diagnose]
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m demo     # tp 2, one rank per GPU

For each stack (``demo.config``'s embedded defaults, random seeded weights, nothing downloaded)
and each M: the unfused path (all-reduce, then the model's torch boundary, ``<package>.bench.baseline``)
and the fused one (``torch.ops.mhc``) are compiled with ``torch.compile`` (``--compile``; ``none``: eager)
and captured in CUDA graphs; a ``--steps``-step decode checks the logits at every step
(``demo.check``; the routing computed once per step and fed to both); then the per-step latency of
both paths, tokens/s, the boundaries per step, the per-boundary saving measured in isolation in the
same run (``demo.isolated``) and the integration efficiency (``demo.report``). Prints the table,
writes ``demo_tp<tp>.json`` and ``demo_tp<tp>.png`` (with matplotlib) into ``--out``. Exit status 1
when a logit check failed.

Under torchrun the GEMMs are sharded over the ranks (each sublayer's output a partial sum), the
unfused path all-reduces with NCCL and the fused op is built over the same process group; NVLink
multicast stays off (as in ``benchmarks.run``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for package in ("mhc-core", "mhc-dsv41", "mhc-glm5"):
    source = str(ROOT / "packages" / package / "src")
    if source not in sys.path:
        sys.path.insert(0, source)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for variable, value in (
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(variable, value)

import torch  # noqa: E402

from . import isolated, report  # noqa: E402
from .boundaries import EmulatedBoundary, FusedBoundary, UnfusedBoundary  # noqa: E402
from .check import Paths, StepResult, decode_check  # noqa: E402
from .config import MODELS, StackConfig, default  # noqa: E402
from .graphs import Graphed  # noqa: E402
from .model import Stack, build  # noqa: E402
from .opaque import OpaqueUnfusedBoundary  # noqa: E402
from .tolerance import DRAWS  # noqa: E402

DEFAULT_M = (1, 8, 64)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "none")


class Environment:
    """The process's place in the TP group (tp 1 without torchrun)."""

    def __init__(self) -> None:
        self.group, self.tp, self.rank = None, 1, 0
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
            self.group, self.tp, self.rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device())

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def compiler(mode: str):
    """``torch.compile`` in ``mode`` (one specialization per M: ``dynamic=False``), or nothing for ``none``."""
    if mode == "none":
        return lambda function: function
    # Every (boundary kind, path, M) compiles the same few code objects again (the isolated boundary
    # calls are closures of one function): 12 or more specializations, past Dynamo's default limit
    # of 8 per code object, which fullgraph turns into an error.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    options = {} if mode == "default" else {"mode": mode}
    return lambda function: torch.compile(function, fullgraph=True, dynamic=False, **options)


def build_op(config: StackConfig, env: Environment, capacity: int, gpu: str):
    """One fused op for every boundary of the model, from the preset of this hidden size and tp."""
    preset = config.preset(env.tp, gpu)
    if config.model == "dsv41":
        from mhc_dsv41 import AllReduceMHC

        op = AllReduceMHC.from_preset(preset, max_num_tokens=capacity, device=env.device, group=env.group)
        if op.top_k != config.moe.top_k:
            raise ValueError(f"preset {preset}: top_k {op.top_k}, the model routes top {config.moe.top_k}")
        return op
    from mhc_glm5 import AllReduceMhcBoundary, presets

    found = presets.get(preset).PRESET
    mixes = config.mixes
    expected = (mixes.rms_eps, mixes.hc_eps, mixes.post_mult, mixes.sinkhorn_repeat, config.norm_eps, config.moe.top_k)
    actual = (found.rms_eps, found.hc_eps, found.post_mult, found.sinkhorn_repeat, found.norm_eps, found.top_k)
    if expected != actual:
        raise ValueError(f"preset {preset}: constants {actual} differ from the model's {expected}")
    return AllReduceMhcBoundary.from_config(found, max_num_tokens=capacity, device=env.device, group=env.group)


def timer(env: Environment):
    """``mhc_core.bench.records.Context.time``: CUDA-graph replays, every rank's replay started together, the
    slowest rank's median."""
    from mhc_core.bench.records import Context

    return Context(tp=env.tp, rank=env.rank, group=env.group, bandwidth=0.0).time


class Demo:
    """One stack on the GPU: the seeded model, its fused op, both paths compiled (not yet captured)."""

    def __init__(
        self,
        config: StackConfig,
        env: Environment,
        *,
        capacity: int,
        compile_mode: str,
        gpu: str,
        seed: int,
        diagnose: bool = False,
    ):
        self.config, self.env, self.seed = config, env, seed
        self.model: Stack = build(config, tp=env.tp, rank=env.rank, device=env.device, seed=seed)
        self.op = build_op(config, env, capacity, gpu)
        self.unfused_boundary = UnfusedBoundary(config, env.group)
        self.fused_boundary = FusedBoundary(self.op)
        self.compile_fn = compiler(compile_mode)
        model = self.model

        def unfused_step(tokens, routing):
            return model(tokens, routing, self.unfused_boundary)

        def fused_step(tokens, routing):
            trace = []
            return model(tokens, routing, self.fused_boundary, trace), trace

        self.route = self.compile_fn(model.route)
        self.unfused, self.fused = self.compile_fn(unfused_step), self.compile_fn(fused_step)
        self.opaque = None
        if diagnose:
            opaque_boundary = OpaqueUnfusedBoundary(config, env.group, self.compile_fn)

            def opaque_step(tokens, routing):
                return model(tokens, routing, opaque_boundary)

            self.opaque = self.compile_fn(opaque_step)

    def tokens(self, m: int) -> torch.Tensor:
        generator = torch.Generator(self.env.device)
        generator.manual_seed(self.seed + m)
        return torch.randint(0, self.config.vocab, (m,), generator=generator, device=self.env.device)

    def paths(self, tokens: torch.Tensor) -> Paths:
        """Both paths captured in CUDA graphs over ``tokens``; the router graph's outputs are their routing."""
        route = Graphed(self.route, tokens)
        routing = route.outputs
        return Paths(
            route=route,
            unfused=Graphed(self.unfused, tokens, routing),
            fused=Graphed(self.fused, tokens, routing),
            eager=self.model,
            unfused_boundary=self.unfused_boundary,
            emulated=[
                EmulatedBoundary(
                    self.config, seed=self.seed + 1000 + draw, device=self.env.device, group=self.env.group
                )
                for draw in range(DRAWS)
            ],
        )

    def check(self, m: int, steps: int) -> tuple[list[StepResult], Paths]:
        """A ``steps``-step decode of ``m`` tokens, checked at every step (``demo.check``)."""
        tokens = self.tokens(m)
        paths = self.paths(tokens)
        return decode_check(self.model, paths, tokens, steps=steps, seed=self.seed, group=self.env.group), paths

    def measure(self, m: int, paths: Paths, steps: list[StepResult]) -> report.Row:
        """Step latency of both paths (router included) and the isolated per-boundary timings."""
        time_us = timer(self.env)
        tokens = self.tokens(m)
        unfused_us = time_us(lambda: self.unfused(tokens, self.route(tokens)))
        fused_us = time_us(lambda: self.fused(tokens, self.route(tokens)))
        opaque = self.opaque
        opaque_us = None if opaque is None else time_us(lambda: opaque(tokens, self.route(tokens)))
        boundaries = {"unfused": self.unfused_boundary, "fused": self.fused_boundary}
        routing = paths.route.outputs
        timings = isolated.measure(self.model, boundaries, paths.fused.outputs[1], routing, time_us, self.compile_fn)
        return report.Row(
            model=self.config.model, tp=self.env.tp, m=m, layers=self.config.layers, unfused_us=unfused_us,
            fused_us=fused_us, isolated_us=timings, steps=[step.as_dict() for step in steps], opaque_us=opaque_us,
        )  # fmt: skip


def run_stack(config: StackConfig, options: argparse.Namespace, env: Environment) -> list[report.Row]:
    demo = Demo(
        config, env, capacity=max(options.m), compile_mode=options.compile, gpu=options.gpu, seed=options.seed,
        diagnose=options.diagnose,
    )  # fmt: skip
    rows = []
    for m in options.m:
        log(env, f"[{config.model} M={m}] compile, capture, {options.steps}-step decode checked at every step")
        steps, paths = demo.check(m, options.steps)
        for step in [step for step in steps if not step.passed][:3]:
            log(env, f"  check failed at step {step.step}: {step}")
        log(env, f"[{config.model} M={m}] timing")
        rows.append(demo.measure(m, paths, steps))
        del paths
    return rows


def log(env: Environment, message: str) -> None:
    if env.rank == 0:
        print(message, flush=True)


def commit() -> str:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return result.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    parser.add_argument("--steps", type=int, default=32, help="decode steps, logits checked at each")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the embedded config's)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="default", help="torch.compile mode of both paths")
    parser.add_argument("--gpu", default="h200", help="the presets' GPU prefix (h200-tp<tp>-h<hidden>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / ".out" / "demo")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also time the unfused path with its boundaries behind opaque custom ops (demo.opaque)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    env = Environment()
    from mhc_core.bench.timing import device_description

    header = {
        "date": datetime.date.today().isoformat(),
        "gpu": device_description(),
        "commit": options.commit or commit(),
        "tp": env.tp,
        "compile": options.compile,
        "steps": options.steps,
    }
    log(env, str(header))
    rows = []
    with torch.no_grad():
        for model in options.stack:
            config = default(model)
            if options.layers is not None:
                config = config.replace(layers=options.layers)
            rows += run_stack(config, options, env)
            log(env, report.table([r for r in rows if r.model == model]))
    if env.rank == 0:
        options.out.mkdir(parents=True, exist_ok=True)
        stem = options.out / f"demo_tp{env.tp}"
        report.write_json(rows, stem.with_suffix(".json"), header)
        plotted = report.plot(rows, stem.with_suffix(".png"), header)
        print(report.table(rows))
        print(f"results in {options.out}" + ("" if plotted else " (matplotlib missing: no plot)"), flush=True)
    env.close()
    return 0 if all(row.check_passed for row in rows) else 1
