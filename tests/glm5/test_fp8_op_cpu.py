"""The GLM op's FP8 layer-input option (issue #33) without a GPU: the shared cases
(``tests.fp8_op_cases``: ``TestSharedCases`` below) against ``AllReduceMhcBoundary``, and GLM's own.

* Presets: a preset's boundary kernels are its format's, its publishes and mixes kernel the same as
  BF16's.
* The call: the side-stream mixes kernel gets post_out and comb_out as with BF16 (it never reads the
  layer input).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.core.test_launch_wiring_cpu import CPU, Kernels, Order
from tests.fp8_op_cases import CAPACITY, HC, HIDDEN, MIX, TOP_K, Fp8Model, Fp8OpCases

#: The recorder op: 5 CTAs of 16 fragments; 2 tokens per cluster from M = 4, the persistent
#: boundary from 128.
CLUSTER = 5
CLUSTER_TOKENS, PERSISTENT_MIN_TOKENS = ((4, 2),), 128


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize("both", (False, True))
def test_a_presets_kernels_are_its_formats_boundaries(both: bool) -> None:
    from mhc_glm5 import presets
    from mhc_glm5.boundary import BoundaryConfig

    base = presets.get("h200-tp1-h4096").PRESET
    preset = dataclasses.replace(base, layer_input_format="mx-g32", layer_input_bf16=both)
    specs, plain = preset.kernel_specs("sm_90a"), base.kernel_specs("sm_90a")
    assert set(specs) == set(plain)
    for name, (path, fields) in specs.items():
        if name.startswith("boundary"):
            config = BoundaryConfig(**fields)
            assert (config.layer_input_format, config.layer_input_bf16) == ("mx-g32", both)
            assert (
                path == plain[name][0]
                and {**fields, "layer_input_format": "bf16", "layer_input_bf16": False} == (plain[name][1])
            )
        else:
            assert (path, fields) == plain[name], "the publishes and the mixes kernel do not depend on the format"


# ------------------------------------------------------------------ the shared cases
TABLE = """
[glm5.h200-tp1-h4096-fp8]
hidden = 4096
hc = 4
tp = 1
top_k = 8
cluster_size = 8
cluster_tokens = [[16, 8], [128, 16]]
persistent_min_tokens = 256
rms_eps = 1e-6
hc_eps = 1e-6
post_mult = 2.0
sinkhorn_repeat = 20
norm_eps = 1e-5
archs = ["sm_90a"]
layer_input_format = "{fmt}"
layer_input_bf16 = {both}
"""


def fp8_op(tp: int, fmt: str, both: bool):
    """An ``AllReduceMhcBoundary`` as construction leaves it, on the CPU, with recorder kernels (the
    boundary kernels' real signatures: FP8 ones append ``layer_input_q`` and ``layer_input_scales``)."""
    from types import SimpleNamespace

    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel
    from mhc_core.host.calls.layer_input import LayerInput
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5.boundary import BoundaryConfig, BoundaryKernel
    from mhc_glm5.config import PERSISTENT, BoundaryTarget, boundary_routing
    from mhc_glm5.mixes import MixesConfig, MixesKernel

    kernels = Kernels()
    op = object.__new__(AllReduceMhcBoundary)
    publish = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_wait", store="unicast")
    config = BoundaryConfig(
        hidden=HIDDEN, tp=tp, cluster_size=CLUSTER, rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-5, mixed_fma=False,
        layer_input_format=fmt, layer_input_bf16=both,
    )  # fmt: skip
    routing = boundary_routing(CLUSTER_TOKENS, PERSISTENT_MIN_TOKENS)
    boundaries = {
        BoundaryTarget(1): config,
        BoundaryTarget(2): dataclasses.replace(config, tokens=2),
        PERSISTENT: dataclasses.replace(config, tokens=8, persistent=True),
    }
    assert set(boundaries) == set(routing.targets)
    finalize = {
        dtype: FinalizePublishKernel(PublishConfig(**publish, top_k=TOP_K, weights=name))
        for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))
    }
    mixes = MixesKernel(MixesConfig(hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20))
    side = SimpleNamespace(handle=4321, fork_handle=0, launched_with=[], idle=True)
    side.launched = lambda capture, tensors, stream: side.launched_with.append(tuple(tensors))
    side.launching = lambda stream, capture, tensors: (0, 0)
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
        _publish_kernel=kernels.compiled("publish", PublishKernel(PublishConfig(**publish))),
        _finalize_kernels={dtype: kernels.compiled("finalize", kernel) for dtype, kernel in finalize.items()},
        cluster_tokens=CLUSTER_TOKENS, persistent_min_tokens=PERSISTENT_MIN_TOKENS, clusters=3,
        layer_input=LayerInput.checked(fmt, both, HIDDEN),
        routing=routing,
        _boundary_kernels={t: kernels.compiled(t.kernel_name, BoundaryKernel(c)) for t, c in boundaries.items()},
        _mixes_kernel=kernels.compiled("mixes", mixes),
        _mixes_handoff=torch.zeros(CAPACITY, MIX), _raw_mixes=torch.zeros(CAPACITY, MIX),
        _arrivals=torch.zeros(1, dtype=torch.int32), _side_work=side,
    )  # fmt: skip
    op._init_call_state()
    op._programs = op._build_programs()
    return op, kernels  # the side work: op._side_work


def params(m: int, make) -> list:
    """``AllReduceMhcBoundary.collect``'s arguments for M tokens."""
    return [
        make((m, HC, HIDDEN), torch.bfloat16), make((m, HC, 1), torch.float32), make((m, HC, HC), torch.float32),
        make((MIX, HC * HIDDEN), torch.bfloat16), make((3,), torch.float32), make((MIX,), torch.float32),
        make((HIDDEN,), torch.bfloat16),
    ]  # fmt: skip


def boundary_for(m: int) -> str:
    if m >= PERSISTENT_MIN_TOKENS:
        return "boundary_persistent"
    return "boundary_x2" if m >= CLUSTER_TOKENS[0][0] else "boundary"


def check_side(returned: tuple, kernels: Kernels, op) -> None:
    """The side stream's kernel: the hand-off rows, post_out and comb_out, as with BF16."""
    (_, boundary), (mixes_name, mixes) = kernels.calls[-2:]
    assert mixes_name == "mixes" and boundary["m"] == mixes["m"]
    assert (mixes["post_out"], mixes["comb_out"]) == (returned[1].data_ptr(), returned[2].data_ptr())
    assert op._side_work.launched_with[-1][:2] == (returned[1], returned[2])


def model() -> Fp8Model:
    return Fp8Model(
        package="mhc_glm5",
        op_class="AllReduceMhcBoundary",
        #: The H200 presets' constants (public glm5_next config).
        good=dict(
            hidden_size=4096,
            max_num_tokens=8,
            rms_eps=1e-6,
            hc_eps=1e-6,
            post_mult=2.0,
            sinkhorn_repeat=20,
            norm_eps=1e-5,
            device="cuda:0",
            top_k=8,
            cluster_tokens=[[16, 8]],
        ),
        bad_options=[
            # 4160 = 32.5 groups of 128; 4104 = 128.25 groups of 32.
            (dict(hidden_size=4160, layer_input_format="fp32-g128"), ValueError, "layer_input_format: .*hidden = 4160"),
            (dict(hidden_size=4104, layer_input_format="mx-g32"), ValueError, "layer_input_format: .*multiple of 32"),
            # 4608 / 8 / 8 = 72 fragments per CTA: 4.5 groups of 128 columns (whole groups of 32).
            (dict(hidden_size=4608, layer_input_format="ue8m0-g128-packed"), ValueError, "cluster_size: .*straddle"),
        ],
        hidden_32_only=4608,
        preset="h200-tp1-h4096",
        table=TABLE,
        fp8_kernels=4,  # every boundary kernel
        fp8_op=fp8_op,
        params=params,
        first_outputs=("residual_out", "post_out", "comb_out"),
        first_specs=lambda m: [
            (torch.bfloat16, (m, HC, HIDDEN)),
            (torch.float32, (m, HC, 1)),
            (torch.float32, (m, HC, HC)),
        ],
        collective_for=boundary_for,
        after_collective=("mixes",),
        float_param=(1, "post"),
        check_side=check_side,
    )


class TestSharedCases(Fp8OpCases):
    @pytest.fixture
    def model(self) -> Fp8Model:
        return model()
