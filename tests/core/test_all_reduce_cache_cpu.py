"""Issue #52, rows 10 to 12, on a CPU: ``lamport_all_reduce``'s cache of ops with real threads and
real processes (a gloo group), its op stood in for by fakes that behave as the real one does where
it matters:

* row 10: a thread's call still uses the op when another thread's larger M replaces it; two
  threads' first calls race to build the op;
* row 11: one rank's M is above the op's capacity while its peer's is not, or both grow to different
  sizes. ``GlooOp``'s call compares the ranks' M over the group as the kernels do with the spin bound
  on (a mismatch is sticky, raised by the next call and ``check()``), its close() is a barrier and its
  construction compares max_num_tokens as the startup's ``config`` vote does;
* row 12: an op a CUDA graph captured is replaced: its graphs now replay NaN, which must be said.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest
import torch

from tests.processes import run_ranks_as_processes


def tokens(m: int) -> torch.Tensor:
    return torch.zeros(m, 64, dtype=torch.bfloat16)


class ThreadOp:
    """A tp = 1 op whose call can be held open (``hold``): a replacement must not close it meanwhile."""

    builds = 0
    build_seconds = 0.0

    def __init__(self, *, group: Any, **arguments: Any) -> None:
        ThreadOp.builds += 1
        time.sleep(ThreadOp.build_seconds)
        self.tp, self.capacity, self.closed = 1, arguments["max_num_tokens"], False
        self.inside, self.release = threading.Event(), threading.Event()
        self.hold = False
        self.closed_during_call = False

    def __call__(self, x: Any, *, out: Any = None) -> ThreadOp:
        assert not self.closed, "a closed op was called"
        if self.hold:
            self.inside.set()
            self.release.wait(2.0)  # long enough for another thread's replacement to close it
            self.closed_during_call = self.closed
        return self

    def close(self) -> None:
        self.closed = True
        self.release.set()


@pytest.fixture
def thread_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.host import allreduce

    monkeypatch.setattr(allreduce, "LamportAllReduce", ThreadOp)
    monkeypatch.setattr(allreduce, "_OPS", {})
    monkeypatch.setattr(ThreadOp, "builds", 0)
    for variable in ("MHC_SPIN_TIMEOUT_MS", "MHC_TRANSPORT", "MHC_MAILBOX_ALLOCATION"):
        monkeypatch.delenv(variable, raising=False)


def run(*bodies: Any) -> list[BaseException]:
    failures: list[BaseException] = []

    def guarded(body: Any) -> None:
        try:
            body()
        except BaseException as error:  # reported by the test
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(body,), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a thread is still waiting"
    return failures


@pytest.mark.usefixtures("thread_ops")
def test_growth_never_closes_the_op_another_threads_call_uses() -> None:
    from mhc_core import lamport_all_reduce

    small = lamport_all_reduce(tokens(2))
    small.hold = True

    def calling() -> None:
        lamport_all_reduce(tokens(2))

    def growing() -> None:
        assert small.inside.wait(10)
        lamport_all_reduce(tokens(64))

    assert not run(calling, growing)
    assert not small.closed_during_call, "the growth closed the op while another thread's call used it"
    assert small.closed, "the op it replaced was never closed"


@pytest.mark.usefixtures("thread_ops")
def test_two_threads_first_calls_build_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core import lamport_all_reduce

    monkeypatch.setattr(ThreadOp, "build_seconds", 0.5)
    both = threading.Barrier(2)
    got: list[Any] = []

    def first_call() -> None:
        both.wait()
        got.append(lamport_all_reduce(tokens(2)))

    assert not run(first_call, first_call)
    assert ThreadOp.builds == 1, f"two threads' first calls built {ThreadOp.builds} ops (each a collective build)"
    assert got[0] is got[1]


@pytest.mark.usefixtures("thread_ops")
def test_replacing_an_op_a_graph_captured_warns_that_its_graphs_are_dead() -> None:
    from mhc_core import lamport_all_reduce
    from mhc_core.host.lifetime import _CAPTURED

    small = lamport_all_reduce(tokens(2))
    _CAPTURED[id(small)] = small  # what the op's first call inside a CUDA-graph capture does
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lamport_all_reduce(tokens(64))
            lamport_all_reduce(tokens(64))
    finally:
        _CAPTURED.pop(id(small), None)
    dead = [w for w in caught if issubclass(w.category, RuntimeWarning) and "replay NaN" in str(w.message)]
    assert len(dead) == 1, f"expected one warning that the old op's graphs replay NaN, got {[str(w) for w in caught]}"


# ---------------------------------------------------------------- processes (row 11)
class GlooOp:
    """``LamportAllReduce`` over a gloo group, as the host sees it (see the module docstring)."""

    def __init__(self, *, group: Any, max_num_tokens: int, **arguments: Any) -> None:
        import torch.distributed as dist

        from mhc_core.host.ranks.groups import resolve_group

        self.group = resolve_group(group)
        self.tp, self.rank, self.capacity = self.group.tp, self.group.rank, max_num_tokens
        self.hidden_size, self.device = 64, torch.device("cpu")
        self.spin = type("Spin", (), {"checks_token_counts": True})()
        self.failure: Exception | None = None
        self.closed = False
        sizes: list[Any] = [None] * self.tp
        dist.all_gather_object(sizes, max_num_tokens, group=group)
        if len(set(sizes)) > 1:
            raise ValueError(f"StartupError: max_num_tokens differs across ranks: {sizes}")

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def __call__(self, x: torch.Tensor, *, out: Any = None) -> torch.Tensor:
        import torch.distributed as dist

        from mhc_core import TokenCountError

        assert not self.closed, "a closed op was called"
        self.check()
        m = int(x.shape[0])
        assert m <= self.capacity
        counts = torch.zeros(self.tp, dtype=torch.int64)
        counts[self.rank] = m
        dist.all_reduce(counts, group=self.group.group)  # the collective compares every rank's M
        peers = {rank: int(count) for rank, count in enumerate(counts) if int(count) != m}
        if peers:
            self.failure = TokenCountError(
                f"rank {self.rank}: this call has M = {m} but {peers} for the same call", m=m, peer_m=peers
            )
        return x

    def close(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group.group)
        self.closed = True


def _grow(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core import TokenCountError, lamport_all_reduce
    from mhc_core.host import allreduce

    allreduce.LamportAllReduce = GlooOp
    torch.cuda.synchronize = lambda device=None: None
    group = dist.group.WORLD
    first = lamport_all_reduce(tokens(4), group=group)
    held = allreduce._OPS[group][(torch.device("cpu"), 64, 0)].op
    errors = []
    for _ in range(2):  # the call, then the next one (a peer learns of a mismatch from the device)
        try:
            lamport_all_reduce(tokens(sizes[rank]), group=group)
        except TokenCountError as error:
            errors.append({"ranks": sorted(error.ranks), "message": str(error)})
            break
        except Exception as error:
            errors.append({"other": f"{type(error).__name__}: {error}"})
            break
    return {"errors": errors, "old_closed": held.closed, "first": tuple(first.shape)}


def test_one_rank_growing_alone_raises_token_count_error_on_every_rank() -> None:
    outcomes = run_ranks_as_processes(_grow, 2, [8, 3], deadline_s=90.0)
    for rank, outcome in outcomes.items():
        assert outcome.kind == "ok", f"rank {rank}: {outcome.message}"
        errors = outcome.value["errors"]
        assert errors and "ranks" in errors[0], f"rank {rank}: expected TokenCountError, got {errors}"
        assert errors[0]["ranks"] == [1 - rank], f"rank {rank}: {errors[0]}"
    assert "M = 8, above the max_num_tokens = 4" in outcomes[0].value["errors"][0]["message"]


def test_ranks_growing_to_different_sizes_raise_before_closing_anything() -> None:
    outcomes = run_ranks_as_processes(_grow, 2, [8, 6], deadline_s=90.0)
    for rank, outcome in outcomes.items():
        assert outcome.kind == "ok", f"rank {rank}: {outcome.message}"
        errors = outcome.value["errors"]
        assert errors and "ranks" in errors[0], f"rank {rank}: expected TokenCountError, got {errors}"
        assert "rank 0 = 8, rank 1 = 6" in errors[0]["message"], errors[0]["message"]
        assert not outcome.value["old_closed"], f"rank {rank}: the old op was closed before the ranks agreed"
