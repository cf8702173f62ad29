"""The FP8 layer-input formats declared once (issue #50): ``mhc_core.fp8_formats`` is the one table,
torch-free, that the torch references, the op option, the device layouts and both models' presets and
kernel configs read (there were three copies, and tests that they agreed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [str(ROOT / "packages" / package / "src") for package in ("mhc-core", "mhc-dsv41", "mhc-glm5")]


def test_the_table_and_the_model_configs_import_without_torch() -> None:
    """What codegen imports (the model configs) reads the table without torch: a process where
    importing torch fails validates an FP8 preset of each model."""
    script = """
import sys
sys.modules["torch"] = None  # any import of torch raises ImportError
from mhc_core import fp8_formats
from mhc_dsv41.config import DSV41Preset, MHCConfig
from mhc_glm5.boundary import BoundaryConfig
from mhc_glm5.config import GLM5Preset
config = MHCConfig(hidden=640, hc=4, tp=1, cluster_size=2, threads=64, rank_lanes=1, layer_input_format="mx-g32")
print(config.fp8_group, config.scale_layout, config.scale_groups, fp8_formats.LAYER_INPUT_FORMATS)
"""
    paths = ":".join(SOURCES)
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {paths.split(':')!r}\n" + script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["32", "swizzled-128x4", "20", "('bf16',", "'fp32-g128',", "'ue8m0-g128-packed',",
                                   "'mx-g32')"]  # fmt: skip


def test_every_reader_reads_the_one_table() -> None:
    from mhc_core import fp8, fp8_formats
    from mhc_core.device import quant
    from mhc_core.host.calls import layer_input
    from mhc_dsv41.config import MHCConfig
    from mhc_glm5.boundary import BoundaryConfig

    assert fp8.FORMATS is fp8_formats.FORMATS and fp8.Fp8Format is fp8_formats.Fp8Format
    assert layer_input.FORMATS is fp8_formats.LAYER_INPUT_FORMATS
    assert set(quant.LAYOUTS) == {f.layout for f in fp8_formats.FORMATS.values()}
    for config in (MHCConfig, BoundaryConfig):  # quantizes, scale_layout, the repr: one definition
        assert issubclass(config, fp8_formats.LayerInputConfig)
        for name in ("quantizes", "stores_bf16_layer_input", "scale_layout", "__repr__"):
            assert getattr(config, name) is getattr(fp8_formats.LayerInputConfig, name), (config, name)


def test_a_bf16_configs_repr_leaves_the_layer_input_out() -> None:
    """The kernels' symbol names are built from the repr: a BF16 config's is what it was before the
    option existed, an FP8 one's names the format (the PTX of the BF16 kernels stays the same)."""
    from mhc_glm5.boundary import BoundaryConfig

    fields = dict(hidden=4096, tp=2, cluster_size=8, rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-5, mixed_fma=False)
    assert repr(BoundaryConfig(**fields)) == (
        "BoundaryConfig(hidden=4096, tp=2, cluster_size=8, rms_eps=1e-06, hc_eps=1e-06, norm_eps=1e-05, "
        "mixed_fma=False, tokens=1, persistent=False)"
    )
    fp8 = BoundaryConfig(**fields, layer_input_format="ue8m0-g128-packed", layer_input_bf16=True)
    assert repr(fp8).endswith("persistent=False, layer_input_format='ue8m0-g128-packed', layer_input_bf16=True)")
