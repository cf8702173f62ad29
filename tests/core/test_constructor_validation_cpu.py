"""Every constructor argument is validated before any CUDA call, compile or allocation: on this
machine (no GPU) a bad argument raises a ValueError / TypeError naming it, and a good set of
arguments gets as far as reading the GPU's arch, which is patched to fail loudly here."""

from __future__ import annotations

import pytest

GOOD_GLM = dict(
    hidden_size=4096, max_num_tokens=8, rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20,
    norm_eps=1e-5, device="cuda:0", top_k=8,
)  # fmt: skip
GOOD_DSV = dict(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8, device="cuda:0")
GOOD_CORE = dict(hidden_size=4096, max_num_tokens=8, device="cuda:0")


class BuildStarted(Exception):
    """Raised where construction leaves validation (the arch is read): every check has passed."""


@pytest.fixture(autouse=True)
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import mhc_core.host.op

    def started(device):
        raise BuildStarted(str(device))

    monkeypatch.setattr(mhc_core.host.op, "device_arch", started)


def op_types():
    from mhc_core import LamportAllReduce
    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    return {
        "core": (LamportAllReduce, GOOD_CORE),
        "dsv41": (AllReduceMHC, GOOD_DSV),
        "glm5": (AllReduceMhcBoundary, GOOD_GLM),
    }


@pytest.mark.parametrize("family", ["core", "dsv41", "glm5"])
def test_good_arguments_reach_the_build(family: str) -> None:
    op_type, good = op_types()[family]
    with pytest.raises(BuildStarted):
        op_type(**good)


COMMON = [
    ("hidden_size", 100, ValueError, "hidden_size: expected a multiple of 8"),
    ("max_num_tokens", 0, ValueError, "max_num_tokens: expected >= 1"),
    ("max_num_tokens", 2**30, ValueError, "max_num_tokens: expected <= 1073741823"),
    ("transport", "bogus", ValueError, "transport: expected one of"),
    ("spin_timeout_ms", -1.0, ValueError, "spin_timeout_ms: expected 0 (off) or a finite value in [0.001, 1e+09] ms"),
    ("device", "cpu", ValueError, "device: expected a CUDA device"),
]
PUBLISH_THREADS = [
    ("publish_threads", 7, ValueError, "publish_threads: expected >= 32"),
    ("publish_threads", 100, ValueError, "publish_threads: expected a multiple of 32"),
]
SPECIFIC = {
    "core": [("threads", 7, ValueError, "threads: expected a multiple of 32"), ("lanes", 3, ValueError, "lanes:")],
    "dsv41": [
        *PUBLISH_THREADS,
        ("threads", 7, ValueError, "threads: expected a multiple of 32"),
        ("cluster_size", 9, ValueError, "cluster_size: expected 1..8"),
        ("rank_lanes", 3, ValueError, "rank_lanes:"),
        ("hc_mult", 0, ValueError, "hc_mult: expected >= 1"),
        ("top_k", 0, ValueError, "top_k: expected >= 1"),
        ("norm_eps", 0.0, ValueError, "norm_eps: expected a finite value > 0"),
        ("norm_eps", "1e-6", TypeError, "norm_eps: expected a float"),
        ("clusters", 0, ValueError, "clusters: expected >= 1"),
        ("staged_tokens", 5, ValueError, "staged_tokens: expected <= 4"),
        ("persistent_min_tokens", 0, ValueError, "persistent_min_tokens: expected >= 1"),
    ],
    "glm5": [
        *PUBLISH_THREADS,
        ("sinkhorn_repeat", 0, ValueError, "sinkhorn_repeat: must be >= 1"),
        ("cluster_size", 7, ValueError, "cluster_size: must divide"),
        ("rms_eps", 0.0, ValueError, "rms_eps:"),
        ("mixes_threads", 7, ValueError, "mixes_threads:"),
        ("cluster_tokens", [(8, 5)], ValueError, "cluster_tokens: tokens_per_cluster must be in 1..4"),
        ("top_k", 0, ValueError, "top_k: expected >= 1"),
        ("clusters", 0, ValueError, "clusters: expected >= 1"),
        ("persistent_min_tokens", -1, ValueError, "persistent_min_tokens: must be >= 0"),
    ],
}


@pytest.mark.parametrize("family", ["core", "dsv41", "glm5"])
def test_bad_arguments_raise_before_any_build(family: str) -> None:
    op_type, good = op_types()[family]
    for key, value, error, message in COMMON + SPECIFIC[family]:
        try:
            op_type(**{**good, key: value})
        except error as raised:
            assert message in str(raised), f"{key}={value!r}: {raised}"
        except BuildStarted:
            raise AssertionError(f"{key}={value!r} was accepted: construction went on to the build") from None
        else:
            raise AssertionError(f"{key}={value!r}: no error")


def test_persistent_threshold_must_follow_the_cluster_tokens() -> None:
    """The persistent boundary's threshold comes after every ``cluster_tokens`` threshold (the
    native program takes the last variant whose threshold M reaches)."""
    from mhc_glm5 import AllReduceMhcBoundary

    with pytest.raises(ValueError, match=r"persistent_min_tokens: must be above every cluster_tokens threshold"):
        AllReduceMhcBoundary(**GOOD_GLM, cluster_tokens=[(16, 2), (32, 8)], persistent_min_tokens=32)
    with pytest.raises(BuildStarted):
        AllReduceMhcBoundary(**GOOD_GLM, cluster_tokens=[(16, 2), (32, 8)], persistent_min_tokens=33)


def test_a_whole_loopback_group_is_refused_by_name() -> None:
    from mhc_core import LamportAllReduce, LoopbackGroup

    with pytest.raises(TypeError, match=r"group: expected one rank of a LoopbackGroup"):
        LamportAllReduce(**GOOD_CORE, group=LoopbackGroup(2, "cuda:0"))


def test_is_supported_never_raises_here() -> None:
    import mhc_core

    assert mhc_core.is_supported() is False
    assert mhc_core.is_supported("cuda:0") is False


def test_both_models_take_norm_eps_at_construction() -> None:
    """Symmetric APIs: both ops take ``norm_eps`` as a constructor argument (and from a preset); the
    DSV op's calls may still pass one, its default is the op's."""
    import inspect

    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    for op_type in (AllReduceMHC, AllReduceMhcBoundary):
        assert "norm_eps" in inspect.signature(op_type.__init__).parameters, op_type
    for method in (AllReduceMHC.__call__, AllReduceMHC.finalize, AllReduceMHC.collect):
        assert inspect.signature(method).parameters["norm_eps"].default is None, method
