"""The DSV op's FP8 layer-input option (issue #33) without a GPU: the shared cases
(``tests.fp8_op_cases``: ``TestSharedCases`` below) against ``AllReduceMHC``, and DSV's own.

* Presets: ``DSV41Preset`` validates the option with the FP8 groups' placement (rank lanes in one
  warp; an error naming the key); a preset's kernels are its format's collectives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.core.test_launch_wiring_cpu import CPU, Kernels, Order
from tests.fp8_op_cases import CAPACITY, HC, HIDDEN, TOP_K, Fp8Model, Fp8OpCases


# ------------------------------------------------------------------ presets
def test_presets_validate_the_option() -> None:
    from mhc_core.presets import PresetError
    from mhc_dsv41 import presets

    preset = presets.get("h200-tp1-h5120").PRESET
    assert (preset.layer_input_format, preset.layer_input_bf16) == ("bf16", False)
    bad = [
        (dict(layer_input_format="e4m3"), "layer_input_format", "expected one of"),
        (dict(layer_input_format="mx-g32", layer_input_bf16="true"), "layer_input_bf16", "True or False"),
        (dict(layer_input_bf16=True), "layer_input_bf16", "expected False"),
        (dict(hidden=5184, layer_input_format="fp32-g128"), "layer_input_format", "multiple of 128"),
        (dict(tp=2, rank_lanes=2, layer_input_format="mx-g32"), None, None),  # 4 fragments x 2 lanes: fine
        (dict(tp=4, rank_lanes=4, layer_input_format="fp32-g128"), "rank_lanes", "at most 2 rank lanes"),
    ]
    for change, key, rule in bad:
        fields = {**{f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}, **change}
        if key is None:
            type(preset)(**fields)
            continue
        with pytest.raises(PresetError, match=f"^key {key!r}: .*{rule}") as raised:
            type(preset)(**fields)
        assert raised.value.key == key


@pytest.mark.parametrize("both", (False, True))
def test_a_presets_kernels_are_its_formats_collectives(both: bool) -> None:
    from mhc_dsv41 import presets
    from mhc_dsv41.config import MHCConfig

    base = presets.get("h200-tp2-h5120").PRESET
    preset = dataclasses.replace(base, layer_input_format="mx-g32", layer_input_bf16=both)
    specs = preset.kernel_specs("sm_90a")
    for name in ("collective", "collective_persistent"):
        config = MHCConfig(**specs[name][1])
        assert (config.layer_input_format, config.layer_input_bf16) == ("mx-g32", both)
        assert config.persistent == (name == "collective_persistent")
    plain = base.kernel_specs("sm_90a")
    assert {k: v for k, v in specs.items() if not k.startswith("collective")} == {
        k: v for k, v in plain.items() if not k.startswith("collective")
    }, "the publishes do not depend on the format"
    # An explicit format (the tests' way to build one preset's FP8 kernels) still wins.
    assert base.collective_config(layer_input_format="fp32-g128")["layer_input_format"] == "fp32-g128"
    assert preset.collective_config(layer_input_format="bf16")["layer_input_bf16"] is False


# ------------------------------------------------------------------ the shared cases
TABLE = """
[dsv41.h200-tp1-h5120-fp8]
hidden = 5120
hc = 4
tp = 1
top_k = 8
norm_eps = 1e-6
archs = ["sm_90a"]
layer_input_format = "{fmt}"
layer_input_bf16 = {both}
"""


def fp8_op(tp: int, fmt: str, both: bool):
    """An ``AllReduceMHC`` as construction leaves it, on the CPU, with recorder kernels (the
    collectives' real signatures: FP8 ones append ``layer_input_q`` and ``layer_input_scales``)."""
    from types import SimpleNamespace

    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel
    from mhc_core.host.calls.layer_input import LayerInput
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import CollectiveTarget, collective_routing
    from mhc_dsv41.kernel import LamportMHCKernel, MHCConfig

    kernels = Kernels()
    op = object.__new__(AllReduceMHC)
    publish = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_stores", store="unicast")
    config = MHCConfig(
        hidden=HIDDEN, hc=HC, tp=tp, cluster_size=2, threads=64, rank_lanes=1, layer_input_format=fmt,
        layer_input_bf16=both,
    )  # fmt: skip
    op.__dict__.update(
        hidden_size=HIDDEN, device=CPU, tp=tp, rank=0, capacity=CAPACITY, top_k=TOP_K, check_routes=False,
        _closed=False, _peers_ready=True, _pending_m=None, _order=Order(),
        group=SimpleNamespace(kind="none", missing_peers=lambda op: []),
        spin=SimpleNamespace(limit_ns=5, address=1234, checks_token_counts=False, check=lambda: None),
        mailbox=SimpleNamespace(
            buffer=torch.zeros(64, dtype=torch.bfloat16), stage_state=torch.zeros(4, dtype=torch.int32),
            destinations=torch.zeros(tp, dtype=torch.int64),
        ),
        _publish_kernel=kernels.compiled("publish", PublishKernel(PublishConfig(**publish))),
        _finalize_kernels={
            torch.float32: kernels.compiled(
                "finalize", FinalizePublishKernel(PublishConfig(**publish, top_k=TOP_K, weights="float32"))
            )
        },
        hc_mult=HC, norm_eps=1e-6, clusters=7, persistent_min_tokens=128, config=config,
        routing=collective_routing(128),
        layer_input=LayerInput.checked(fmt, both, HIDDEN), _quantizes=fmt != "bf16",
        _collective_kernels={
            CollectiveTarget(False): kernels.compiled("collective", LamportMHCKernel(config)),
            CollectiveTarget(True): kernels.compiled(
                "collective_persistent", LamportMHCKernel(dataclasses.replace(config, persistent=True))
            ),
        },
    )  # fmt: skip
    op._init_call_state()
    op._programs = op._build_programs()
    return op, kernels


def params(m: int, make) -> list:
    """``AllReduceMHC.collect``'s arguments for M tokens."""
    return [
        make((m, HC, HIDDEN), torch.bfloat16), make((m, HC), torch.float32), make((m, HC, HC), torch.float32),
        make((m, HC), torch.float32), make((HIDDEN,), torch.bfloat16), 1e-6,
    ]  # fmt: skip


def model() -> Fp8Model:
    return Fp8Model(
        package="mhc_dsv41",
        op_class="AllReduceMHC",
        good=dict(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8, device="cuda:0"),
        bad_options=[
            # 5184 = 40.5 groups of 128 (a whole number of 32-column groups); 5000 = 156.25 groups of 32.
            (dict(hidden_size=5184, layer_input_format="fp32-g128"), ValueError, "layer_input_format: .*hidden = 5184"),
            (
                dict(hidden_size=5184, layer_input_format="ue8m0-g128-packed"),
                ValueError,
                "layer_input_format: .*of 128",
            ),
            (dict(hidden_size=5000, layer_input_format="mx-g32"), ValueError, "layer_input_format: .*multiple of 32"),
        ],
        hidden_32_only=5184,
        preset="h200-tp1-h5120",
        table=TABLE,
        fp8_kernels=2,  # both collectives
        fp8_op=fp8_op,
        params=params,
        first_outputs=("residual_out",),
        first_specs=lambda m: [(torch.bfloat16, (m, HC, HIDDEN))],
        collective_for=lambda m: "collective_persistent" if m >= 128 else "collective",
        float_param=(3, "pre"),
    )


class TestSharedCases(Fp8OpCases):
    @pytest.fixture
    def model(self) -> Fp8Model:
        return model()
