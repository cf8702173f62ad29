"""Multi-GPU suite: one process per GPU under torchrun, a real NCCL group, torch symmetric memory,
unicast transport (NVLink multicast stays off).

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.multigpu.run --tp 2

Every rank draws every rank's inputs from the same seed, runs its own share through the op and
checks its outputs against the reference; outputs are then gathered and compared bit for bit
across ranks. Prints one line per case and ends with "N passed, M failed".
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

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

from tests.support import assert_bitwise_equal, bf16_randn, poisoned  # noqa: E402

CAPACITY = 160


def gather_bits(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (NCCL all_gather has no int16: gather the raw dtype)."""
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.contiguous())
    return copies


def check_identical_across_ranks(*tensors: torch.Tensor) -> None:
    for index, tensor in enumerate(tensors):
        copies = gather_bits(tensor)
        for rank, copy in enumerate(copies):
            assert_bitwise_equal(copy, copies[0], f"output {index}: rank {rank} vs rank 0")


def shared_generator(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


# ----------------------------------------------------------------------------- core
def core_cases(group, tp: int, rank: int) -> dict[str, Callable[[], None]]:
    from mhc_core import LamportAllReduce, MoEOutput, reference

    ops: dict[tuple, LamportAllReduce] = {}

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

    def hundred_calls() -> None:
        generator = shared_generator(100)
        for call in range(100):
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
        for replay in range(1000):
            partials = [bf16_randn(m, 4096, generator=generator) for _ in range(tp)]
            x.copy_(partials[rank])
            out.view(torch.int16).fill_(0x7FA5)
            graph.replay()
            assert_bitwise_equal(out, reference.all_reduce(partials), f"replay {replay}")

    def finalize() -> None:
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
                from tests.core.test_finalize_gpu import finalize_tolerance
                from tests.support import assert_within, bf16_ulp

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
        "core: 100 consecutive calls": hundred_calls,
        "core: CUDA graph, 1000 replays": graph_replays,
        "core: MoE finalize, fp32 and bf16 weights": finalize,
    }


# ---------------------------------------------------------------------------- dsv41
def dsv41_cases(group, tp: int, rank: int) -> dict[str, Callable[[], None]]:
    from mhc_core import reference
    from mhc_dsv41 import AllReduceMHC, presets
    from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS, check_outputs, inputs

    name = f"h200-tp{tp}-h5120"
    op = AllReduceMHC.from_preset(name, max_num_tokens=CAPACITY, device="cuda", group=group)
    hc, hidden = presets.get(name).PRESET.hc, presets.get(name).PRESET.hidden

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
            for _ in range(200):
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

    return {f"dsv41: {name} shapes": shapes, f"dsv41: {name} CUDA graphs": graph}


# ----------------------------------------------------------------------------- glm5
def glm5_cases(group, tp: int, rank: int) -> dict[str, Callable[[], None]]:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--only", choices=("core", "dsv41", "glm5"), action="append")
    options = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    if tp != options.tp:
        raise SystemExit(f"--tp {options.tp} but the process group has {tp} ranks")
    suites = {"core": core_cases, "dsv41": dsv41_cases, "glm5": glm5_cases}
    passed = failed = 0
    for suite, make_cases in suites.items():
        if options.only and suite not in options.only:
            continue
        for name, case in make_cases(group, tp, rank).items():
            try:
                case()
                torch.cuda.synchronize()
                ok = torch.tensor([1], device="cuda")
            except Exception:  # report, then keep the ranks in step
                traceback.print_exc()
                ok = torch.tensor([0], device="cuda")
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if rank == 0:
                print(f"{'PASS' if ok.item() else 'FAIL'} tp={tp} {name}", flush=True)
            passed += int(ok.item())
            failed += 1 - int(ok.item())
    dist.barrier()
    if rank == 0:
        print(f"multigpu: {passed} passed, {failed} failed", flush=True)
    dist.destroy_process_group()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
