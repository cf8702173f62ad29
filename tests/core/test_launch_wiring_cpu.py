"""What the ops pass to their kernels, without a GPU: ops whose kernels are recorders (TVM-FFI
functions made from Python callables) and whose device is the CPU run their real native programs
(``mhc_core.host.calls.programs``: the C++ executor checks, allocates and launches) on CPU tensors.

Covers the tp = 1 direct path against the mailbox path, MoE input, the two phases, the norm_eps
default, output allocation, GLM's boundary selection by M and its side launch, and that every
rejected call raises the precise error before any launch."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import tvm_ffi

HIDDEN, HC, M, TOP_K, CAPACITY = 64, 4, 3, 2, 8
#: The DSV op's persistent collective from this M (CAPACITY allows it).
PERSISTENT_MIN_TOKENS = 5
CPU = torch.device("cpu")


class Kernels:
    """Recorder kernels: every launch is ``(name, {parameter: value})``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def compiled(self, name: str, kernel) -> SimpleNamespace:
        signature = kernel.signature()

        def record(*args) -> None:
            self.calls.append((name, dict(zip((param.name for param in signature), args, strict=True))))

        return SimpleNamespace(function=tvm_ffi.convert(record), kernel=kernel, signature=signature)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class Order:
    """A CallOrder without CUDA: nothing to order on the CPU."""

    done_handle, stream, capture, in_call = 0, None, 0, False

    def begin(self) -> int:
        return 0

    def end(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def common(op, tp: int, kernels: Kernels) -> None:
    """The state construction leaves, on the CPU, with recorder kernels."""
    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel

    config = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_stores", store="unicast")
    op.__dict__.update(
        hidden_size=HIDDEN, device=CPU, tp=tp, rank=0, capacity=CAPACITY, top_k=TOP_K, check_routes=False,
        _closed=False, _peers_ready=True, _pending_m=None, _order=Order(),
        group=SimpleNamespace(kind="none", missing_peers=lambda op: []),
        spin=SimpleNamespace(
            limit_ns=5, handoff_limit_ns=7, address=1234, checks_token_counts=False, check=lambda: None
        ),
        mailbox=SimpleNamespace(
            buffer=torch.zeros(64, dtype=torch.bfloat16), stage_state=torch.zeros(4, dtype=torch.int32),
            destinations=torch.zeros(tp, dtype=torch.int64),
        ),
        _publish_kernel=kernels.compiled("publish", PublishKernel(PublishConfig(**config))),
        _finalize_kernels={
            dtype: kernels.compiled(
                "finalize", FinalizePublishKernel(PublishConfig(**config, top_k=TOP_K, weights=name))
            )
            for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))
            if dtype in type(op).weight_dtypes
        },
    )  # fmt: skip
    op._init_call_state()  # the lock and the launch marker every call path uses


def dsv_op(tp: int):
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import CollectiveTarget, collective_routing
    from mhc_dsv41.kernel import LamportMHCKernel, MHCConfig

    kernels = Kernels()
    op = object.__new__(AllReduceMHC)
    common(op, tp, kernels)
    config = MHCConfig(hidden=HIDDEN, hc=HC, tp=tp, cluster_size=1, threads=64, rank_lanes=1)
    op.__dict__.update(
        hc_mult=HC,
        norm_eps=1e-6,
        clusters=132,
        persistent_min_tokens=PERSISTENT_MIN_TOKENS,
        routing=collective_routing(PERSISTENT_MIN_TOKENS),
        _collective_kernels={
            CollectiveTarget(False): kernels.compiled("collective", LamportMHCKernel(config)),
            CollectiveTarget(True): kernels.compiled(
                "collective_persistent", LamportMHCKernel(dataclasses.replace(config, persistent=True))
            ),
        },
    )
    op._programs = op._build_programs()
    return op, kernels


def dsv_args(m: int = M):
    return (
        torch.randn(m, HC, HIDDEN).to(torch.bfloat16), torch.rand(m, HC), torch.rand(m, HC, HC), torch.rand(m, HC),
        torch.ones(HIDDEN, dtype=torch.bfloat16),
    )  # fmt: skip


def moe_fields(m: int = M, dtype: torch.dtype = torch.float32) -> tuple:
    rows = m * TOP_K
    return (
        torch.randn(rows, HIDDEN).to(torch.bfloat16), torch.rand(m, TOP_K, dtype=dtype),
        torch.arange(rows, dtype=torch.int32).view(m, TOP_K), torch.randn(m, HIDDEN).to(torch.bfloat16),
    )  # fmt: skip


def address(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


@pytest.mark.parametrize("tp", [1, 2])
def test_dsv_call_takes_the_persistent_collective_from_its_threshold(tp: int) -> None:
    """Below ``persistent_min_tokens`` the one-token collective, from it on the persistent one; the
    clusters argument is the op's either way (the one-token kernel launches one per token)."""
    op, kernels = dsv_op(tp)
    for m, expected in ((PERSISTENT_MIN_TOKENS - 1, "collective"), (PERSISTENT_MIN_TOKENS, "collective_persistent")):
        op(torch.randn(m, HIDDEN).to(torch.bfloat16), *dsv_args(m))
        name, values = kernels.calls[-1]
        assert name == expected and values["m"] == m and values["clusters"] == 132


@pytest.mark.parametrize("tp", [1, 2])
def test_dsv_call_launches(tp: int) -> None:
    op, kernels = dsv_op(tp)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    residual, post, comb, pre, weight = dsv_args()
    residual_out, layer_input = op(x, residual, post, comb, pre, weight)
    assert kernels.names() == (["collective"] if tp == 1 else ["publish", "collective"])
    values = kernels.calls[-1][1]
    assert values["eps"] == pytest.approx(1e-6), "norm_eps defaults to the op's"
    if tp == 1:
        assert values["direct"] == 1 and values["x"] == address(x) and values["prefetch"] == 0
    else:
        assert values["direct"] == 0 and values["x"] == address(residual) and values["prefetch"] == 1
        assert kernels.calls[0][1]["x"] == address(x) and kernels.calls[0][1]["m"] == M
    assert values["residual_out"] == address(residual_out) and values["layer_input"] == address(layer_input)
    assert values["m"] == M and values["residual"] == address(residual) and values["gamma"] == address(weight)
    assert residual_out.shape == (M, HC, HIDDEN) and residual_out.dtype == torch.bfloat16
    assert layer_input.shape == (M, HIDDEN) and layer_input.dtype == torch.bfloat16
    assert residual_out.is_contiguous() and layer_input.is_contiguous()
    op(x, residual, post, comb, pre, weight, 1e-3)
    assert kernels.calls[-1][1]["eps"] == pytest.approx(1e-3), "an explicit norm_eps wins"


def test_dsv_out_is_written_in_place() -> None:
    op, kernels = dsv_op(1)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    out = (torch.empty(M, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(M, HIDDEN, dtype=torch.bfloat16))
    returned = op(x, *dsv_args(), out=out)
    assert returned[0] is out[0] and returned[1] is out[1]
    assert kernels.calls[-1][1]["residual_out"] == address(out[0])


def test_dsv_finalize_publishes_at_every_tp() -> None:
    op, kernels = dsv_op(1)
    gemm2, weights, index, shared = moe_fields()
    op.finalize(gemm2, weights, index, shared, *dsv_args())
    assert kernels.names() == ["finalize", "collective"]
    publish = kernels.calls[0][1]
    assert publish["gemm2"] == address(gemm2) and publish["weights"] == address(weights)
    assert publish["index"] == address(index) and publish["shared"] == address(shared)
    assert publish["rows"] == M * TOP_K and publish["m"] == M
    assert kernels.calls[1][1]["direct"] == 0 and kernels.calls[1][1]["prefetch"] == 1


def test_dsv_two_phases() -> None:
    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    op.publish(x)
    assert op._pending_m == M
    with pytest.raises(ValueError, match=r"residual: expected shape \[3, 4, 64\], got \[2, 4, 64\]"):
        op.collect(*dsv_args(2))
    assert op._pending_m == M, "a rejected collect leaves the publish pending"
    op.collect(*dsv_args(), after_publish=False)
    assert kernels.names() == ["publish", "collective"] and op._pending_m is None
    assert kernels.calls[-1][1]["prefetch"] == 0, "no promise that the publish came right before"


BAD_DSV_CALLS = {
    "x dtype": (lambda a: {**a, "x": a["x"].view(torch.float16)}, TypeError, "x: expected dtype bfloat16, got float16"),
    "x type": (lambda a: {**a, "x": [[0.0]]}, TypeError, "x: expected a torch.Tensor, got list"),
    "M too large": (
        lambda a: {**a, "x": torch.zeros(9, HIDDEN, dtype=torch.bfloat16)},
        ValueError,
        "x: expected 1 <= M <= max_num_tokens = 8, got M = 9",
    ),
    "residual M": (
        lambda a: {**a, "residual": torch.zeros(2, HC, HIDDEN, dtype=torch.bfloat16)},
        ValueError,
        r"residual: expected shape \[3, 4, 64\], got \[2, 4, 64\]",
    ),
    "post shapes": (lambda a: {**a, "post": torch.rand(M, HC, 2)}, ValueError, r"post: expected shape \[3, 4\] or"),
    "comb strided": (
        lambda a: {**a, "comb": torch.rand(M, HC, HC).transpose(1, 2)},
        ValueError,
        "comb: expected a contiguous tensor",
    ),
    "weight misaligned": (
        lambda a: {**a, "norm_weight": torch.ones(HIDDEN + 1, dtype=torch.bfloat16)[1:]},
        ValueError,
        "norm_weight: expected a 16-byte aligned data pointer",
    ),
    "eps zero": (lambda a: {**a, "norm_eps": 0.0}, ValueError, "norm_eps: expected a finite value > 0, got 0.0"),
    "eps str": (lambda a: {**a, "norm_eps": "1e-6"}, TypeError, "norm_eps: expected a float, got str"),
    "eps nan": (lambda a: {**a, "norm_eps": float("nan")}, ValueError, "norm_eps: expected a finite value > 0"),
    "out dtype": (
        lambda a: {**a, "out": (torch.empty(M, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(M, HIDDEN))},
        TypeError,
        r"out\[1\] \(layer_input\): expected dtype bfloat16, got float32",
    ),
    "out type": (lambda a: {**a, "out": torch.empty(1)}, TypeError, "out: expected a"),
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD_DSV_CALLS))
def test_dsv_rejects_before_any_launch(tp: int, case: str) -> None:
    op, kernels = dsv_op(tp)
    residual, post, comb, pre, weight = dsv_args()
    good = dict(
        x=torch.randn(M, HIDDEN).to(torch.bfloat16), residual=residual, post=post, comb=comb, pre=pre,
        norm_weight=weight, norm_eps=1e-6,
    )  # fmt: skip
    change, error, message = BAD_DSV_CALLS[case]
    with pytest.raises(error, match=message):
        op(**change(good))
    assert kernels.calls == [], "a kernel was launched for a rejected call"
    op(**good)  # the op is still usable
    assert kernels.names()[-1] == "collective"


def test_dsv_moe_weights_dtype_is_checked_by_name() -> None:
    op, kernels = dsv_op(1)
    with pytest.raises(TypeError, match="expert_weights: expected dtype float32, got bfloat16"):
        op.finalize(*moe_fields(dtype=torch.bfloat16), *dsv_args())
    with pytest.raises(ValueError, match=r"expanded_idx_to_permuted_idx: expected shape \[3, 2\], got \[3, 3\]"):
        gemm2, weights, _, shared = moe_fields()
        op.finalize(gemm2, weights, torch.zeros(M, TOP_K + 1, dtype=torch.int32), shared, *dsv_args())
    assert kernels.calls == []


def glm_op(tp: int, cluster_tokens=((4, 2),), persistent_min_tokens: int = 0):
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5.boundary import BoundaryConfig, BoundaryKernel
    from mhc_glm5.config import boundary_routing
    from mhc_glm5.mixes import MixesConfig, MixesKernel

    kernels = Kernels()
    op = object.__new__(AllReduceMhcBoundary)
    common(op, tp, kernels)
    # The boundary kernels differ only in their names here: the recorders need a signature.
    boundary = BoundaryKernel(BoundaryConfig.__new__(BoundaryConfig))
    side = SimpleNamespace(handle=4321, fork_handle=0, launched_with=[], idle=True)
    side.launched = lambda capture, tensors, stream: side.launched_with.append(tuple(tensors))
    side.launching = lambda stream, capture, tensors: (0, 0)  # (events): kept until a join in the real SideWork
    routing = boundary_routing(tuple(cluster_tokens), persistent_min_tokens)
    op.__dict__.update(
        cluster_tokens=tuple(cluster_tokens), persistent_min_tokens=persistent_min_tokens, clusters=CLUSTERS,
        routing=routing,
        _boundary_kernels={t: kernels.compiled(t.kernel_name, boundary) for t in routing.targets},
        _mixes_kernel=kernels.compiled("mixes", MixesKernel(MixesConfig.__new__(MixesConfig))),
        _mixes_handoff=torch.zeros(CAPACITY, 24), _raw_mixes=torch.zeros(CAPACITY, 24),
        _arrivals=torch.zeros(1, dtype=torch.int32), _side_work=side,
    )  # fmt: skip
    op._programs = op._build_programs()
    return op, kernels, side


#: The persistent boundary's cluster count in these ops.
CLUSTERS = 3


def glm_args(m: int = M):
    return (
        torch.randn(m, HC, HIDDEN).to(torch.bfloat16), torch.rand(m, HC, 1), torch.rand(m, HC, HC),
        torch.randn(24, HC * HIDDEN).to(torch.bfloat16), torch.rand(3), torch.rand(24),
        torch.ones(HIDDEN).to(torch.bfloat16),
    )  # fmt: skip


@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_glm_call_picks_its_boundary_and_launches_the_mixes_on_the_side_stream(m: int) -> None:
    op, kernels, side = glm_op(1)
    x = torch.randn(m, HIDDEN).to(torch.bfloat16)
    args = glm_args(m)
    residual_out, post_out, comb_out, layer_input = op(x, *args)
    expected = "boundary_x2" if m >= 4 else "boundary"
    assert kernels.names() == [expected, "mixes"]
    boundary, mixes = kernels.calls[0][1], kernels.calls[1][1]
    assert boundary["direct"] == 1 and boundary["x"] == address(x) and boundary["prefetch"] == 0
    assert boundary["stream"] == 0 and mixes["stream"] == 4321, "the mixes go onto the side stream by handle"
    assert mixes["post_out"] == address(post_out) and mixes["comb_out"] == address(comb_out)
    assert mixes["scale"] == address(args[4]) and mixes["base"] == address(args[5]) and mixes["m"] == m
    assert side.launched_with == [(post_out, comb_out, args[4], args[5])], "the side kernel's tensors are kept"
    shapes = [(m, HC, HIDDEN), (m, HC, 1), (m, HC, HC), (m, HIDDEN)]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    for tensor, shape, dtype in zip((residual_out, post_out, comb_out, layer_input), shapes, dtypes, strict=True):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()


@pytest.mark.parametrize("tp", [1, 2])
def test_glm_side_stream_forks_before_the_boundary(tp: int) -> None:
    """The mixes kernel polls the boundary's hand-off rows while the boundary runs: the side stream
    forks before the boundary launch, not after it (forking at the side launch serialised the two,
    +1.7 us at M = 1 on the H200). The native program carries the fork point; CPU programs record
    no events, so this reads the program."""
    op, _, _ = glm_op(tp)
    programs = op._programs
    for program in (programs.call, programs.collect, *programs.call_moe.values()):
        is_mixes = [launch.signature is op._mixes_kernel.signature for launch in program.launches]
        boundary = next(i for i, launch in enumerate(program.launches) if launch.forks_side)
        assert program.launches[boundary].functions[0] is op.boundary_kernel(1).function
        assert is_mixes.index(True) == boundary + 1


def test_a_program_forks_its_side_stream_once_before_the_side_launch() -> None:
    from mhc_core.host.calls.programs import Launch, Program

    op, _, _ = glm_op(1)
    boundary, mixes = op._programs.collect.launches
    program = op._programs.collect
    for launches in ([mixes, boundary], [boundary, Launch(**{**vars(boundary), "forks_side": True})]):
        with pytest.raises(ValueError, match="launches: expected forks_side launches"):
            Program(program.rules, program.outputs, launches, CPU, CAPACITY)


@pytest.mark.parametrize("m", [5, 6, 8])
def test_glm_call_takes_the_persistent_boundary_from_its_threshold(m: int) -> None:
    """From ``persistent_min_tokens`` the persistent boundary serves the call, with the op's
    cluster count (the kernel launches min(groups, clusters) clusters)."""
    op, kernels, _ = glm_op(1, persistent_min_tokens=6)
    op(torch.randn(m, HIDDEN).to(torch.bfloat16), *glm_args(m))
    assert kernels.names() == ["boundary_persistent" if m >= 6 else "boundary_x2", "mixes"]
    assert kernels.calls[0][1]["clusters"] == CLUSTERS and kernels.calls[0][1]["m"] == m
    assert op.persistent(m) == (m >= 6) and (m < 6 or op.tokens_per_cluster(m) == 8)


def test_glm_warmup_launches_every_boundary_kernel() -> None:
    op, kernels, _ = glm_op(2, cluster_tokens=((4, 2), (6, 8)), persistent_min_tokens=7)
    for plan in op.warmup_rounds():
        plan.publish()
        plan.collect(True)
    launched = {name for name in kernels.names()}
    expected = {"boundary", "boundary_x2", "boundary_x8", "boundary_persistent", "mixes", "publish", "finalize"}
    assert expected <= launched


def test_glm_rejects_a_bad_fn_before_any_launch() -> None:
    op, kernels, _ = glm_op(1)
    residual, post, comb, fn, scale, base, weight = glm_args()
    with pytest.raises(ValueError, match=r"fn: expected shape \[24, 256\], got \[24, 128\]"):
        op(
            torch.randn(M, HIDDEN).to(torch.bfloat16),
            residual,
            post,
            comb,
            fn[:, :128].contiguous(),
            scale,
            base,
            weight,
        )
    assert kernels.calls == []


def test_plan_validates_both_phases_before_any_launch() -> None:
    from mhc_core import run_ranks

    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    residual, post, comb, pre, weight = dsv_args()
    with pytest.raises(ValueError, match=r"pre: expected shape \[3, 4\]"):
        op.plan("call", x, residual, post, comb, torch.rand(M, HC + 1), weight)
    assert kernels.calls == []
    outputs = run_ranks([op], "call", [(x, residual, post, comb, pre, weight)])
    assert kernels.names() == ["publish", "collective"] and outputs[0][0].shape == (M, HC, HIDDEN)
