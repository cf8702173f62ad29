"""Multi-GPU suite: every rank a process, a real torch process group, the ops' own transport (NVLink
multicast stays off). Two modes, and a third for one killed rank:

* **One process per GPU** (the default): torchrun, a NCCL group, the mailbox in torch symmetric
  memory::

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.multigpu.run --tp 2

* **Processes per GPU** (``--procs-per-gpu``): rank r on GPU ``r % device_count`` (every rank on GPU 0
  of a one-GPU host), a gloo group (NCCL cannot put two ranks on one GPU), the mailbox mapped through
  CUDA IPC (the ops' ``mailbox_allocation="auto"`` takes it when ranks share a GPU); the harness's
  own collectives go through CPU tensors. Without MPS the processes' kernels time-slice: a spinning
  collective waits for its peers' slices (correct, slower)::

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 -m tests.multigpu.run --tp 4 --procs-per-gpu

* **Kill** (``--kill-rank R``): driven by ``tests.multigpu.kill`` (not torchrun, which tears the job
  down when a rank dies): good calls, then rank R SIGKILLs itself; every other rank's next calls must
  raise (``LamportTimeoutError``, or a CUDA error) within the spin bound plus slack.

Every rank draws every rank's inputs from the same seed, runs its own share through the op and
checks its outputs against the reference; outputs are then compared bit for bit across ranks. The
suites: ``core``, ``dsv41``, ``glm5`` (shapes, MoE finalize, CUDA graphs), ``fp8`` (both models' FP8
layer input, every format, bitwise against the reference quantiser and across ranks) and ``stress`` (hundreds of
calls of random M with random host-side delays per rank; construction, a call and ``close()`` with
one rank a second late). Prints one line per case with the wall time of its slowest rank and ends
with "multigpu: N passed, M failed".

``nox -s multigpu`` runs this runner as a matrix, ``multigpu(tp=2|4|8, mode='gpus'|'procs-per-gpu')``.
The cases stay hand-written functions here rather than pytest cases collected in each rank, because
every case is itself a collective over all ranks: (1) a rank whose case fails must still take part
in the cases' closing collectives (``agree``, the cross-rank bit comparison), or its peers spin in
the Lamport wait until their spin bound; a pytest failure or skip decided on one rank (an assert, a
``skipif``, ``-x``, ``-k`` given to one rank) would leave the ranks in different cases. Here every
rank runs the same list in the same order and a failure is a value that ``agree`` reduces. (2)
Cases share state a per-rank collection would rebuild per test: one process group, ops built once
per shape and reused across cases (construction is itself a collective vote), and the GPU kept busy
between them. (3) The kill mode needs a driver outside torchrun (``tests.multigpu.kill``), which
tears the job down when a rank dies. (4) The verdict is the slowest rank's wall time per case and
one "N passed" line for the whole job. The case lists (``SUITES``) and ``--only`` give what
collection would: a named subset.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for package in ("mhc-core", "mhc-dsv41", "mhc-glm5"):
    sys.path.insert(0, str(ROOT / "packages" / package / "src"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MHC_SPIN_TIMEOUT_MS", "10000")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.support import assert_bitwise_equal, bf16_randn, bits, poisoned  # noqa: E402

CAPACITY = 160
SUITE_NAMES = ("core", "dsv41", "glm5", "fp8", "stress")
MAILBOX_ALLOCATION_ENV = "MHC_MAILBOX_ALLOCATION"
#: Host-side delay before each stressed call: uniform in [0, MAX_DELAY_S], per rank.
MAX_DELAY_S = 0.002
#: Stressed calls are launched this many at a time, then checked (the GPU runs ahead of the checks).
CHECK_EVERY = 16
#: How late rank tp - 1 is to construction, its first call and close() in the skew cases.
SKEW_S = 1.0
#: Calls a surviving rank makes after the kill before it gives up waiting for an error.
KILL_CALLS = 3

#: Where the harness's own collectives run: CUDA tensors under NCCL, CPU tensors under gloo.
COLLECTIVE_DEVICE = torch.device("cuda")


# -------------------------------------------------------------------------- options
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.multigpu.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, required=True, choices=(2, 4, 8))
    parser.add_argument("--only", choices=SUITE_NAMES, action="append", help="run only these suites (repeatable)")
    parser.add_argument(
        "--procs-per-gpu",
        action="store_true",
        help="rank r on GPU r %% device_count, a gloo group, the mailbox through CUDA IPC (ranks sharing a GPU)",
    )
    parser.add_argument(
        "--mailbox-allocation",
        choices=("auto", "symmetric", "ipc"),
        help=f"export {MAILBOX_ALLOCATION_ENV} (the ops' mailbox_allocation; default: the op's 'auto')",
    )
    parser.add_argument(
        "--protocol",
        choices=("auto", "one-shot", "two-shot"),
        help="export MHC_PROTOCOL (the fused ops' all-reduce protocol, issue #47; default: the op's 'auto', "
        "which routes by M at the presets' crossovers); the plain LamportAllReduce stays one-shot",
    )
    parser.add_argument(
        "--calls-scale",
        type=float,
        default=1.0,
        help="scale every loop's call and replay count (e.g. 0.2 where time-slicing makes calls slow)",
    )
    parser.add_argument("--stress-calls", type=int, default=300, help="calls per stressed op (before --calls-scale)")
    kill = parser.add_argument_group("kill mode (run by tests.multigpu.kill)")
    kill.add_argument("--kill-rank", type=int, help="this rank SIGKILLs itself after the good calls")
    kill.add_argument("--kill-spin-ms", type=float, default=3000.0, help="the op's spin_timeout_ms in kill mode")
    kill.add_argument("--kill-slack-s", type=float, default=5.0, help="seconds allowed beyond the spin bound")
    kill.add_argument("--kill-good-calls", type=int, default=20, help="checked calls before the kill")
    kill.add_argument(
        "--kill-protocol", choices=("one-shot", "two-shot"), default="one-shot", help="the protocol of the killed op"
    )
    options = parser.parse_args(argv)
    if options.kill_rank is not None and not 0 <= options.kill_rank < options.tp:
        parser.error(f"--kill-rank: expected a rank in [0, {options.tp}), got {options.kill_rank}")
    if options.calls_scale <= 0:
        parser.error(f"--calls-scale: expected > 0, got {options.calls_scale}")
    return options


def scaled(count: int, options: argparse.Namespace) -> int:
    """A loop's count under ``--calls-scale`` (at least 1)."""
    return max(1, round(count * options.calls_scale))


def rank_device(local_rank: int, device_count: int, procs_per_gpu: bool) -> int:
    """The GPU of a rank: its own (one process per GPU), else shared round-robin."""
    if procs_per_gpu:
        if device_count < 1:
            raise RuntimeError("--procs-per-gpu: no CUDA device is visible")
        return local_rank % device_count
    if local_rank >= device_count:
        raise RuntimeError(
            f"local rank {local_rank} but {device_count} GPUs: one process per GPU needs a GPU per rank "
            "(--procs-per-gpu runs several ranks on one GPU)"
        )
    return local_rank


def backend(procs_per_gpu: bool) -> str:
    """NCCL cannot put two ranks on one GPU: processes per GPU take gloo."""
    return "gloo" if procs_per_gpu else "nccl"


#: The fused ops' protocol variable (``mhc_core.protocols.PROTOCOL_ENV``), named without importing them.
PROTOCOL_ENV = "MHC_PROTOCOL"


def init(options: argparse.Namespace) -> tuple[Any, int, int]:
    """Bind this rank's GPU and start the process group; (group, tp, rank)."""
    global COLLECTIVE_DEVICE
    if options.mailbox_allocation:
        os.environ[MAILBOX_ALLOCATION_ENV] = options.mailbox_allocation
    if options.protocol:
        os.environ[PROTOCOL_ENV] = options.protocol
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(local_rank, torch.cuda.device_count(), options.procs_per_gpu)
    torch.cuda.set_device(device)
    if options.procs_per_gpu:
        # Every rank is on this host: gloo over loopback (the lent hosts resolve no outside address).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        COLLECTIVE_DEVICE = torch.device("cpu")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
        COLLECTIVE_DEVICE = torch.device("cuda", device)
    tp, rank = dist.get_world_size(), dist.get_rank()
    if tp != options.tp:
        raise SystemExit(f"--tp {options.tp} but the process group has {tp} ranks")
    return dist.group.WORLD, tp, rank


# ------------------------------------------------------------- the harness's collectives
def gather_bits(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor``, bit for bit. NCCL all_gather has no int16: gather the raw
    dtype on the GPU; gloo takes CPU tensors and no int16 or BF16 either: gather the bytes."""
    local = tensor.contiguous()
    world = dist.get_world_size()
    if COLLECTIVE_DEVICE.type == "cpu":
        raw = local.cpu().view(torch.uint8)
        copies = [torch.empty_like(raw) for _ in range(world)]
        dist.all_gather(copies, raw)
        return [copy.view(tensor.dtype) for copy in copies]
    copies = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(copies, local)
    return copies


def check_identical_across_ranks(*tensors: torch.Tensor) -> None:
    for index, tensor in enumerate(tensors):
        copies = gather_bits(tensor)
        for rank, copy in enumerate(copies):
            assert_bitwise_equal(copy, copies[0], f"output {index}: rank {rank} vs rank 0")


def agree(ok: bool, seconds: float) -> tuple[bool, float]:
    """Whether every rank passed, and the slowest rank's seconds (one all-reduce, MAX of both)."""
    values = torch.tensor([0.0 if ok else 1.0, seconds], dtype=torch.float64, device=COLLECTIVE_DEVICE)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values[0].item() == 0.0, values[1].item()


def digest(*tensors: torch.Tensor) -> str:
    """The bits of ``tensors`` hashed (compared across ranks without moving them all)."""
    hasher = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        hasher.update(bits(tensor.contiguous()).cpu().numpy().tobytes())
    return hasher.hexdigest()


def gather_objects(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def shared_generator(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


def synchronize() -> None:
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- core
def core_cases(group, tp: int, rank: int, options: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from mhc_core import LamportAllReduce, MoEOutput, reference

    ops: dict[tuple, LamportAllReduce] = {}
    calls, replays = scaled(100, options), scaled(1000, options)

    def op_for(hidden: int, top_k: int = 0) -> LamportAllReduce:
        if (hidden, top_k) not in ops:
            ops[hidden, top_k] = LamportAllReduce(
                hidden_size=hidden, max_num_tokens=CAPACITY, device="cuda", group=group, top_k=top_k
            )
        return ops[hidden, top_k]

    def all_reduce_shapes() -> None:
        for hidden in (2560, 4096, 4608, 7168):
            generator = shared_generator(hidden)
            for m in (1, 7, 64, CAPACITY):
                partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
                out = poisoned((m, hidden), torch.bfloat16)
                result = op_for(hidden)(partials[rank], out=out)
                assert_bitwise_equal(result, reference.all_reduce(partials), f"hidden {hidden} M {m}")
                check_identical_across_ranks(result)

    def negative_zero_inputs() -> None:
        x = torch.full((CAPACITY, 4096), -0.0, dtype=torch.bfloat16, device="cuda")
        result = op_for(4096)(x)
        assert (result.view(torch.int16) == 0).all()

    def consecutive_calls() -> None:
        generator = shared_generator(100)
        for call in range(calls):
            m = 1 + (call * 37) % CAPACITY
            partials = [bf16_randn(m, 2560, generator=generator) for _ in range(tp)]
            assert_bitwise_equal(op_for(2560)(partials[rank]), reference.all_reduce(partials), f"call {call}")

    def graph_replays() -> None:
        op = op_for(4096)
        m = 7
        x = torch.zeros(m, 4096, dtype=torch.bfloat16, device="cuda")
        out = poisoned((m, 4096), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(x, out=out)
        generator = shared_generator(1000)
        for replay in range(replays):
            partials = [bf16_randn(m, 4096, generator=generator) for _ in range(tp)]
            x.copy_(partials[rank])
            out.view(torch.int16).fill_(0x7FA5)
            graph.replay()
            assert_bitwise_equal(out, reference.all_reduce(partials), f"replay {replay}")

    def finalize() -> None:
        from tests.core.test_finalize_gpu import finalize_tolerance
        from tests.support import assert_within, bf16_ulp

        for weight_dtype in (torch.float32, torch.bfloat16):
            generator = shared_generator(7 if weight_dtype == torch.float32 else 8)
            for m in (1, 13, CAPACITY):
                moes = []
                for _ in range(tp):
                    rows = 2 * m + 3
                    index = torch.randint(0, rows, (m, 8), generator=generator, device="cuda", dtype=torch.int32)
                    index[torch.rand(m, 8, generator=generator, device="cuda") < 0.3] = -1
                    index[0] = -1
                    shared = bf16_randn(m, 4608, generator=generator)
                    shared[0] = -0.0
                    moes.append(
                        MoEOutput(
                            bf16_randn(rows, 4608, generator=generator),
                            torch.rand(m, 8, generator=generator, device="cuda").to(weight_dtype),
                            index,
                            shared,
                        )
                    )
                result = op_for(4608, top_k=8)(moes[rank])
                values = [
                    reference.finalize(
                        mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output
                    )
                    for mo in moes
                ]
                expected = reference.all_reduce(values)
                tolerance = bf16_ulp(expected) + sum(finalize_tolerance(mo) for mo in moes)
                assert_within(result, expected, tolerance, f"finalize M {m}")
                assert (result[0].view(torch.int16) == 0).all()
                check_identical_across_ranks(result)

    return {
        "core: all-reduce shapes, bit-exact": all_reduce_shapes,
        "core: -0 inputs": negative_zero_inputs,
        f"core: {calls} consecutive calls": consecutive_calls,
        f"core: CUDA graph, {replays} replays": graph_replays,
        "core: MoE finalize, fp32 and bf16 weights": finalize,
    }


# ---------------------------------------------------------------------------- dsv41
def dsv41_cases(group, tp: int, rank: int, options: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from mhc_core import reference
    from mhc_dsv41 import AllReduceMHC, presets
    from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS, check_outputs, inputs

    name = f"h200-tp{tp}-h5120"
    op = AllReduceMHC.from_preset(name, max_num_tokens=CAPACITY, device="cuda", group=group)
    hc, hidden = presets.get(name).PRESET.hc, presets.get(name).PRESET.hidden
    replays = scaled(200, options)

    def shapes() -> None:
        generator = shared_generator(41)
        for index, m in enumerate((1, 3, 16, 128, CAPACITY)):
            residual, post, comb, pre, weight = inputs(
                m, hc, hidden, generator, post_3d=index % 2 == 1, negative_zero=index == 2
            )
            partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
            out = (poisoned((m, hc, hidden), torch.bfloat16), poisoned((m, hidden), torch.bfloat16))
            result = op(partials[rank], residual, post, comb, pre, weight, NORM_EPS, out=out)
            check_outputs([result], reference.all_reduce(partials), residual, post, comb, pre, weight)
            check_identical_across_ranks(*result)

    def graph() -> None:
        for m in (1, 37, CAPACITY):
            generator = shared_generator(m)
            x = torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda")
            residual, post, comb, pre, weight = inputs(m, hc, hidden, generator, post_3d=False, negative_zero=False)
            out = (poisoned((m, hc, hidden), torch.bfloat16), poisoned((m, hidden), torch.bfloat16))
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                op(x, residual, post, comb, pre, weight, NORM_EPS, out=out)
            for _ in range(replays):
                partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
                x.copy_(partials[rank])
                for static, value in zip(
                    (residual, post, comb, pre, weight),
                    inputs(m, hc, hidden, generator, post_3d=False, negative_zero=False),
                    strict=True,
                ):
                    static.copy_(value)
                cuda_graph.replay()
                check_outputs([out], reference.all_reduce(partials), residual, post, comb, pre, weight)
            check_identical_across_ranks(*out)

    return {f"dsv41: {name} shapes": shapes, f"dsv41: {name} CUDA graphs, {replays} replays per M": graph}


# ----------------------------------------------------------------------------- glm5
def glm5_cases(group, tp: int, rank: int, options: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from mhc_core import reference
    from mhc_glm5 import AllReduceMhcBoundary
    from tests.glm5.checks import boundary_inputs, check_boundary

    name = f"h200-tp{tp}-h4096"
    capacity = 1032
    op = AllReduceMhcBoundary.from_preset(name, max_num_tokens=capacity, device="cuda", group=group)
    hidden = op.hidden_size

    def run(m: int, generator: torch.Generator, negative_zero: bool = False) -> None:
        args = boundary_inputs(m, hidden, generator, negative_zero=negative_zero)
        partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
        result = op(partials[rank], *args.values())
        op.join()
        torch.cuda.synchronize()
        check_boundary(op, [result], reference.all_reduce(partials, lanes=4), args, [op.raw_mixes[:m].clone()])
        check_identical_across_ranks(*result, op.raw_mixes[:m])

    def shapes() -> None:
        generator = shared_generator(53)
        for index, m in enumerate((1, 5, 17, 33, 100, 1025, capacity)):
            run(m, generator, negative_zero=index == 1)

    def moe() -> None:
        from mhc_core import MoEOutput

        generator = shared_generator(59)
        for weight_dtype in (torch.float32, torch.bfloat16):
            for m in (1, 33):
                args = boundary_inputs(m, hidden, generator)
                moes = []
                for _ in range(tp):
                    index = torch.randint(
                        0, 2 * m, (m, op.top_k), generator=generator, device="cuda", dtype=torch.int32
                    )
                    index[torch.rand(m, op.top_k, generator=generator, device="cuda") < 0.3] = -1
                    moes.append(
                        MoEOutput(
                            bf16_randn(2 * m, hidden, generator=generator),
                            (torch.rand(m, op.top_k, generator=generator, device="cuda") / op.top_k).to(weight_dtype),
                            index,
                            bf16_randn(m, hidden, generator=generator),
                        )
                    )
                result = op(moes[rank], *args.values())
                op.join()
                torch.cuda.synchronize()
                check_identical_across_ranks(*result, op.raw_mixes[:m])

    return {
        f"glm5: {name} (one-token and grouped kernels)": shapes,
        f"glm5: {name} MoE input, fp32 and bf16 weights": moe,
    }


# ------------------------------------------------------------------------------ fp8
def fp8_cases(group, tp: int, rank: int, options: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """Issue #33's FP8 layer input over real ranks: both models, every format beside the BF16 copy,
    one format FP8-only, on ``__call__``, ``finalize`` / MoE input and ``publish`` + ``collect``, the
    one-token and the persistent / grouped kernels, and one CUDA graph per model replayed on fresh
    data. Every call: outputs poisoned first (every second call), ``residual_out`` and the BF16 copy
    equal the BF16 op's on the same inputs, ``q`` and the scales (whole allocation) equal
    ``mhc_core.fp8.quantize`` of that layer input, and every rank's bytes equal rank 0's. The FP8
    kernels ship in no package: rank 0 compiles them into the cache in parallel first."""
    from mhc_core import device_arch, fp8
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41 import presets as dsv41_presets
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5 import presets as glm5_presets
    from tests.dsv41 import test_fp8_op_gpu as dsv41_fp8
    from tests.dsv41.test_allreduce_mhc_gpu import LOOPING_CLUSTERS, NORM_EPS
    from tests.glm5 import test_fp8_op_gpu as glm5_fp8

    formats = tuple(fp8.FORMATS)
    dsv41_preset = dsv41_presets.get(f"h200-tp{tp}-h5120").PRESET
    glm5_preset = glm5_presets.get(f"h200-tp{tp}-h4096").PRESET
    # (format, BF16 copy beside it): every format in both-outputs mode, one in FP8-only mode per model.
    dsv41_modes = [(name, True) for name in formats] + [("mx-g32", False)]
    glm5_modes = [(name, True) for name in formats] + [("fp32-g128", False)]
    if rank == 0:
        from benchmarks import prewarm

        arch = device_arch(torch.cuda.current_device())
        fields = [{"layer_input_format": name, "layer_input_bf16": both} for name, both in dsv41_modes]
        specs = prewarm.preset_specs(dsv41_preset, arch, fields)
        fields = [{"layer_input_format": name, "layer_input_bf16": both} for name, both in glm5_modes]
        specs += prewarm.preset_specs(glm5_preset, arch, fields)
        print(prewarm.prewarm(specs, arch), flush=True)
    dist.barrier()

    persistent = dict(persistent_min_tokens=1, clusters=LOOPING_CLUSTERS)
    dsv41_capacity, glm5_capacity = CAPACITY, 304

    def dsv41_op(**fields: Any) -> Any:
        return AllReduceMHC.from_config(
            dsv41_preset, max_num_tokens=dsv41_capacity, device="cuda", group=group, **fields
        )

    def glm5_op(**fields: Any) -> Any:
        return AllReduceMhcBoundary.from_config(
            glm5_preset, max_num_tokens=glm5_capacity, device="cuda", group=group, **fields
        )

    dsv41_ops = {
        (name, both, looping): dsv41_op(
            layer_input_format=name, layer_input_bf16=both, **(persistent if looping else {})
        )
        for name, both in dsv41_modes
        for looping in (False, True)
    }
    dsv41_bf16 = {looping: dsv41_op(**(persistent if looping else {})) for looping in (False, True)}
    glm5_ops = {(name, both): glm5_op(layer_input_format=name, layer_input_bf16=both) for name, both in glm5_modes}
    glm5_bf16 = glm5_op()
    replays = scaled(20, options)

    def check(module: Any, outputs: tuple, reference: tuple, name: str, both: bool, m: int, what: str) -> None:
        """This rank as ``module.check_call``'s rank 0 (every check), then every output's whole
        allocation against rank 0's."""
        hidden = outputs[0].shape[-1]
        module.check_call([outputs], [reference], name, both, m, hidden, f"{what}, rank {rank}")
        check_identical_across_ranks(*(module.flat_bytes(tensor) for tensor in outputs))

    # -------------------------------------------------------------- dsv41
    def dsv41_args(how: str, m: int, generator: torch.Generator) -> tuple[str, tuple]:
        partials, shared = dsv41_fp8.case([dsv41_bf16[False]] * tp, m, generator)
        if how == "finalize":
            mo = dsv41_fp8.moe_inputs([dsv41_bf16[False]] * tp, m, generator)[rank]
            moe = (mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output)
            return "finalize", (*moe, *shared, NORM_EPS)
        return how, (partials[rank], *shared, NORM_EPS)

    def dsv41_call(op: Any, how: str, args: tuple, out: tuple | None) -> tuple:
        kwargs = {} if out is None else dict(out=out)
        if how == "collect":
            op.publish(args[0])
            return op.collect(*args[1:], **kwargs)
        return getattr(op, "finalize" if how == "finalize" else "__call__")(*args, **kwargs)

    def dsv41_formats() -> None:
        calls = {
            False: ((1, "call"), (5, "collect"), (130, "finalize")),
            True: ((LOOPING_CLUSTERS + 1, "call"), (37, "collect")),
        }
        for (name, both, looping), op in dsv41_ops.items():
            generator = shared_generator(sum(map(ord, f"dsv41 {name} {both} {looping}")))
            for index, (m, how) in enumerate(calls[looping]):
                kernel = "persistent" if looping else "one-token"
                what = f"dsv41 {name} {'both' if both else 'fp8'} {kernel} {how} M = {m}"
                how, args = dsv41_args(how, m, generator)
                out = dsv41_fp8.poisoned_outputs(name, both, m, op.hidden_size) if index % 2 == 0 else None
                outputs = dsv41_call(op, how, args, out)
                reference = dsv41_call(dsv41_bf16[looping], how, args, None)
                synchronize()
                check(dsv41_fp8, outputs, reference, name, both, m, what)

    def dsv41_graph() -> None:
        name, m = "ue8m0-g128-packed", 37
        op, generator = dsv41_ops[name, True, False], shared_generator(83)
        _, args = dsv41_args("call", m, generator)
        static = tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)
        out = dsv41_fp8.poisoned_outputs(name, True, m, op.hidden_size)
        dsv41_call(op, "call", static, out)  # eager first, then capture: an engine's order
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dsv41_call(op, "call", static, out)
        for replay in range(replays):
            _, args = dsv41_args("call", m, generator)
            for target, value in zip(static, args, strict=True):
                if isinstance(target, torch.Tensor):
                    target.copy_(value)
            graph.replay()
            reference = dsv41_call(dsv41_bf16[False], "call", static, None)
            synchronize()
            check(dsv41_fp8, out, reference, name, True, m, f"dsv41 {name} graph replay {replay}")

    # --------------------------------------------------------------- glm5
    def glm5_run(op: Any, how: str, x: Any, shared: tuple, out: tuple | None) -> tuple:
        kwargs = {} if out is None else dict(out=out)
        if how == "collect":
            op.publish(x)
            result = op.collect(*shared, **kwargs)
        else:
            result = op(x, *shared, **kwargs)
        op.join()
        return result

    def glm5_inputs(how: str, m: int, generator: torch.Generator) -> tuple[Any, tuple]:
        partials, shared = glm5_fp8.case([glm5_bf16] * tp, m, generator)
        if how == "moe":
            return glm5_fp8.moe_inputs([glm5_bf16] * tp, m, torch.float32, generator)[rank], shared
        return partials[rank], shared

    def glm5_formats() -> None:
        # One-token, x8 / x16 grouped and (where the preset has it) persistent: M from the thresholds.
        calls = ((1, "call"), (20, "moe"), (130, "collect"), (301, "call"))
        for (name, both), op in glm5_ops.items():
            generator = shared_generator(sum(map(ord, f"glm5 {name} {both}")))
            for index, (m, how) in enumerate(calls):
                grouping = f"{op.tokens_per_cluster(m)} per cluster"
                what = f"glm5 {name} {'both' if both else 'fp8'} {how} M = {m} ({grouping})"
                x, shared = glm5_inputs(how, m, generator)
                out = glm5_fp8.poisoned_outputs(name, both, m, op.hidden_size) if index % 2 == 0 else None
                outputs = glm5_run(op, how, x, shared, out)
                reference = glm5_run(glm5_bf16, how, x, shared, None)
                synchronize()
                check(glm5_fp8, outputs, reference, name, both, m, what)

    def glm5_graph() -> None:
        name, m = "mx-g32", 37
        op, generator = glm5_ops[name, True], shared_generator(89)
        x, shared = glm5_inputs("call", m, generator)
        x, shared = x.clone(), tuple(arg.clone() for arg in shared)
        out = glm5_fp8.poisoned_outputs(name, True, m, op.hidden_size)
        glm5_run(op, "call", x, shared, out)  # eager first, then capture: an engine's order
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            glm5_run(op, "call", x, shared, out)
        for replay in range(replays):
            fresh_x, fresh = glm5_inputs("call", m, generator)
            x.copy_(fresh_x)
            for target, value in zip(shared, fresh, strict=True):
                target.copy_(value)
            graph.replay()
            reference = glm5_run(glm5_bf16, "call", x, shared, None)
            synchronize()
            check(glm5_fp8, out, reference, name, True, m, f"glm5 {name} graph replay {replay}")

    return {
        f"fp8: dsv41 h200-tp{tp}-h5120, every format, one-token and persistent": dsv41_formats,
        f"fp8: dsv41 CUDA graph, {replays} replays": dsv41_graph,
        f"fp8: glm5 h200-tp{tp}-h4096, every format, every kernel": glm5_formats,
        f"fp8: glm5 CUDA graph, {replays} replays": glm5_graph,
    }


# --------------------------------------------------------------------------- stress
def random_calls(
    op: Any,
    rank: int,
    calls: int,
    seed: int,
    make_call: Callable[[int, int], tuple[tuple, Any]],
    check_call: Callable[[Any, Any], None],
) -> str:
    """``calls`` calls of ``op`` with ranks out of step: M per call from a generator seeded alike on
    every rank (the same M everywhere), each rank sleeping a random 0-2 ms (its own seed) before
    each call; launched ``CHECK_EVERY`` at a time, then each checked (``check_call(outputs,
    context)`` raises) and hashed. The hashes are compared across ranks at the end.

    ``make_call(index, m)`` returns this rank's call arguments and a check context. A failed check
    is kept and the calls go on, and an op error ends this rank's calls, so that every rank reaches
    the final gather and ``close()`` (collectives) whatever fails; the first failure is raised then.
    """
    shared = random.Random(seed)
    delays = random.Random(seed * 7919 + rank + 1)
    pending: list[tuple[int, int, Any, Any]] = []
    hashes: list[str] = []
    failure: BaseException | None = None
    slept = 0.0

    def check_pending() -> None:
        nonlocal failure
        for index, m, context, outputs in pending:
            try:
                check_call(outputs, context)
            except AssertionError as error:
                failure = failure or AssertionError(f"call {index} (M = {m}): {error}")
            hashes.append(digest(*(outputs if isinstance(outputs, tuple) else (outputs,))))
        pending.clear()

    try:
        for index in range(calls):
            m = shared.randint(1, CAPACITY)
            args, context = make_call(index, m)
            delay = delays.uniform(0.0, MAX_DELAY_S)
            time.sleep(delay)
            slept += delay
            pending.append((index, m, context, op(*args)))
            if len(pending) == CHECK_EVERY:
                check_pending()
        check_pending()
        op.check()
    except Exception as error:  # the op failed: stop calling, keep the ranks' collectives in step
        traceback.print_exc()
        failure = failure or error
    everyone = gather_objects(hashes)
    op.close()
    if failure is not None:
        raise failure
    for peer, theirs in enumerate(everyone):
        if len(theirs) != len(hashes):
            raise AssertionError(f"rank {peer} checked {len(theirs)} calls, rank {rank} {len(hashes)}")
        different = [index for index, (a, b) in enumerate(zip(theirs, hashes, strict=True)) if a != b]
        if different:
            raise AssertionError(f"rank {peer}'s outputs differ bitwise from rank {rank}'s in calls {different[:8]}")
    return f"{calls} calls, M in [1, {CAPACITY}], rank {rank} slept {slept:.2f} s in total"


def skewed(rank: int, tp: int, build: Callable[[], Any], use: Callable[[Any], tuple], calls: int = 4) -> str:
    """Rank tp - 1 sleeps ``SKEW_S`` before building the op, before its first call and before
    ``close()``; the others do not. Every step must succeed on every rank, and ``use(op)`` (one
    checked call, returning its outputs) give bitwise the same outputs on every rank (hashed,
    compared before ``close()``). Returns how long this rank's steps took (on a punctual rank:
    about ``SKEW_S`` each, the wait for the late one)."""
    late = rank == tp - 1
    seconds: dict[str, float] = {}
    failure: BaseException | None = None
    hashes: list[str] = []

    def step(name: str, action: Callable[[], Any]) -> Any:
        if late:
            time.sleep(SKEW_S)
        start = time.perf_counter()
        value = action()
        synchronize()
        seconds[name] = time.perf_counter() - start
        return value

    def call(op: Any) -> None:
        # A failed call is kept and the steps go on: close() is collective, every rank must reach it.
        nonlocal failure
        try:
            hashes.append(digest(*use(op)))
        except Exception as error:
            traceback.print_exc()
            failure = failure or error

    op = step("construction", build)
    step("first call", lambda: call(op))
    for _ in range(calls - 1):
        call(op)
    everyone = gather_objects(hashes)
    step("close()", op.close)
    if failure is not None:
        raise failure
    if any(theirs != hashes for theirs in everyone):
        raise AssertionError(f"the ranks' outputs differ bitwise: {everyone}")
    described = ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items())
    return f"rank {rank}{' (late)' if late else ''}: {described}"


def stress_cases(group, tp: int, rank: int, options: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from mhc_core import LamportAllReduce, reference
    from mhc_dsv41 import AllReduceMHC, presets
    from mhc_glm5 import AllReduceMhcBoundary
    from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS, check_outputs, inputs
    from tests.glm5.checks import boundary_inputs, check_boundary

    calls = scaled(options.stress_calls, options)
    dsv_name, glm_name = f"h200-tp{tp}-h5120", f"h200-tp{tp}-h4096"
    hc, dsv_hidden = presets.get(dsv_name).PRESET.hc, presets.get(dsv_name).PRESET.hidden

    def all_reduce_random() -> str:
        op = LamportAllReduce(hidden_size=4096, max_num_tokens=CAPACITY, device="cuda", group=group)
        generator = shared_generator(4096)

        def make_call(index: int, m: int) -> tuple[tuple, Any]:
            partials = [bf16_randn(m, 4096, generator=generator) for _ in range(tp)]
            return (partials[rank],), partials

        def check_call(result: torch.Tensor, partials: list[torch.Tensor]) -> None:
            assert_bitwise_equal(result, reference.all_reduce(partials), "all-reduce")

        return random_calls(op, rank, calls, 31, make_call, check_call)

    def dsv41_random() -> str:
        op = AllReduceMHC.from_preset(dsv_name, max_num_tokens=CAPACITY, device="cuda", group=group)
        generator = shared_generator(5120)

        def make_call(index: int, m: int) -> tuple[tuple, Any]:
            residual, post, comb, pre, weight = inputs(
                m, hc, dsv_hidden, generator, post_3d=index % 2 == 1, negative_zero=index % 5 == 0
            )
            partials = [bf16_randn(m, dsv_hidden, generator=generator) for _ in range(tp)]
            return (partials[rank], residual, post, comb, pre, weight, NORM_EPS), (
                partials, residual, post, comb, pre, weight,
            )  # fmt: skip

        def check_call(result: tuple, context: tuple) -> None:
            partials, *mixes = context
            check_outputs([result], reference.all_reduce(partials), *mixes)

        return random_calls(op, rank, calls, 41, make_call, check_call)

    def all_reduce_skew() -> str:
        generator = shared_generator(17)

        def use(op: LamportAllReduce) -> tuple:
            partials = [bf16_randn(5, 4096, generator=generator) for _ in range(tp)]
            result = op(partials[rank])
            assert_bitwise_equal(result, reference.all_reduce(partials), "skewed call")
            return (result,)

        return skewed(
            rank,
            tp,
            lambda: LamportAllReduce(hidden_size=4096, max_num_tokens=16, device="cuda", group=group),
            use,
        )

    def glm5_skew() -> str:
        generator = shared_generator(19)

        def use(op: AllReduceMhcBoundary) -> tuple:
            m = 5
            args = boundary_inputs(m, op.hidden_size, generator)
            partials = [bf16_randn(m, op.hidden_size, generator=generator) for _ in range(tp)]
            result = op(partials[rank], *args.values())
            op.join()
            synchronize()
            raw = op.raw_mixes[:m].clone()
            check_boundary(op, [result], reference.all_reduce(partials, lanes=4), args, [raw])
            return (*result, raw)

        return skewed(
            rank,
            tp,
            lambda: AllReduceMhcBoundary.from_preset(glm_name, max_num_tokens=64, device="cuda", group=group),
            use,
        )

    return {
        f"stress: LamportAllReduce, {calls} calls, random M, 0-2 ms host delays": all_reduce_random,
        f"stress: dsv41 {dsv_name}, {calls} calls, random M, 0-2 ms host delays": dsv41_random,
        f"stress: LamportAllReduce built, first called and closed with rank {tp - 1} {SKEW_S:.0f} s late": (
            all_reduce_skew
        ),
        f"stress: glm5 {glm_name} built, first called and closed with rank {tp - 1} {SKEW_S:.0f} s late": glm5_skew,
    }


SUITES: dict[str, Callable[..., dict[str, Callable[[], Any]]]] = {
    "core": core_cases,
    "dsv41": dsv41_cases,
    "glm5": glm5_cases,
    "fp8": fp8_cases,
    "stress": stress_cases,
}


# ----------------------------------------------------------------------------- kill
def kill_result_line(
    rank: int, error: BaseException | None, seconds: float, bound: float, calls: int, again: BaseException | None
) -> tuple[bool, str]:
    """A surviving rank's verdict and the line ``tests.multigpu.kill`` reads: it passes when its
    calls raised a ``LamportTimeoutError`` (or a CUDA error: the dead process's memory may have gone
    with it) within ``bound`` seconds, and the call after that raised again."""
    from mhc_core import LamportTimeoutError

    expected = isinstance(error, LamportTimeoutError) or (isinstance(error, RuntimeError) and "CUDA" in str(error))
    ok = expected and seconds <= bound and again is not None
    missing = getattr(error, "missing_ranks", None)
    line = (
        f"KILL-RESULT rank={rank} ok={int(ok)} error={type(error).__name__ if error else None} "
        f"seconds={seconds:.3f} bound={bound:.3f} calls={calls} missing={list(missing) if missing else None} "
        f"again={type(again).__name__ if again else None}"
    )
    return ok, line


class _TwoShotKillOp:
    """DSV4.1's fused op forced to the two-shot, called like the plain all-reduce (fixed mixes)."""

    def __init__(self, op, generator) -> None:
        from tests.dsv41.test_allreduce_mhc_gpu import inputs

        self.op = op
        self.args = inputs(8, 4, 4096, generator, post_3d=False, negative_zero=False)

    def __call__(self, x):
        return self.op(x, *self.args)

    def check(self) -> None:
        self.op.check()


def _two_shot_kill_op(group, spin_ms: float, generator) -> _TwoShotKillOp:
    from mhc_dsv41 import AllReduceMHC

    op = AllReduceMHC(
        hidden_size=4096, hc_mult=4, max_num_tokens=16, top_k=8, device="cuda", group=group, spin_timeout_ms=spin_ms,
        protocol="two-shot",
    )  # fmt: skip
    return _TwoShotKillOp(op, generator)


def kill_main(options: argparse.Namespace, group, tp: int, rank: int) -> int:
    """Good calls, a barrier, then rank ``--kill-rank`` SIGKILLs itself (its GPU idle, its last call
    collected: it publishes nothing more) and every other rank calls on until a call raises."""
    from mhc_core import LamportAllReduce, reference

    victim = options.kill_rank
    generator = shared_generator(23)
    if options.kill_protocol == "two-shot":
        op = _two_shot_kill_op(group, options.kill_spin_ms, generator)
    else:
        op = LamportAllReduce(
            hidden_size=4096, max_num_tokens=16, device="cuda", group=group, spin_timeout_ms=options.kill_spin_ms
        )
    for call in range(options.kill_good_calls):
        partials = [bf16_randn(8, 4096, generator=generator) for _ in range(tp)]
        if options.kill_protocol == "two-shot":
            # The fused op's reduced row, bit for bit: its layer input with unit weights is the
            # RMSNorm of the all-reduce's own collapse; here only the two-shot's health is checked.
            outputs = op(partials[rank])
            assert torch.isfinite(outputs[0].float()).all(), f"good call {call}: a non-finite output"
        else:
            assert_bitwise_equal(op(partials[rank]), reference.all_reduce(partials), f"good call {call}")
    op.check()
    synchronize()
    dist.barrier()
    if rank == victim:
        print(f"KILL rank={rank}: {options.kill_good_calls} good calls done, SIGKILL to myself", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    bound = options.kill_spin_ms / 1000 + options.kill_slack_s
    x = bf16_randn(8, 4096, generator=generator)
    error: BaseException | None = None
    again: BaseException | None = None
    calls = 0
    start = time.perf_counter()
    while calls < KILL_CALLS and error is None:
        calls += 1
        try:
            op(x)
            synchronize()
            op.check()
        except Exception as caught:
            error = caught
    seconds = time.perf_counter() - start
    if error is not None:
        try:
            op(x)
            synchronize()
            op.check()
        except Exception as caught:
            again = caught
    ok, line = kill_result_line(rank, error, seconds, bound, calls, again)
    print(line, flush=True)
    if error is not None:
        print(f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    sys.stderr.flush()
    # No close() or destroy_process_group(): both are collective, and a peer is dead.
    os._exit(0 if ok else 1)


# ----------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    group, tp, rank = init(options)
    if options.kill_rank is not None:
        return kill_main(options, group, tp, rank)
    mode = "processes per GPU, gloo" if options.procs_per_gpu else "one process per GPU, NCCL"
    if rank == 0:
        allocation = os.environ.get(MAILBOX_ALLOCATION_ENV, "auto (unset)")
        print(
            f"multigpu tp={tp}: {mode}, {torch.cuda.device_count()} GPU(s) visible, "
            f"{MAILBOX_ALLOCATION_ENV}={allocation}, MHC_SPIN_TIMEOUT_MS={os.environ['MHC_SPIN_TIMEOUT_MS']}",
            flush=True,
        )
    passed = failed = 0
    total = time.perf_counter()
    kept = []  # every suite's ops stay alive until the end: none is freed while a peer may map it
    for suite, make_cases in SUITES.items():
        if options.only and suite not in options.only:
            continue
        start = time.perf_counter()
        cases = make_cases(group, tp, rank, options)  # builds the suite's ops (collective)
        kept.append(cases)
        synchronize()
        _, seconds = agree(True, time.perf_counter() - start)
        if rank == 0:
            print(f"setup tp={tp} {suite}: {seconds:.1f} s", flush=True)
        for name, case in cases.items():
            start = time.perf_counter()
            detail = None
            try:
                detail = case()
                synchronize()
                ok = True
            except Exception:  # report, then keep the ranks in step
                traceback.print_exc()
                ok = False
            ok, seconds = agree(ok, time.perf_counter() - start)
            if rank == 0:
                note = f" [{detail}]" if detail else ""
                print(f"{'PASS' if ok else 'FAIL'} tp={tp} {name} ({seconds:.1f} s){note}", flush=True)
            passed += int(ok)
            failed += 1 - int(ok)
    dist.barrier()
    if rank == 0:
        print(f"multigpu tp={tp} ({mode}): {time.perf_counter() - total:.1f} s in total", flush=True)
        print(f"multigpu: {passed} passed, {failed} failed", flush=True)
    dist.destroy_process_group()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
