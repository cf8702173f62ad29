"""Both models build their op from a preset in one way (issue #35 part 3): ``from_config(preset)``
and a plain constructor given the same values (which builds a ``"custom"`` preset first) reach the
build with equal configurations: the same preset fields, kernel configs and startup fingerprint
(what every rank votes on, and what the kernels are compiled from). No GPU: construction is stopped
where it first touches the device."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest


class Built(Exception):
    """Raised where construction leaves validation: carries the op as far as it got."""

    def __init__(self, op: Any) -> None:
        super().__init__("built")
        self.op = op


@pytest.fixture(autouse=True)
def stop_at_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.host.op import LamportOp

    def stop(self: Any) -> None:
        raise Built(self)

    monkeypatch.setattr(LamportOp, "_build_publishes", stop)


def reach_the_build(build: Any, **arguments: Any) -> Any:
    with pytest.raises(Built) as stopped:
        build(**arguments)
    return stopped.value.op


def same_preset(a: Any, b: Any) -> None:
    """Equal but for what names the preset (its name, archs, whether it was tuned)."""
    anonymous = dict(name="custom", archs=b.archs, tuned=b.tuned)
    assert dataclasses.replace(a, **anonymous) == b


@pytest.mark.parametrize("layer_input_format", ["bf16", "mx-g32"])
def test_dsv41_plain_constructor_equals_from_config(layer_input_format: str) -> None:
    from mhc_dsv41 import AllReduceMHC, presets

    preset = dataclasses.replace(presets.get("h200-tp1-h5120").PRESET, layer_input_format=layer_input_format)
    common = dict(max_num_tokens=16, device="cuda:0")
    from_config = reach_the_build(AllReduceMHC.from_config, preset=preset, **common)
    plain = reach_the_build(
        AllReduceMHC, hidden_size=preset.hidden, hc_mult=preset.hc, top_k=preset.top_k,
        cluster_size=preset.cluster_size, threads=preset.threads, rank_lanes=preset.rank_lanes,
        publish_threads=preset.publish_threads, norm_eps=preset.norm_eps, layer_input_format=layer_input_format,
        **common,
    )  # fmt: skip
    assert plain.preset.name == "custom" and from_config.preset is preset
    same_preset(from_config.preset, plain.preset)
    assert plain.config == from_config.config and plain.routing == from_config.routing
    assert plain._publish_config == from_config._publish_config
    assert plain._finalize_configs == from_config._finalize_configs
    assert plain._fingerprint() == from_config._fingerprint()


@pytest.mark.parametrize("layer_input_format", ["bf16", "fp32-g128"])
def test_glm5_plain_constructor_equals_from_config(layer_input_format: str) -> None:
    from mhc_glm5 import AllReduceMhcBoundary, presets

    preset = dataclasses.replace(presets.get("h200-tp1-h4096").PRESET, layer_input_format=layer_input_format)
    common = dict(max_num_tokens=16, device="cuda:0")
    from_config = reach_the_build(AllReduceMhcBoundary.from_config, preset=preset, **common)
    plain = reach_the_build(
        AllReduceMhcBoundary, hidden_size=preset.hidden, top_k=preset.top_k, cluster_size=preset.cluster_size,
        cluster_tokens=preset.cluster_tokens, rms_eps=preset.rms_eps, hc_eps=preset.hc_eps,
        post_mult=preset.post_mult, sinkhorn_repeat=preset.sinkhorn_repeat, norm_eps=preset.norm_eps,
        publish_threads=preset.publish_threads, mixes_threads=preset.mixes_threads,
        persistent_min_tokens=preset.persistent_min_tokens, layer_input_format=layer_input_format, **common,
    )  # fmt: skip
    assert plain.preset.name == "custom" and from_config.preset is preset
    same_preset(from_config.preset, plain.preset)
    assert plain._publish_config == from_config._publish_config
    assert plain._finalize_configs == from_config._finalize_configs
    assert plain._fingerprint() == from_config._fingerprint()
    for arch in ("sm_90a", "sm_100a"):  # the kernels each would compile
        assert plain.preset.kernel_specs(arch) == from_config.preset.kernel_specs(arch)


def test_from_config_options_replace_the_presets_fields() -> None:
    """An option over a preset field is the preset's field in the op (one source of truth)."""
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41 import presets as dsv_presets
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5 import presets as glm_presets

    common = dict(max_num_tokens=16, device="cuda:0")
    dsv = reach_the_build(
        AllReduceMHC.from_config, preset=dsv_presets.get("h200-tp1-h5120").PRESET, norm_eps=1e-5, **common
    )
    assert dsv.preset.norm_eps == dsv.norm_eps == 1e-5
    glm = reach_the_build(
        AllReduceMhcBoundary.from_config, preset=glm_presets.get("h200-tp1-h4096").PRESET,
        persistent_min_tokens=None, **common,
    )  # fmt: skip
    assert glm.preset.persistent_min_tokens == 0


def test_from_config_refuses_another_tp_before_the_build() -> None:
    from mhc_dsv41 import AllReduceMHC, presets

    preset = presets.get("h200-tp2-h5120").PRESET
    with pytest.raises(ValueError, match=r"group: preset 'h200-tp2-h5120' is for tp = 2, the group has tp = 1"):
        AllReduceMHC.from_config(preset, max_num_tokens=16, device="cuda:0")
