"""Issue #34, "can I use it here?": ``mhc_core.check_fused_support`` says per TP group whether the fused
ops can run, and if not why (arch, peer access, one node, tp, multicast), the same on every rank.
torch.cuda's queries and the ranks' exchange are fakes: a CPU shows every case."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mhc_core
from mhc_core.host.ranks import fallback
from mhc_core.host.ranks.fallback import RankFacts

GPUS = [f"GPU-{index}" for index in range(8)]


def fake_node(
    monkeypatch: pytest.MonkeyPatch,
    *,
    count: int = 8,
    capability: tuple[int, int] = (9, 0),
    no_peer: frozenset[tuple[int, int]] = frozenset(),
    multicast: bool = True,
) -> None:
    """This process sees ``count`` GPUs of ``capability``; peer access everywhere but ``no_peer``."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"uuid": GPUS[index]})())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in no_peer)
    monkeypatch.setattr(fallback, "multicast_problem", lambda index: None if multicast else "no multicast on it")


def ranks_on(
    monkeypatch: pytest.MonkeyPatch, devices: list[int], hosts: list[str] | None = None, multicast: bool = False
) -> list[RankFacts]:
    """Every rank's facts as this process would gather them: rank r on GPU ``devices[r]``."""
    facts = []
    for rank, index in enumerate(devices):
        local = fallback.local_facts(rank, index, multicast)
        host = hosts[rank] if hosts else local.host
        facts.append(RankFacts(rank, host, local.problem, local.gpu, local.arch, local.peer_access,
                               local.multicast_problem))  # fmt: skip
    return facts


class FakeGroup:
    """Stands for a process group of ``len(facts)`` ranks: the exchange returns ``facts``."""


def check(monkeypatch: pytest.MonkeyPatch, facts: list[RankFacts], multicast: bool = False) -> Any:
    monkeypatch.setattr(fallback, "_group_shape", lambda group: (len(facts), 0))
    monkeypatch.setattr(fallback, "exchange", lambda group, mine, tp: facts)
    return mhc_core.check_fused_support(FakeGroup(), "cuda:0", multicast=multicast)


def test_tp1_on_a_supported_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    answer = mhc_core.check_fused_support(None, "cuda:0")
    assert answer and answer.ok and answer.tp == 1 and answer.reason == "supported"


def test_eight_ranks_on_one_nvlink_node(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    answer = check(monkeypatch, ranks_on(monkeypatch, list(range(8)), multicast=True), multicast=True)
    assert answer.ok, answer.reason


def test_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch, capability=(8, 0))
    answer = check(monkeypatch, ranks_on(monkeypatch, [0, 1]))
    assert not answer
    assert answer.reasons[0].startswith("rank 0: unsupported GPU 'NVIDIA GPU': compute capability 8.0")
    assert answer.reasons[1].startswith("rank 1: unsupported GPU")


def test_cpu_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    answer = mhc_core.check_fused_support()
    assert not answer and "rank 0: this torch" in answer.reason and "CPU-only build" in answer.reason


def test_peer_access(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch, no_peer=frozenset({(0, 1), (1, 0)}))
    answer = check(monkeypatch, ranks_on(monkeypatch, [0, 1, 2, 3]))
    assert answer.reasons == ("peer access: no CUDA peer access between the GPUs of ranks 0-1 (no NVLink or P2P)",)


def test_ranks_sharing_a_gpu_need_no_peer_access(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch, no_peer=frozenset({(0, 1), (1, 0)}))
    assert check(monkeypatch, ranks_on(monkeypatch, [0, 0])).ok


def test_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    facts = ranks_on(monkeypatch, [0, 1, 0, 1], hosts=["a/1", "a/1", "b/2", "b/2"])
    answer = check(monkeypatch, facts)
    assert answer.reasons == (
        "one node: the group spans 2 hosts (ranks 0, 1 on a; ranks 2, 3 on b); the mailbox cannot cross nodes",
    )


def test_tp_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    answer = check(monkeypatch, ranks_on(monkeypatch, [0, 1, 2]))
    assert answer.reasons == ("tp: the fused ops support tp in (1, 2, 4, 8); this group has tp = 3",)


def test_mixed_archs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    facts = ranks_on(monkeypatch, [0, 1])
    facts[1] = RankFacts(1, facts[1].host, None, facts[1].gpu, (10, 0), facts[1].peer_access)
    assert check(monkeypatch, facts).reasons == (
        "arch: the group's GPUs differ (rank 0 sm_90, rank 1 sm_100); one op runs one kernel set",
    )


def test_multicast_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch, multicast=False)
    facts = ranks_on(monkeypatch, [0, 1], multicast=True)
    assert check(monkeypatch, facts).ok, "multicast not asked: no reason"
    answer = check(monkeypatch, facts, multicast=True)
    assert answer.reasons == ("multicast: rank 0: no multicast on it", "multicast: rank 1: no multicast on it")


def test_multicast_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    answer = check(monkeypatch, ranks_on(monkeypatch, [0, 0], multicast=True), multicast=True)
    assert answer.reasons == (
        "multicast: ranks 0, 1 share a GPU; NVLink multicast needs one GPU per rank (symmetric memory)",
    )


def test_multicast_disabled_by_torch_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert fallback.multicast_problem(0) == "NVLink multicast is disabled (TORCH_SYMM_MEM_DISABLE_MULTICAST=1)"


def test_loopback_ranks_share_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(monkeypatch)
    group = mhc_core.LoopbackGroup(4, "cuda:0")
    answer = mhc_core.check_fused_support(group[1], "cuda:0")
    assert answer.ok and answer.tp == 4


def test_a_group_of_another_kind_is_refused() -> None:
    with pytest.raises(TypeError, match=r"group: expected None, a torch.distributed.ProcessGroup .* got str"):
        mhc_core.check_fused_support("tp2")


def test_every_rank_gets_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer is computed from every rank's facts alone: rank 1's view gives rank 0's answer."""
    fake_node(monkeypatch, no_peer=frozenset({(2, 3), (3, 2)}))
    facts = ranks_on(monkeypatch, [0, 1, 2, 3])
    assert fallback.verdict(4, facts, False) == fallback.verdict(4, list(facts), False)
    assert not fallback.verdict(4, facts, False)


def test_a_real_gloo_group_exchanges_the_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank gloo group: the facts go through all_gather_object."""
    import torch.distributed as dist

    fake_node(monkeypatch)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        answer = mhc_core.check_fused_support(dist.group.WORLD, "cuda:0", multicast=True)
    finally:
        dist.destroy_process_group()
    assert answer.ok and answer.tp == 1, answer.reason
