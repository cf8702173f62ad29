"""GLM-5.3-Flash's entry in the model registry (``mhc_core.registry``; entry point ``mhc_kernels.models``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mhc_core.registry import Model

#: The grouped boundaries' kernel names: ``boundary_x<group size>``.
GROUPED_PREFIX = "boundary_x"


def dynamic_shared(kernel: str, geometry: Mapping[str, Any]) -> int | None:
    """The boundary's dynamic shared memory, as the preset's GEOMETRY states it."""
    if kernel == "boundary":
        return int(geometry["shared_bytes"])
    if kernel == "boundary_persistent":
        return int(geometry["persistent_shared_bytes"])
    if kernel.startswith(GROUPED_PREFIX):
        shared = geometry["grouped_shared_bytes"].get(int(kernel.removeprefix(GROUPED_PREFIX)))
        return None if shared is None else int(shared)
    return None


MODEL = Model(
    key="glm5",
    title="GLM-5.3-Flash",
    distribution="mhc-glm5",
    package="mhc_glm5",
    preset_type="mhc_glm5.config:GLM5Preset",
    op_type="mhc_glm5.op:AllReduceMhcBoundary",
    reference="mhc_glm5.reference",
    custom_ops="mhc_glm5.library",
    benchmark_suites=(
        ("glm5", "mhc_glm5.bench.suites:glm5_suite"),
        ("glm5-thresholds", "mhc_glm5.bench.suites:glm5_thresholds_suite"),
        ("glm5-breakdown", "mhc_glm5.bench.suites:glm5_breakdown"),
        ("glm5-persistent", "mhc_glm5.bench.suites:glm5_persistent"),
        ("glm5-overlap", "mhc_glm5.bench.overlap:overlap_suite"),
    ),
    # glm5-persistent and glm5-overlap are asked for by name (the latter compiles a dozen functions).
    benchmark_defaults=("glm5", "glm5-thresholds", "glm5-breakdown"),
    benchmark_tables=(("glm5-overlap", "mhc_glm5.bench.overlap:overlap_table"),),
    benchmark_case="mhc_glm5.bench.case:CASE",
    device_modules=(
        "mhc_glm5.boundary",
        "mhc_glm5.grouped",
        "mhc_glm5.grouped_mma",
        "mhc_glm5.mixes",
        "mhc_glm5.fn_stage",
        "mhc_glm5.stages",
        "mhc_glm5.fp8_store",
    ),
    dynamic_shared=dynamic_shared,
)
