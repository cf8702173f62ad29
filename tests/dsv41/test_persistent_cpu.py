"""The persistent collective's occupancy assumption, on CPU: every H200 preset's persistent kernel
stays within ``COLLECTIVE_REGISTERS`` (what ``resident_clusters`` counts with), without spills."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_persistent_collective_fits_its_register_budget(tp: int) -> None:
    from mhc_core.host.binaries.compiler import KernelSpec, compile_kernel
    from mhc_dsv41 import presets
    from mhc_dsv41.config import COLLECTIVE_REGISTERS, MHCConfig, resident_clusters

    preset = presets.get(f"h200-tp{tp}-h5120").PRESET
    path, config = preset.kernel_specs("sm_90a")["collective_persistent"]
    report = compile_kernel(KernelSpec(path, config), "sm_90a", inspect=True, prebuilt=False).report
    assert report.registers is not None and report.registers <= COLLECTIVE_REGISTERS, report
    assert report.spill_stores == 0 and report.spill_loads == 0, report
    # 132 SMs x 3 CTAs of 128 threads at 160 registers, over clusters of 5 CTAs.
    assert resident_clusters(MHCConfig(**config), 132) == 132 * 3 // preset.cluster_size
