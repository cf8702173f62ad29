"""What the lifecycle tests share: building ops (fresh, on loopback ranks above tp 1), one call's
inputs and poisoned outputs for each model (the plain all-reduce, DSV4.1's AllReduceMHC, GLM-5.3's
AllReduceMhcBoundary) checked with the existing suites' reference checks, and sleeping a stream
for a given time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS, check_outputs
from tests.dsv41.test_allreduce_mhc_gpu import inputs as dsv_inputs
from tests.glm5.checks import boundary_inputs, check_boundary
from tests.glm5.test_boundary_gpu import poisoned_outputs
from tests.support import (
    assert_bitwise_equal,
    bf16_randn,
    build_ranks,
    is_poisoned,
    needs_compiler,
    poison,
    poisoned,
    run_ranks,
)

CORE_HIDDEN = 4096


# ------------------------------------------------------------------ building
def core_ops(tp: int, capacity: int, **options: Any) -> list:
    from mhc_core import LamportAllReduce

    needs_compiler("LamportAllReduce")

    return build_ranks(
        tp,
        lambda group: LamportAllReduce(
            hidden_size=CORE_HIDDEN, max_num_tokens=capacity, device="cuda", group=group, **options
        ),
    )


def dsv_ops(name: str, capacity: int, **options: Any) -> list:
    from mhc_dsv41 import AllReduceMHC, presets

    preset = presets.get(name).PRESET
    return build_ranks(
        preset.tp,
        lambda group: AllReduceMHC.from_config(preset, max_num_tokens=capacity, device="cuda", group=group, **options),
    )


def glm_ops(name: str, capacity: int, **options: Any) -> list:
    from mhc_glm5 import AllReduceMhcBoundary, presets

    preset = presets.get(name).PRESET
    return build_ranks(
        preset.tp,
        lambda group: AllReduceMhcBoundary.from_config(
            preset, max_num_tokens=capacity, device="cuda", group=group, **options
        ),
    )


# --------------------------------------------------------------------- models
@dataclass
class Case:
    """One call's inputs: every rank's partial, and what every rank passes alike."""

    m: int
    partials: list[torch.Tensor]
    shared: Any  # core: (); DSV: (residual, post, comb, pre, norm_weight); GLM: boundary_inputs' dict


class Model:
    """One op family seen as a user drives it: make a case, call every rank, check the results."""

    glm = False

    def case(self, ops: list, m: int, generator: torch.Generator, *, negative_zero: bool = False) -> Case:
        partials = [bf16_randn(m, ops[0].hidden_size, generator=generator) for _ in ops]
        if negative_zero:
            partials[0][-1] = -0.0
        return Case(m, partials, self._shared(ops[0], m, generator, negative_zero))

    def refill(self, case: Case, ops: list, generator: torch.Generator) -> None:
        """Fresh data into a case's tensors (a graph's static inputs)."""
        fresh = self.case(ops, case.m, generator)
        for static, value in zip(case.partials, fresh.partials, strict=True):
            static.copy_(value)
        for static, value in zip(self._tensors(case.shared), self._tensors(fresh.shared), strict=True):
            static.copy_(value)

    def rank_args(self, case: Case, rank: int) -> tuple:
        raise NotImplementedError

    def outputs(self, ops: list, m: int) -> list:
        raise NotImplementedError

    def call(self, ops: list, case: Case, outs: list, *, join: bool = True) -> list:
        """Every rank's call through ``run_ranks`` on the current stream (GLM: then each op's join())."""
        results = run_ranks(
            ops, "call", [self.rank_args(case, r) for r in range(len(ops))], [dict(out=o) for o in outs]
        )
        if self.glm and join:
            for op in ops:
                op.join()
        return results

    def call_rank(self, op, case: Case, rank: int, out, *, join: bool = True):
        """One rank's own call on the current stream (GLM: then its join())."""
        result = op(*self.rank_args(case, rank), out=out)
        if self.glm and join:
            op.join()
        return result

    def check(self, ops: list, results: list, case: Case, raw_mixes: list | None = None) -> None:
        raise NotImplementedError

    def _shared(self, op, m: int, generator: torch.Generator, negative_zero: bool) -> Any:
        raise NotImplementedError

    def _tensors(self, shared: Any) -> list[torch.Tensor]:
        return list(shared.values()) if isinstance(shared, dict) else list(shared)


class CoreModel(Model):
    names = ("out",)

    def _shared(self, op, m, generator, negative_zero):
        return ()

    def rank_args(self, case, rank):
        return (case.partials[rank],)

    def outputs(self, ops, m):
        return [poisoned((m, ops[0].hidden_size), torch.bfloat16) for _ in ops]

    def check(self, ops, results, case, raw_mixes=None):
        from mhc_core import reference

        torch.cuda.synchronize()
        expected = reference.all_reduce(case.partials)
        for rank, result in enumerate(results):
            assert_bitwise_equal(result, expected, f"rank {rank}")


class DsvModel(Model):
    names = ("residual_out", "layer_input")

    def _shared(self, op, m, generator, negative_zero):
        return dsv_inputs(m, op.hc_mult, op.hidden_size, generator, post_3d=False, negative_zero=negative_zero)

    def rank_args(self, case, rank):
        return (case.partials[rank], *case.shared, NORM_EPS)

    def outputs(self, ops, m):
        op = ops[0]
        return [
            (poisoned((m, op.hc_mult, op.hidden_size), torch.bfloat16), poisoned((m, op.hidden_size), torch.bfloat16))
            for _ in ops
        ]

    def check(self, ops, results, case, raw_mixes=None):
        from mhc_core import reference

        torch.cuda.synchronize()
        check_outputs(results, reference.all_reduce(case.partials), *case.shared)


class GlmModel(Model):
    glm = True
    names = ("residual_out", "post_out", "comb_out", "layer_input")

    def _shared(self, op, m, generator, negative_zero):
        return boundary_inputs(m, op.hidden_size, generator, negative_zero=negative_zero)

    def rank_args(self, case, rank):
        return (case.partials[rank], *case.shared.values())

    def outputs(self, ops, m):
        return [poisoned_outputs(m, ops[0].hidden_size) for _ in ops]

    def check(self, ops, results, case, raw_mixes=None):
        """``raw_mixes``: each rank's raw mixes of this call; by default the ops' (their last call's)."""
        from mhc_core import reference

        torch.cuda.synchronize()
        if raw_mixes is None:
            raw_mixes = [op.raw_mixes[: case.m].clone() for op in ops]
        check_boundary(ops[0], results, reference.all_reduce(case.partials, lanes=4), case.shared, raw_mixes)


CORE, DSV, GLM = CoreModel(), DsvModel(), GlmModel()


# -------------------------------------------------------------------- outputs
def as_tuple(result) -> tuple:
    return (result,) if isinstance(result, torch.Tensor) else tuple(result)


def poison_all(outs: list) -> None:
    for rank_outs in outs:
        for tensor in as_tuple(rank_outs):
            poison(tensor)


def assert_results_equal(model: Model, actual: list, expected: list, what: str) -> None:
    """Every rank's every output bitwise equal, and written (a poisoned pair is equal too)."""
    for rank, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        for name, a, b in zip(model.names, as_tuple(mine), as_tuple(theirs), strict=True):
            assert not is_poisoned(a).any(), f"{what}: rank {rank} {name} never written"
            assert_bitwise_equal(a, b, f"{what}: rank {rank} {name}")


def assert_written_nan(tensor: torch.Tensor, what: str) -> None:
    """Every element NaN, written by a kernel (the poison is a NaN pattern too)."""
    assert not is_poisoned(tensor).any(), f"{what}: {int(is_poisoned(tensor).sum())} elements never written"
    finite = int((~torch.isnan(tensor)).sum())
    assert finite == 0, f"{what}: {finite} of {tensor.numel()} elements are not NaN"


def overlaps(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``tensor``'s bytes share any address with one of ``(data_ptr, nbytes)``."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    return any(start < other + size and other < end for other, size in ranges)


# ---------------------------------------------------------------------- sleep
def sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for ``ms`` milliseconds, measured now (the SM clock moves with load)."""
    torch.cuda._sleep(1_000)  # load the sleep kernel first: loading waits behind running kernels
    torch.cuda._sleep(20_000_000)  # let the clock ramp up before measuring
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / start.elapsed_time(end))
