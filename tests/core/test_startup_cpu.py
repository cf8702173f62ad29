"""The startup every rank agrees on (``mhc_core.host.startup``), with real processes over a gloo
group on a CPU: ranks built with different configurations, or one rank whose construction fails,
raise on every rank before anything is allocated, and no rank waits for a peer that will never
come. (The votes run before the device is touched, so a CPU shows them; what follows them needs a
GPU: the multi-process suite, ``tests.multigpu``.)"""

from __future__ import annotations

import datetime
import multiprocessing
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

#: Long enough for two processes to import torch and the packages on a loaded 2-core machine.
DEADLINE_S = 180
WORLD = 2


def _build(model: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD
    if model == "dsv41":
        from mhc_dsv41 import AllReduceMHC

        arguments: dict[str, Any] = dict(hidden_size=5120, hc_mult=4, max_num_tokens=64, top_k=8)
        AllReduceMHC(**(arguments | options), device="cuda:0", group=group)
    elif model == "dsv41-preset":
        from mhc_dsv41 import AllReduceMHC

        AllReduceMHC.from_preset(
            options.pop("name"), **({"max_num_tokens": 64} | options), device="cuda:0", group=group
        )
    elif model == "glm5":
        from mhc_glm5 import AllReduceMhcBoundary

        AllReduceMhcBoundary.from_preset(
            "h200-tp2-h4096", **({"max_num_tokens": 64} | options), device="cuda:0", group=group
        )
    else:
        from mhc_core import LamportAllReduce

        LamportAllReduce(**(dict(hidden_size=4096, max_num_tokens=64) | options), device="cuda:0", group=group)


def _rank(rank: int, store: str, model: str, options: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    try:
        _build(model, dict(options))
        results.put((rank, "built", ""))
    except BaseException as error:  # report any outcome: the parent decides
        results.put((rank, type(error).__name__, f"{error}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def build_on_ranks(tmp_path: Path, model: str, per_rank: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """Build ``model`` on two gloo ranks (rank r with ``per_rank[r]``): rank -> (outcome, message).
    Fails the test if any rank is still running after ``DEADLINE_S`` (it waits for its peer)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = str(tmp_path / "store")
    processes = [context.Process(target=_rank, args=(r, store, model, per_rank[r], results)) for r in range(WORLD)]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, str]] = {}
    try:
        for _ in range(WORLD):
            rank, outcome, message = results.get(timeout=DEADLINE_S)
            outcomes[rank] = (outcome, message)
    except Exception:
        pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    hung = [rank for rank in range(WORLD) if rank not in outcomes]
    assert not hung, f"ranks {hung} never finished construction (waiting for a peer); the others: {outcomes}"
    return outcomes


def first_line(outcome: tuple[str, str]) -> str:
    return outcome[1].splitlines()[0] if outcome[1] else ""


@pytest.mark.parametrize(
    ("model", "field", "options"),
    [
        ("dsv41", "max_num_tokens", [{"max_num_tokens": 64}, {"max_num_tokens": 128}]),
        ("dsv41", "hidden_size", [{"hidden_size": 5120}, {"hidden_size": 4096}]),
        ("dsv41", "spin_timeout_ms", [{"spin_timeout_ms": 5000.0}, {}]),
        ("allreduce", "top_k", [{"top_k": 0}, {"top_k": 8}]),
        ("glm5", "mailbox_allocation", [{"mailbox_allocation": "ipc"}, {"mailbox_allocation": "auto"}]),
    ],
)
def test_a_configuration_that_differs_raises_on_every_rank(tmp_path, model, field, options):
    outcomes = build_on_ranks(tmp_path, model, options)
    for rank, outcome in outcomes.items():
        assert outcome[0] == "StartupError", f"rank {rank}: expected StartupError, got {outcome}"
        message = first_line(outcome)
        assert field in message and "rank 0 =" in message and "rank 1 =" in message, message
        assert "nothing was allocated" in message, message


def test_a_rank_whose_arguments_fail_stops_its_peers(tmp_path):
    outcomes = build_on_ranks(tmp_path, "dsv41", [{}, {"hc_mult": 0}])
    assert outcomes[1][0] == "ValueError" and "hc_mult" in first_line(outcomes[1]), outcomes[1]
    assert outcomes[0][0] == "StartupError", outcomes[0]
    message = first_line(outcomes[0])
    assert "rank 1" in message and "hc_mult" in message, message


def test_a_preset_the_peer_lacks_stops_its_peers(tmp_path):
    outcomes = build_on_ranks(tmp_path, "dsv41-preset", [{"name": "h200-tp2-h5120"}, {"name": "no-such-preset"}])
    assert outcomes[0][0] == "StartupError" and "no-such-preset" in first_line(outcomes[0]), outcomes[0]


def test_ranks_that_agree_fail_alike_past_the_votes_without_waiting(tmp_path):
    """Equal configurations pass the config vote; on a CPU every rank then fails on the device,
    and each one's failure ballot meets its peer's (nobody waits in the kernels vote)."""
    outcomes = build_on_ranks(tmp_path, "dsv41", [{}, {}])
    for rank, outcome in outcomes.items():
        assert outcome[0] in ("AssertionError", "RuntimeError", "StartupError", "built"), (rank, outcome)
        assert "configurations" not in first_line(outcome), outcome


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host rank 0 builds: tests/core/test_startup_gpu.py")
def test_loopback_ranks_compare_their_configurations():
    """Loopback ranks (one process) vote too: the first rank's fingerprint is what later ranks of the
    same instance must match (rank 0 then fails on the CPU's missing device, after its vote)."""
    from mhc_core import LoopbackGroup
    from mhc_core.host.startup import StartupError
    from mhc_dsv41 import AllReduceMHC

    group = LoopbackGroup(2, "cuda:0")
    arguments = dict(hidden_size=5120, hc_mult=4, max_num_tokens=64, top_k=8, device="cuda:0")
    with pytest.raises((AssertionError, RuntimeError)):
        AllReduceMHC(**arguments, group=group[0], spin_timeout_ms=5000.0)
    with pytest.raises(StartupError, match=r"spin_timeout_ms: rank 0 = 5000.0, rank 1 = 7000.0"):
        AllReduceMHC(**arguments, group=group[1], spin_timeout_ms=7000.0)
