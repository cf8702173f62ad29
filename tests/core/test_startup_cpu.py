"""The startup every rank agrees on (``mhc_core.host.ranks.startup``), with real processes over a gloo
group on a CPU: ranks built with different configurations, or one rank whose construction fails,
raise on every rank before anything is allocated, and no rank waits for a peer that will never
come. (The votes run before the device is touched, so a CPU shows them; what follows them needs a
GPU: the multi-process suite, ``tests.multigpu``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.processes import Outcome, run_ranks_as_processes


def _build(rank: int, world: int, model: str, per_rank: list[dict[str, Any]]) -> None:
    import torch.distributed as dist

    group, options = dist.group.WORLD, dict(per_rank[rank])
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


def build_on_ranks(model: str, per_rank: list[dict[str, Any]]) -> dict[int, Outcome]:
    """Build ``model`` on two gloo ranks, rank r with ``per_rank[r]``; fails if any rank hangs."""
    return run_ranks_as_processes(_build, len(per_rank), model, per_rank)


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
def test_a_configuration_that_differs_raises_on_every_rank(model, field, options):
    outcomes = build_on_ranks(model, options)
    for rank, outcome in outcomes.items():
        assert outcome.kind == "StartupError", f"rank {rank}: expected StartupError, got {outcome}"
        message = outcome.first_line
        assert field in message and "rank 0 =" in message and "rank 1 =" in message, message
        assert "nothing was allocated" in message, message


def test_a_rank_whose_arguments_fail_stops_its_peers():
    outcomes = build_on_ranks("dsv41", [{}, {"hc_mult": 0}])
    assert outcomes[1].kind == "ValueError" and "hc_mult" in outcomes[1].first_line, outcomes[1]
    assert outcomes[0].kind == "StartupError", outcomes[0]
    message = outcomes[0].first_line
    assert "rank 1" in message and "hc_mult" in message, message


def test_a_preset_the_peer_lacks_stops_its_peers():
    outcomes = build_on_ranks("dsv41-preset", [{"name": "h200-tp2-h5120"}, {"name": "no-such-preset"}])
    assert outcomes[0].kind == "StartupError" and "no-such-preset" in outcomes[0].first_line, outcomes[0]


def test_ranks_that_agree_fail_alike_past_the_votes_without_waiting():
    """Equal configurations pass the config vote; on a CPU every rank then fails on the device,
    and each one's failure ballot meets its peer's (nobody waits in the kernels vote)."""
    outcomes = build_on_ranks("dsv41", [{}, {}])
    for rank, outcome in outcomes.items():
        assert outcome.kind in ("AssertionError", "RuntimeError", "StartupError", "ok"), (rank, outcome)
        assert "configurations" not in outcome.first_line, outcome


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host rank 0 builds: tests/core/test_startup_gpu.py")
def test_loopback_ranks_compare_their_configurations():
    """Loopback ranks (one process) vote too: the first rank's fingerprint is what later ranks of the
    same instance must match (rank 0 then fails on the CPU's missing device, after its vote)."""
    from mhc_core import LoopbackGroup
    from mhc_core.host.ranks.startup import StartupError
    from mhc_dsv41 import AllReduceMHC

    group = LoopbackGroup(2, "cuda:0")
    arguments = dict(hidden_size=5120, hc_mult=4, max_num_tokens=64, top_k=8, device="cuda:0")
    with pytest.raises((AssertionError, RuntimeError)):
        AllReduceMHC(**arguments, group=group[0], spin_timeout_ms=5000.0)
    with pytest.raises(StartupError, match=r"spin_timeout_ms: rank 0 = 5000.0, rank 1 = 7000.0"):
        AllReduceMHC(**arguments, group=group[1], spin_timeout_ms=7000.0)
