"""DSV4.1's entry in the model registry (``mhc_core.registry``; entry point ``mhc_kernels.models``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mhc_core.registry import Model


def dynamic_shared(kernel: str, geometry: Mapping[str, Any]) -> int | None:
    """The collective's dynamic shared memory, as the preset's GEOMETRY states it."""
    if kernel == "collective":
        return int(geometry["shared_bytes"])
    if kernel == "collective_persistent":
        return int(geometry["persistent_shared_bytes"])
    return None


MODEL = Model(
    key="dsv41",
    title="DSV4.1",
    distribution="mhc-dsv41",
    package="mhc_dsv41",
    preset_type="mhc_dsv41.config:DSV41Preset",
    op_type="mhc_dsv41.op:AllReduceMHC",
    defaults="mhc_dsv41.config:default_geometry",
    reference="mhc_dsv41.reference",
    custom_ops="mhc_dsv41.library",
    benchmark_suites=(
        ("dsv41", "mhc_dsv41.bench.suites:dsv41_suite"),
        ("dsv41-geometry", "mhc_dsv41.bench.suites:dsv41_geometry"),
    ),
    benchmark_defaults=("dsv41",),
    benchmark_case="mhc_dsv41.bench.case:CASE",
    device_modules=("mhc_dsv41.kernel",),
    dynamic_shared=dynamic_shared,
)
