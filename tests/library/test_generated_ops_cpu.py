"""Each model's six boundary ops are generated from one declaration (issue #50,
``mhc_core.host.boundary_ops``): the call forms' parameters, once per model. The public names and
schemas are those the hand-written ops had (engines and compiled graphs name them), and every op has
its fake implementation."""

# ruff: noqa: E501  (the schemas, each on its line)
from __future__ import annotations

import importlib

import pytest
import torch

#: The schemas of the hand-written ops (mhc-core 0.6.0), after ``mhc::<name>``.
SCHEMAS = {
    "dsv41_boundary": "(Tensor(a0!) state, SymInt handle, Tensor x, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps) -> (Tensor, Tensor)",
    "dsv41_boundary_fp8": "(Tensor(a0!) state, SymInt handle, Tensor x, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
    "dsv41_collect": "(Tensor(a0!) state, SymInt handle, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps) -> (Tensor, Tensor)",
    "dsv41_collect_fp8": "(Tensor(a0!) state, SymInt handle, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
    "dsv41_finalize": "(Tensor(a0!) state, SymInt handle, Tensor gemm2_permuted, Tensor expert_weights, Tensor index, Tensor shared_output, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps) -> (Tensor, Tensor)",
    "dsv41_finalize_fp8": "(Tensor(a0!) state, SymInt handle, Tensor gemm2_permuted, Tensor expert_weights, Tensor index, Tensor shared_output, Tensor residual, Tensor post, Tensor comb, Tensor pre, Tensor norm_weight, float norm_eps, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
    "glm5_boundary": "(Tensor(a0!) state, SymInt handle, Tensor x, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight) -> (Tensor, Tensor)",
    "glm5_boundary_fp8": "(Tensor(a0!) state, SymInt handle, Tensor x, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
    "glm5_boundary_moe": "(Tensor(a0!) state, SymInt handle, Tensor gemm2_permuted, Tensor expert_weights, Tensor index, Tensor shared_output, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight) -> (Tensor, Tensor)",
    "glm5_boundary_moe_fp8": "(Tensor(a0!) state, SymInt handle, Tensor gemm2_permuted, Tensor expert_weights, Tensor index, Tensor shared_output, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
    "glm5_collect": "(Tensor(a0!) state, SymInt handle, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight) -> (Tensor, Tensor)",
    "glm5_collect_fp8": "(Tensor(a0!) state, SymInt handle, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, Tensor norm_weight, str layer_input_format, bool layer_input_bf16) -> (Tensor, Tensor, Tensor, Tensor)",
}  # fmt: skip


@pytest.mark.parametrize("package", ("mhc_dsv41", "mhc_glm5"))
def test_the_six_ops_come_from_the_declaration_with_their_schemas(package: str) -> None:
    from mhc_core.host.boundary_ops import BoundaryOps

    library = importlib.import_module(f"{package}.library")
    ops = library.OPS
    assert isinstance(ops, BoundaryOps)
    prefix = package.removeprefix("mhc_") + "_"
    assert sorted(ops.ops) == sorted(name for name in SCHEMAS if name.startswith(prefix))
    for name, op in ops.ops.items():
        assert getattr(library, name) is op, "the module names each op"
        schema = str(getattr(torch.ops.mhc, name).default._schema)
        assert schema == f"mhc::{name}{SCHEMAS[name]}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, "Meta") or torch.library.get_kernel(
            op.qualname, "Meta"
        ), f"{name}: no fake implementation"
